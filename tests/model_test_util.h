// Tiny model configurations shared by the model and train unit tests (KV-cached inference, generation,
// Hugging Face model I/O, MoE): two layers, hidden size 32, four heads, so a forward takes microseconds; and
// the synthetic micro-batches the model, stage and pipeline tests feed them.
#pragma once
#include <cstdint>

#include "loom/model/gpt.h"

namespace loom::test {

// An owned (B, T) micro-batch of deterministic tokens and targets for model/pipeline tests: element i is
// token (37 i + 11 + token_shift) % V and target (53 i + 5 + target_shift) % V (shifts vary micro-batches).
struct SyntheticBatch {
  Tensor tokens, targets;
  GPTBatch view() const { return GPTBatch{tokens, targets, {}, {}, {}}; }
};
inline SyntheticBatch synthetic_batch(int64_t B, int64_t T, int64_t V, int64_t token_shift = 0,
                                      int64_t target_shift = 0) {
  SyntheticBatch b;
  b.tokens = Tensor::empty({B, T}, DType::kI32);
  b.targets = Tensor::empty({B, T}, DType::kI32);
  for (int64_t i = 0; i < B * T; ++i) {
    b.tokens.data<int32_t>()[i] = int32_t((i * 37 + 11 + token_shift) % V);
    b.targets.data<int32_t>()[i] = int32_t((i * 53 + 5 + target_shift) % V);
  }
  return b;
}

// GPT-2's architecture (LayerNorm, GeLU, learned positions, linear biases, output tied to the embedding).
inline GPTConfig tiny_gpt2_config(int64_t max_positions, int64_t vocab, int64_t padded_vocab) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.max_position_embeddings = max_positions;
  c.vocab_size = vocab;
  c.padded_vocab_size = padded_vocab;
  return c;
}

// `c` with Llama's architecture: RMSNorm, SwiGLU (F = 48), grouped-query attention with two groups, no
// linear biases, an untied output layer and RoPE.
inline GPTConfig llama_variant(GPTConfig c) {
  c.normalization = NormKind::kRMSNorm;
  c.activation = MlpActivation::kSwiGLU;
  c.ffn_hidden = 48;
  c.group_query_attention = true;
  c.num_query_groups = 2;
  c.add_bias_linear = false;
  c.untie_embeddings_and_output_weights = true;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  return c;
}

// `c` (a Llama variant) as a mixture of experts: E experts of width F in every layer, top-k softmax routing
// (Mixtral's), no shared experts.
inline GPTConfig moe_variant(GPTConfig c, int64_t E, int64_t k, int64_t F) {
  c.moe.num_experts = c.moe.router.num_experts = E;
  c.moe.router.topk = k;
  c.moe.ffn_hidden_size = F;
  return c;
}

}  // namespace loom::test

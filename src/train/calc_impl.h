// Private to the train layer: the two architecture/precision tests that both halves of `loom calc` ask,
// calc.cpp (validation and arithmetic) and calc_report.cpp (the printed report), and calc_lora.cpp's LoRA
// shapes and scratch.
#pragma once
#include "loom/train/calc.h"

namespace loom::calc_detail {

// GPT-2's layer (LayerNorm, 4h GeLU MLP, multi-head attention with h/a heads, biases, learned positions, tied
// output): the shapes the paper's formulas describe.
inline bool is_gpt2_architecture(const GPTConfig& m) {
  const GPTConfig d;
  return m.normalization == d.normalization && m.activation == d.activation &&
         m.ffn_hidden_size() == 4 * m.hidden_size && m.head_dim() * m.num_attention_heads == m.hidden_size &&
         m.num_kv_heads() == m.num_attention_heads &&
         m.add_bias_linear && !m.untie_embeddings_and_output_weights &&
         m.position_embedding_type == d.position_embedding_type && !m.qk_layernorm;
}

inline bool is_16bit(const PrecisionConfig& pr) { return pr.bf16 || pr.fp16; }

// The adapters of one transformer layer for `lora`, in target order, global shapes; UserError naming
// --lora-rank when the rank exceeds an adapter's min(in, out), as LoraAdapter refuses it.
std::vector<LoraAdapterShape> lora_layer_adapters(const GPTConfig& m, const LoraOptions& lora);

// A single process's largest transient LoRA allocation (bytes): over the adapters, the most that one
// adapter's forward (dropped input, h, spread B, the up GEMM's output) or backward (dropped input, h, dh,
// then the spread B and its gradient, or the input gradient) holds at once. `tokens` = micro-batch x
// sequence; compute_bytes / grad_bytes: the compute and gradient dtypes' sizes.
int64_t lora_scratch_bytes(const std::vector<LoraAdapterShape>& adapters, const LoraConfig& cfg, int64_t tokens,
                           int64_t compute_bytes, int64_t grad_bytes);

}  // namespace loom::calc_detail

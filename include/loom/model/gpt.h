// GPT-2 architecture assembled from nn modules, with Megatron's parameter names:
//   embedding.word_embeddings.weight (Vp, C), embedding.position_embeddings.weight (P, C)
//   decoder.layers.N.{input_layernorm, self_attention.linear_qkv, self_attention.linear_proj,
//                     pre_mlp_layernorm, mlp.linear_fc1, mlp.linear_fc2}.{weight,bias}
//   decoder.final_layernorm.{weight,bias}; the output layer is tied to the word embedding.
// Pre-LN layers: x += proj(attn(ln1(x))); x += fc2(gelu(fc1(ln2(x)))). qkv uses Megatron's grouped
// layout (per head: q, k, v). Activation memory: per layer the saved tensors below (12·B·T·C floats);
// the GeLU output is not saved but recomputed in backward from fc1's output (4·B·T·C per layer saved).
// Gradient scratch (dres, dln, datt, dqkv, dfc) is shared by all layers since backward visits one at a time.
#pragma once
#include <memory>
#include <vector>

#include "loom/nn/modules.h"

namespace loom {

struct GPTConfig {
  int64_t num_layers = 12;               // L (--num-layers)
  int64_t hidden_size = 768;             // C (--hidden-size)
  int64_t num_attention_heads = 12;      // NH (--num-attention-heads)
  int64_t max_position_embeddings = 1024;  // P (--max-position-embeddings)
  int64_t vocab_size = 50257;            // V: real tokens; the loss covers these columns only
  int64_t padded_vocab_size = 50304;     // Vp: V rounded up to --make-vocab-size-divisible-by
  float init_method_std = 0.02f;         // --init-method-std
  float layernorm_epsilon = 1e-5f;       // --norm-epsilon
  int64_t ffn_hidden_size() const { return 4 * hidden_size; }
  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  // Parameters, counted exactly from the shapes.
  int64_t num_parameters() const;
  // Model FLOPs of one forward+backward over B sequences of length T (matmuls only, causal attention
  // counted in full as Megatron does): 3 x (24·B·T·L·C² + 4·B·T²·L·C + 2·B·T·C·Vp).
  double flops_per_step(int64_t B, int64_t T) const;
  void validate() const;  // throws UserError naming the flag
};

// One micro-batch. tokens and targets (B, T) i32 are required; the rest are optional (empty views):
// loss_mask (B, T) f32 (Megatron's loss mask: --eod-mask-loss), position_ids (B, T) i32
// (--reset-position-ids), segment_ids (B, T) i32 (--reset-attention-mask: documents do not attend
// to each other).
struct GPTBatch {
  TensorView tokens, targets;
  TensorView loss_mask, position_ids, segment_ids;
};

class GPTModel {
 public:
  GPTModel(const GPTConfig& cfg, const DeviceContext& ctx);
  GPTModel(const GPTModel&) = delete;
  GPTModel& operator=(const GPTModel&) = delete;
  ~GPTModel();

  const GPTConfig& config() const { return cfg_; }
  ParameterSet& params() { return params_; }
  const ParameterSet& params() const { return params_; }
  void initialize(uint64_t seed) { params_.initialize(seed); }

  // Forward over a micro-batch. Returns the mean loss over its tokens (over the unmasked tokens when a
  // loss mask is given: sum(loss · mask) / sum(mask), as Megatron). dloss_scale != 0 prepares
  // backward: the logits buffer becomes dlogits = dloss_scale · d(sum of mask · losses).
  // With dloss_scale == 0 the logits stay available through logits().
  float forward(const GPTBatch& batch, float dloss_scale);
  float forward(TensorView tokens, TensorView targets, float dloss_scale) {
    return forward(GPTBatch{tokens, targets, {}, {}, {}}, dloss_scale);
  }
  // Accumulates parameter gradients of the last forward (which must have had dloss_scale != 0); `batch`
  // must be the one that forward saw.
  void backward(const GPTBatch& batch);
  void backward(TensorView tokens) { backward(GPTBatch{tokens, {}, {}, {}, {}}); }
  TensorView logits() const { return logits_; }  // (B, T, Vp)
  TensorView losses() const { return losses_; }  // (B, T) per-token losses of the last forward

 private:
  struct Layer;
  struct LayerActs;
  void ensure_buffers(int64_t B, int64_t T);

  GPTConfig cfg_;
  const DeviceContext& ctx_;
  ParameterSet params_;
  std::unique_ptr<Embedding> embedding_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::unique_ptr<LayerNorm> final_ln_;

  int64_t B_ = 0, T_ = 0;
  bool backward_ready_ = false;
  Tensor x0_;                      // (B, T, C) embedding output = input of layer 0
  std::vector<LayerActs> acts_;    // saved activations per layer
  Tensor lnf_;                     // (B, T, C)
  LayerNorm::Saved lnf_saved_;
  Tensor logits_;                  // (B, T, Vp), dlogits in place after a training forward
  Tensor losses_;                  // (B, T)
  // Shared scratch: GeLU output (forward and recomputed in backward), the attention projection output
  // (consumed at once by the fused residual + LayerNorm) and activation gradients.
  Tensor gelu_, proj_, dres_, dln_, datt_, dqkv_, dfc_;
};

}  // namespace loom

// Single-device building blocks with explicit forward/backward. Each module owns its parameters
// (declared into a ParameterSet) and keeps no activations itself: what backward needs lives in a Saved
// struct the caller owns, so recomputation is "drop the Saved struct and run forward again".
// Gradient semantics follow the op table: parameter grads accumulate, activation grads overwrite,
// except LayerNorm's dinp, which accumulates into the residual stream.
#pragma once
#include <string>

#include "loom/nn/parameter.h"

namespace loom {

// y = x W^T + b; W (out, in). Megatron's ColumnParallel/RowParallel linear reduce to this with TP = 1.
class Linear {
 public:
  Linear(ParameterSet& ps, const std::string& prefix, int64_t in_features, int64_t out_features, bool bias,
         float init_std);
  void forward(const DeviceContext& ctx, TensorView out, TensorView inp) const;
  // dinp overwritten (skipped when empty); dW, db accumulate.
  void backward(const DeviceContext& ctx, TensorView dinp, TensorView dout, TensorView inp) const;
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  Parameter& weight() const { return *weight_; }

 private:
  int64_t in_, out_;
  Parameter* weight_;
  Parameter* bias_ = nullptr;
};

class LayerNorm {
 public:
  struct Saved {
    Tensor mean, rstd;  // (N) f32
  };
  LayerNorm(ParameterSet& ps, const std::string& prefix, int64_t C, float eps);
  void forward(const DeviceContext& ctx, TensorView out, Saved& s, TensorView inp) const;
  // residual = a + b, out = layernorm(residual), in one pass.
  void forward_residual(const DeviceContext& ctx, TensorView residual, TensorView out, Saved& s, TensorView a,
                        TensorView b) const;
  // dinp ACCUMULATES (+=): LayerNorm inputs are the residual stream.
  void backward(const DeviceContext& ctx, TensorView dinp, TensorView dout, TensorView inp, const Saved& s) const;

 private:
  int64_t C_;
  float eps_;
  Parameter* weight_;
  Parameter* bias_;
};

// Token embedding (V, C) plus optional learned absolute position embedding (max_positions, C).
class Embedding {
 public:
  Embedding(ParameterSet& ps, int64_t padded_vocab, int64_t C, int64_t max_positions, float init_std);
  // position_ids (B, T) i32 optional (default: 0..T-1 in every row).
  void forward(const DeviceContext& ctx, TensorView out, TensorView tokens, TensorView position_ids = {}) const;
  void backward(const DeviceContext& ctx, TensorView dout, TensorView tokens,
                TensorView position_ids = {}) const;  // grads accumulate
  Parameter& word_embeddings() const { return *word_; }

 private:
  Parameter* word_;
  Parameter* position_ = nullptr;
};

// Causal multi-head attention core (scores, softmax, weighted values) over Megatron's grouped qkv layout.
class AttentionCore {
 public:
  struct Saved {
    Tensor lse;  // (B, NH, T) f32
  };
  explicit AttentionCore(const AttentionParams& p) : p_(p) {}
  // segment_ids (B, T) i32 optional: documents packed in a sequence do not attend to each other.
  void forward(const DeviceContext& ctx, TensorView out, Saved& s, TensorView qkv, TensorView segment_ids = {}) const;
  void backward(const DeviceContext& ctx, TensorView dqkv, TensorView dout, TensorView qkv, TensorView out,
                const Saved& s, TensorView segment_ids = {}) const;
  const AttentionParams& params() const { return p_; }

 private:
  AttentionParams p_;
};

// Allocates `t` with shape/dtype on ctx unless it already has exactly that shape (buffers are reused
// across steps; the shape only changes when the batch shape does).
void ensure_tensor(const DeviceContext& ctx, Tensor& t, Shape s, DType dt = DType::kF32);

}  // namespace loom

// Single-device building blocks with explicit forward/backward. Each module owns its parameters
// (declared into a ParameterSet) and keeps no activations itself: what backward needs lives in a Saved
// struct the caller owns, so recomputation is "drop the Saved struct and run forward again".
// Gradient semantics follow the op table: parameter grads accumulate, activation grads overwrite,
// except Norm's dinp, which accumulates into the residual stream.
// Mixed precision: modules read Parameter::compute (the compute-dtype copy of the master weights) and
// accumulate into Parameter::grad (grad dtype); activations are in the compute dtype, statistics f32.
// Constant tables (RotaryEmbedding's cos/sin) are f32 and built once at construction.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "loom/param/parameter.h"

namespace loom {

// y = x W^T + b; W (out, in). Megatron's ColumnParallel/RowParallel linear reduce to this with TP = 1.
class Linear {
 public:
  Linear(ParameterSet& ps, const std::string& prefix, int64_t in_features, int64_t out_features, bool bias,
         float init_std);
  // A tensor-parallel shard of the global (out_features, in_features) layer. partition_dim 0
  // (column-parallel): this rank holds the output rows `shard` of the weight and of the bias;
  // partition_dim 1 (row-parallel): the input columns `shard` of the weight, the bias (out_features)
  // whole (replicated; the caller adds it once across the group). in/out_features() are the local sizes.
  Linear(ParameterSet& ps, const std::string& prefix, int64_t in_features, int64_t out_features, bool bias,
         float init_std, int partition_dim, std::vector<ShardRange> shard);
  void forward(const DeviceContext& ctx, TensorView out, TensorView inp) const;
  // dinp overwritten (skipped when empty); dW, db accumulate.
  void backward(const DeviceContext& ctx, TensorView dinp, TensorView dout, TensorView inp) const;
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  Parameter& weight() const { return *weight_; }
  Parameter* bias() const { return bias_; }  // null without bias

 private:
  int64_t in_, out_;
  Parameter* weight_;
  Parameter* bias_ = nullptr;
};

enum class NormKind { kLayerNorm, kRMSNorm };  // Megatron's --normalization LayerNorm | RMSNorm
// "LayerNorm" / "RMSNorm" (Megatron's spelling); UserError naming --normalization otherwise.
NormKind parse_norm_kind(const std::string& s);
const char* norm_kind_name(NormKind k);

// LayerNorm (weight and bias) or RMSNorm (weight only) over the last dim C. Parameters: <prefix>.weight
// (ones), and <prefix>.bias (zeros) for LayerNorm; both without weight decay.
class Norm {
 public:
  struct Saved {
    Tensor mean, rstd;  // (N) f32; mean stays empty for RMSNorm
  };
  Norm(ParameterSet& ps, const std::string& prefix, int64_t C, float eps, NormKind kind = NormKind::kLayerNorm);
  // inp, out (N, C) (leading dims flattened).
  void forward(const DeviceContext& ctx, TensorView out, Saved& s, TensorView inp) const;
  // residual = a + b, out = norm(residual), in one pass.
  void forward_residual(const DeviceContext& ctx, TensorView residual, TensorView out, Saved& s, TensorView a,
                        TensorView b) const;
  // dinp ACCUMULATES (+=): norm inputs are the residual stream.
  void backward(const DeviceContext& ctx, TensorView dinp, TensorView dout, TensorView inp, const Saved& s) const;
  NormKind kind() const { return kind_; }
  // Its parameters: the weight, and the bias of a LayerNorm.
  std::vector<Parameter*> parameters() const { return bias_ ? std::vector<Parameter*>{weight_, bias_} : std::vector<Parameter*>{weight_}; }
  // Parameters of one norm over C channels: 2C for LayerNorm, C for RMSNorm.
  static int64_t num_parameters(NormKind kind, int64_t C) { return kind == NormKind::kLayerNorm ? 2 * C : C; }

 private:
  int64_t C_;
  float eps_;
  NormKind kind_;
  Parameter* weight_;
  Parameter* bias_ = nullptr;
};
// The GPT-2 name, kept for callers that only ever build LayerNorms (the default kind).
using LayerNorm = Norm;

// Token embedding (V, C) plus optional learned absolute position embedding (max_positions, C).
class Embedding {
 public:
  Embedding(ParameterSet& ps, int64_t padded_vocab, int64_t C, int64_t max_positions, float init_std);
  // Vocabulary-parallel: this rank holds the word-embedding rows `vocab_shard` of the (padded_vocab, C)
  // table (the position table stays whole). forward/backward then need the vocabulary-parallel lookup of
  // loom/parallel/tensor_parallel.h; the plain ones below assume the whole table.
  Embedding(ParameterSet& ps, int64_t padded_vocab, int64_t C, int64_t max_positions, float init_std,
            ShardRange vocab_shard);
  // position_ids (B, T) i32 optional (default: 0..T-1 in every row).
  void forward(const DeviceContext& ctx, TensorView out, TensorView tokens, TensorView position_ids = {}) const;
  void backward(const DeviceContext& ctx, TensorView dout, TensorView tokens,
                TensorView position_ids = {}) const;  // grads accumulate
  Parameter& word_embeddings() const { return *word_; }
  Parameter* position_embeddings() const { return position_; }  // null without learned positions

 private:
  Parameter* word_;
  Parameter* position_ = nullptr;
};

// One dropout site's mask for one micro-batch: element i is dropped with probability p as decided by
// dropout_keep(seed, stream, i) (see loom/core/rng.h). The mask is a pure function of these three
// numbers, so backward and a recomputed forward regenerate it instead of storing it. p == 0: no dropout.
struct DropoutMask {
  float p = 0;
  uint64_t seed = 0;
  uint64_t stream = 0;
  uint64_t offset = 0;  // the tensor's first element in the mask's index space (a piece of a larger tensor)
  bool active() const { return p > 0; }
};

// Causal multi-head attention core (scores, softmax, weighted values) over Megatron's grouped qkv layout.
class AttentionCore {
 public:
  struct Saved {
    Tensor lse;           // (B, NH, T) f32
    DropoutMask dropout;  // the attention-probability dropout forward used; backward applies the same mask
  };
  explicit AttentionCore(const AttentionParams& p) : p_(p) {}
  // segment_ids (B, T) i32 optional: documents packed in a sequence do not attend to each other.
  // dropout: Megatron's attention dropout on the softmax probabilities (inactive by default).
  void forward(const DeviceContext& ctx, TensorView out, Saved& s, TensorView qkv, TensorView segment_ids = {},
               const DropoutMask& dropout = {}) const;
  void backward(const DeviceContext& ctx, TensorView dqkv, TensorView dout, TensorView qkv, TensorView out,
                const Saved& s, TensorView segment_ids = {}) const;
  const AttentionParams& params() const { return p_; }
  // params() with the attention dropout of `d` (inactive mask: none), as forward/backward pass it to the op.
  AttentionParams with_dropout(const DropoutMask& d) const;

 private:
  AttentionParams p_;
};

// Llama 3.1's frequency scaling of RoPE (Megatron's --use-rope-scaling, Hugging Face's rope_type
// "llama3"): wavelengths longer than original_max_positions / low_freq_factor are divided by `factor`,
// those shorter than original_max_positions / high_freq_factor are kept, and the band in between
// interpolates smoothly. Megatron fixes everything but the factor (--rope-scaling-factor) at these values.
struct RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_positions = 8192.0;
};

struct RotaryOptions {
  int64_t rotary_dim = 0;    // rotated channels of each head: even, in [2, HS] (--rotary-percent · HS)
  double base = 10000.0;     // --rotary-base
  bool interleaved = false;  // --rotary-interleaved: pairs (2c, 2c+1) instead of (c, c + rotary_dim/2)
  std::optional<RopeScaling> scaling;  // --use-rope-scaling
};

// Rotary position embedding of the q and k heads of a grouped qkv tensor (in place). The cos/sin tables
// (max_positions, rotary_dim/2) f32 are computed once, in f64 and rounded: angle(p, i) = p · inv_freq[i],
// inv_freq[i] = base^(-2i / rotary_dim), Llama-3 scaled when asked.
class RotaryEmbedding {
 public:
  RotaryEmbedding(const DeviceContext& ctx, const RotaryOptions& o, int64_t max_positions);
  // inv_freq[i], i < rotary_dim / 2, in f64 (scaled when o.scaling is set).
  static std::vector<double> inverse_frequencies(const RotaryOptions& o);
  // position_ids (B, T) i32 optional: the position of each token (default t).
  void forward(const DeviceContext& ctx, TensorView qkv, const AttentionParams& p, TensorView position_ids = {}) const;
  // The inverse rotation of the dq and dk heads of dqkv (in place): gradients before the rotation.
  void backward(const DeviceContext& ctx, TensorView dqkv, const AttentionParams& p,
                TensorView position_ids = {}) const;
  const Tensor& cos() const { return cos_; }
  const Tensor& sin() const { return sin_; }
  const RotaryOptions& options() const { return o_; }

 private:
  RotaryOptions o_;
  Tensor cos_, sin_;  // (max_positions, rotary_dim / 2) f32 on the context's device
};

// Megatron's --qk-layernorm: one norm over HS shared by all query heads (<prefix>.q_layernorm) and one
// shared by all key heads (<prefix>.k_layernorm), applied to the heads of a grouped qkv tensor in place
// (v heads untouched). The heads are gathered into contiguous rows for the norm ops and scattered back with
// DeviceContext::copy, one copy per (token, query group) and head kind.
class QKNorm {
 public:
  struct Saved {
    Tensor q_inp;  // (B, T, NH·HS) the query heads before the norm
    Tensor k_inp;  // (B, T, NKV·HS) the key heads before the norm
    Norm::Saved q, k;  // statistics over (B·T·NH) and (B·T·NKV) rows
  };
  QKNorm(ParameterSet& ps, const std::string& prefix, const AttentionParams& p, float eps, NormKind kind);
  // Normalises the q and k heads of qkv (B, T, NKV·(NH/NKV + 2)·HS) in place. scratch: at least B·T·NH·HS
  // elements of qkv's dtype (holds a norm output before it is scattered back).
  void forward(const DeviceContext& ctx, TensorView qkv, Saved& s, TensorView scratch) const;
  // Replaces the dq and dk heads of dqkv by the gradients before the norm; scratch_a and scratch_b as
  // forward's scratch. Weight gradients accumulate.
  void backward(const DeviceContext& ctx, TensorView dqkv, const Saved& s, TensorView scratch_a,
                TensorView scratch_b) const;

  // The q-norm's and the k-norm's parameters.
  std::vector<Parameter*> parameters() const {
    std::vector<Parameter*> out = q_norm_.parameters();
    for (Parameter* p : k_norm_.parameters()) out.push_back(p);
    return out;
  }

 private:
  AttentionParams p_;
  Norm q_norm_, k_norm_;
};

// out = dropout(inp) with the mask `d` (out may alias inp), and its backward dinp = dropout'(dout) (dinp may
// alias dout). With an inactive mask they copy (or do nothing when the views alias).
void dropout_forward(const DeviceContext& ctx, TensorView out, TensorView inp, const DropoutMask& d);
void dropout_backward(const DeviceContext& ctx, TensorView dinp, TensorView dout, const DropoutMask& d);

// Allocates `t` with shape/dtype on ctx unless it already has exactly that shape (buffers are reused
// across steps; the shape only changes when the batch shape does).
void ensure_tensor(const DeviceContext& ctx, Tensor& t, Shape s, DType dt = DType::kF32);

}  // namespace loom

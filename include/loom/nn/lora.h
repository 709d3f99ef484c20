// LoRA (Hu et al. 2021; PEFT's LoraLayer, NeMo's ParallelLinearAdapter): a low-rank update added to a
// frozen linear layer's output, y = W x (+ b) + scale · B (A · dropout(x)), A (rank, in), B (out, rank),
// scale = alpha / rank. Initialised as PEFT does: A from kaiming_uniform_(a = sqrt(5)), i.e.
// U(-1/sqrt(in), 1/sqrt(in)) of the GLOBAL in, and B zero, so the adapted layer starts equal to the base.
// The parameters are <prefix>.lora_A.weight and <prefix>.lora_B.weight (no weight decay exemption: PEFT
// trains them with the optimizer's weight decay). Dropout uses Philox masks (seed, stream), regenerated in
// backward, so nothing but h = scale · A · dropout(x) (N, rank) is ever kept, and even that only by the
// single-device forward/backward pair (the parallel linears recompute it: 2·N·in·rank flops, noise next to
// the base GEMM).
//
// Placement in a tensor-parallel layer (LoraPlacement), as NeMo places its adapters:
//   column-parallel layer: A whole (replicated), B holds this rank's output rows; h is the same on every
//     rank, so dA and the adapter's input gradient are partial sums over the TP group (A is marked
//     Parameter::sequence_parallel so the optimizer completes its gradient there; the input gradient joins
//     the base layer's before its all-reduce);
//   row-parallel layer: A holds this rank's input columns, B whole; h is a partial sum the caller
//     all-reduces before up_accumulate.
// A "slice" adapter adapts some of a fused layer's output columns only (PEFT's q_proj on Loom's fused
// linear_qkv, gate_proj on the fused [gate | up] fc1): its B's local rows land at `columns` of the layer's
// local output. Single-device building block with explicit forward/backward like loom/nn/modules.h; the
// parallel linears (loom/parallel/parallel_linear.h) own and run the adapters.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "loom/nn/modules.h"
#include "loom/param/parameter.h"

namespace loom {

struct LoraConfig {
  int64_t rank = 0;      // --lora-rank
  float alpha = 32.0f;   // --lora-alpha (scale = alpha / rank)
  float dropout = 0.0f;  // --lora-dropout, on the adapter's input
  float scale() const { return alpha / float(rank); }
};

struct LoraPlacement {
  int64_t in_global = 0, out_global = 0;  // the adapter's global (in, out); out is the adapted slice's width
  // Row-parallel layer: A holds this rank's input columns (partition dim 1); unset: A whole.
  std::optional<ShardRange> a_shard;
  // Column-parallel layer: B holds these output rows (partition dim 0); empty: B whole.
  std::vector<ShardRange> b_shard;
  // The adapted columns of the layer's local output, in the order of B's local rows; empty: all of them.
  std::vector<ShardRange> columns;
  int64_t layer_out = 0;  // the layer's local output width (with `columns`)
  // A whole single-device adapter (in, out).
  static LoraPlacement whole(int64_t in, int64_t out) { return {in, out, std::nullopt, {}, {}, out}; }
};

class LoraAdapter {
 public:
  struct Saved {
    Tensor h;  // (N, rank) scale · A · dropout(x)
  };
  // UserError naming the flag for a rank < 1 or > min(in, out) (the update would not be low rank), a
  // dropout outside [0, 1) or an alpha <= 0.
  LoraAdapter(ParameterSet& ps, const std::string& prefix, int64_t in_features, int64_t out_features,
              const LoraConfig& cfg);
  LoraAdapter(ParameterSet& ps, const std::string& prefix, const LoraPlacement& place, const LoraConfig& cfg);

  // Single device: out (N, out) += scale · dropout(inp) A^T B^T; inp (N, in), both in the compute dtype.
  // The dropout mask is (seed, stream) over the flat (N, in) index.
  void forward(const DeviceContext& ctx, TensorView out, Saved& s, TensorView inp, uint64_t seed = 0,
               uint64_t stream = 0) const;
  // dA, dB accumulate; dinp ACCUMULATES (+=) the adapter's input gradient (the base layer wrote its own
  // first); dinp empty skips it.
  void backward(const DeviceContext& ctx, TensorView dinp, TensorView dout, TensorView inp, const Saved& s,
                uint64_t seed = 0, uint64_t stream = 0) const;

  // ---- the steps, for layers that put collectives between them ----
  // dropout(x) as (N, in) with `mask` (its p: the adapter's dropout in training, 0 in evaluation), or x
  // itself when the mask is inactive. `holder` keeps the dropped copy alive.
  TensorView input(const DeviceContext& ctx, TensorView x, Tensor& holder, const DropoutMask& mask) const;
  // h (N, rank) = scale · x A^T (x the adapter's input after dropout; a row-parallel rank's local columns).
  void down(const DeviceContext& ctx, TensorView h, TensorView x) const;
  // out (N, layer_out) += h B^T at the adapted columns.
  void up_accumulate(const DeviceContext& ctx, TensorView out, TensorView h) const;
  // dB += dout^T h (the adapted columns of dout); dh (N, rank) = scale · dout B (overwrite).
  void up_backward(const DeviceContext& ctx, TensorView dh, TensorView dout, TensorView h) const;
  // dA += dh^T x; the input gradient dh A through the dropout mask ADDED to dx (empty: skipped).
  void down_backward(const DeviceContext& ctx, TensorView dx, TensorView dh, TensorView x_dropped,
                     const DropoutMask& mask) const;

  Parameter& a() const { return *a_; }
  Parameter& b() const { return *b_; }
  const LoraConfig& config() const { return cfg_; }
  int64_t in_features() const { return in_; }  // local
  int64_t rank() const { return cfg_.rank; }

 private:
  // B spread over the layer's full local output rows (zero elsewhere), for slice adapters.
  Tensor spread_b(const DeviceContext& ctx) const;
  int64_t in_, out_;  // local (out: B's local rows)
  LoraPlacement place_;
  LoraConfig cfg_;
  Parameter* a_;
  Parameter* b_;
};

}  // namespace loom

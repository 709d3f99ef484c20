// A mixture-of-experts MLP (Megatron-Core's MoELayer) in place of a transformer layer's dense MLP: the
// router, the token dispatcher (expert parallelism), the grouped expert MLP and optional shared experts.
// Private to the model layer; TransformerLayer owns one per MoE layer.
//
// Forward over this rank's residual rows x (N_l, C) (its SP shard / CP chunks, or all tokens):
//   router (the micro-batch's tokens routed together, RoutingGroup)  -> probs, this rank's row map
//   xp = permute(x)  -> dispatcher -> xe (the local experts' rows) -> experts -> ye -> combine -> yp
//   y = unpermute(yp, probs) [+ shared(x) · (sigmoid(x · gate) with --moe-shared-expert-gate)]
// Backward is the exact reverse; the router adds the aux/z-loss gradients scaled by aux_grad_scale. The
// buffers of one call are allocated per call (their sizes depend on the routing) and kept in
// MoeLayerSaved until backward. Parameter order: router, shared experts, then the routed experts last (the
// expert-parallel unit).
#pragma once
#include <functional>
#include <numeric>
#include <optional>

#include "loom/model/gpt.h"
#include "loom/nn/moe.h"
#include "loom/parallel/moe_dispatch.h"
#include "loom/parallel/parallel_linear.h"

namespace loom {

struct MoeLayerSaved {
  Router::Saved router;
  Tensor xp;                     // (M_l, C) this rank's rows, expert-major
  TokenDispatcher::Saved disp;
  Tensor xe, ye;                 // (rows, C) the local experts' input and output rows
  GroupedMLP::Saved experts;
  Tensor yp;                     // (M_l, C) the experts' outputs of this rank's rows
  Tensor sh_fc;                  // (N, S1/TP) shared fc1's output
  Tensor sh_y;                   // (N_l, C) shared experts' output (before the gate)
  Tensor gate;                   // (N_l, 1) f32 sigmoid(x · gate)
  Tensor gate_rows;              // (N_l, 1) i32 the identity row map that applies it
};

// Per-call settings the model supplies.
struct MoeCall {
  const RoutingGroup* group = nullptr;  // the micro-batch's tokens over ranks (null: all local)
  int64_t seq_length = 0;               // T (seq_aux_loss)
  bool training = false;
  double aux_grad_scale = 1.0;          // the main loss's backward scale
  TensorView sp_gathered{}, sp_grad{};  // (N, C) scratch for the shared experts' column input under SP
  bool overlap_shared = false;          // --moe-shared-expert-overlap
};

class MoeMlp {
 public:
  MoeMlp(ParameterSet& ps, const GPTConfig& c, int64_t layer, const TpRegion& region, const ExpertParallel& ep);
  // y (N_l, C) overwritten.
  void forward(const DeviceContext& ctx, const MoeCall& m, TensorView y, MoeLayerSaved& s, TensorView x) const;
  // dx (N_l, C) overwritten from dy (N_l, C); parameter gradients accumulate; records the statistics.
  void backward(const DeviceContext& ctx, const MoeCall& m, TensorView dx, TensorView dy, TensorView x,
                MoeLayerSaved& s) const;

  Router router;
  std::optional<ColumnParallelLinear> shared_fc1;
  std::optional<RowParallelLinear> shared_fc2;
  Parameter* shared_gate = nullptr;  // (1, C)
  TokenDispatcher dispatcher;
  GroupedMLP experts;
  MoeLayerStats& stats() const { return stats_; }

 private:
  static std::vector<ShardRange> shared_fc1_shard(const GPTConfig& c, const TpRegion& region);
  void shared_forward(const DeviceContext& ctx, const MoeCall& m, MoeLayerSaved& s, TensorView x) const;
  void shared_backward(const DeviceContext& ctx, const MoeCall& m, TensorView dx, TensorView dy, TensorView x,
                       MoeLayerSaved& s) const;
  TpRegion region_;
  int64_t C_, S_local_;  // hidden; this rank's shared-expert width (S / TP)
  bool gated_;
  mutable MoeLayerStats stats_;
};

}  // namespace loom

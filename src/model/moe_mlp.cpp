// The mixture-of-experts MLP's forward and backward (see moe_mlp.h). Invariant: backward reads only what
// forward saved in MoeLayerSaved (a recomputed forward rebuilds all of it, routing included, bit for bit).
#include "model/moe_mlp.h"

#include <cmath>

#include "model/transformer_layer.h"

namespace loom {

namespace {

void activation_forward(const DeviceContext& ctx, bool gated, TensorView act, TensorView fc, int64_t N, int64_t F) {
  if (gated) ctx.ops().glu_forward(act.reshape({N, F}), fc.reshape({N, 2 * F}), GluKind::kSwiGLU);
  else ctx.ops().gelu_forward(act, fc);
}

}  // namespace

MoeMlp::MoeMlp(ParameterSet& ps, const GPTConfig& c, int64_t layer, const TpRegion& region, const ExpertParallel& ep)
    : router(ps, TransformerLayer::prefix(layer) + "mlp", c.hidden_size, c.moe.router, c.init_method_std),
      shared_fc1(c.moe.shared_expert_intermediate_size > 0
                     ? std::optional<ColumnParallelLinear>(
                           std::in_place, ps, TransformerLayer::prefix(layer) + "mlp.shared_experts.linear_fc1",
                           c.hidden_size, (c.gated_mlp() ? 2 : 1) * c.moe.shared_expert_intermediate_size, false,
                           c.init_method_std, region, shared_fc1_shard(c, region))
                     : std::nullopt),
      shared_fc2(c.moe.shared_expert_intermediate_size > 0
                     ? std::optional<RowParallelLinear>(
                           std::in_place, ps, TransformerLayer::prefix(layer) + "mlp.shared_experts.linear_fc2",
                           c.moe.shared_expert_intermediate_size, c.hidden_size, false, TransformerLayer::scaled_std(c),
                           region, even_shard(c.moe.shared_expert_intermediate_size, region.size(), region.rank()))
                     : std::nullopt),
      shared_gate(c.moe.shared_expert_gate ? &ps.add(TransformerLayer::prefix(layer) + "mlp.shared_experts.gate_weight",
                                                     {1, c.hidden_size}, InitKind::kNormal, c.init_method_std, false)
                                           : nullptr),
      dispatcher(c.moe.num_experts, ep),
      experts(ps, TransformerLayer::prefix(layer) + "mlp", c.moe.num_experts / ep.ep_size(), c.hidden_size,
              c.moe_ffn_hidden_size(), c.gated_mlp(), c.init_method_std, TransformerLayer::scaled_std(c),
              dispatcher.first_local_expert(), ep.etp_replicated || ep.etp_size() > 1 ? ep.etp_size() : 1,
              ep.etp_rank()),
      region_(region),
      C_(c.hidden_size),
      S_local_(c.moe.shared_expert_intermediate_size / region.size()),
      gated_(c.gated_mlp()) {
  // Replicated parameters used on this rank's token shard only: partial gradients, summed over TP.
  if (region.sequence_parallel) {
    router.weight().sequence_parallel = true;
    if (shared_gate) shared_gate->sequence_parallel = true;
  }
  stats_.layer = layer;
  stats_.tokens_per_expert.assign(size_t(c.moe.num_experts), 0.0);
}

std::vector<ShardRange> MoeMlp::shared_fc1_shard(const GPTConfig& c, const TpRegion& region) {
  const int64_t S = c.moe.shared_expert_intermediate_size;
  const ShardRange s = even_shard(S, region.size(), region.rank());
  if (!c.gated_mlp()) return {s};
  return {s, {S + s.start, s.size}};
}

void MoeMlp::shared_forward(const DeviceContext& ctx, const MoeCall& m, MoeLayerSaved& s, TensorView x) const {
  const int64_t Nl = x.numel() / C_, N = region_.sequence_parallel ? Nl * region_.size() : Nl;
  const DType cd = x.dtype();
  ensure_tensor(ctx, s.sh_fc, {N, (gated_ ? 2 : 1) * S_local_}, cd);
  ensure_tensor(ctx, s.sh_y, {Nl, C_}, cd);
  shared_fc1->forward(ctx, s.sh_fc, x, m.sp_gathered);
  Tensor act = ctx.empty({N, S_local_}, cd);
  activation_forward(ctx, gated_, act, s.sh_fc, N, S_local_);
  Tensor full = region_.sequence_parallel ? ctx.empty({N, C_}, cd) : Tensor();
  const TensorView r = shared_fc2->forward(ctx, region_.sequence_parallel ? full.view() : s.sh_y.view(), act,
                                           RowEpilogue{}, s.sh_y);
  if (r.raw() != s.sh_y.raw()) ctx.copy(s.sh_y, r);
  if (shared_gate) {  // gate = sigmoid(x · g), on the host (N_l values)
    Tensor z = ctx.empty({Nl, 1}, DType::kF32);
    ctx.ops().matmul_forward(z, x.reshape({Nl, C_}), shared_gate->compute, TensorView());
    std::vector<float> g(static_cast<size_t>(Nl));
    if (Nl > 0) ctx.copy(TensorView(g.data(), DType::kF32, {Nl, 1}), z);
    ctx.synchronize();
    for (float& v : g) v = float(1.0 / (1.0 + std::exp(-double(v))));
    ensure_tensor(ctx, s.gate, {Nl, 1});
    if (Nl > 0) ctx.copy(s.gate, TensorView(g.data(), DType::kF32, {Nl, 1}));
    // Row n scaled by gate[n]: the weighted combine of moe_unpermute over the identity row map (kept
    // across calls of the same size).
    if (!s.gate_rows.defined() || s.gate_rows.shape()[0] != Nl) {
      std::vector<int32_t> id(static_cast<size_t>(Nl));
      for (int64_t n = 0; n < Nl; ++n) id[size_t(n)] = int32_t(n);
      s.gate_rows = ctx.empty({Nl, 1}, DType::kI32);
      if (Nl > 0) ctx.copy(s.gate_rows, TensorView(id.data(), DType::kI32, {Nl, 1}));
    }
  }
}

void MoeMlp::shared_backward(const DeviceContext& ctx, const MoeCall& m, TensorView dx, TensorView dy, TensorView x,
                             MoeLayerSaved& s) const {
  const int64_t Nl = x.numel() / C_, N = region_.sequence_parallel ? Nl * region_.size() : Nl;
  const DType cd = x.dtype();
  TensorView dsh = dy;  // d(shared output before the gate)
  Tensor dsh_t, dgx;
  if (shared_gate) {
    // y = gate ⊙ sh: d(sh) = gate ⊙ dy, d(gate)[n] = <dy[n], sh[n]>, d(z) = d(gate) · gate · (1 - gate).
    Tensor dgate = ctx.empty({Nl, 1}, DType::kF32);
    dsh_t = ctx.empty({Nl, C_}, cd);
    ctx.ops().moe_unpermute_backward(dsh_t, dgate, dy.reshape({Nl, C_}), s.sh_y, s.gate, s.gate_rows);
    dsh = dsh_t;
    std::vector<float> dg(static_cast<size_t>(Nl)), g(static_cast<size_t>(Nl));
    if (Nl > 0) {
      ctx.copy(TensorView(dg.data(), DType::kF32, {Nl, 1}), dgate);
      ctx.copy(TensorView(g.data(), DType::kF32, {Nl, 1}), s.gate);
    }
    ctx.synchronize();
    for (int64_t n = 0; n < Nl; ++n) dg[size_t(n)] = dg[size_t(n)] * g[size_t(n)] * (1.0f - g[size_t(n)]);
    Tensor dz = ctx.empty({Nl, 1}, DType::kF32);
    if (Nl > 0) ctx.copy(dz, TensorView(dg.data(), DType::kF32, {Nl, 1}));
    if (cd != DType::kF32) {
      Tensor d16 = ctx.empty({Nl, 1}, cd);
      ctx.ops().cast(d16, dz);
      dz = d16;
    }
    dgx = ctx.empty({Nl, C_}, cd);
    ctx.ops().matmul_backward(dgx, shared_gate->grad, TensorView(), dz, x.reshape({Nl, C_}), shared_gate->compute);
  }
  Tensor act = ctx.empty({N, S_local_}, cd), dact = ctx.empty({N, S_local_}, cd);
  Tensor full = ctx.empty({N, C_}, cd);
  Tensor dfc = ctx.empty(s.sh_fc.shape(), cd);
  // The activation is recomputed for shared_fc2's weight gradient; where that backward splits, from the pass
  // that takes its gradient (as TransformerLayer::mlp_backward).
  auto activation_backward = [&](TensorView act_out) {
    if (gated_) ctx.ops().glu_backward(dfc.reshape({N, 2 * S_local_}), s.sh_fc.reshape({N, 2 * S_local_}),
                                       dact.reshape({N, S_local_}), GluKind::kSwiGLU, act_out);
    else ctx.ops().gelu_backward(dfc, s.sh_fc, dact, act_out);
  };
  if (shared_fc2->splits_backward()) {
    shared_fc2->backward(ctx, dact, dsh, act, RowEpilogue{}, full, {}, [&] { activation_backward(act); });
  } else {
    activation_forward(ctx, gated_, act, s.sh_fc, N, S_local_);
    shared_fc2->backward(ctx, dact, dsh, act, RowEpilogue{}, full);
    activation_backward(TensorView());
  }
  shared_fc1->backward(ctx, dx, dfc, x, m.sp_gathered, m.sp_grad);
  if (dgx.defined()) ctx.ops().residual_forward(dx, dx, dgx);
}

void MoeMlp::forward(const DeviceContext& ctx, const MoeCall& m, TensorView y, MoeLayerSaved& s, TensorView x) const {
  const int64_t Nl = x.numel() / C_;
  const TensorView x2 = x.reshape({Nl, C_});
  router.forward(ctx, s.router, x2, m.seq_length, m.training, m.group);
  const int64_t Ml = std::accumulate(s.router.group_sizes.begin(), s.router.group_sizes.end(), int64_t(0));
  s.xp = ctx.empty({Ml, C_}, x.dtype());
  ctx.ops().moe_permute_forward(s.xp, x2, s.router.row_id_map);
  const bool overlap = m.overlap_shared && shared_fc1.has_value();
  std::function<void()> run_shared;
  if (overlap) run_shared = [&] { shared_forward(ctx, m, s, x); };
  s.xe = dispatcher.dispatch(ctx, s.disp, s.xp, s.router.group_sizes, run_shared);
  if (shared_fc1 && !overlap) shared_forward(ctx, m, s, x);
  s.ye = ctx.empty(s.xe.shape(), x.dtype());
  experts.forward(ctx, s.ye, s.experts, s.xe, s.disp.group_sizes);
  s.yp = dispatcher.combine(ctx, s.disp, s.ye);
  ctx.ops().moe_unpermute_forward(y.reshape({Nl, C_}), s.yp, s.router.probs, s.router.row_id_map);
  if (shared_fc1) {
    if (shared_gate) {
      Tensor gated = ctx.empty({Nl, C_}, x.dtype());
      ctx.ops().moe_unpermute_forward(gated, s.sh_y, s.gate, s.gate_rows);
      ctx.ops().residual_forward(y, y, gated);
    } else {
      ctx.ops().residual_forward(y, y, s.sh_y);
    }
  }
}

void MoeMlp::backward(const DeviceContext& ctx, const MoeCall& m, TensorView dx, TensorView dy, TensorView x,
                      MoeLayerSaved& s) const {
  const int64_t Nl = x.numel() / C_, E = router.config().num_experts;
  const TensorView x2 = x.reshape({Nl, C_}), dy2 = dy.reshape({Nl, C_});
  Tensor dyp = ctx.empty(s.yp.shape(), x.dtype()), dprobs = ctx.empty({Nl, E}, DType::kF32);
  ctx.ops().moe_unpermute_backward(dyp, dprobs, dy2, s.yp, s.router.probs, s.router.row_id_map);
  const Tensor dye = dispatcher.combine_backward(ctx, s.disp, dyp);
  Tensor dxe = ctx.empty(s.xe.shape(), x.dtype());
  experts.backward(ctx, dxe, dye, s.xe, s.experts, s.disp.group_sizes);
  const Tensor dxp = dispatcher.dispatch_backward(ctx, s.disp, dxe);
  ctx.ops().moe_permute_backward(dx.reshape({Nl, C_}), dxp, s.router.row_id_map);
  Tensor tmp = ctx.empty({Nl, C_}, x.dtype());
  router.backward(ctx, tmp, dprobs, x2, s.router, m.aux_grad_scale);
  ctx.ops().residual_forward(dx, dx, tmp);
  if (shared_fc1) {
    shared_backward(ctx, m, tmp, dy, x, s);
    ctx.ops().residual_forward(dx, dx, tmp);
  }
  // Statistics of this training micro-batch (backward runs once per micro-batch; a recomputed forward
  // would count twice).
  const RouterConfig& rc = router.config();
  const Routing& r = s.router.routing;
  if (rc.aux_loss_coeff != 0) stats_.load_balancing_loss += r.aux_loss / rc.aux_loss_coeff;
  if (rc.z_loss_coeff != 0) stats_.z_loss += r.z_loss / rc.z_loss_coeff;
  ++stats_.micro_batches;
  for (int64_t e = 0; e < E; ++e) {
    stats_.tokens_per_expert[size_t(e)] += double(r.tokens_per_expert[size_t(e)]);
    if (rc.enable_expert_bias) router.local_tokens_per_expert()[size_t(e)] += float(r.tokens_per_expert[size_t(e)]);
  }
}

}  // namespace loom

// The grouped expert MLP: fc1 (grouped GEMM) -> SwiGLU or GeLU -> fc2 (grouped GEMM) over the experts'
// contiguous row groups. Each layer's E expert weights are declared consecutively, so allocate() lays them
// out contiguously and one (E, rows, cols) view of the compute copy (and of the gradient) feeds the grouped
// GEMM; the views check that contiguity (a parameter storage that binds experts elsewhere would fail loudly).
// Saved: the fc1 output and the activation output (M rows each); backward allocates its two temporaries.
#include "loom/nn/modules.h"
#include "loom/nn/moe.h"

namespace loom {

namespace {

// The (E, rows, cols) view over E consecutive parameters' tensors (compute copy or gradient).
TensorView stacked(const std::vector<Parameter*>& ps, bool grad, const char* what) {
  const Tensor& first = grad ? ps[0]->grad : ps[0]->compute;
  LOOM_CHECK(first.defined(), "[GroupedMLP] ", what, ": ", ps[0]->name, " has no ", grad ? "gradient" : "compute copy");
  const int64_t rows = ps[0]->shape[0], cols = ps[0]->shape[1];
  const int64_t bytes = rows * cols * int64_t(dtype_size(first.dtype()));
  for (size_t e = 1; e < ps.size(); ++e) {
    const Tensor& t = grad ? ps[e]->grad : ps[e]->compute;
    LOOM_CHECK(t.defined() && static_cast<const char*>(t.raw()) ==
                                  static_cast<const char*>(first.raw()) + int64_t(e) * bytes,
               "[GroupedMLP] ", what, ": the expert weights ", ps[0]->name, "..", ps.back()->name,
               " are not contiguous in the parameter buffer");
  }
  return TensorView(first.raw(), first.dtype(), {int64_t(ps.size()), rows, cols}, first.device());
}

}  // namespace

GroupedMLP::GroupedMLP(ParameterSet& ps, const std::string& prefix, int64_t num_experts, int64_t hidden,
                       int64_t ffn_hidden, bool gated, float init_std, float fc2_init_std, int64_t first_expert, int etp,
                       int etp_rank)
    : E_(num_experts), C_(hidden), F_(ffn_hidden / etp), gated_(gated) {
  LOOM_CHECK(num_experts >= 1 && hidden >= 1 && ffn_hidden >= 1 && first_expert >= 0, "[GroupedMLP] expected positive "
             "sizes, got E=", num_experts, " C=", hidden, " F=", ffn_hidden, " first expert ", first_expert);
  LOOM_CHECK(etp >= 1 && etp_rank >= 0 && etp_rank < etp && ffn_hidden % etp == 0, "[GroupedMLP] the FFN width ",
             ffn_hidden, " must split evenly over ", etp, " expert-tensor-parallel ranks (rank ", etp_rank, ")");
  const int64_t F1 = gated ? 2 * ffn_hidden : ffn_hidden;
  const ShardRange f{int64_t(etp_rank) * F_, F_};
  const std::vector<ShardRange> fc1_rows =
      gated ? std::vector<ShardRange>{f, {ffn_hidden + f.start, F_}} : std::vector<ShardRange>{f};
  auto name = [&](const char* which, int64_t e) {
    return prefix + ".experts." + which + ".weight" + std::to_string(first_expert + e);
  };
  for (int64_t e = 0; e < E_; ++e)
    fc1_.push_back(etp == 1 ? &ps.add(name("linear_fc1", e), {F1, hidden}, InitKind::kNormal, init_std, false)
                            : &ps.add_sharded(name("linear_fc1", e), {F1, hidden}, 0, fc1_rows, InitKind::kNormal,
                                              init_std, false));
  for (int64_t e = 0; e < E_; ++e)
    fc1_[size_t(e)]->expert = true;
  for (int64_t e = 0; e < E_; ++e)
    fc2_.push_back(etp == 1 ? &ps.add(name("linear_fc2", e), {hidden, ffn_hidden}, InitKind::kNormal, fc2_init_std, false)
                            : &ps.add_sharded(name("linear_fc2", e), {hidden, ffn_hidden}, 1, {f}, InitKind::kNormal,
                                              fc2_init_std, false));
  for (Parameter* p : fc2_) p->expert = true;
}

TensorView GroupedMLP::fc1_weight() const { return stacked(fc1_, false, "fc1 weight"); }
TensorView GroupedMLP::fc2_weight() const { return stacked(fc2_, false, "fc2 weight"); }
TensorView GroupedMLP::fc1_grad() const { return stacked(fc1_, true, "fc1 gradient"); }
TensorView GroupedMLP::fc2_grad() const { return stacked(fc2_, true, "fc2 gradient"); }

void GroupedMLP::forward(const DeviceContext& ctx, TensorView out, Saved& s, TensorView inp,
                         const std::vector<int64_t>& group_sizes) const {
  const int64_t M = inp.numel() / C_, F1 = gated_ ? 2 * F_ : F_;
  const DType dt = inp.dtype();
  ensure_tensor(ctx, s.fc1_out, {M, F1}, dt);
  ensure_tensor(ctx, s.act_out, {M, F_}, dt);
  const OpTable& ops = ctx.ops();
  ops.grouped_matmul_forward(s.fc1_out, inp.reshape({M, C_}), fc1_weight(), group_sizes);
  if (M > 0) {
    if (gated_) ops.glu_forward(s.act_out, s.fc1_out, GluKind::kSwiGLU);
    else ops.gelu_forward(s.act_out, s.fc1_out);
  }
  ops.grouped_matmul_forward(out.reshape({M, C_}), s.act_out, fc2_weight(), group_sizes);
}

void GroupedMLP::backward(const DeviceContext& ctx, TensorView dinp, TensorView dout, TensorView inp, const Saved& s,
                          const std::vector<int64_t>& group_sizes) const {
  const int64_t M = inp.numel() / C_, F1 = gated_ ? 2 * F_ : F_;
  const DType dt = inp.dtype();
  const OpTable& ops = ctx.ops();
  Tensor dact = ctx.empty({M, F_}, dt), dfc1 = ctx.empty({M, F1}, dt);
  // Each weight gradient is stored rather than added when it is the step's first write (take_grad_write).
  ops.grouped_matmul_backward(dact, fc2_grad(), dout.reshape({M, C_}), s.act_out, fc2_weight(), group_sizes,
                              take_grad_write(ctx, fc2_));
  if (M > 0) {
    if (gated_) ops.glu_backward(dfc1, s.fc1_out, dact, GluKind::kSwiGLU);
    else ops.gelu_backward(dfc1, s.fc1_out, dact);
  }
  ops.grouped_matmul_backward(dinp.reshape({M, C_}), fc1_grad(), dfc1, inp.reshape({M, C_}), fc1_weight(),
                              group_sizes, take_grad_write(ctx, fc1_));
}

}  // namespace loom

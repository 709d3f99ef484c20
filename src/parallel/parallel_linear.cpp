// Tensor-parallel linear layers and their mappings (see include/loom/parallel/parallel_linear.h).
#include "loom/parallel/parallel_linear.h"

#include "loom/parallel/tensor_parallel.h"

namespace loom {

namespace {

void gemm_forward(const DeviceContext& ctx, const std::optional<Fp8Gemm>& fp8, TensorView out, TensorView inp,
                  const Parameter& w, TensorView bias) {
  if (fp8) {
    fp8->forward(ctx, out, inp, w.compute, bias);
    return;
  }
  ctx.ops().matmul_forward(out, inp, w.compute, bias);
}

// The weight gradient is stored rather than added when it is the step's first write (take_grad_write). With
// `between`: the input gradient, then `between` (which may write inp), then the weight's and bias's (never
// with FP8: RowParallelLinear::backward checks splits_backward first).
void gemm_backward(const DeviceContext& ctx, const std::optional<Fp8Gemm>& fp8, TensorView dinp, Parameter& w,
                   TensorView dbias, TensorView dout, TensorView inp, const std::function<void()>& between = {}) {
  if (between) {
    ctx.ops().matmul_backward(dinp, TensorView(), TensorView(), dout, inp, w.compute);
    between();
    ctx.ops().matmul_backward(TensorView(), w.grad, dbias, dout, inp, w.compute, take_grad_write(ctx, w));
    return;
  }
  const GradWrite write = take_grad_write(ctx, w);
  if (fp8) {
    fp8->backward(ctx, dinp, w.grad, dbias, dout, inp, w.compute, write);
    return;
  }
  ctx.ops().matmul_backward(dinp, w.grad, dbias, dout, inp, w.compute, write);
}

// One adapter's dropped input and h = scale · A · x, the partial h all-reduced over `reduce` (row-parallel
// layers; null: h is complete).
struct LoraActs {
  Tensor dropped, h;
  TensorView x;
};
LoraActs lora_down(const DeviceContext& ctx, const LoraAdapter& a, TensorView input, const DropoutMask& mask,
                   size_t k, const Communicator* reduce) {
  LoraActs r;
  r.x = a.input(ctx, input, r.dropped, {mask.p, mask.seed, lora_stream(mask.stream, k), mask.offset});
  r.h = ctx.empty({r.x.size(0), a.rank()}, input.dtype());
  a.down(ctx, r.h, r.x);
  if (reduce != nullptr) tp_all_reduce(reduce, r.h);
  return r;
}

// The adapters' backward given the layer's output gradient `dout` (the adapted layer's full local output
// rows): dA, dB accumulate, their input gradients added to dx.
void lora_backward(const DeviceContext& ctx, const std::vector<std::unique_ptr<LoraAdapter>>& adapters,
                   TensorView dx, TensorView dout, TensorView input, const DropoutMask& mask,
                   const Communicator* reduce) {
  for (size_t k = 0; k < adapters.size(); ++k) {
    const LoraAdapter& a = *adapters[k];
    const LoraActs r = lora_down(ctx, a, input, mask, k, reduce);
    Tensor dh = ctx.empty(r.h.shape(), dout.dtype());
    a.up_backward(ctx, dh, dout, r.h);
    a.down_backward(ctx, dx, dh, r.x, {mask.p, mask.seed, lora_stream(mask.stream, k), mask.offset});
  }
}

}  // namespace

uint64_t lora_stream(uint64_t stream, size_t k) { return stream ^ (uint64_t(k + 1) * 0x9E3779B97F4A7C15ull); }

LoraAdapter& Fp8GemmOwner::add_lora(ParameterSet& ps, const std::string& prefix, const LoraPlacement& place,
                                    const LoraConfig& cfg) {
  lora_.push_back(std::make_unique<LoraAdapter>(ps, prefix, place, cfg));
  return *lora_.back();
}

TensorView copy_or_gather_to_tp_forward(const TpRegion& r, TensorView shard, TensorView full) {
  if (!r.sequence_parallel) return shard;  // copy_to_tp: the input is replicated already
  sp_all_gather(r.tp, full, shard);
  return full;
}

void copy_or_gather_to_tp_backward(const TpRegion& r, TensorView dshard, TensorView dfull) {
  if (r.sequence_parallel)
    sp_reduce_scatter(r.tp, dshard, dfull);
  else
    tp_all_reduce(r.tp, dshard);
}

TensorView reduce_or_scatter_from_tp_forward(const TpRegion& r, TensorView full, TensorView shard) {
  if (!r.sequence_parallel) {
    tp_all_reduce(r.tp, full);
    return full;
  }
  sp_reduce_scatter(r.tp, shard, full);
  return shard;
}

TensorView reduce_or_scatter_from_tp_backward(const TpRegion& r, TensorView dfull, TensorView dshard) {
  if (!r.sequence_parallel) return dshard;
  sp_all_gather(r.tp, dfull, dshard);
  return dfull;
}

void Fp8GemmOwner::enable_fp8(const DeviceContext& ctx, const Shape& weight_shape, const Fp8ScalingGroup* fwd,
                              int input_slot, int weight_slot, const Fp8ScalingGroup* bwd, int grad_slot, bool wgrad) {
  fp8_.emplace(fwd, input_slot, weight_slot, bwd, grad_slot, wgrad);
  fp8_->reserve(ctx, weight_shape);
}

// ---- ColumnParallelLinear ---------------------------------------------------------------------------

ColumnParallelLinear::ColumnParallelLinear(ParameterSet& ps, const std::string& prefix, int64_t in_features,
                                           int64_t out_features, bool bias, float init_std, const TpRegion& region,
                                           std::vector<ShardRange> shard)
    : name_(prefix), region_(region) {
  const Linear lin = region.size() == 1
                         ? Linear(ps, prefix, in_features, out_features, bias, init_std)
                         : Linear(ps, prefix, in_features, out_features, bias, init_std, 0, std::move(shard));
  weight_ = &lin.weight();
  bias_ = lin.bias();
}

ColumnParallelLinear::ColumnParallelLinear(const std::string& prefix, Parameter& borrowed_weight,
                                           const TpRegion& region)
    : name_(prefix), region_(region), weight_(&borrowed_weight) {}

void ColumnParallelLinear::forward(const DeviceContext& ctx, TensorView out, TensorView input, TensorView gathered,
                                   const DropoutMask& lora_dropout) const {
  const TensorView x = copy_or_gather_to_tp_forward(region_, input, gathered);
  gemm_forward(ctx, fp8_, out, x, *weight_, bias_ ? bias_->compute.view() : TensorView());
  for (size_t k = 0; k < lora_.size(); ++k)
    lora_[k]->up_accumulate(ctx, out, lora_down(ctx, *lora_[k], x, lora_dropout, k, nullptr).h);
}

void ColumnParallelLinear::backward(const DeviceContext& ctx, TensorView dinput, TensorView dout, TensorView input,
                                    TensorView gathered, TensorView dgathered, const DropoutMask& lora_dropout) const {
  const TensorView x = copy_or_gather_to_tp_forward(region_, input, gathered);
  const TensorView dx = region_.sequence_parallel ? dgathered : dinput;
  gemm_backward(ctx, fp8_, dx, *weight_, bias_ ? bias_->grad.view() : TensorView(), dout, x);
  // The adapters' input gradients are partial sums like the base's: added before the reduction.
  lora_backward(ctx, lora_, dx, dout, x, lora_dropout, nullptr);
  copy_or_gather_to_tp_backward(region_, dinput, dgathered);
}

// ---- RowParallelLinear ------------------------------------------------------------------------------

RowParallelLinear::RowParallelLinear(ParameterSet& ps, const std::string& prefix, int64_t in_features,
                                     int64_t out_features, bool bias, float init_std, const TpRegion& region,
                                     ShardRange shard)
    : name_(prefix),
      region_(region),
      linear_(region.size() == 1 ? Linear(ps, prefix, in_features, out_features, bias, init_std)
                                 : Linear(ps, prefix, in_features, out_features, bias, init_std, 1, {shard})) {
  // Under SP the bias is added to this rank's token rows only (after the reduce-scatter in effect): its
  // gradient is a partial sum, completed over the TP group before the optimizer.
  if (Parameter* b = linear_.bias(); b && region.sequence_parallel) b->sequence_parallel = true;
}

TensorView RowParallelLinear::forward(const DeviceContext& ctx, TensorView full, TensorView input,
                                      const RowEpilogue& epilogue, TensorView shard,
                                      const DropoutMask& lora_dropout) const {
  Parameter* b = linear_.bias();
  // The bias once across the group: added by rank 0 before the reduction.
  gemm_forward(ctx, fp8_, full, input, linear_.weight(),
               b != nullptr && region_.rank() == 0 ? b->compute.view() : TensorView());
  // The adapters' updates likewise: h complete on every rank, h·B^T added by rank 0.
  const Communicator* reduce = region_.size() > 1 ? region_.tp : nullptr;
  for (size_t k = 0; k < lora_.size(); ++k) {
    const LoraActs r = lora_down(ctx, *lora_[k], input, lora_dropout, k, reduce);
    if (region_.rank() == 0) lora_[k]->up_accumulate(ctx, full, r.h);
  }
  if (region_.size() == 1) {
    if (epilogue.active) epilogue.forward(full, full);
    return full;
  }
  if (region_.sequence_parallel) {
    if (epilogue.active) epilogue.forward(full, full);
    return reduce_or_scatter_from_tp_forward(region_, full, shard);
  }
  reduce_or_scatter_from_tp_forward(region_, full, shard);
  if (epilogue.active) epilogue.forward(full, full);
  return full;
}

void RowParallelLinear::backward(const DeviceContext& ctx, TensorView dinput, TensorView dout, TensorView input,
                                 const RowEpilogue& epilogue, TensorView full, const DropoutMask& lora_dropout,
                                 const std::function<void()>& before_weight_grad) const {
  LOOM_CHECK(!before_weight_grad || splits_backward(), "[", name_, "] backward cannot run a callback before the "
             "weight gradient with an FP8 GEMM or LoRA adapters (splits_backward() is false)");
  const Communicator* reduce = region_.size() > 1 ? region_.tp : nullptr;
  Parameter* b = linear_.bias();
  if (!region_.sequence_parallel) {
    // dout is replicated: every rank computes the whole (replicated) bias gradient.
    TensorView d = reduce_or_scatter_from_tp_backward(region_, full, dout);
    if (epilogue.active) {
      epilogue.backward(full, d);
      d = full;
    }
    gemm_backward(ctx, fp8_, dinput, linear_.weight(), b ? b->grad.view() : TensorView(), d, input,
                  before_weight_grad);
    lora_backward(ctx, lora_, dinput, d, input, lora_dropout, reduce);
    return;
  }
  // SP: all-gather the token shards; the bias gradient sums this rank's own rows only.
  const int64_t C = full.size(full.ndim() - 1), N = full.numel() / C, Nl = N / region_.size();
  const TensorView rows = full.reshape({N, C});
  reduce_or_scatter_from_tp_backward(region_, rows, dout);
  if (epilogue.active) epilogue.backward(rows, rows);
  gemm_backward(ctx, fp8_, dinput, linear_.weight(), TensorView(), rows, input, before_weight_grad);
  lora_backward(ctx, lora_, dinput, rows, input, lora_dropout, reduce);
  if (b && b->grad.defined()) ctx.ops().bias_backward(b->grad, rows.slice_flat(int64_t(region_.rank()) * Nl * C, {Nl, C}));
}

}  // namespace loom

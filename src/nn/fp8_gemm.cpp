// FP8 GEMMs of one linear layer (loom/nn/fp8_gemm.h).
#include "loom/nn/fp8_gemm.h"

#include "loom/core/check.h"

namespace loom {

namespace {
// (R, C) view of a tensor whose last dim is C.
TensorView as_2d(TensorView t) {
  const int64_t c = t.size(t.ndim() - 1);
  return t.reshape({t.numel() / c, c});
}
}  // namespace

void Fp8Gemm::reserve(const DeviceContext& ctx, const Shape& weight_shape) {
  LOOM_CHECK(fwd_ != nullptr && weight_shape.ndim() == 2, "[Fp8Gemm] reserve expects a 2-D weight");
  weight_q_ = ctx.empty(weight_shape, fwd_->dtype());
  weight_qt_ = ctx.empty({weight_shape[1], weight_shape[0]}, fwd_->dtype());
}

Tensor Fp8Gemm::quantize(const DeviceContext& ctx, TensorView x, const Fp8ScalingGroup& group, int slot) const {
  Tensor q = ctx.empty(x.shape(), group.dtype());
  ctx.ops().fp8_quantize(q, x, group.scale(slot), group.amax(slot));
  return q;
}

void Fp8Gemm::quantize_weight(const DeviceContext& ctx, TensorView weight) const {
  if (weight_valid_) return;
  const int64_t N = weight.size(0), K = weight.size(1);
  if (!weight_q_.defined() || weight_q_.numel() != weight.numel()) {
    weight_q_ = ctx.empty({N, K}, fwd_->dtype());
    weight_qt_ = ctx.empty({K, N}, fwd_->dtype());
  }
  ctx.ops().fp8_quantize(weight_q_, weight, fwd_->scale(weight_slot_), fwd_->amax(weight_slot_));
  ctx.ops().transpose(weight_qt_.reshape({K, N}), weight_q_.reshape({N, K}));
  weight_valid_ = true;
}

void Fp8Gemm::forward(const DeviceContext& ctx, TensorView out, TensorView inp, TensorView weight,
                      TensorView bias) const {
  LOOM_CHECK(fwd_ != nullptr && bwd_ != nullptr, "[Fp8Gemm] forward on a site without scaling groups");
  const Tensor x = quantize(ctx, inp, *fwd_, input_slot_);
  quantize_weight(ctx, weight);
  ctx.ops().fp8_gemm(out, x, fwd_->scale_inv(input_slot_), weight_q_, fwd_->scale_inv(weight_slot_), bias, false);
}

void Fp8Gemm::backward(const DeviceContext& ctx, TensorView dinp, TensorView dweight, TensorView dbias,
                       TensorView dout, TensorView inp, TensorView weight, GradWrite dweight_write) const {
  LOOM_CHECK(fwd_ != nullptr && bwd_ != nullptr, "[Fp8Gemm] backward on a site without scaling groups");
  const TensorView g2 = as_2d(dout);
  const int64_t M = g2.size(0), N = g2.size(1), K = weight.size(1);
  const Tensor g = quantize(ctx, g2, *bwd_, grad_slot_);  // (M, N)
  quantize_weight(ctx, weight);
  if (dinp.defined())  // dx (M, K) = deq(g) (M, N) · deq(W^T) (K, N)^T
    ctx.ops().fp8_gemm(dinp, g, bwd_->scale_inv(grad_slot_), weight_qt_, fwd_->scale_inv(weight_slot_),
                       TensorView(), false);
  if (dweight.defined()) {
    if (wgrad_) {  // dW (N, K) (+)= deq(g^T) (N, M) · deq(x^T) (K, M)^T
      const Tensor x = quantize(ctx, as_2d(inp), *fwd_, input_slot_);
      Tensor gt = ctx.empty({N, M}, g.dtype()), xt = ctx.empty({K, M}, x.dtype());
      ctx.ops().transpose(gt, g);
      ctx.ops().transpose(xt, x);
      ctx.ops().fp8_gemm(dweight, gt, bwd_->scale_inv(grad_slot_), xt, fwd_->scale_inv(input_slot_), TensorView(),
                         dweight_write == GradWrite::kAccumulate);
    } else {
      ctx.ops().matmul_backward(TensorView(), dweight, TensorView(), dout, inp, weight, dweight_write);
    }
  }
  if (dbias.defined()) ctx.ops().bias_backward(dbias, g2);
}

}  // namespace loom

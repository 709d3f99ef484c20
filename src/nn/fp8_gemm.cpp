// FP8 GEMM emulation of one linear layer (loom/nn/fp8_gemm.h).
#include "loom/nn/fp8_gemm.h"

#include "loom/core/check.h"

namespace loom {

Tensor Fp8Gemm::quantize_dequantize(const DeviceContext& ctx, TensorView x, const Fp8ScalingGroup& group, int slot,
                                    Tensor out) const {
  Tensor q = ctx.empty(x.shape(), group.dtype());
  ctx.ops().fp8_quantize(q, x, group.scale(slot), group.amax(slot));
  if (!out.defined()) out = ctx.empty(x.shape(), DType::kF32);
  ctx.ops().fp8_dequantize(out, q, group.scale_inv(slot));
  return out;
}

const Tensor& Fp8Gemm::weight_deq(const DeviceContext& ctx, TensorView weight) const {
  if (!weight_valid_) {
    const bool reuse = weight_deq_.defined() && weight_deq_.numel() == weight.numel();
    weight_deq_ = quantize_dequantize(ctx, weight, *fwd_, weight_slot_, reuse ? weight_deq_ : Tensor());
    if (weight_deq_.shape() != weight.shape()) weight_deq_ = weight_deq_.reshape(weight.shape());
    weight_valid_ = true;
  }
  return weight_deq_;
}

void Fp8Gemm::forward(const DeviceContext& ctx, TensorView out, TensorView inp, TensorView weight,
                      TensorView bias) const {
  LOOM_CHECK(fwd_ != nullptr && bwd_ != nullptr, "[Fp8Gemm] forward on a site without scaling groups");
  const Tensor x = quantize_dequantize(ctx, inp, *fwd_, input_slot_);
  const Tensor& w = weight_deq(ctx, weight);
  Tensor b;
  if (bias.defined()) {
    b = ctx.empty(bias.shape(), DType::kF32);
    ctx.ops().cast(b, bias);
  }
  if (out.dtype() == DType::kF32) {
    ctx.ops().matmul_forward(out, x, w, b);
    return;
  }
  Tensor o = ctx.empty(out.shape(), DType::kF32);
  ctx.ops().matmul_forward(o, x, w, b);
  ctx.ops().cast(out, o);
}

void Fp8Gemm::backward(const DeviceContext& ctx, TensorView dinp, TensorView dweight, TensorView dbias,
                       TensorView dout, TensorView inp, TensorView weight) const {
  LOOM_CHECK(fwd_ != nullptr && bwd_ != nullptr, "[Fp8Gemm] backward on a site without scaling groups");
  const Tensor g = quantize_dequantize(ctx, dout, *bwd_, grad_slot_);
  const Tensor& w = weight_deq(ctx, weight);
  if (dinp.defined()) {
    // f32 product (the operands are f32), rounded once into a 16-bit dinp.
    const Tensor d = dinp.dtype() == DType::kF32 ? Tensor() : ctx.empty(dinp.shape(), DType::kF32);
    const TensorView target = d.defined() ? d.view() : dinp;
    ctx.ops().matmul_backward(target, TensorView(), TensorView(), g, TensorView(), w);
    if (d.defined()) ctx.ops().cast(dinp, d);
  }
  if (dweight.defined()) {
    if (wgrad_) {
      const Tensor x = quantize_dequantize(ctx, inp, *fwd_, input_slot_);
      ctx.ops().matmul_backward(TensorView(), dweight, TensorView(), g, x, w);
    } else {
      ctx.ops().matmul_backward(TensorView(), dweight, TensorView(), dout, inp, weight);
    }
  }
  if (dbias.defined()) {
    const int64_t n = dout.size(dout.ndim() - 1);
    ctx.ops().bias_backward(dbias, dout.reshape({dout.numel() / n, n}));
  }
}

}  // namespace loom

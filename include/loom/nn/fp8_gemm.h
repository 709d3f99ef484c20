// The GEMMs of a linear layer under FP8 (Transformer Engine's delayed scaling; loom/fp8/fp8.h), emulated
// on backends without FP8 tensor cores: each operand is quantised with its current scale (recording its
// amax) and dequantised to f32, the product runs as an f32 GEMM — fp8 x fp8 products are exact in f32
// and the sum accumulates in f32, as on the tensor cores — and the result is rounded once to the output
// dtype. Per layer:
//   forward   out = deq(q(x)) · deq(q(W))^T + b              x, W in the forward format (E4M3)
//   backward  dx  = deq(q(dout)) · deq(q(W))                 dout in the backward format (E5M2 hybrid)
//             dW += deq(q(dout))^T · deq(q(x))               (wgrad; else dout^T · x in the compute dtype)
//             db += column sums of dout (never quantised)
// The weight is quantised once per step (Transformer Engine does so with gradient accumulation): the
// cache stays valid until begin_step(); the input is quantised again in backward from the saved
// high-precision input with the same scale, which gives the forward's fp8 values (scales only change
// between steps) and records the same amax again (max is idempotent).
#pragma once
#include "loom/backend/device_context.h"
#include "loom/core/tensor.h"
#include "loom/fp8/fp8.h"

namespace loom {

// One GEMM site's FP8 state: where its three tensors' scaling slots are, and its weight cache.
class Fp8Gemm {
 public:
  Fp8Gemm() = default;
  Fp8Gemm(const Fp8ScalingGroup* fwd, int input_slot, int weight_slot, const Fp8ScalingGroup* bwd, int grad_slot,
          bool wgrad)
      : fwd_(fwd), bwd_(bwd), input_slot_(input_slot), weight_slot_(weight_slot), grad_slot_(grad_slot),
        wgrad_(wgrad) {}
  // A new step: the weights changed (or their scale did), so the next use quantises them again.
  void begin_step() { weight_valid_ = false; }
  // Allocates the dequantised-weight cache up front (f32, the weight's shape), so a model's buffers exist
  // from construction on (GPTModel::memory_plan counts it).
  void reserve(const DeviceContext& ctx, const Shape& weight_shape) { weight_deq_ = ctx.empty(weight_shape, DType::kF32); }

  // out = inp · weight^T + bias (see the header comment); inp, weight in the compute dtype, bias null or
  // in the compute dtype, out in the compute dtype or f32.
  void forward(const DeviceContext& ctx, TensorView out, TensorView inp, TensorView weight, TensorView bias) const;
  // dinp overwritten (skipped when empty); dweight, dbias accumulate (skipped when empty).
  void backward(const DeviceContext& ctx, TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout,
                TensorView inp, TensorView weight) const;

 private:
  // deq(q(x)) with slot `slot` of `group`, as f32 shaped like x (into `out` when given).
  Tensor quantize_dequantize(const DeviceContext& ctx, TensorView x, const Fp8ScalingGroup& group, int slot,
                             Tensor out = Tensor()) const;
  const Tensor& weight_deq(const DeviceContext& ctx, TensorView weight) const;

  const Fp8ScalingGroup* fwd_ = nullptr;
  const Fp8ScalingGroup* bwd_ = nullptr;
  int input_slot_ = 0, weight_slot_ = 0, grad_slot_ = 0;
  bool wgrad_ = true;
  mutable Tensor weight_deq_;  // f32, valid for one step
  mutable bool weight_valid_ = false;
};

}  // namespace loom

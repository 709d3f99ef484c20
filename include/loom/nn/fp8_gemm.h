// The GEMMs of a linear layer under FP8 (Transformer Engine's delayed scaling; loom/fp8/fp8.h). Each
// operand is quantised with its current scale (recording its amax) and the product runs as an FP8 GEMM
// (OpTable::fp8_gemm: FP8 tensor cores through cuBLASLt on sm_89+, dequantise + f32 GEMM elsewhere —
// fp8 x fp8 products are exact in f32 and the sum accumulates in f32 either way); the result is rounded
// once to the output dtype. The FP8 GEMM wants both operands K-contiguous ("TN"), so the backward GEMMs
// use transposed fp8 copies, as Transformer Engine's cast-transpose does. Per layer:
//   forward   out = deq(q(x)) · deq(q(W))^T + b              x, W in the forward format (E4M3)
//   backward  dx  = deq(q(dout)) · deq(q(W))                 dout in the backward format (E5M2 hybrid);
//                                                            operand q(W)^T (K, N), cached with q(W)
//             dW += deq(q(dout))^T · deq(q(x))               (wgrad; operands q(dout)^T, q(x)^T; else
//                                                            dout^T · x in the compute dtype)
//             db += column sums of dout (never quantised)
// The weight is quantised once per step (Transformer Engine does so with gradient accumulation): the
// cache (q(W) and its transpose, 1 byte per element each) stays valid until begin_step(); the input is
// quantised again in backward from the saved high-precision input with the same scale, which gives the
// forward's fp8 values (scales only change between steps) and records the same amax again (max is
// idempotent).
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
  // The scaling slots of its input and weight (forward group) and its output gradient (backward group).
  int input_slot() const { return input_slot_; }
  int weight_slot() const { return weight_slot_; }
  int grad_slot() const { return grad_slot_; }
  // A new step: the weights changed (or their scale did), so the next use quantises them again.
  void begin_step() { weight_valid_ = false; }
  // Allocates the weight cache up front (q(W) (N, K) and q(W)^T (K, N) in the forward fp8 format), so a
  // model's buffers exist from construction on (GPTModel::memory_plan counts them).
  void reserve(const DeviceContext& ctx, const Shape& weight_shape);

  // out = inp · weight^T + bias (see the header comment); inp, weight in the compute dtype, bias null or
  // in the compute dtype, out in the compute dtype or f32.
  void forward(const DeviceContext& ctx, TensorView out, TensorView inp, TensorView weight, TensorView bias) const;
  // dinp overwritten (skipped when empty); dweight, dbias accumulate (skipped when empty), dweight stored
  // instead with GradWrite::kOverwrite (the OpTable's matmul_backward rule).
  void backward(const DeviceContext& ctx, TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout,
                TensorView inp, TensorView weight, GradWrite dweight_write = GradWrite::kAccumulate) const;

 private:
  // q(x) with slot `slot` of `group` (fp8, x's shape), recording x's amax.
  Tensor quantize(const DeviceContext& ctx, TensorView x, const Fp8ScalingGroup& group, int slot) const;
  // Quantises the weight into the cache (and its transpose) unless this step already did.
  void quantize_weight(const DeviceContext& ctx, TensorView weight) const;

  const Fp8ScalingGroup* fwd_ = nullptr;
  const Fp8ScalingGroup* bwd_ = nullptr;
  int input_slot_ = 0, weight_slot_ = 0, grad_slot_ = 0;
  bool wgrad_ = true;
  mutable Tensor weight_q_;   // (N, K) fp8, valid for one step
  mutable Tensor weight_qt_;  // (K, N) fp8: the transpose, operand of the dgrad GEMM
  mutable bool weight_valid_ = false;
};

}  // namespace loom

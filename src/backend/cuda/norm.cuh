// Launchers for LayerNorm and RMSNorm on the GPU (kernels in norm.cu): forward, backward and the fused
// residual-add + norm forward, with the OpTable semantics of include/loom/backend/ops.h and the CPU
// reference (src/backend/cpu/norm.cpp, rmsnorm.cpp):
//   - inp/out/residual/a/b/dout/dinp and weight/bias share one compute dtype (f32, bf16 or f16); mean and
//     rstd are f32 (optional in the forwards, required by the backwards); dweight/dbias are f32 or the
//     compute dtype; arithmetic is f32 and every result is rounded once;
//   - backward: dinp ACCUMULATES (residual stream), dweight/dbias accumulate, each may be absent;
//   - deterministic: row statistics use an order fixed by C alone (so a recomputed or fused forward
//     reproduces the unfused one bit for bit, whatever the buffers' alignment), parameter gradients go
//     through per-block f32 partials summed in block order — no float atomics.
// All work runs on ctx.compute_stream(); nothing synchronizes the host. Host-only header.
#pragma once
#include "backend/cuda/cuda_context.cuh"
#include "loom/core/tensor.h"

namespace loom::cuda {

// out (N, C) = (inp - mean) * rstd * weight + bias; saves mean, rstd (N) f32 when given. bias optional.
void layernorm_forward(const CudaContext& ctx, TensorView out, TensorView mean, TensorView rstd, TensorView inp,
                       TensorView weight, TensorView bias, float eps);
// dinp += ..., dweight += ..., dbias += ... (each optional); mean and rstd from the forward.
void layernorm_backward(const CudaContext& ctx, TensorView dinp, TensorView dweight, TensorView dbias,
                        TensorView dout, TensorView inp, TensorView weight, TensorView mean, TensorView rstd);
// residual = a + b (rounded to the compute dtype), out = layernorm(residual); a and b are read once.
void residual_layernorm_forward(const CudaContext& ctx, TensorView residual, TensorView out, TensorView mean,
                                TensorView rstd, TensorView a, TensorView b, TensorView weight, TensorView bias,
                                float eps);

// out = inp * rstd * weight, rstd = 1 / sqrt(mean(inp^2) + eps) saved (N) f32 when given.
void rmsnorm_forward(const CudaContext& ctx, TensorView out, TensorView rstd, TensorView inp, TensorView weight,
                     float eps);
// dinp += ..., dweight += ... (each optional); rstd from the forward.
void rmsnorm_backward(const CudaContext& ctx, TensorView dinp, TensorView dweight, TensorView dout, TensorView inp,
                      TensorView weight, TensorView rstd);
// residual = a + b, out = rmsnorm(residual).
void residual_rmsnorm_forward(const CudaContext& ctx, TensorView residual, TensorView out, TensorView rstd,
                              TensorView a, TensorView b, TensorView weight, float eps);

}  // namespace loom::cuda

// Launchers for dtype casts on the GPU (kernels in cast.cu). f32 -> bf16 rounds to nearest, ties to
// even, and keeps NaN a NaN (quiet bit set, sign and high payload kept): bit-identical to
// loom::f32_to_bf16, the CPU reference. bf16 -> f32 is exact. Launches are asynchronous on `stream`.
// The op table's cast (the CudaContext overload) converts between any two of f32, bf16, f16, fp8e4m3 and
// fp8e5m2, bit for bit as CpuOps::cast does (RNE, NaN rules, fp8 saturating); see cast.cu.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend/cuda/cuda_context.cuh"
#include "loom/core/tensor.h"

namespace loom::cuda {

// dst[i] = bf16(src[i]) for i < n; raw device pointers, any alignment.
void cast_f32_to_bf16(uint16_t* dst, const float* src, int64_t n, cudaStream_t stream);
// dst[i] = f32(src[i]) for i < n.
void cast_bf16_to_f32(float* dst, const uint16_t* src, int64_t n, cudaStream_t stream);
// Tensor form: dst and src are CUDA tensors with the same element count, one f32 and the other bf16
// (or both the same dtype, which is a device copy).
void cast(TensorView dst, TensorView src, cudaStream_t stream);

// OpTable::cast: out = inp converted to out's dtype (same element count; any pair of f32, bf16, f16,
// fp8e4m3, fp8e5m2; the same dtype is a device copy). On ctx.compute_stream().
void cast(const CudaContext& ctx, TensorView out, TensorView inp);

}  // namespace loom::cuda

// Launchers for dtype casts on the GPU (kernels in cast.cu). f32 -> bf16 rounds to nearest, ties to
// even, and keeps NaN a NaN (quiet bit set, sign and high payload kept): bit-identical to
// loom::f32_to_bf16, the CPU reference. bf16 -> f32 is exact. Launches are asynchronous on `stream`.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "loom/core/tensor.h"

namespace loom::cuda {

// dst[i] = bf16(src[i]) for i < n; raw device pointers, any alignment.
void cast_f32_to_bf16(uint16_t* dst, const float* src, int64_t n, cudaStream_t stream);
// dst[i] = f32(src[i]) for i < n.
void cast_bf16_to_f32(float* dst, const uint16_t* src, int64_t n, cudaStream_t stream);
// Tensor form: dst and src are CUDA tensors with the same element count, one f32 and the other bf16
// (or both the same dtype, which is a device copy).
void cast(TensorView dst, TensorView src, cudaStream_t stream);

}  // namespace loom::cuda

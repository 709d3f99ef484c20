// CUDA hidden dropout: out = inp * keep / (1 - p) and the same for the gradient. CPU twin:
// src/backend/cpu/dropout.cpp; the mask and the values are the CPU's bit for bit:
//   - keep[i] = dropout_keep(seed, stream, offset + i, dropout_threshold(p)): Philox block (offset + i) / 4,
//     word (offset + i) % 4 (device_utils.cuh's Philox = loom::philox4x32). One thread owns one Philox block,
//     i.e. the up-to-4 elements of the tensor whose global indices fall in [4q, 4q + 4), so each block is
//     computed once; the first and last groups are partial when offset or offset + n is not a multiple of 4;
//   - kept values: the element widened to f32, times the f32 scale 1 / (1 - p) computed on the host with the
//     CPU's expression, rounded once (a lone multiply: nothing to contract into an FMA); dropped values are
//     exactly +0 (a select, so a dropped inf or NaN does not leak);
//   - out may be inp (each thread reads its group before writing it); partial overlap is rejected;
//     p == 0 is a device copy, or nothing when out is inp;
//   - groups move as one 4-element access (16 bytes f32, 8 bytes bf16/f16) when offset % 4 == 0 and both
//     pointers allow it; otherwise element by element. Results do not depend on the launch shape.
#include <cstdint>
#include <utility>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/elementwise.cuh"
#include "loom/core/rng.h"

namespace loom::cuda {

namespace {

template <typename T>
struct Quad {
  T v[4];
};

template <typename T>
__device__ __forceinline__ Quad<T> load_quad(const T* p) {
  Quad<T> out;
  if constexpr (sizeof(T) == 4) {
    const uint4 r = *reinterpret_cast<const uint4*>(p);
    memcpy(&out, &r, sizeof(out));
  } else {
    const uint2 r = *reinterpret_cast<const uint2*>(p);
    memcpy(&out, &r, sizeof(out));
  }
  return out;
}
template <typename T>
__device__ __forceinline__ void store_quad(T* p, const Quad<T>& x) {
  if constexpr (sizeof(T) == 4) {
    uint4 r;
    memcpy(&r, &x, sizeof(r));
    *reinterpret_cast<uint4*>(p) = r;
  } else {
    uint2 r;
    memcpy(&r, &x, sizeof(r));
    *reinterpret_cast<uint2*>(p) = r;
  }
}

__device__ __forceinline__ float drop(float x, uint32_t word, uint32_t threshold, float scale) {
  return word >= threshold ? x * scale : 0.0f;
}

// Group q holds global indices [4 (offset/4 + q), +4), i.e. tensor elements [4q - offset%4, +4) ∩ [0, n).
// `vec`: offset % 4 == 0 and both pointers aligned to 4 elements, so every full group is one access.
template <typename T>
__global__ void dropout_kernel(T* out, const T* inp, int64_t n, uint64_t seed, uint64_t stream, uint64_t offset,
                               uint32_t threshold, float scale, bool vec) {
  const int64_t shift = int64_t(offset % 4);
  const uint64_t block0 = offset / 4;
  const int64_t groups = (shift + n + 3) / 4;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t q = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; q < groups; q += stride) {
    const Philox4 w = philox4x32(seed, stream, block0 + uint64_t(q));
    const int64_t e0 = 4 * q - shift;  // tensor index of word 0; negative only for a partial first group
    if (vec && e0 + 4 <= n) {
      Quad<T> x = load_quad(inp + e0);
#pragma unroll
      for (int k = 0; k < 4; ++k) x.v[k] = store<T>(drop(load(x.v[k]), w.w[k], threshold, scale));
      store_quad(out + e0, x);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int64_t e = e0 + k;
        if (e >= 0 && e < n) out[e] = store<T>(drop(load(inp[e]), w.w[k], threshold, scale));
      }
    }
  }
}

void dropout(const CudaContext& ctx, TensorView out, TensorView inp, float p, uint64_t seed, uint64_t stream,
             uint64_t offset, const char* op) {
  // out is inp itself or does not overlap it (checked, with the rest, by the OpTable entry point).
  const auto* a = static_cast<const char*>(inp.raw());
  const auto* b = static_cast<const char*>(out.raw());
  const int64_t n = inp.numel();
  if (n == 0) return;
  cudaStream_t s = ctx.compute_stream();
  if (p == 0.0f) {
    if (a != b)
      LOOM_CUDA_CHECK(cudaMemcpyAsync(out.raw(), inp.raw(), size_t(inp.nbytes()), cudaMemcpyDeviceToDevice, s));
    return;
  }
  const uint32_t threshold = dropout_threshold(p);
  const float scale = 1.0f / (1.0f - p);  // the CPU's f32 value (dropout.cpp)
  dispatch_float(inp.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    const uintptr_t quad = 4 * sizeof(T);
    const bool vec = offset % 4 == 0 && reinterpret_cast<uintptr_t>(a) % quad == 0 &&
                     reinterpret_cast<uintptr_t>(b) % quad == 0;
    const int64_t groups = (int64_t(offset % 4) + n + 3) / 4;
    dropout_kernel<T><<<grid_for(groups), kThreads, 0, s>>>(ptr<T>(out), cptr<T>(inp), n, seed, stream, offset,
                                                            threshold, scale, vec);
    LOOM_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace

void dropout_forward(const CudaContext& ctx, TensorView out, TensorView inp, float p, uint64_t seed, uint64_t stream,
                     uint64_t offset) {
  dropout(ctx, out, inp, p, seed, stream, offset, "[dropout_forward] inp");
}

void dropout_backward(const CudaContext& ctx, TensorView dinp, TensorView dout, float p, uint64_t seed,
                      uint64_t stream, uint64_t offset) {
  dropout(ctx, dinp, dout, p, seed, stream, offset, "[dropout_backward] dout");
}

}  // namespace loom::cuda

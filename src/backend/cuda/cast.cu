// f32 <-> bf16 cast kernels. Memory-bound: the aligned path moves 4 elements per thread per step
// (one 16-byte load of f32, one 8-byte store of bf16); unaligned views take the scalar path. Grid-
// stride loops with int64 indices, so any n works with a bounded grid.
#include "backend/cuda/cast.cuh"

#include <algorithm>

#include "backend/cuda/cuda_check.cuh"

namespace loom::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;  // enough to fill any GPU; the loops cover the rest

// Same bit recipe as loom::f32_to_bf16 (the CPU reference), so results match bit for bit.
__device__ __forceinline__ uint16_t f32_to_bf16_bits(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x0040u);  // NaN: make it quiet
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest, ties to even (overflow carries into inf)
  return uint16_t(u >> 16);
}

__device__ __forceinline__ float bf16_bits_to_f32(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }

__global__ void f32_to_bf16_vec4(uint2* __restrict__ dst, const float4* __restrict__ src, int64_t n4) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = src[i];
    uint2 out;
    out.x = uint32_t(f32_to_bf16_bits(v.x)) | (uint32_t(f32_to_bf16_bits(v.y)) << 16);
    out.y = uint32_t(f32_to_bf16_bits(v.z)) | (uint32_t(f32_to_bf16_bits(v.w)) << 16);
    dst[i] = out;
  }
}

__global__ void f32_to_bf16_scalar(uint16_t* __restrict__ dst, const float* __restrict__ src, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = f32_to_bf16_bits(src[i]);
}

__global__ void bf16_to_f32_vec4(float4* __restrict__ dst, const uint2* __restrict__ src, int64_t n4) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const uint2 v = src[i];
    dst[i] = make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xFFFF0000u),
                         __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xFFFF0000u));
  }
}

__global__ void bf16_to_f32_scalar(float* __restrict__ dst, const uint16_t* __restrict__ src, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = bf16_bits_to_f32(src[i]);
}

unsigned grid_for(int64_t work) {
  return unsigned(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

}  // namespace

void cast_f32_to_bf16(uint16_t* dst, const float* src, int64_t n, cudaStream_t stream) {
  LOOM_CHECK(n >= 0, "[cast] expected n >= 0, got ", n);
  if (n == 0) return;
  int64_t done = 0;
  if (aligned(src, 16) && aligned(dst, 8) && n >= 4) {
    const int64_t n4 = n / 4;
    f32_to_bf16_vec4<<<grid_for(n4), kThreads, 0, stream>>>(reinterpret_cast<uint2*>(dst),
                                                           reinterpret_cast<const float4*>(src), n4);
    LOOM_CUDA_CHECK(cudaGetLastError());
    done = n4 * 4;
  }
  if (done < n) {
    f32_to_bf16_scalar<<<grid_for(n - done), kThreads, 0, stream>>>(dst + done, src + done, n - done);
    LOOM_CUDA_CHECK(cudaGetLastError());
  }
}

void cast_bf16_to_f32(float* dst, const uint16_t* src, int64_t n, cudaStream_t stream) {
  LOOM_CHECK(n >= 0, "[cast] expected n >= 0, got ", n);
  if (n == 0) return;
  int64_t done = 0;
  if (aligned(src, 8) && aligned(dst, 16) && n >= 4) {
    const int64_t n4 = n / 4;
    bf16_to_f32_vec4<<<grid_for(n4), kThreads, 0, stream>>>(reinterpret_cast<float4*>(dst),
                                                           reinterpret_cast<const uint2*>(src), n4);
    LOOM_CUDA_CHECK(cudaGetLastError());
    done = n4 * 4;
  }
  if (done < n) {
    bf16_to_f32_scalar<<<grid_for(n - done), kThreads, 0, stream>>>(dst + done, src + done, n - done);
    LOOM_CUDA_CHECK(cudaGetLastError());
  }
}

void cast(TensorView dst, TensorView src, cudaStream_t stream) {
  LOOM_CHECK(dst.numel() == src.numel(), "[cast] expected the same element count, got ", dst.desc(), " <- ",
             src.desc());
  LOOM_CHECK(dst.device().type == DeviceType::kCUDA && src.device().type == DeviceType::kCUDA,
             "[cast] expected CUDA tensors, got ", dst.desc(), " <- ", src.desc());
  if (dst.dtype() == src.dtype()) {
    if (dst.nbytes() > 0)
      LOOM_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), size_t(src.nbytes()), cudaMemcpyDeviceToDevice, stream));
  } else if (dst.dtype() == DType::kBF16 && src.dtype() == DType::kF32) {
    cast_f32_to_bf16(static_cast<uint16_t*>(dst.raw()), static_cast<const float*>(src.raw()), src.numel(), stream);
  } else if (dst.dtype() == DType::kF32 && src.dtype() == DType::kBF16) {
    cast_bf16_to_f32(static_cast<float*>(dst.raw()), static_cast<const uint16_t*>(src.raw()), src.numel(), stream);
  } else {
    LOOM_FAIL("[cast] expected an f32 <-> bf16 cast, got ", dst.desc(), " <- ", src.desc());
  }
}

}  // namespace loom::cuda

// Cast kernels. Memory-bound: the aligned paths move 4 elements per thread per step (f32 <-> bf16: one
// 16-byte load of f32, one 8-byte store of bf16); unaligned views take the scalar path. Grid-stride loops
// with int64 indices, so any n works with a bounded grid.
//
// The op-table cast (every pair of f32, bf16, f16, fp8e4m3, fp8e5m2) is bit-identical to CpuOps::cast,
// whose rules are not those of one conversion but of two paths:
//   - between f32, bf16 and f16 the CPU widens exactly (an f16 NaN keeps its sign and payload) and
//     narrows with RNE (bf16: NaN quietened, sign and top payload kept; f16: NaN -> sign | 0x7E00);
//   - when either side is fp8, the CPU decodes with the core conversions (every NaN becomes +qNaN, so
//     an f16/fp8 NaN loses its sign; bf16/f32 NaNs are exact) and encodes with them (fp8 saturates:
//     overflow and inf go to the largest finite value, NaN -> sign | the format's NaN pattern).
// The device element types of device_utils.cuh implement the core conversions; only the f16 decode of the
// first path differs, hence load_lowp below.
#include "backend/cuda/cast.cuh"

#include <algorithm>

#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/device_utils.cuh"

namespace loom::cuda {

namespace {

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

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// ---- op-table cast ----------------------------------------------------------------------------------------
// f16 decoded as the CPU's exact widening does (lowp.h f16_decode): a NaN keeps its sign and payload.
__device__ __forceinline__ float f16_widen_exact(uint16_t b) {
  const uint32_t sign = uint32_t(b & 0x8000u) << 16;
  const uint32_t mag = b & 0x7FFFu;
  if (mag >= 0x7C00u) return __uint_as_float(sign | (mag << 13) | 0x7F800000u);
  return __uint_as_float(sign | __float_as_uint(f16_bits_to_f32(uint16_t(mag))));
}

// kLowp: both sides are f32/bf16/f16 (the CPU's widen/narrow path); otherwise the core decoders.
template <bool kLowp, typename T>
__device__ __forceinline__ float cast_load(T x) {
  return load(x);
}
template <>
__device__ __forceinline__ float cast_load<true, F16>(F16 x) {
  return f16_widen_exact(x.bits);
}

// Four elements of T moved with one load or store of 4 * sizeof(T) bytes (16, 8 or 4).
template <int Bytes>
struct RawVec;
template <>
struct RawVec<16> { using type = uint4; };
template <>
struct RawVec<8> { using type = uint2; };
template <>
struct RawVec<4> { using type = uint32_t; };

template <typename T>
struct Quad {
  T v[4];
};

template <typename T>
__device__ __forceinline__ Quad<T> load_quad(const T* base, int64_t q) {
  using R = typename RawVec<int(4 * sizeof(T))>::type;
  const R raw = reinterpret_cast<const R*>(base)[q];
  Quad<T> out;
  memcpy(&out, &raw, sizeof(R));
  return out;
}

template <typename T>
__device__ __forceinline__ void store_quad(T* base, int64_t q, const Quad<T>& in) {
  using R = typename RawVec<int(4 * sizeof(T))>::type;
  R raw;
  memcpy(&raw, &in, sizeof(R));
  reinterpret_cast<R*>(base)[q] = raw;
}

// vec: both buffers are aligned to 4 elements, so quads [0, n/4) move whole; the tail goes one by one.
template <typename In, typename Out, bool kLowp>
__global__ void cast_kernel(Out* __restrict__ out, const In* __restrict__ in, int64_t n, bool vec) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t start = 0;
  if (vec) {
    const int64_t nq = n / 4;
    for (int64_t q = tid; q < nq; q += stride) {
      const Quad<In> a = load_quad(in, q);
      Quad<Out> b;
#pragma unroll
      for (int j = 0; j < 4; ++j) b.v[j] = store<Out>(cast_load<kLowp>(a.v[j]));
      store_quad(out, q, b);
    }
    start = nq * 4;
  }
  for (int64_t i = start + tid; i < n; i += stride) out[i] = store<Out>(cast_load<kLowp>(in[i]));
}

bool is_compute(DType dt) { return dt == DType::kF32 || dt == DType::kBF16 || dt == DType::kF16; }

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

void cast(const CudaContext& ctx, TensorView out, TensorView inp) {
  const int64_t n = inp.numel();
  if (out.dtype() == inp.dtype()) {  // any dtype, as on the CPU: a copy
    if (out.raw() != inp.raw() && n > 0)
      LOOM_CUDA_CHECK(cudaMemcpyAsync(out.raw(), inp.raw(), size_t(inp.nbytes()), cudaMemcpyDeviceToDevice,
                                      ctx.compute_stream()));
    return;
  }
  const bool lowp = is_compute(inp.dtype()) && is_compute(out.dtype());
  dispatch_float_or_fp8(inp.dtype(), "[cast] inp", [&](auto in_tag) {
    dispatch_float_or_fp8(out.dtype(), "[cast] out", [&](auto out_tag) {
      using In = decltype(in_tag);
      using Out = decltype(out_tag);
      if (n == 0) return;
      const bool vec = reinterpret_cast<uintptr_t>(inp.raw()) % (4 * sizeof(In)) == 0 &&
                       reinterpret_cast<uintptr_t>(out.raw()) % (4 * sizeof(Out)) == 0;
      const unsigned grid = grid_for(vec ? n / 4 + 4 : n);
      if (lowp) {
        cast_kernel<In, Out, true><<<grid, kThreads, 0, ctx.compute_stream()>>>(ptr<Out>(out), cptr<In>(inp), n, vec);
      } else {
        cast_kernel<In, Out, false><<<grid, kThreads, 0, ctx.compute_stream()>>>(ptr<Out>(out), cptr<In>(inp), n, vec);
      }
      LOOM_CUDA_LAUNCH_CHECK();
    });
  });
}

}  // namespace loom::cuda

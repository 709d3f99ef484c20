// Device-side helpers shared by the CUDA kernels (include from .cu files only): element types with
// conversions bit-identical to the CPU reference (loom/core/dtype.h: RNE, NaN kept quiet with its sign,
// FP8 saturating), a dtype dispatcher for launchers, Philox4x32-10 identical to loom::philox4x32 (so
// dropout masks match the CPU backend bit for bit), warp/block reductions, launch-size helpers and
// scratch tensors from the context's caching allocator.
//
// Invariants: every kernel does its arithmetic in f32 (as the CPU ops do); indices are int64_t; launchers
// run on ctx.compute_stream() and never synchronize unless they return a host value.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/cuda_context.cuh"
#include "loom/core/tensor.h"

namespace loom::cuda {

// ---- element types ------------------------------------------------------------------------------------
// 16- and 8-bit floats are stored as raw bits; load()/store() convert through f32. The storage structs are
// layout-compatible with the tensors' bytes (2 or 1 bytes, no padding).
struct Bf16 { uint16_t bits; };
struct F16 { uint16_t bits; };
struct F8E4M3 { uint8_t bits; };
struct F8E5M2 { uint8_t bits; };

__device__ __forceinline__ float bits_to_f32_bf16(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }

__device__ __forceinline__ uint16_t f32_to_bf16_rne(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x0040u);  // NaN: quiet, sign kept
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// Generic minifloat codec, the same rules as loom's CPU encoder (src/core/dtype.cpp): round to nearest
// even; subnormals; IEEE formats (f16, e5m2) have inf; saturate=true sends overflow and inf to the largest
// finite value (FP8), false to inf (f16). NaN -> sign | nan_bits.
template <int EBITS, int MBITS, int BIAS, bool HAS_INF>
__device__ __forceinline__ uint32_t minifloat_encode(float x, uint32_t nan_bits, uint32_t max_bits, bool saturate) {
  const uint32_t sign = (__float_as_uint(x) >> 31) << (EBITS + MBITS);
  const uint32_t inf_bits = ((1u << EBITS) - 1) << MBITS;
  if (isnan(x)) return sign | nan_bits;
  const float a = fabsf(x);
  if (isinf(a)) return sign | ((saturate || !HAS_INF) ? max_bits : inf_bits);
  constexpr int kMinNormalExp = 1 - BIAS;
  const uint32_t ua = __float_as_uint(a);
  const int fexp = int(ua >> 23) - 127;  // unbiased f32 exponent (f32 subnormals: -127, handled below)
  if (fexp < kMinNormalExp) {
    // q = round(a * 2^(MBITS - kMinNormalExp)): exact scaling in f32 unless a is far below the grid,
    // where the result is 0 or 1 anyway; rintf rounds half to even.
    const float q = rintf(scalbnf(a, MBITS - kMinNormalExp));
    return sign | uint32_t(q);
  }
  // Normal: round the 23-bit f32 mantissa to MBITS with ties to even.
  uint32_t mant = ua & 0x7FFFFFu;
  int e = fexp;
  constexpr int kDrop = 23 - MBITS;
  const uint32_t half = 1u << (kDrop - 1);
  const uint32_t rem = mant & ((1u << kDrop) - 1);
  uint32_t m = mant >> kDrop;
  if (rem > half || (rem == half && (m & 1u))) ++m;
  if (m == (1u << MBITS)) {
    m = 0;
    ++e;
  }
  const int biased = e + BIAS;
  const int emax_field = HAS_INF ? (1 << EBITS) - 2 : (1 << EBITS) - 1;
  const uint32_t bits = (uint32_t(biased) << MBITS) | m;
  if (biased > emax_field || bits > max_bits) return sign | ((saturate || !HAS_INF) ? max_bits : inf_bits);
  return sign | bits;
}

template <int EBITS, int MBITS, int BIAS, bool HAS_INF>
__device__ __forceinline__ float minifloat_decode(uint32_t bits, uint32_t nan_bits) {
  const uint32_t sign = bits >> (EBITS + MBITS);
  const uint32_t e = (bits >> MBITS) & ((1u << EBITS) - 1);
  const uint32_t m = bits & ((1u << MBITS) - 1);
  const float s = sign ? -1.0f : 1.0f;
  constexpr uint32_t kEmax = (1u << EBITS) - 1;
  if (HAS_INF && e == kEmax) return m == 0 ? s * __int_as_float(0x7F800000) : __int_as_float(0x7FC00000);
  if (!HAS_INF && (bits & ((1u << (EBITS + MBITS)) - 1)) == nan_bits) return __int_as_float(0x7FC00000);
  if (e == 0) return s * scalbnf(float(m), 1 - BIAS - MBITS);
  return s * scalbnf(1.0f + scalbnf(float(m), -MBITS), int(e) - BIAS);
}

__device__ __forceinline__ uint16_t f32_to_f16_rne(float x) {
  return uint16_t(minifloat_encode<5, 10, 15, true>(x, 0x7E00u, 0x7BFFu, false));
}
__device__ __forceinline__ float f16_bits_to_f32(uint16_t b) { return minifloat_decode<5, 10, 15, true>(b, 0x7E00u); }
__device__ __forceinline__ uint8_t f32_to_e4m3_sat(float x) {
  return uint8_t(minifloat_encode<4, 3, 7, false>(x, 0x7Fu, 0x7Eu, true));
}
__device__ __forceinline__ float e4m3_bits_to_f32(uint8_t b) { return minifloat_decode<4, 3, 7, false>(b, 0x7Fu); }
__device__ __forceinline__ uint8_t f32_to_e5m2_sat(float x) {
  return uint8_t(minifloat_encode<5, 2, 15, true>(x, 0x7Eu, 0x7Bu, true));
}
__device__ __forceinline__ float e5m2_bits_to_f32(uint8_t b) { return minifloat_decode<5, 2, 15, true>(b, 0x7Eu); }

__device__ __forceinline__ float load(float x) { return x; }
__device__ __forceinline__ float load(Bf16 x) { return bits_to_f32_bf16(x.bits); }
__device__ __forceinline__ float load(F16 x) { return f16_bits_to_f32(x.bits); }
__device__ __forceinline__ float load(F8E4M3 x) { return e4m3_bits_to_f32(x.bits); }
__device__ __forceinline__ float load(F8E5M2 x) { return e5m2_bits_to_f32(x.bits); }

template <typename T>
__device__ __forceinline__ T store(float x);
template <>
__device__ __forceinline__ float store<float>(float x) { return x; }
template <>
__device__ __forceinline__ Bf16 store<Bf16>(float x) { return Bf16{f32_to_bf16_rne(x)}; }
template <>
__device__ __forceinline__ F16 store<F16>(float x) { return F16{f32_to_f16_rne(x)}; }
template <>
__device__ __forceinline__ F8E4M3 store<F8E4M3>(float x) { return F8E4M3{f32_to_e4m3_sat(x)}; }
template <>
__device__ __forceinline__ F8E5M2 store<F8E5M2>(float x) { return F8E5M2{f32_to_e5m2_sat(x)}; }

// The storage type of a DType, for host-side dispatch: dispatch_float(dt, "[op] out", [&](auto tag) {
// using T = decltype(tag); kernel<T><<<...>>>(...); }). `what` names the tensor in the error.
template <typename F>
void dispatch_float(DType dt, const char* what, F&& f) {
  switch (dt) {
    case DType::kF32: f(float{}); return;
    case DType::kBF16: f(Bf16{}); return;
    case DType::kF16: f(F16{}); return;
    default: LOOM_FAIL(what, ": expected f32, bf16 or f16, got ", dtype_name(dt));
  }
}
// As dispatch_float, also accepting the two FP8 formats.
template <typename F>
void dispatch_float_or_fp8(DType dt, const char* what, F&& f) {
  switch (dt) {
    case DType::kF8E4M3: f(F8E4M3{}); return;
    case DType::kF8E5M2: f(F8E5M2{}); return;
    default: dispatch_float(dt, what, std::forward<F>(f));
  }
}

template <typename T>
T* ptr(TensorView t) { return static_cast<T*>(t.raw()); }
template <typename T>
const T* cptr(TensorView t) { return static_cast<const T*>(t.raw()); }

// ---- Philox4x32-10 (bit-identical to loom::philox4x32 in src/core/rng.cpp) --------------------------------
struct Philox4 { uint32_t w[4]; };

__device__ __forceinline__ Philox4 philox4x32(uint64_t seed, uint64_t stream, uint64_t block) {
  uint32_t c0 = uint32_t(block), c1 = uint32_t(block >> 32), c2 = uint32_t(stream), c3 = uint32_t(stream >> 32);
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    const uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// dropout_keep of loom/core/rng.h: element `index` is kept iff its Philox word >= threshold
// (threshold = loom::dropout_threshold(p), computed on the host).
__device__ __forceinline__ bool dropout_keep(uint64_t seed, uint64_t stream, uint64_t index, uint32_t threshold) {
  return philox4x32(seed, stream, index / 4).w[index % 4] >= threshold;
}

// ---- reductions ----------------------------------------------------------------------------------------
// Fixed shuffle trees: results depend only on the data and the launch shape, never on timing.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result. `shared` holds
// 32 values of T; the call ends with the buffer free for reuse.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* shared) {
  const int lane = threadIdx.x % 32, wid = threadIdx.x / 32, nw = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) shared[wid] = v;
  __syncthreads();
  T r = lane < nw ? shared[lane] : T(0);
  r = warp_sum(r);
  return r;
}
__device__ __forceinline__ float block_max(float v, float* shared) {
  const int lane = threadIdx.x % 32, wid = threadIdx.x / 32, nw = blockDim.x / 32;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[wid] = v;
  __syncthreads();
  float r = lane < nw ? shared[lane] : -INFINITY;
  return warp_max(r);
}

// Fixed-order column sums for gradient reductions over partials. Launch with blockDim (32, kColumnSumLanes)
// and one block per 32 columns; column blockIdx.x * 32 + threadIdx.x of src (element (r, col) at
// src[r * stride + col], rows [0, rows)). Lane y sums rows y, y + kColumnSumLanes, ... in order, then the
// lanes' sums are added in lane order: deterministic, and the rows are read in parallel instead of one
// dependent chain per column. Every thread of the block must call it; the total is returned to
// threadIdx.y == 0 (other lanes get 0).
constexpr int kColumnSumLanes = 16;
template <typename Acc>
__device__ Acc column_sum_fixed_order(const float* src, int64_t rows, int64_t stride, int64_t col, int64_t ncols) {
  __shared__ Acc part[kColumnSumLanes][33];
  Acc t = 0;
  if (col < ncols)
    for (int64_t r = threadIdx.y; r < rows; r += kColumnSumLanes) t += Acc(src[r * stride + col]);
  part[threadIdx.y][threadIdx.x] = t;
  __syncthreads();
  Acc sum = 0;
  if (threadIdx.y == 0)
#pragma unroll
    for (int r = 0; r < kColumnSumLanes; ++r) sum += part[r][threadIdx.x];
  return sum;
}

// ---- launch helpers ---------------------------------------------------------------------------------------
constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 65536;  // grid-stride loops cover the rest

inline unsigned grid_for(int64_t work, int threads = kThreads) {
  return unsigned(std::clamp<int64_t>((work + threads - 1) / threads, 1, kMaxGrid));
}

// Checks the launch that was just made (configuration errors surface here, not at the next sync).
#define LOOM_CUDA_LAUNCH_CHECK() LOOM_CUDA_CHECK(cudaGetLastError())

// A device scratch tensor from the caching allocator (freed back to the cache, stream-ordered: safe because
// all ops run on the compute stream).
inline Tensor scratch(const CudaContext& ctx, Shape s, DType dt) { return Tensor::empty(s, dt, ctx.device()); }

}  // namespace loom::cuda

// AdamW, the f64 sum of squares, the inf/NaN scan, scale_ and fill_ on the GPU: all memory-bound
// elementwise passes or reductions over flat buffers.
//
// - adamw_update: one fused pass over (param, grad, m, v), float4 when all four are 16-byte aligned,
//   scalar otherwise. Each element follows the CPU reference (optimizer.cpp) operation by operation with
//   explicitly rounded intrinsics (__fmul_rn, __fadd_rn, __fdiv_rn, __fsqrt_rn, __fmaf_rn), so nvcc's FMA
//   contraction cannot merge p * decay into the final add: results equal the CPU's bit for bit (both are
//   IEEE f32 per operation; the coefficients are computed on the host by the same code).
// - sum_squares: every thread owns 16-byte chunks (chunk c = elements [c*W, c*W + W), W = 16 / element
//   size), chunk c going to global thread c mod (blocks * threads); the block count is a function of numel
//   only. Each thread adds its chunks' squares in f64 in index order, the block reduces with the fixed
//   shuffle tree, partials go to a scratch buffer and one block sums them in a fixed tree. A chunk is read
//   with one 16-byte load when the buffer is aligned and with W scalar loads otherwise, in the same order,
//   so the result depends on numel and the data alone, never on timing, alignment or the device.
// - has_inf_or_nan: bit tests on the raw encoding (an all-ones exponent field; e4m3's only non-finite
//   pattern is S.1111.111), an int flag set by any thread that sees one, one copy back.
// - scale_: x = round(f32(x) * s); a NaN input stays that NaN (quietened) as on x86, where the CPU
//   reference runs; GPU arithmetic would return the canonical NaN instead.
// - fill_: the element's bit pattern is computed on the host with the CPU's conversions, then replicated.
#include "backend/cuda/optimizer.cuh"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/host_readback.cuh"
#include "backend/cpu/adamw_coefs.h"
#include "loom/core/dtype.h"

namespace loom::cuda {

namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// ---- AdamW ------------------------------------------------------------------------------------------

// The coefficients are the CPU reference's (backend/cpu/adamw_coefs.h), computed on the host.
using cpu::AdamWCoefs;
using cpu::adamw_coefs;

// One element, in the CPU's operation order:
//   g = grad * grad_scale; m = fma(1-b1, g, m*b1); v = fma((1-b2)*g, g, v*b2); p = p * decay;
//   p = p + (neg_step * m) / (sqrt(v) / sqrt(bc2) + eps)
__device__ __forceinline__ void adamw_elem(float& p, float g_raw, float& m, float& v, const AdamWCoefs& k) {
  const float g = __fmul_rn(g_raw, k.grad_scale);
  const float mi = __fmaf_rn(k.one_minus_beta1, g, __fmul_rn(m, k.beta1));
  const float vi = __fmaf_rn(__fmul_rn(k.one_minus_beta2, g), g, __fmul_rn(v, k.beta2));
  const float pd = __fmul_rn(p, k.decay);
  const float d = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), k.bc2_sqrt), k.eps);
  p = __fadd_rn(pd, __fdiv_rn(__fmul_rn(k.neg_step_size, mi), d));
  m = mi;
  v = vi;
}

__global__ void adamw_vec4_kernel(float4* __restrict__ param, float4* __restrict__ grad, float4* __restrict__ m,
                                  float4* __restrict__ v, int64_t n4, AdamWCoefs k, bool zero_grad) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    float4 p4 = param[i], m4 = m[i], v4 = v[i];
    const float4 g4 = grad[i];
    adamw_elem(p4.x, g4.x, m4.x, v4.x, k);
    adamw_elem(p4.y, g4.y, m4.y, v4.y, k);
    adamw_elem(p4.z, g4.z, m4.z, v4.z, k);
    adamw_elem(p4.w, g4.w, m4.w, v4.w, k);
    param[i] = p4;
    m[i] = m4;
    v[i] = v4;
    if (zero_grad) grad[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
}

__global__ void adamw_scalar_kernel(float* __restrict__ param, float* __restrict__ grad, float* __restrict__ m,
                                    float* __restrict__ v, int64_t n, AdamWCoefs k, bool zero_grad) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float p = param[i], mi = m[i], vi = v[i];
    adamw_elem(p, grad[i], mi, vi, k);
    param[i] = p;
    m[i] = mi;
    v[i] = vi;
    if (zero_grad) grad[i] = 0.0f;
  }
}

// ---- SGD ----------------------------------------------------------------------------------------------
// The CPU reference's order (backend/cpu/sgd.cpp): g = grad * gs; d = fma(p, wd, g); buf = buf * mom
// (rounded); buf = buf + d; p = fma(d, -lr, p). Explicitly rounded intrinsics: nvcc may not contract the
// momentum product into the add.
template <bool kDecay, bool kMomentum>
__global__ void sgd_kernel(float* __restrict__ param, float* __restrict__ grad, float* __restrict__ buf, int64_t n,
                           float gs, float wd, float mom, float neg_lr, bool zero_grad) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float d = __fmul_rn(grad[i], gs);
    const float p = param[i];
    if constexpr (kDecay) d = __fmaf_rn(p, wd, d);
    if constexpr (kMomentum) {
      d = __fadd_rn(__fmul_rn(buf[i], mom), d);
      buf[i] = d;
    }
    param[i] = __fmaf_rn(d, neg_lr, p);
    if (zero_grad) grad[i] = 0.0f;
  }
}

// ---- zero count ---------------------------------------------------------------------------------------------
// Per-thread counts of elements whose magnitude bits are all clear, added into one u64 counter.
template <typename U>
__global__ void count_zeros_kernel(const U* __restrict__ x, int64_t n, U magnitude_mask,
                                   unsigned long long* __restrict__ count) {
  unsigned long long local = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    local += (x[i] & magnitude_mask) == 0;
  if (local) atomicAdd(count, local);
}

// ---- |x| statistics ------------------------------------------------------------------------------------------
// One block per kAbsBlock elements (a function of numel only); each block writes its (Σ|x|, max|x|,
// Σ sqrt|x|) partial, summed in block order on the host.
constexpr int64_t kAbsBlock = 65536;
constexpr int kAbsThreads = 256;

__global__ void __launch_bounds__(kAbsThreads) abs_stats_kernel(const float* __restrict__ x, int64_t n,
                                                                double* __restrict__ partial) {
  __shared__ double s_sum[kAbsThreads], s_max[kAbsThreads], s_sqrt[kAbsThreads];
  const int64_t begin = int64_t(blockIdx.x) * kAbsBlock, end = min(n, begin + kAbsBlock);
  double sum = 0.0, mx = 0.0, sq = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kAbsThreads) {
    const double a = fabs(double(x[i]));
    sum += a;
    sq += sqrt(a);
    if (isnan(a) || (!isnan(mx) && a > mx)) mx = a;
  }
  s_sum[threadIdx.x] = sum;
  s_max[threadIdx.x] = mx;
  s_sqrt[threadIdx.x] = sq;
  __syncthreads();
  for (int stride = kAbsThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      s_sum[threadIdx.x] += s_sum[threadIdx.x + stride];
      s_sqrt[threadIdx.x] += s_sqrt[threadIdx.x + stride];
      const double o = s_max[threadIdx.x + stride], m = s_max[threadIdx.x];
      if (isnan(o) || (!isnan(m) && o > m)) s_max[threadIdx.x] = o;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    partial[3 * blockIdx.x] = s_sum[0];
    partial[3 * blockIdx.x + 1] = s_max[0];
    partial[3 * blockIdx.x + 2] = s_sqrt[0];
  }
}

// The partials in block order (one thread: a few thousand blocks at most per call).
__global__ void abs_stats_total_kernel(const double* __restrict__ partial, int64_t blocks, double* __restrict__ out) {
  double sum = 0.0, mx = 0.0, sq = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    sum += partial[3 * b];
    const double m = partial[3 * b + 1];
    if (isnan(m) || (!isnan(mx) && m > mx)) mx = m;
    sq += partial[3 * b + 2];
  }
  out[0] = sum;
  out[1] = mx;
  out[2] = sq;
}

// ---- raw 16-byte chunks --------------------------------------------------------------------------------
// W elements of T read with one 16-byte load (the caller guarantees alignment).
template <typename T>
struct Chunk16 {
  static constexpr int W = int(16 / sizeof(T));
  T v[W];
};

template <typename T>
__device__ __forceinline__ Chunk16<T> load_chunk(const T* base, int64_t c) {
  const uint4 raw = reinterpret_cast<const uint4*>(base)[c];  // plain load: scale_ rewrites what it reads
  Chunk16<T> out;
  memcpy(&out, &raw, 16);
  return out;
}

template <typename T>
__device__ __forceinline__ void store_chunk(T* base, int64_t c, const Chunk16<T>& in) {
  uint4 raw;
  memcpy(&raw, &in, 16);
  reinterpret_cast<uint4*>(base)[c] = raw;
}

// ---- sum of squares ---------------------------------------------------------------------------------------
constexpr int kSumThreads = 256;
constexpr int64_t kSumMaxBlocks = 1024;  // also the finishing block's width; with W, defines the split

// Blocks for n elements of W per chunk: a function of n (and the dtype) only.
unsigned sum_blocks(int64_t n, int w) {
  const int64_t chunks = (n + w - 1) / w;
  return unsigned(std::clamp<int64_t>((chunks + kSumThreads - 1) / kSumThreads, 1, kSumMaxBlocks));
}

template <typename T>
__device__ __forceinline__ double square(T x) {
  const double d = double(load(x));
  return d * d;
}

template <typename T>
__global__ void __launch_bounds__(kSumThreads) sum_squares_partial_kernel(const T* __restrict__ x, int64_t n,
                                                                          bool vec, double* __restrict__ partial) {
  constexpr int W = Chunk16<T>::W;
  __shared__ double shared[32];
  const int64_t chunks = (n + W - 1) / W;
  const int64_t full = n / W;
  double acc = 0.0;
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks; c += int64_t(gridDim.x) * blockDim.x) {
    if (vec && c < full) {
      const Chunk16<T> ch = load_chunk(x, c);
#pragma unroll
      for (int j = 0; j < W; ++j) acc += square(ch.v[j]);
    } else {
      const int64_t end = min(n, (c + 1) * W);
      for (int64_t i = c * W; i < end; ++i) acc += square(x[i]);
    }
  }
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(kSumMaxBlocks) sum_partials_kernel(const double* __restrict__ partial,
                                                                     int nblocks, double* __restrict__ out) {
  __shared__ double shared[32];
  double v = threadIdx.x < unsigned(nblocks) ? partial[threadIdx.x] : 0.0;
  v = block_sum(v, shared);
  if (threadIdx.x == 0) *out = v;
}

// ---- inf / NaN scan ---------------------------------------------------------------------------------------
// U is the raw storage (uint32/16/8); an element is non-finite iff (bits & mask) == mask.
template <typename U>
__global__ void nonfinite_kernel(const U* __restrict__ x, int64_t n, bool vec, U mask, int* __restrict__ flag) {
  constexpr int W = Chunk16<U>::W;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  bool bad = false;
  int64_t start = 0;
  if (vec) {
    const int64_t full = n / W;
    for (int64_t c = tid; c < full; c += stride) {
      const Chunk16<U> ch = load_chunk(x, c);
#pragma unroll
      for (int j = 0; j < W; ++j) bad |= (ch.v[j] & mask) == mask;
    }
    start = full * W;
  }
  for (int64_t i = start + tid; i < n; i += stride) bad |= (x[i] & mask) == mask;
  if (bad) *flag = 1;  // every writer stores the same value: no race on the result
}

// ---- scale_ ------------------------------------------------------------------------------------------------
// Decode as the CPU's scale_ does: f16 keeps a NaN's sign (the CPU widens bf16/f16 exactly before
// multiplying); fp8 decodes through the core tables (canonical NaN), as load() does.
template <typename T>
__device__ __forceinline__ float load_keep_nan(T x) {
  return load(x);
}
template <>
__device__ __forceinline__ float load_keep_nan<F16>(F16 x) {
  const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  const uint32_t mag = x.bits & 0x7FFFu;
  if (mag >= 0x7C00u) return __uint_as_float(sign | (mag << 13) | 0x7F800000u);
  return __uint_as_float(sign | __float_as_uint(f16_bits_to_f32(uint16_t(mag))));
}

// v * s as x86 computes it: a NaN operand comes back quietened with its payload (GPU arithmetic would
// return the canonical NaN and lose the sign a bf16 NaN keeps on the CPU).
__device__ __forceinline__ float mul_x86(float v, float s) {
  if (isnan(v)) return __uint_as_float(__float_as_uint(v) | 0x00400000u);
  if (isnan(s)) return __uint_as_float(__float_as_uint(s) | 0x00400000u);
  return __fmul_rn(v, s);
}

template <typename T>
__global__ void scale_kernel(T* __restrict__ x, int64_t n, bool vec, float s) {
  constexpr int W = Chunk16<T>::W;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t start = 0;
  if (vec) {
    const int64_t full = n / W;
    for (int64_t c = tid; c < full; c += stride) {
      Chunk16<T> ch = load_chunk(x, c);
#pragma unroll
      for (int j = 0; j < W; ++j) ch.v[j] = store<T>(mul_x86(load_keep_nan(ch.v[j]), s));
      store_chunk(x, c, ch);
    }
    start = full * W;
  }
  for (int64_t i = start + tid; i < n; i += stride) x[i] = store<T>(mul_x86(load_keep_nan(x[i]), s));
}

// ---- fill_ -------------------------------------------------------------------------------------------------
template <typename U>
__global__ void fill_kernel(U* __restrict__ x, int64_t n, bool vec, U value) {
  constexpr int W = Chunk16<U>::W;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t start = 0;
  if (vec) {
    Chunk16<U> ch;
#pragma unroll
    for (int j = 0; j < W; ++j) ch.v[j] = value;
    const int64_t full = n / W;
    for (int64_t c = tid; c < full; c += stride) store_chunk(x, c, ch);
    start = full * W;
  }
  for (int64_t i = start + tid; i < n; i += stride) x[i] = value;
}

template <typename U>
void launch_fill(const CudaContext& ctx, void* x, int64_t n, U value) {
  const bool vec = aligned16(x);
  fill_kernel<U><<<grid_for(vec ? n / Chunk16<U>::W + 1 : n), kThreads, 0, ctx.compute_stream()>>>(
      static_cast<U*>(x), n, vec, value);
  LOOM_CUDA_LAUNCH_CHECK();
}

template <typename F>
void dispatch_any_float(DType dt, const char* op, F&& f) {
  switch (dt) {
    case DType::kF32: f(float{}); return;
    case DType::kBF16: f(Bf16{}); return;
    case DType::kF16: f(F16{}); return;
    case DType::kF8E4M3: f(F8E4M3{}); return;
    case DType::kF8E5M2: f(F8E5M2{}); return;
    default: LOOM_FAIL("[", op, "] expected a float dtype (f32, bf16, f16, fp8e4m3, fp8e5m2), got ", dtype_name(dt));
  }
}

}  // namespace

void adamw_update(const CudaContext& ctx, TensorView param, TensorView grad, TensorView m, TensorView v,
                  const AdamWParams& p) {
  const int64_t n = param.numel();
  const AdamWCoefs k = adamw_coefs(p);
  if (n == 0) return;
  float* pp = ptr<float>(param);
  float* pg = ptr<float>(grad);
  float* pm = ptr<float>(m);
  float* pv = ptr<float>(v);
  int64_t done = 0;
  if (aligned16(pp) && aligned16(pg) && aligned16(pm) && aligned16(pv) && n >= 4) {
    const int64_t n4 = n / 4;
    adamw_vec4_kernel<<<grid_for(n4), kThreads, 0, ctx.compute_stream()>>>(
        reinterpret_cast<float4*>(pp), reinterpret_cast<float4*>(pg), reinterpret_cast<float4*>(pm),
        reinterpret_cast<float4*>(pv), n4, k, p.zero_grad);
    LOOM_CUDA_LAUNCH_CHECK();
    done = n4 * 4;
  }
  if (done < n) {
    adamw_scalar_kernel<<<grid_for(n - done), kThreads, 0, ctx.compute_stream()>>>(
        pp + done, pg + done, pm + done, pv + done, n - done, k, p.zero_grad);
    LOOM_CUDA_LAUNCH_CHECK();
  }
}

void sgd_update(const CudaContext& ctx, TensorView param, TensorView grad, TensorView momentum_buf,
                const SgdParams& p) {
  const int64_t n = param.numel();
  if (n == 0) return;
  float* buf = p.momentum != 0.0f ? ptr<float>(momentum_buf) : nullptr;
  const auto launch = [&](auto kernel) {
    kernel<<<grid_for(n), kThreads, 0, ctx.compute_stream()>>>(ptr<float>(param), ptr<float>(grad), buf, n,
                                                                p.grad_scale, p.weight_decay, p.momentum, -p.lr,
                                                                p.zero_grad);
    LOOM_CUDA_LAUNCH_CHECK();
  };
  const bool decay = p.weight_decay != 0.0f;
  if (decay && buf) launch(sgd_kernel<true, true>);
  else if (decay) launch(sgd_kernel<true, false>);
  else if (buf) launch(sgd_kernel<false, true>);
  else launch(sgd_kernel<false, false>);
}

int64_t count_zeros(const CudaContext& ctx, TensorView x) {
  const int64_t n = x.numel();
  if (n == 0) return 0;
  Tensor count = scratch(ctx, {1}, DType::kI64);
  LOOM_CUDA_CHECK(cudaMemsetAsync(count.raw(), 0, sizeof(int64_t), ctx.compute_stream()));
  auto* c = static_cast<unsigned long long*>(count.raw());
  const auto launch = [&](auto tag, auto mask) {
    using U = decltype(tag);
    count_zeros_kernel<U><<<grid_for(n), kThreads, 0, ctx.compute_stream()>>>(cptr<U>(x), n, U(mask), c);
    LOOM_CUDA_LAUNCH_CHECK();
  };
  switch (dtype_size(x.dtype())) {
    case 4: launch(uint32_t{}, 0x7FFFFFFFu); break;
    case 2: launch(uint16_t{}, 0x7FFFu); break;
    default: launch(uint8_t{}, 0x7Fu); break;
  }
  int64_t result = 0;
  std::memcpy(&result, read_back(ctx, count.raw(), sizeof(int64_t)), sizeof(int64_t));
  return result;
}

AbsStats abs_stats(const CudaContext& ctx, TensorView x) {
  AbsStats out;
  const int64_t n = x.numel();
  if (n == 0) return out;
  const int64_t blocks = (n + kAbsBlock - 1) / kAbsBlock;
  Tensor buf = scratch(ctx, {3 * blocks + 3}, DType::kI64);  // 8-byte slots: f64 partials, then the total
  auto* partial = static_cast<double*>(buf.raw());
  abs_stats_kernel<<<unsigned(blocks), kAbsThreads, 0, ctx.compute_stream()>>>(cptr<float>(x), n, partial);
  LOOM_CUDA_LAUNCH_CHECK();
  abs_stats_total_kernel<<<1, 1, 0, ctx.compute_stream()>>>(partial, blocks, partial + 3 * blocks);
  LOOM_CUDA_LAUNCH_CHECK();
  double total[3];
  std::memcpy(total, read_back(ctx, partial + 3 * blocks, sizeof(total)), sizeof(total));
  out.sum_abs = total[0];
  out.max_abs = total[1];
  out.sum_sqrt_abs = total[2];
  return out;
}

double sum_squares(const CudaContext& ctx, TensorView x) {
  const int64_t n = x.numel();
  double result = 0.0;
  dispatch_any_float(x.dtype(), "sum_squares", [&](auto tag) {
    using T = decltype(tag);
    if (n == 0) return;
    const unsigned blocks = sum_blocks(n, Chunk16<T>::W);
    // Partials and the total in one i64 scratch (8-byte slots; Loom has no f64 dtype): [0, blocks) then total.
    Tensor buf = scratch(ctx, {int64_t(blocks) + 1}, DType::kI64);
    double* partial = static_cast<double*>(buf.raw());
    sum_squares_partial_kernel<T><<<blocks, kSumThreads, 0, ctx.compute_stream()>>>(cptr<T>(x), n,
                                                                                     aligned16(x.raw()), partial);
    LOOM_CUDA_LAUNCH_CHECK();
    sum_partials_kernel<<<1, int(kSumMaxBlocks), 0, ctx.compute_stream()>>>(partial, int(blocks), partial + blocks);
    LOOM_CUDA_LAUNCH_CHECK();
    std::memcpy(&result, read_back(ctx, partial + blocks, sizeof(double)), sizeof(double));
  });
  return result;
}

bool has_inf_or_nan(const CudaContext& ctx, TensorView x) {
  const int64_t n = x.numel();
  // Exponent-field masks of the encodings (e4m3 has no inf; its NaN is the all-ones magnitude).
  uint32_t mask = 0;
  switch (x.dtype()) {
    case DType::kF32: mask = 0x7F800000u; break;
    case DType::kBF16: mask = 0x7F80u; break;
    case DType::kF16: mask = 0x7C00u; break;
    case DType::kF8E4M3: mask = 0x7Fu; break;
    case DType::kF8E5M2: mask = 0x7Cu; break;
    default:
      LOOM_FAIL("[has_inf_or_nan] expected a float dtype (f32, bf16, f16, fp8e4m3, fp8e5m2), got ",
                dtype_name(x.dtype()));
  }
  if (n == 0) return false;
  Tensor flag = scratch(ctx, {1}, DType::kI32);
  LOOM_CUDA_CHECK(cudaMemsetAsync(flag.raw(), 0, sizeof(int), ctx.compute_stream()));
  const bool vec = aligned16(x.raw());
  const auto launch = [&](auto tag) {
    using U = decltype(tag);
    const int64_t work = vec ? n / Chunk16<U>::W + Chunk16<U>::W : n;
    nonfinite_kernel<U><<<grid_for(work), kThreads, 0, ctx.compute_stream()>>>(cptr<U>(x), n, vec, U(mask),
                                                                              ptr<int>(flag));
    LOOM_CUDA_LAUNCH_CHECK();
  };
  switch (dtype_size(x.dtype())) {
    case 4: launch(uint32_t{}); break;
    case 2: launch(uint16_t{}); break;
    default: launch(uint8_t{}); break;
  }
  int bad = 0;
  std::memcpy(&bad, read_back(ctx, flag.raw(), sizeof(int)), sizeof(int));
  return bad != 0;
}

void scale_(const CudaContext& ctx, TensorView x, float s) {
  const int64_t n = x.numel();
  dispatch_any_float(x.dtype(), "scale_", [&](auto tag) {
    using T = decltype(tag);
    if (n == 0) return;
    const bool vec = aligned16(x.raw());
    const int64_t work = vec ? n / Chunk16<T>::W + Chunk16<T>::W : n;
    scale_kernel<T><<<grid_for(work), kThreads, 0, ctx.compute_stream()>>>(ptr<T>(x), n, vec, s);
    LOOM_CUDA_LAUNCH_CHECK();
  });
}

void fill_(const CudaContext& ctx, TensorView x, float value) {
  const int64_t n = x.numel();
  // The element's bits, converted exactly as CpuOps::fill_ converts the value.
  uint64_t bits = 0;
  switch (x.dtype()) {
    case DType::kF32: {
      uint32_t u;
      std::memcpy(&u, &value, 4);
      bits = u;
      break;
    }
    case DType::kBF16: bits = f32_to_bf16(value); break;
    case DType::kF16: bits = f32_to_f16(value); break;
    case DType::kF8E4M3: bits = f32_to_fp8_e4m3(value); break;
    case DType::kF8E5M2: bits = f32_to_fp8_e5m2(value); break;
    case DType::kI32: bits = uint32_t(int32_t(value)); break;
    case DType::kI64: bits = uint64_t(int64_t(value)); break;
    case DType::kU16: bits = uint16_t(value); break;
    default: LOOM_FAIL("[fill_] expected a float, i32, i64 or u16 dtype, got ", dtype_name(x.dtype()));
  }
  if (n == 0) return;
  const size_t es = dtype_size(x.dtype());
  if (bits == 0 || es == 1) {  // a byte pattern: the copy engine's memset does it
    LOOM_CUDA_CHECK(cudaMemsetAsync(x.raw(), int(bits & 0xFFu), size_t(n) * es, ctx.compute_stream()));
    return;
  }
  switch (es) {
    case 2: launch_fill(ctx, x.raw(), n, uint16_t(bits)); break;
    case 4: launch_fill(ctx, x.raw(), n, uint32_t(bits)); break;
    default: launch_fill(ctx, x.raw(), n, uint64_t(bits)); break;
  }
}

}  // namespace loom::cuda

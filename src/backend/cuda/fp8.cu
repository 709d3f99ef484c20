// FP8 kernels: per-tensor quantise (with the amax reduction), dequantise, the delayed-scaling update, the
// FP8 GEMM (cuBLASLt tensor cores, or an exact dequantise-then-f32 fallback) and a tiled transpose.
//
// Invariants:
//   - quantise computes x · scale in f32 and encodes it with device_utils' saturating RNE codec, the same
//     bits as the CPU's encoder; dequantise computes decode(v) · scale_inv in f32 and rounds once to out;
//   - amax: each block reduces max |x| (a NaN or inf element makes it +inf) into a per-block slot, and one
//     single-block kernel folds the slots into amax[0] with the CPU's rule. Max is exact, so the result does
//     not depend on the split; no atomics, no host round trip;
//   - the scaling update handles one tensor (one column of the history) per thread, reading the column
//     before shifting it, so the roll needs no second buffer and no inter-thread ordering;
//   - quantise/dequantise move 4 elements per thread step when both pointers allow vector accesses (16- or
//     8-byte input loads, 4-byte fp8 words); odd tails and unaligned views take the scalar loop.
#include "backend/cuda/fp8.cuh"

#include <cfloat>
#include <cmath>
#include <utility>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/matmul.cuh"

namespace loom::cuda {

namespace {

constexpr unsigned kMaxAmaxBlocks = 1024;  // per-block amax slots; a grid-stride loop covers larger inputs

template <typename T>
struct alignas(4 * sizeof(T)) Pack4 {
  T v[4];
};

bool aligned_to(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

template <typename F>
void dispatch_fp8(DType dt, const char* what, F&& f) {
  switch (dt) {
    case DType::kF8E4M3: f(F8E4M3{}); return;
    case DType::kF8E5M2: f(F8E5M2{}); return;
    default: LOOM_FAIL(what, ": expected e4m3 or e5m2, got ", dtype_name(dt));
  }
}

// |x| folded into a running max that NaN/inf turn into +inf for good (fmaxf would drop a NaN).
__device__ __forceinline__ float amax_step(float m, float x) {
  const float a = fabsf(x);
  return isfinite(a) ? fmaxf(m, a) : __int_as_float(0x7F800000);
}

// x · s, except that a NaN x passes through unchanged: the GPU's multiply returns a canonical NaN, while
// the CPU's keeps the operand's (its sign then survives into the fp8 code and the narrowed 16-bit value).
__device__ __forceinline__ float scale_keep_nan(float x, float s) { return isnan(x) ? x : x * s; }

// out[i] = store<TOut>(f(load(inp[i]))) for i in [0, n), grid-stride: with `vec` (both pointers aligned to a
// Pack4) first in 4-element packs, each thread taking packs tid, tid + stride, ..., then the scalar tail;
// f sees each thread's elements in that order.
template <typename TIn, typename TOut, typename F>
__device__ __forceinline__ void map_elements(TOut* __restrict__ out, const TIn* __restrict__ inp, int64_t n,
                                             bool vec, F f) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if (vec) {
    const int64_t n4 = n / 4;
    const auto* in4 = reinterpret_cast<const Pack4<TIn>*>(inp);
    auto* out4 = reinterpret_cast<Pack4<TOut>*>(out);
    for (int64_t i = tid; i < n4; i += stride) {
      const Pack4<TIn> x = in4[i];
      Pack4<TOut> y;
#pragma unroll
      for (int j = 0; j < 4; ++j) y.v[j] = store<TOut>(f(load(x.v[j])));
      out4[i] = y;
    }
    done = n4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) out[i] = store<TOut>(f(load(inp[i])));
}

template <typename TIn, typename TOut>
__global__ void quantize_kernel(TOut* __restrict__ out, const TIn* __restrict__ inp, int64_t n,
                                const float* __restrict__ scale, float* __restrict__ block_amax, bool vec) {
  __shared__ float sh[32];
  const float s = *scale;
  float m = 0.0f;
  map_elements(out, inp, n, vec, [&](float f) {
    m = amax_step(m, f);
    return scale_keep_nan(f, s);
  });
  m = block_max(m, sh);
  if (threadIdx.x == 0) block_amax[blockIdx.x] = m;
}

// amax[0] = +inf if any slot is +inf or the old value is not finite, else max(old, slots) (std::max's
// argument order, as the CPU).
__global__ void amax_fold_kernel(float* __restrict__ amax, const float* __restrict__ block_amax, int nslots) {
  __shared__ float sh[32];
  float m = 0.0f;
  for (int i = threadIdx.x; i < nslots; i += blockDim.x) m = fmaxf(m, block_amax[i]);
  m = block_max(m, sh);
  if (threadIdx.x == 0) {
    const float old = *amax;
    *amax = (isinf(m) || !isfinite(old)) ? __int_as_float(0x7F800000) : (old < m ? m : old);
  }
}

template <typename TIn, typename TOut>
__global__ void dequantize_kernel(TOut* __restrict__ out, const TIn* __restrict__ inp, int64_t n,
                                  const float* __restrict__ scale_inv, bool vec) {
  const float si = *scale_inv;
  map_elements(out, inp, n, vec, [si](float f) { return scale_keep_nan(f, si); });
}

// One thread per tensor j (a column of the (L, n) history): reduce, update, then roll the column.
__global__ void update_scaling_kernel(float* __restrict__ hist, float* __restrict__ scale,
                                      float* __restrict__ scale_inv, int64_t L, int64_t n, float fp8_max,
                                      float two_m, bool use_max) {
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += int64_t(gridDim.x) * blockDim.x) {
    float amax = hist[j];
    if (use_max)
      for (int64_t r = 1; r < L && !isnan(amax); ++r) {
        const float v = hist[r * n + j];
        amax = isnan(v) ? v : (amax < v ? v : amax);
      }
    float s = scale[j];
    if (amax > 0.0f && isfinite(amax)) {
      s = (fp8_max / amax) / two_m;
      if (isinf(s)) s = FLT_MAX;
      scale[j] = s;
    }
    scale_inv[j] = 1.0f / s;
    for (int64_t r = L - 1; r >= 1; --r) hist[r * n + j] = hist[(r - 1) * n + j];
    hist[j] = 0.0f;
  }
}

constexpr int kTile = 32;
constexpr int kTileRows = 8;  // threads down a tile; each moves kTile / kTileRows elements

// out (C, R) = inp (R, C)^T through a shared tile: rows of inp are read and rows of out written coalesced;
// the +1 column keeps the column-wise tile reads free of bank conflicts. Tile loops are uniform per block,
// so the barriers are reached by every thread.
template <typename E>
__global__ void transpose_kernel(E* __restrict__ out, const E* __restrict__ inp, int64_t R, int64_t C) {
  __shared__ E tile[kTile][kTile + 1];
  const int64_t tiles_r = (R + kTile - 1) / kTile, tiles_c = (C + kTile - 1) / kTile;
  for (int64_t ty = blockIdx.y; ty < tiles_r; ty += gridDim.y) {
    for (int64_t tx = blockIdx.x; tx < tiles_c; tx += gridDim.x) {
      const int64_t r0 = ty * kTile, c0 = tx * kTile;
      for (int j = threadIdx.y; j < kTile; j += kTileRows) {
        const int64_t r = r0 + j, c = c0 + threadIdx.x;
        if (r < R && c < C) tile[j][threadIdx.x] = inp[r * C + c];
      }
      __syncthreads();
      for (int j = threadIdx.y; j < kTile; j += kTileRows) {
        const int64_t oc = c0 + j, orow = r0 + threadIdx.x;  // out row oc (an inp column), out column orow
        if (oc < C && orow < R) out[oc * R + orow] = tile[threadIdx.x][j];
      }
      __syncthreads();
    }
  }
}

}  // namespace

void fp8_quantize(const CudaContext& ctx, TensorView out, TensorView inp, TensorView scale, TensorView amax) {
  const int64_t n = inp.numel();
  cudaStream_t s = ctx.compute_stream();
  // Even an empty input folds into amax (a non-finite old amax becomes +inf), as on the CPU.
  dispatch_float(inp.dtype(), "[fp8_quantize] inp", [&](auto in_tag) {
    using TIn = decltype(in_tag);
    dispatch_fp8(out.dtype(), "[fp8_quantize] out", [&](auto out_tag) {
      using TOut = decltype(out_tag);
      const bool vec = n >= 4 && aligned_to(inp.raw(), sizeof(Pack4<TIn>)) && aligned_to(out.raw(), 4);
      const unsigned blocks = std::min(grid_for(vec ? n / 4 : n), kMaxAmaxBlocks);
      Tensor slots = scratch(ctx, {int64_t(blocks)}, DType::kF32);
      quantize_kernel<TIn, TOut><<<blocks, kThreads, 0, s>>>(ptr<TOut>(out), cptr<TIn>(inp), n, cptr<float>(scale),
                                                             ptr<float>(slots), vec);
      LOOM_CUDA_LAUNCH_CHECK();
      amax_fold_kernel<<<1, kThreads, 0, s>>>(ptr<float>(amax), cptr<float>(slots), int(blocks));
      LOOM_CUDA_LAUNCH_CHECK();
    });
  });
}

void fp8_dequantize(const CudaContext& ctx, TensorView out, TensorView inp, TensorView scale_inv) {
  const int64_t n = inp.numel();
  if (n == 0) return;
  cudaStream_t s = ctx.compute_stream();
  dispatch_fp8(inp.dtype(), "[fp8_dequantize] inp", [&](auto in_tag) {
    using TIn = decltype(in_tag);
    dispatch_float(out.dtype(), "[fp8_dequantize] out", [&](auto out_tag) {
      using TOut = decltype(out_tag);
      const bool vec = n >= 4 && aligned_to(inp.raw(), 4) && aligned_to(out.raw(), sizeof(Pack4<TOut>));
      dequantize_kernel<TIn, TOut><<<grid_for(vec ? n / 4 : n), kThreads, 0, s>>>(
          ptr<TOut>(out), cptr<TIn>(inp), n, cptr<float>(scale_inv), vec);
      LOOM_CUDA_LAUNCH_CHECK();
    });
  });
}

void fp8_update_scaling(const CudaContext& ctx, TensorView amax_history, TensorView scale, TensorView scale_inv,
                        float fp8_max, int margin, bool use_max) {
  const int64_t L = amax_history.size(0), n = amax_history.size(1);
  if (n == 0) return;
  // 2^margin exactly as the CPU computes it (inf for huge margins, which then gives a zero scale there too).
  const float two_m = std::ldexp(1.0f, margin);
  update_scaling_kernel<<<grid_for(n), kThreads, 0, ctx.compute_stream()>>>(
      ptr<float>(amax_history), ptr<float>(scale), ptr<float>(scale_inv), L, n, fp8_max, two_m, use_max);
  LOOM_CUDA_LAUNCH_CHECK();
}

void fp8_gemm(const CudaContext& ctx, TensorView out, TensorView a, TensorView a_scale_inv, TensorView b,
              TensorView b_scale_inv, TensorView bias, bool accumulate) {
  constexpr const char* op = "fp8_gemm";
  const int64_t N = b.size(0), K = b.size(1);
  const int64_t M = a.shape().rows();
  if (M == 0 || N == 0) return;
  if (K == 0) {
    detail::gemm_finalize(ctx, out, nullptr, bias, accumulate, M, N);
    return;
  }

  // Row-major out (M, N) is column-major out^T (N x M) = b-stored (K x N, op T) · a-stored (K x M): the TN
  // form FP8 cuBLASLt requires. Its A/B scales are therefore b's and a's.
  detail::LtGemm g{.m = N, .n = M, .k = K, .trans_a = true, .lda = K, .ldb = K, .ldd = N};

  // f32 product into out itself when nothing has to be added after it in f32, else into scratch.
  const bool direct_f32 = out.dtype() == DType::kF32 && !accumulate;
  auto product_target = [&](Tensor& tmp) -> float* {
    if (direct_f32) return static_cast<float*>(out.raw());
    tmp = scratch(ctx, {M, N}, DType::kF32);
    return ptr<float>(tmp);
  };

  const int sm = ctx.props().major * 10 + ctx.props().minor;
  const bool tensor_core_shape = sm >= 89 && K % 16 == 0 && N % 16 == 0 && aligned_to(a.raw(), 16) &&
                                 aligned_to(b.raw(), 16) && aligned_to(out.raw(), 16);
  if (tensor_core_shape) {
    g.a = b.raw();
    g.a_type = b.dtype();
    g.b = a.raw();
    g.b_type = a.dtype();
    g.a_scale = cptr<float>(b_scale_inv);
    g.b_scale = cptr<float>(a_scale_inv);
    // FP8 cuBLASLt takes a bias of out's dtype only for 16-bit outputs (f32 outputs would want a bf16 bias in
    // the epilogue); any other bias (f32, or 16-bit of another dtype than out's) is added in f32 after the
    // product, before the rounding (gemm_finalize).
    const bool epilogue_bias = !bias.defined() || (out.dtype() != DType::kF32 && bias.dtype() == out.dtype());
    if (epilogue_bias) {
      g.d = out.raw();
      g.d_type = out.dtype();
      g.accumulate = accumulate;
      g.bias = bias.defined() ? bias.raw() : nullptr;
      if (detail::lt_matmul(ctx, g, op, /*allow_unsupported=*/true)) return;
    } else {
      Tensor tmp;
      float* d = product_target(tmp);
      g.d = d;
      g.d_type = DType::kF32;
      if (detail::lt_matmul(ctx, g, op, /*allow_unsupported=*/true)) {
        detail::gemm_finalize(ctx, out, d, bias, accumulate, M, N);
        return;
      }
    }
  }

  // Fallback (pre-Ada GPU, or a shape/alignment FP8 cuBLASLt does not take): the CPU's emulation.
  Tensor af = scratch(ctx, {M, K}, DType::kF32), bf = scratch(ctx, {N, K}, DType::kF32);
  fp8_dequantize(ctx, af, a.reshape({M, K}), a_scale_inv);
  fp8_dequantize(ctx, bf, b, b_scale_inv);
  Tensor tmp;
  float* d = product_target(tmp);
  g.a = bf.raw();
  g.a_type = DType::kF32;
  g.b = af.raw();
  g.b_type = DType::kF32;
  g.a_scale = g.b_scale = nullptr;
  g.d = d;
  g.d_type = DType::kF32;
  g.accumulate = false;
  g.bias = nullptr;
  detail::lt_matmul(ctx, g, op);
  if (!direct_f32 || bias.defined()) detail::gemm_finalize(ctx, out, d, bias, accumulate, M, N);
}

void transpose(const CudaContext& ctx, TensorView out, TensorView inp) {
  const int64_t R = inp.size(0), C = inp.size(1);
  const size_t es = dtype_size(inp.dtype());
  if (R == 0 || C == 0) return;
  const int64_t tiles_r = (R + kTile - 1) / kTile, tiles_c = (C + kTile - 1) / kTile;
  const dim3 grid(unsigned(std::min<int64_t>(tiles_c, kMaxGrid)), unsigned(std::min<int64_t>(tiles_r, 65535)));
  const dim3 block(kTile, kTileRows);
  cudaStream_t s = ctx.compute_stream();
  auto run = [&](auto tag) {
    using E = decltype(tag);
    transpose_kernel<E><<<grid, block, 0, s>>>(static_cast<E*>(out.raw()), static_cast<const E*>(inp.raw()), R, C);
    LOOM_CUDA_LAUNCH_CHECK();
  };
  if (es == 1) run(uint8_t{});
  else if (es == 2) run(uint16_t{});
  else run(uint32_t{});
}

}  // namespace loom::cuda

// Linear-layer matmuls on the GPU through cuBLASLt, plus the two small kernels the products need around
// them (a bias/accumulate finaliser and the bias-gradient column sum).
//
// Row-major tensors are handed to cuBLASLt (column-major) as their transposes, so no operand is ever copied:
//   forward  out^T  (N x M) = W^T-stored (K x N, op T) · inp^T-stored (K x M)       "TN"
//   dinp     dinp^T (K x M) = W-as-(K x N)            · dout^T-stored (N x M)      "NN"
//   dweight  dW^T   (K x N) = inp^T-stored (K x M)    · (dout^T-stored)^T (M x N)  "NT", beta = 1
// Accumulation is f32 (CUBLAS_COMPUTE_32F; kAllowTf32 below keeps f32 operands exact by default). The bias
// is fused through the BIAS epilogue when cuBLASLt takes its dtype (that of D); otherwise the product goes
// to f32 (out itself, or scratch when out is 16-bit) and gemm_finalize adds the bias and rounds once.
//
// Determinism: cuBLASLt gives bit-identical results run to run for one algorithm on one GPU and one
// stream; the algorithm for a problem is chosen once (heuristic cache below) and reused. The bias gradient
// is a two-stage column sum whose split depends only on (M, N): per-chunk partial sums in a fixed order into
// scratch, then one fixed-order pass over the chunks. No floating-point atomics.
#include "backend/cuda/matmul.cuh"

#include <cublasLt.h>

#include <map>
#include <cstdio>
#include <mutex>
#include <tuple>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/vec_io.cuh"

namespace loom::cuda {

namespace {

// TF32 for f32 operands roughly doubles their speed but rounds the operands to 10-bit mantissas, which
// breaks the f32 cross-check against the CPU; off unless a build deliberately flips it.
constexpr bool kAllowTf32 = false;

cudaDataType_t to_cuda(DType dt) {
  switch (dt) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
    case DType::kF8E4M3: return CUDA_R_8F_E4M3;
    case DType::kF8E5M2: return CUDA_R_8F_E5M2;
    default: LOOM_FAIL("[matmul] no cuBLASLt type for ", dtype_name(dt));
  }
}

// Largest power of two (<= 256, cuBLASLt's default assumption) dividing the address.
uint32_t pointer_alignment(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  if (u == 0) return 256;
  const uintptr_t low = u & (~u + 1);
  return uint32_t(low >= 256 ? 256 : low);
}

// ---- heuristic cache ------------------------------------------------------------------------------------
// A plan is everything cublasLtMatmul needs that does not change between calls with the same problem:
// descriptors, layouts and the chosen algorithm. Pointer alignments are part of the key because they
// restrict which algorithms are valid; the pointers themselves (data, bias, scales) are set per call.
struct PlanKey {
  int device;
  int64_t m, n, k, lda, ldb, ldd;
  bool trans_a, trans_b, bias, scaled;
  DType a_type, b_type, d_type;
  uint32_t align_a, align_b, align_d, align_bias;
  auto tie() const {
    return std::tie(device, m, n, k, lda, ldb, ldd, trans_a, trans_b, bias, scaled, a_type, b_type, d_type, align_a,
                    align_b, align_d, align_bias);
  }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool supported = false;
};

class PlanCache {
 public:
  // Leaked on purpose: plans hold cuBLASLt objects that must not be destroyed after the CUDA runtime has
  // been torn down at exit.
  static PlanCache& get() {
    static PlanCache* c = new PlanCache();
    return *c;
  }
  std::mutex& mutex() { return mu_; }
  // Caller holds mutex().
  Plan& find_or_build(const CudaContext& ctx, const PlanKey& key, const detail::LtGemm& g) {
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    if (plans_.size() >= kMaxPlans) clear();
    return plans_.emplace(key, build(ctx, key, g)).first->second;
  }

 private:
  static constexpr size_t kMaxPlans = 4096;  // a training run uses a few dozen shapes; bounds pathological use

  void clear() {
    for (auto& [k, p] : plans_) destroy(p);
    plans_.clear();
  }
  static void destroy(Plan& p) {
    if (p.la) cublasLtMatrixLayoutDestroy(p.la);
    if (p.lb) cublasLtMatrixLayoutDestroy(p.lb);
    if (p.ld) cublasLtMatrixLayoutDestroy(p.ld);
    if (p.desc) cublasLtMatmulDescDestroy(p.desc);
    p = Plan{};
  }

  static Plan build(const CudaContext& ctx, const PlanKey& key, const detail::LtGemm& g) {
    Plan p;
    const bool all_f32 = g.a_type == DType::kF32 && g.b_type == DType::kF32;
    const cublasComputeType_t compute =
        all_f32 && kAllowTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, compute, CUDA_R_32F));
    const int32_t ta = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    if (key.bias) {
      const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
      LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
      // The heuristic reads the pointer's value for its alignment.
      LOOM_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
    }
    if (key.scaled) {
      LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g.a_scale,
                                                       sizeof(g.a_scale)));
      LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g.b_scale,
                                                       sizeof(g.b_scale)));
    }
    // Stored (column-major) shapes: op(A) is m x k, op(B) is k x n.
    LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.la, to_cuda(g.a_type), uint64_t(g.trans_a ? g.k : g.m),
                                                 uint64_t(g.trans_a ? g.m : g.k), g.lda));
    LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.lb, to_cuda(g.b_type), uint64_t(g.trans_b ? g.n : g.k),
                                                 uint64_t(g.trans_b ? g.k : g.n), g.ldb));
    LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.ld, to_cuda(g.d_type), uint64_t(g.m), uint64_t(g.n), g.ldd));

    cublasLtMatmulPreference_t pref = nullptr;
    LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = ctx.workspace_bytes();
    auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attr, const void* v, size_t n) {
      const cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, attr, v, n);
      if (st != CUBLAS_STATUS_SUCCESS) cublasLtMatmulPreferenceDestroy(pref);
      LOOM_CUBLAS_CHECK(st);
    };
    set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_a, sizeof(uint32_t));
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_b, sizeof(uint32_t));
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_d, sizeof(uint32_t));
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_d, sizeof(uint32_t));
    cublasLtMatmulHeuristicResult_t result{};
    int count = 0;
    // An unsupported type combination or layout answers NOT_SUPPORTED (or INVALID_VALUE for some FP8
    // constraints): recorded as an unsupported plan, so the caller can fall back without asking again.
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(ctx.cublaslt(), p.desc, p.la, p.lb, p.ld, p.ld, pref, 1, &result, &count);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st == CUBLAS_STATUS_SUCCESS && count > 0 && result.state == CUBLAS_STATUS_SUCCESS &&
        result.workspaceSize <= ws) {
      p.algo = result.algo;
      p.supported = true;
    }
    return p;
  }

  std::mutex mu_;
  std::map<PlanKey, Plan> plans_;
};

// ---- kernels -------------------------------------------------------------------------------------------------

// out = round([out +] (src + bias)); src and out may alias (f32 out), so no __restrict__ on them.
template <typename TOut, typename TBias>
__global__ void finalize_kernel(TOut* out, const float* src, const TBias* __restrict__ bias, bool accumulate,
                                int64_t M, int64_t N) {
  const int64_t total = M * N;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    float v = src ? src[i] : 0.0f;
    if (bias) v += load(bias[i % N]);
    if (accumulate) v = load(out[i]) + v;
    out[i] = store<TOut>(v);
  }
}

constexpr int kColTile = 32;     // columns per block (one warp across, coalesced row reads)
constexpr int kRowLanes = 8;     // threads down the rows of a chunk
constexpr int64_t kMinRowsPerChunk = 64;
constexpr int64_t kMaxChunks = 256;  // bounds the partials buffer at 256 * N floats

// partial[c, col] = sum of dout[r, col] over chunk c's rows, in a fixed order (strided per lane, then the
// 8 lanes in order). grid.y = chunk, grid.x strides over column tiles.
template <typename T>
__global__ void colsum_partial_kernel(float* __restrict__ partial, const T* __restrict__ dout, int64_t M, int64_t N,
                                      int64_t rows_per_chunk) {
  __shared__ float sh[kRowLanes][kColTile + 1];
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < M ? r0 + rows_per_chunk : M;
  const int64_t tiles = (N + kColTile - 1) / kColTile;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t col = t * kColTile + threadIdx.x;
    float s = 0.0f;
    if (col < N)
      for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) s += load(dout[r * N + col]);
    sh[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < N) {
      float tot = 0.0f;
#pragma unroll
      for (int j = 0; j < kRowLanes; ++j) tot += sh[j][threadIdx.x];
      partial[int64_t(blockIdx.y) * N + col] = tot;
    }
    __syncthreads();
  }
}

// dbias[col] = round(dbias[col] + sum of partial[c, col] over the chunks) (f32, column_sum_fixed_order).
template <typename TB>
__global__ void colsum_final_kernel(TB* __restrict__ dbias, const float* __restrict__ partial, int64_t chunks,
                                    int64_t N) {
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const float tot = column_sum_fixed_order<float>(partial, chunks, N, col, N);
  if (threadIdx.y == 0 && col < N) dbias[col] = store<TB>(load(dbias[col]) + tot);
}

// dbias (N) += column sums of dout (M, N).
void column_sum_accumulate(const CudaContext& ctx, TensorView dbias, TensorView dout, int64_t M, int64_t N) {
  if (M == 0 || N == 0) return;
  const int64_t want = std::clamp<int64_t>((M + kMinRowsPerChunk - 1) / kMinRowsPerChunk, 1, kMaxChunks);
  const int64_t rows_per_chunk = (M + want - 1) / want;
  const int64_t chunks = (M + rows_per_chunk - 1) / rows_per_chunk;
  Tensor partial = scratch(ctx, {chunks, N}, DType::kF32);
  const int64_t tiles = (N + kColTile - 1) / kColTile;
  const dim3 grid(unsigned(std::min<int64_t>(tiles, kMaxGrid)), unsigned(chunks));
  const dim3 block(kColTile, kRowLanes);
  cudaStream_t s = ctx.compute_stream();
  dispatch_float(dout.dtype(), "[matmul_backward] dout", [&](auto tag) {
    using T = decltype(tag);
    colsum_partial_kernel<T><<<grid, block, 0, s>>>(ptr<float>(partial), cptr<T>(dout), M, N, rows_per_chunk);
    LOOM_CUDA_LAUNCH_CHECK();
  });
  dispatch_float(dbias.dtype(), "[matmul_backward] dbias", [&](auto tag) {
    using TB = decltype(tag);
    colsum_final_kernel<TB><<<unsigned((N + 31) / 32), dim3(32, kColumnSumLanes), 0, s>>>(ptr<TB>(dbias),
                                                                                    cptr<float>(partial), chunks, N);
    LOOM_CUDA_LAUNCH_CHECK();
  });
}

// The scales of an FP8 product, each (when given) copied to its own 16-byte-aligned slot.
__global__ void copy_scales_kernel(float* da, const float* a, float* db, const float* b) {
  if (a) *da = *a;
  if (b) *db = *b;
}

}  // namespace

namespace detail {

bool lt_matmul(const CudaContext& ctx, const LtGemm& g_in, const char* op, bool allow_unsupported) {
  LtGemm g = g_in;
  const bool scaled = g.a_scale != nullptr || g.b_scale != nullptr;
  // cuBLASLt's FP8 kernels answer NOT_SUPPORTED at launch (after the heuristic accepted the problem) for a
  // scale pointer that is not 16-byte aligned (seen with cuBLASLt 13.1 on an H200); callers keep scales
  // side by side (FP8 delayed-scaling state), so such pointers are copied into an aligned scratch first.
  Tensor scales;
  if (scaled && (!aligned16(g.a_scale) || !aligned16(g.b_scale))) {
    scales = scratch(ctx, {8}, DType::kF32);
    float* s = ptr<float>(scales);
    copy_scales_kernel<<<1, 1, 0, ctx.compute_stream()>>>(s, g.a_scale, s + 4, g.b_scale);
    LOOM_CUDA_LAUNCH_CHECK();
    g.a_scale = g.a_scale ? s : nullptr;
    g.b_scale = g.b_scale ? s + 4 : nullptr;
  }
  const PlanKey key{ctx.index(),
                    g.m,
                    g.n,
                    g.k,
                    g.lda,
                    g.ldb,
                    g.ldd,
                    g.trans_a,
                    g.trans_b,
                    g.bias != nullptr,
                    scaled,
                    g.a_type,
                    g.b_type,
                    g.d_type,
                    pointer_alignment(g.a),
                    pointer_alignment(g.b),
                    pointer_alignment(g.d),
                    g.bias ? pointer_alignment(g.bias) : 256u};
  PlanCache& cache = PlanCache::get();
  // Held through the launch: the cached descriptor's pointer attributes are rewritten per call.
  std::lock_guard<std::mutex> lock(cache.mutex());
  Plan& p = cache.find_or_build(ctx, key, g);
  if (!p.supported) {
    if (allow_unsupported) return false;
    LOOM_FAIL("[", op, "] cuBLASLt has no algorithm for m=", g.m, " n=", g.n, " k=", g.k, " (", dtype_name(g.a_type),
              " x ", dtype_name(g.b_type), " -> ", dtype_name(g.d_type), g.bias ? ", bias" : "", ")");
  }
  if (g.bias)
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
  if (scaled) {
    LOOM_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g.a_scale, sizeof(g.a_scale)));
    LOOM_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g.b_scale, sizeof(g.b_scale)));
  }
  const float alpha = 1.0f, beta = g.accumulate ? 1.0f : 0.0f;
  const cublasStatus_t st = cublasLtMatmul(ctx.cublaslt(), p.desc, &alpha, g.a, p.la, g.b, p.lb, &beta, g.d, p.ld,
                                           g.d, p.ld, &p.algo, ctx.workspace(), ctx.workspace_bytes(),
                                           ctx.compute_stream());
  // Some FP8 constraints are only checked here, after the heuristic has answered: such a problem is
  // remembered as unsupported, so the caller's fallback runs now and on every later call (said once).
  if (st == CUBLAS_STATUS_NOT_SUPPORTED && allow_unsupported) {
    p.supported = false;
    std::fprintf(stderr, "[%s] cuBLASLt refused m=%lld n=%lld k=%lld (%s x %s -> %s%s%s); using the fallback\n", op,
                 (long long)g.m, (long long)g.n, (long long)g.k, dtype_name(g.a_type), dtype_name(g.b_type),
                 dtype_name(g.d_type), g.bias ? ", bias" : "", g.accumulate ? ", beta 1" : "");
    return false;
  }
  LOOM_CUBLAS_CHECK(st);
  return true;
}

void gemm_finalize(const CudaContext& ctx, TensorView out, const float* src, TensorView bias, bool accumulate,
                   int64_t M, int64_t N) {
  const int64_t total = M * N;
  if (total == 0) return;
  cudaStream_t s = ctx.compute_stream();
  dispatch_float(out.dtype(), "[matmul] out", [&](auto out_tag) {
    using TOut = decltype(out_tag);
    auto launch = [&](auto bias_tag, const void* b) {
      using TB = decltype(bias_tag);
      finalize_kernel<TOut, TB><<<grid_for(total), kThreads, 0, s>>>(ptr<TOut>(out), src, static_cast<const TB*>(b),
                                                                     accumulate, M, N);
      LOOM_CUDA_LAUNCH_CHECK();
    };
    if (bias.defined())
      dispatch_float(bias.dtype(), "[matmul] bias", [&](auto bias_tag) { launch(bias_tag, bias.raw()); });
    else
      launch(float{}, nullptr);
  });
}

}  // namespace detail

void matmul_forward(const CudaContext& ctx, TensorView out, TensorView inp, TensorView weight, TensorView bias) {
  const char* op = "matmul_forward";
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t M = inp.shape().rows();
  const DType cd = inp.dtype();
  if (M == 0 || N == 0) return;
  if (K == 0) {
    detail::gemm_finalize(ctx, out, nullptr, bias, false, M, N);
    return;
  }
  detail::LtGemm g{.m = N, .n = M, .k = K, .trans_a = true,
                   .a = weight.raw(), .a_type = cd, .lda = K,
                   .b = inp.raw(), .b_type = cd, .ldb = K,
                   .d = out.raw(), .d_type = out.dtype(), .ldd = N};
  if (!bias) {
    detail::lt_matmul(ctx, g, op);
    return;
  }
  // cuBLASLt's bias must have D's dtype; any other combination (or a bias pointer no epilogue kernel takes)
  // adds it in f32 before the single rounding.
  if (bias.dtype() == out.dtype()) {
    g.bias = bias.raw();
    if (detail::lt_matmul(ctx, g, op, /*allow_unsupported=*/true)) return;
    g.bias = nullptr;
  }
  if (out.dtype() == DType::kF32) {
    g.d = out.raw();
    g.d_type = DType::kF32;
    detail::lt_matmul(ctx, g, op);
    detail::gemm_finalize(ctx, out, static_cast<const float*>(out.raw()), bias, false, M, N);
  } else {
    Tensor tmp = scratch(ctx, {M, N}, DType::kF32);
    g.d = tmp.raw();
    g.d_type = DType::kF32;
    detail::lt_matmul(ctx, g, op);
    detail::gemm_finalize(ctx, out, cptr<float>(tmp), bias, false, M, N);
  }
}

void matmul_backward(const CudaContext& ctx, TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout,
                     TensorView inp, TensorView weight, GradWrite dweight_write) {
  const char* op = "matmul_backward";
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t M = dout.shape().rows();
  const DType cd = dout.dtype();
  if (dinp) {
    if (N == 0) {
      detail::gemm_finalize(ctx, dinp, nullptr, TensorView{}, false, M, K);
    } else if (M > 0 && K > 0) {
      const detail::LtGemm g{.m = K, .n = M, .k = N,
                             .a = weight.raw(), .a_type = cd, .lda = K,
                             .b = dout.raw(), .b_type = cd, .ldb = N,
                             .d = dinp.raw(), .d_type = dinp.dtype(), .ldd = K};
      detail::lt_matmul(ctx, g, op);
    }
  }
  const bool overwrite = dweight_write == GradWrite::kOverwrite;
  if (dweight && M > 0 && N > 0 && K > 0) {
    const detail::LtGemm g{.m = K, .n = N, .k = M, .trans_b = true,
                           .a = inp.raw(), .a_type = cd, .lda = K,
                           .b = dout.raw(), .b_type = cd, .ldb = N,
                           .d = dweight.raw(), .d_type = dweight.dtype(), .ldd = K, .accumulate = !overwrite};
    detail::lt_matmul(ctx, g, op);
  } else if (dweight && overwrite && dweight.numel() > 0) {  // an empty product stores zeros
    LOOM_CUDA_CHECK(cudaMemsetAsync(dweight.raw(), 0, size_t(dweight.numel()) * dtype_size(dweight.dtype()),
                                    ctx.compute_stream()));
  }
  if (dbias) column_sum_accumulate(ctx, dbias, dout, M, N);
}

}  // namespace loom::cuda

// Mixture-of-experts ops on the CPU (the reference for src/backend/cuda/moe.cu): token permutation into the
// expert-grouped order, the probability-weighted unpermutation back to tokens, their backwards, and the
// grouped GEMM over the experts' contiguous row groups.
// Invariants:
//   - every output row is written by one task (a token, or one group's GEMM) that visits its inputs in a
//     fixed order (e = 0..E-1), so results never depend on the number of threads; no atomics;
//   - 16-bit rows are widened into per-thread f32 scratch, combined in f32 and narrowed once (RNE); the
//     dprobs dot products accumulate in f64;
//   - row_id_map's values are checked here (they are in host memory): each is -1 or in [0, M) and every row
//     0..M-1 is used exactly once, before any output is written;
//   - the grouped GEMM runs each group as matmul_forward / matmul_backward would. Where those build and cache
//     a oneDNN primitive per product shape (bf16), the expert group sizes, which change every step, would
//     build new primitives on most calls (and keep them all), so every product runs on the group's rows
//     rounded up to kGroupRowQuantum times a 7-smooth number (padded_rows), a few shapes that repeat. The
//     row-independent products (out, dinp) run in place on the extra rows too when they exist: those rows
//     belong to later groups, which are computed afterwards and overwrite them; otherwise (the end of the
//     buffer) and for dweight (a reduction over the rows) the group's rows are copied into per-thread
//     scratch followed by zero rows. (Cutting a group into a head of whole multiples and a small tail
//     instead costs as much as the pad: a tail product re-reads and re-packs the whole expert weight for a
//     few rows.) The rounding depends on the group size only: the same bits for every thread count;
//   - f32 grouped GEMMs run every group's product as pieces of at least kF32PieceMin output rows or columns
//     (cut along the larger output dimension, fixed by the shape), all groups' pieces in one parallel
//     region, each one serial sgemm over the whole reduction: no barrier per group, and wide pieces
//     (matmul_forward's split cuts a 1024-wide output into 16 pieces, each re-packing the whole other
//     operand: ~20% slower on the experts' 256-row products). The bits depend on the shapes only; they equal
//     matmul_forward's where oneDNN's sgemm gives a row the same bits whatever the piece (its AVX-512
//     kernels do, its AVX2 ones not always: there they agree to the order of the sums);
//   - with AVX-512, f32 weight gradients over at most kDweightKernelMaxRows group rows run on dweight_piece
//     instead of sgemm (runs_on_dweight_kernel), in pieces of whole rows: Loom's 6 x 64 register tile over
//     packed operands, whose overwriting stores are non-temporal. The experts' weight gradients are written
//     once per step and read by nobody in it, and sgemm's ordinary stores fetch every line before writing
//     it: on the benchmark's 128-row experts the fc1 weight gradient took ~20% less time this way
//     (bench/RESULTS.md). Each output is one fused multiply-add chain over the rows in order from zero
//     (+ the old value when accumulating): the bits of oneDNN's AVX-512 sgemm up to its 384-row reduction
//     block (a test checks equality), so with oneDNN on its AVX-512 kernels the bits do not depend on which
//     of the two runs a product.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/lowp.h"

namespace loom::cpu {

namespace {

constexpr int64_t kParallelMinRows = 16;

// row_id_map (N, E) must map the (n, e) pairs with a row bijectively onto [0, M).
void check_row_id_map(const char* op, TensorView row_id_map, int64_t M) {
  const int64_t n_pairs = row_id_map.numel();
  const int32_t* map = row_id_map.data<int32_t>();
  std::vector<char> seen(size_t(M), 0);
  int64_t used = 0;
  for (int64_t i = 0; i < n_pairs; ++i) {
    const int32_t r = map[i];
    if (r < 0) {
      LOOM_CHECK(r == -1, "[", op, "] row_id_map[", i, "] = ", r, ": expected -1 (no row) or a row in [0, ", M, ")");
      continue;
    }
    LOOM_CHECK(r < M, "[", op, "] row_id_map[", i, "] = ", r, " is outside the ", M, " permuted rows");
    LOOM_CHECK(!seen[size_t(r)], "[", op, "] row ", r, " appears twice in row_id_map");
    seen[size_t(r)] = 1;
    ++used;
  }
  LOOM_CHECK(used == M, "[", op, "] row_id_map uses ", used, " rows but the permuted buffer has ", M);
}

}  // namespace

void CpuOps::do_moe_permute_forward(TensorView out, TensorView inp, TensorView row_id_map) const {
  const int64_t N = row_id_map.size(0), E = row_id_map.size(1), C = inp.size(1), M = out.size(0);
  check_row_id_map("moe_permute_forward", row_id_map, M);
  const int32_t* map = row_id_map.data<int32_t>();
  const size_t row_bytes = size_t(C) * dtype_size(inp.dtype());
  const char* src = static_cast<const char*>(inp.raw());
  char* dst = static_cast<char*>(out.raw());
#pragma omp parallel for schedule(static) if (N >= kParallelMinRows)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e) {
      const int32_t r = map[n * E + e];
      if (r >= 0) std::memcpy(dst + int64_t(r) * int64_t(row_bytes), src + n * int64_t(row_bytes), row_bytes);
    }
}

namespace {

// Row `row` (C elements) of `base` as f32: the row itself when dt is f32, else widened into scratch.
const float* f32_row(const void* base, DType dt, int64_t row, int64_t C, float* scratch) {
  if (dt == DType::kF32) return static_cast<const float*>(base) + row * C;
  widen(scratch, elem_ptr(base, dt, row * C), dt, C);
  return scratch;
}

// out (N, C) row n = Σ over its experts e (row_id_map[n, e] = r >= 0) of w · inp row r, w = probs[n, e] or 1
// (probs null): the permutation's adjoint and the weighted combine share it. f32 accumulation per row.
void combine_rows(const char* op, TensorView out, TensorView inp, const float* probs, TensorView row_id_map) {
  const int64_t N = row_id_map.size(0), E = row_id_map.size(1), C = out.size(1), M = inp.size(0);
  check_row_id_map(op, row_id_map, M);
  const int32_t* map = row_id_map.data<int32_t>();
  const DType dt = out.dtype();
#pragma omp parallel for schedule(static) if (N >= kParallelMinRows)
  for (int64_t n = 0; n < N; ++n) {
    // f32: accumulate in the output row itself (out and inp never overlap).
    float* acc = dt == DType::kF32 ? out.data<float>() + n * C : thread_scratch(0, size_t(C));
    float* scratch = thread_scratch(1, size_t(C));
    std::fill(acc, acc + C, 0.0f);
    for (int64_t e = 0; e < E; ++e) {
      const int32_t r = map[n * E + e];
      if (r < 0) continue;
      const float w = probs ? probs[n * E + e] : 1.0f;
      const float* row = f32_row(inp.raw(), dt, r, C, scratch);
      for (int64_t c = 0; c < C; ++c) acc[c] += w * row[c];
    }
    if (dt != DType::kF32) narrow(elem_ptr(out.raw(), dt, n * C), dt, acc, C);
  }
}

}  // namespace

void CpuOps::do_moe_permute_backward(TensorView dinp, TensorView dout, TensorView row_id_map) const {
  combine_rows("moe_permute_backward", dinp, dout, nullptr, row_id_map);
}

void CpuOps::do_moe_unpermute_forward(TensorView out, TensorView inp, TensorView probs, TensorView row_id_map) const {
  combine_rows("moe_unpermute_forward", out, inp, probs.data<float>(), row_id_map);
}

void CpuOps::do_moe_unpermute_backward(TensorView dinp, TensorView dprobs, TensorView dout, TensorView inp,
                                       TensorView probs, TensorView row_id_map) const {
  const int64_t N = row_id_map.size(0), E = row_id_map.size(1), C = dout.size(1), M = dinp.size(0);
  check_row_id_map("moe_unpermute_backward", row_id_map, M);
  const int32_t* map = row_id_map.data<int32_t>();
  const float* p = probs.data<float>();
  float* dp = dprobs.defined() ? dprobs.data<float>() : nullptr;
  const DType dt = dout.dtype();
#pragma omp parallel for schedule(static) if (N >= kParallelMinRows)
  for (int64_t n = 0; n < N; ++n) {
    float* scratch = thread_scratch(1, size_t(C));
    const float* dy = f32_row(dout.raw(), dt, n, C, thread_scratch(0, size_t(C)));
    for (int64_t e = 0; e < E; ++e) {
      const int32_t r = map[n * E + e];
      if (r < 0) {
        if (dp) dp[n * E + e] = 0.0f;
        continue;
      }
      if (dp) {
        // A SIMD reduction: f64 lanes summed in an order fixed at compile time (a serial f64 sum cannot be
        // vectorised and took ~20 ms of the 2048-token top-8 layer).
        const float* row = f32_row(inp.raw(), dt, r, C, scratch);
        double dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < C; ++c) dot += double(dy[c]) * double(row[c]);
        dp[n * E + e] = float(dot);
      }
      const float w = p[n * E + e];
      float* out_row = dt == DType::kF32 ? dinp.data<float>() + int64_t(r) * C : scratch;
      for (int64_t c = 0; c < C; ++c) out_row[c] = w * dy[c];
      if (dt != DType::kF32) narrow(elem_ptr(dinp.raw(), dt, int64_t(r) * C), dt, scratch, C);
    }
  }
}

namespace {

constexpr int64_t kGroupRowQuantum = 16;  // see the header

// True when q (>= 1) has no prime factor above 7.
bool seven_smooth(int64_t q) {
  for (int64_t p : {2, 3, 5, 7})
    while (q % p == 0) q /= p;
  return q == 1;
}

// m (>= 0) rounded up to kGroupRowQuantum x a 7-smooth multiplier. oneDNN 2.6's bf16 (AMX) matmul runs 2-8x
// slower when M / 16 is 29, 31, 53, 58, 59, 61 or 62 (37, 41, 43 and 47 were fine), on every product shape of
// a Mixtral expert (bench/RESULTS.md); no 7-smooth multiplier was, they cost ~4% of padding on average, and
// they give fewer distinct shapes to cache.
int64_t padded_rows(int64_t m) {
  if (m <= 0) return 0;
  int64_t q = (m + kGroupRowQuantum - 1) / kGroupRowQuantum;
  while (!seven_smooth(q)) ++q;
  return q * kGroupRowQuantum;
}

// Per-thread scratch of `bytes` bytes (f32 slot `slot`).
char* scratch_bytes(int slot, int64_t bytes) {
  return reinterpret_cast<char*>(thread_scratch(slot, size_t(bytes + 3) / 4));
}

// rows (p, cols) of `dt` in scratch slot `slot`: rows [o, o + m) of src (·, cols), then zero rows.
TensorView zero_padded_rows(int slot, TensorView src, int64_t o, int64_t m, int64_t p) {
  const DType dt = src.dtype();
  const int64_t cols = src.size(1), row_bytes = cols * int64_t(dtype_size(dt));
  char* buf = scratch_bytes(slot, p * row_bytes);
  std::memcpy(buf, elem_ptr(src.raw(), dt, o * cols), size_t(m * row_bytes));
  std::memset(buf + m * row_bytes, 0, size_t((p - m) * row_bytes));
  return TensorView(buf, dt, {p, cols});
}

// A row-independent product f(dst rows, src rows) (dst (M, ·), src (M, ·)) of the group rows [o, o + m),
// on padded_rows(m) rows when `pad` (see the header), else on the m rows.
template <class F>
void group_rows_product(TensorView dst, TensorView src, int64_t o, int64_t m, bool pad, F&& f) {
  if (m == 0) return;
  const int64_t M = dst.size(0), dc = dst.size(1), sc = src.size(1), p = pad ? padded_rows(m) : m;
  if (o + p <= M) {
    f(dst.slice_flat(o * dc, {p, dc}), src.slice_flat(o * sc, {p, sc}));
    return;
  }
  const TensorView s = zero_padded_rows(2, src, o, m, p);
  const int64_t dst_row_bytes = dc * int64_t(dtype_size(dst.dtype()));
  char* d = scratch_bytes(3, p * dst_row_bytes);
  f(TensorView(d, dst.dtype(), {p, dc}), s);
  std::memcpy(elem_ptr(dst.raw(), dst.dtype(), o * dc), d, size_t(m * dst_row_bytes));
}

// ---- f32: (group, piece) tasks of serial sgemms ----

constexpr int64_t kF32PieceMin = 512;  // see the header

// C (M, N) [+]= op(A) · op(B) as sgemm_serial takes it; on dweight_piece instead when dweight_kernel.
struct SgemmTask {
  bool ta, tb, acc;
  int64_t M, N, K;
  const float* A;
  int64_t lda;
  const float* B;
  int64_t ldb;
  float* C;
  int64_t ldc;
  bool dweight_kernel = false;
};

#if defined(__AVX512F__)

constexpr int64_t kDweightKernelMaxRows = 384;  // see the header

constexpr int64_t kTileRows = 6, kTileCols = 64;

// A 64-byte aligned pointer into scratch slot `slot` with room for n floats.
float* aligned_scratch(int slot, int64_t n) {
  float* p = thread_scratch(slot, size_t(n + 16));
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

// Stores `v` (the 16 columns from c of a panel w columns wide) to dst: non-temporal when whole, aligned and
// overwriting; added to the old values when accumulating.
inline void store_cols(float* dst, __m512 v, int64_t c, int64_t w, bool acc) {
  if (c >= w) return;
  const __mmask16 m = w - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (w - c)) - 1);
  if (acc) {
    _mm512_mask_storeu_ps(dst, m, _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, dst)));
  } else if (m == 0xFFFF && (reinterpret_cast<uintptr_t>(dst) & 63) == 0) {
    _mm512_stream_ps(dst, v);
  } else {
    _mm512_mask_storeu_ps(dst, m, v);
  }
}

// rows (<= 6) x w (<= 64) of C [+]= the tile's a (m x 6, row-interleaved) times b (m x 64): one fused
// multiply-add chain per output over i = 0..m-1. When pf is set, also prefetches pf + i * ldpf into L2 for
// every i (a line of each row of the next B panel).
inline void dweight_tile(int64_t m, const float* a, const float* b, float* C, int64_t ldc, int64_t rows, int64_t w,
                         bool acc, const float* pf, int64_t ldpf) {
  __m512 c[kTileRows][4];
  for (auto& row : c)
    for (__m512& v : row) v = _mm512_setzero_ps();
  for (int64_t i = 0; i < m; ++i, a += kTileRows, b += kTileCols) {
    if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + i * ldpf), _MM_HINT_T1);
    const __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16), b2 = _mm512_load_ps(b + 32),
                 b3 = _mm512_load_ps(b + 48);
    for (int r = 0; r < kTileRows; ++r) {
      const __m512 av = _mm512_set1_ps(a[r]);
      c[r][0] = _mm512_fmadd_ps(av, b0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(av, b1, c[r][1]);
      c[r][2] = _mm512_fmadd_ps(av, b2, c[r][2]);
      c[r][3] = _mm512_fmadd_ps(av, b3, c[r][3]);
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < 4; ++j) store_cols(C + r * ldc + 16 * j, c[r][j], 16 * j, w, acc);
}

// C (M, N) [+]= A^T · B for A (K, M) with leading dimension lda and B (K, N): a weight-gradient piece
// (rows of dout^T times the group's inputs), on the calling thread. A is packed once into 6-row strips
// (zero rows past M), B one 64-column panel at a time (zero columns past N); every tile reads both from
// cache, and C is written once.
void dweight_piece(const SgemmTask& t) {
  const int64_t M = t.M, N = t.N, m = t.K, strips = (M + kTileRows - 1) / kTileRows;
  float* ap = aligned_scratch(4, strips * m * kTileRows);
  float* bp = aligned_scratch(5, m * kTileCols);
  for (int64_t s = 0; s < strips; ++s)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t r = 0; r < kTileRows; ++r) {
        const int64_t row = s * kTileRows + r;
        ap[(s * m + i) * kTileRows + r] = row < M ? t.A[i * t.lda + row] : 0.0f;
      }
  for (int64_t c0 = 0; c0 < N; c0 += kTileCols) {
    const int64_t w = std::min(kTileCols, N - c0);
    for (int64_t i = 0; i < m; ++i) {
      std::memcpy(bp + i * kTileCols, t.B + i * t.ldb + c0, size_t(w) * sizeof(float));
      std::fill(bp + i * kTileCols + w, bp + (i + 1) * kTileCols, 0.0f);
    }
    // The first strips prefetch the next panel's B lines (one 16-float line of every row each): B rows are
    // far apart, and reading them at the next panel's packing would wait on memory line by line.
    for (int64_t s = 0; s < strips; ++s) {
      const int64_t pf_col = c0 + kTileCols + 16 * s;
      dweight_tile(m, ap + s * m * kTileRows, bp, t.C + s * kTileRows * t.ldc + c0, t.ldc,
                   std::min(kTileRows, M - s * kTileRows), w, t.acc,
                   s < kTileCols / 16 && pf_col < N ? t.B + pf_col : nullptr, t.ldb);
    }
  }
  _mm_sfence();  // the non-temporal stores are done before the region's barrier
}

#endif  // __AVX512F__

// Whether dweight_piece runs the whole product t (op(A) = A^T, op(B) = B: a weight gradient) instead of
// sgemm. Its pieces are whole rows, so it takes a product only where the rows are the larger dimension or
// make at least two pieces (fewer would leave a thread idle).
bool runs_on_dweight_kernel(const SgemmTask& t) {
#if defined(__AVX512F__)
  return t.ta && !t.tb && t.K > 0 && t.K <= kDweightKernelMaxRows && (t.M >= t.N || t.M >= 2 * kF32PieceMin);
#else
  (void)t;
  return false;
#endif
}

// Appends the pieces of one product: its output cut along the larger dimension (along the rows for
// dweight_piece, whose pieces then write whole rows) into pieces of at least kF32PieceMin (one piece when
// that dimension is smaller than twice that).
void add_pieces(std::vector<SgemmTask>& tasks, SgemmTask t) {
  if (t.M == 0 || t.N == 0) return;
  t.dweight_kernel = runs_on_dweight_kernel(t);
  const bool by_m = t.M >= t.N || t.dweight_kernel;
  const int64_t D = by_m ? t.M : t.N;
  const int64_t P = std::max<int64_t>(1, D / kF32PieceMin), step = (D + P - 1) / P;
  for (int64_t d0 = 0; d0 < D; d0 += step) {
    SgemmTask p = t;
    const int64_t db = std::min(step, D - d0);
    if (by_m) {
      p.M = db;
      p.A = t.ta ? t.A + d0 : t.A + d0 * t.lda;
      p.C = t.C + d0 * t.ldc;
    } else {
      p.N = db;
      p.B = t.tb ? t.B + d0 * t.ldb : t.B + d0;
      p.C = t.C + d0;
    }
    tasks.push_back(p);
  }
}

// Runs the tasks in parallel, largest first (any order gives the same bits).
void run_tasks(std::vector<SgemmTask>& tasks) {
  std::stable_sort(tasks.begin(), tasks.end(), [](const SgemmTask& a, const SgemmTask& b) {
    return a.M * a.N * a.K > b.M * b.N * b.K;
  });
  const int64_t n = int64_t(tasks.size());
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
  for (int64_t i = 0; i < n; ++i) {
    const SgemmTask& t = tasks[size_t(i)];
#if defined(__AVX512F__)
    if (t.dweight_kernel) {
      dweight_piece(t);
      continue;
    }
#endif
    sgemm_serial(t.ta, t.tb, t.M, t.N, t.K, t.A, t.lda, t.B, t.ldb, t.acc, t.C, t.ldc);
  }
}

bool all_f32(std::initializer_list<TensorView> ts) {
  for (const TensorView& t : ts)
    if (t && t.dtype() != DType::kF32) return false;
  return true;
}

}  // namespace

void CpuOps::do_grouped_matmul_forward(TensorView out, TensorView inp, TensorView weight,
                                       const std::vector<int64_t>& group_sizes) const {
  const int64_t N = weight.size(1), K = weight.size(2);
  if (all_f32({out, inp, weight}) && N > 0 && K > 0) {
    std::vector<SgemmTask> tasks;
    const float *x = inp.data<float>(), *w = weight.data<float>();
    float* y = out.data<float>();
    int64_t o = 0;
    for (size_t g = 0; g < group_sizes.size(); ++g) {  // out_g (m, N) = inp_g (m, K) · W_g^T
      add_pieces(tasks, {false, true, false, group_sizes[g], N, K, x + o * K, K, w + int64_t(g) * N * K, K,
                         y + o * N, N});
      o += group_sizes[g];
    }
    run_tasks(tasks);
    return;
  }
  const bool pad = matmul_caches_shapes(inp.dtype());
  int64_t o = 0;
  for (size_t g = 0; g < group_sizes.size(); ++g) {
    const TensorView w = weight.slice_flat(int64_t(g) * N * K, {N, K});
    group_rows_product(out, inp, o, group_sizes[g], pad,
                       [&](TensorView y, TensorView x) { do_matmul_forward(y, x, w, TensorView()); });
    o += group_sizes[g];
  }
}

void CpuOps::do_grouped_matmul_backward(TensorView dinp, TensorView dweight, TensorView dout, TensorView inp,
                                        TensorView weight, const std::vector<int64_t>& group_sizes,
                                        GradWrite dweight_write) const {
  const int64_t N = weight.size(1), K = weight.size(2);
  const bool overwrite = dweight_write == GradWrite::kOverwrite;
  if (all_f32({dinp, dweight, dout, inp, weight}) && N > 0 && K > 0) {
    std::vector<SgemmTask> tasks;
    const float *dy = dout.data<float>(), *x = inp.data<float>(), *w = weight.data<float>();
    float* dx = dinp ? dinp.data<float>() : nullptr;
    float* dw = dweight ? dweight.data<float>() : nullptr;
    int64_t o = 0;
    for (size_t g = 0; g < group_sizes.size(); ++g) {
      const int64_t m = group_sizes[g];
      const float* wg = w + int64_t(g) * N * K;
      if (dx)  // dinp_g (m, K) = dout_g (m, N) · W_g
        add_pieces(tasks, {false, false, false, m, K, N, dy + o * N, N, wg, K, dx + o * K, K});
      if (dw && m > 0)  // dW_g (N, K) (+)= dout_g^T (N, m) · inp_g (m, K)
        add_pieces(tasks, {true, false, !overwrite, N, K, m, dy + o * N, N, x + o * K, K, dw + int64_t(g) * N * K,
                           K});
      else if (dw && overwrite)  // an empty group's gradient is zero
        std::fill(dw + int64_t(g) * N * K, dw + int64_t(g + 1) * N * K, 0.0f);
      o += m;
    }
    run_tasks(tasks);
    return;
  }
  const bool pad = matmul_caches_shapes(dout.dtype());
  int64_t o = 0;
  for (size_t g = 0; g < group_sizes.size(); ++g) {
    const int64_t m = group_sizes[g];
    const TensorView w = weight.slice_flat(int64_t(g) * N * K, {N, K});
    const TensorView dw = dweight ? dweight.slice_flat(int64_t(g) * N * K, {N, K}) : TensorView();
    if (m > 0 && (!pad || padded_rows(m) == m)) {  // one product for both, in place
      do_matmul_backward(dinp ? dinp.slice_flat(o * K, {m, K}) : TensorView(), dw, TensorView(),
                         dout.slice_flat(o * N, {m, N}), inp.slice_flat(o * K, {m, K}), w, dweight_write);
    } else if (m > 0) {
      if (dinp)
        group_rows_product(dinp, dout, o, m, pad, [&](TensorView dx, TensorView dy) {
          do_matmul_backward(dx, TensorView(), TensorView(), dy, TensorView(), w, GradWrite::kAccumulate);
        });
      if (dw) {
        const int64_t p = padded_rows(m);
        do_matmul_backward(TensorView(), dw, TensorView(), zero_padded_rows(2, dout, o, m, p),
                           zero_padded_rows(3, inp, o, m, p), w, dweight_write);
      }
    } else if (dw && overwrite) {  // an empty group's gradient is zero
      fill_(dw, 0.0f);
    }
    o += m;
  }
}

}  // namespace loom::cpu

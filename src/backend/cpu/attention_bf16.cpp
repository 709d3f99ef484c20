// The bf16 path of the CPU attention core (attention_bf16.h): VDPBF16PS block products, and the forward and
// backward tasks that stage bf16 operands for them (the f32 tile path is attention.cpp; what both share is
// attention_core.h).
//
// Products: bf16_gemm is register-blocked as in attention_tiles.cpp: 4 rows of c x up to 4 vectors of 16
// lanes = 16 accumulators, the 4 vectors of B's current pair row and one broadcast pair of a fit the 32
// AVX-512 registers. Compiled for AVX512-BF16 whatever the build's -march (the function attributes below)
// and chosen at run time.
//
// Tasks: the f32 path's tasks, tiles and online softmax, with every block product on bf16_band_gemm: operands are the
// bf16 rows themselves (no widening), the products accumulate in f32, and P and dS are rounded to bf16 for the products
// that take them, as on the GPU. The scores come out unscaled and are multiplied by the softmax scale in f32 (the f32
// path scales q before the product instead). Operand layouts: a product's left operand is plain rows (k, v rows; P^T
// and dS^T tiles straight from the S^T layout; P and dS transposed), its right operand pair-interleaved (q^T and dO^T
// by a 32-bit transpose of the block, v, k, q and dO rows by interleave_pairs). Head rows are padded with zeros to H2,
// a multiple of 32. Key tiles start at even keys (the pair layout of k and v is by absolute pairs): a block's first
// key is rounded down to even, which adds at most one key that no query of the block sees, masked like any other.
// Inside a tile the products skip, per group of 4 rows, the 16-query vectors and the key or query pairs the band
// hides from all 4 (bf16_band_gemm, the f32 path's rule); the masked pairs left in take part with zero coefficients
// (P = dS = 0), as do keys past the block's last one (zero rows, or in backward, from a group's second head on, the
// later keys' own rows). With finite inputs that changes nothing; a NaN or infinity in q, k, v or dO spreads (0 x NaN)
// to the other rows and columns of the tile pairs it enters, as in an unfused masked softmax followed by a matmul. A
// non-finite loss or gradient norm skips the step either way.
#include "backend/cpu/attention_bf16.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "backend/cpu/attention_core.h"
#include "loom/core/check.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LOOM_HAVE_BF16_DOT 1
#endif

namespace loom::cpu::attn {

namespace {

std::atomic<bool> g_switch{true};

#if defined(LOOM_HAVE_BF16_DOT)
// c[r][0 : NV*16] (+)= sum_p a_pair[r][p] . b_pair[p][0 : NV*16] for 4 rows.
template <int NV>
__attribute__((target("avx512f,avx512bf16"))) void rows4(float* c, int64_t ldc, const uint16_t* a,
                                                                 int64_t lda, const uint32_t* b, int64_t ldb,
                                                                 int64_t pairs, bool accumulate) {
  __m512 acc[4][NV];
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? _mm512_loadu_ps(c + r * ldc + v * 16) : _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + p * ldb + v * 16);
    for (int r = 0; r < 4; ++r) {
      uint32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * p, sizeof(pair));
      const __m512bh av = (__m512bh)_mm512_set1_epi32(int(pair));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + r * ldc + v * 16, acc[r][v]);
}

bool detect() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16"); }
#endif

}  // namespace

bool bf16_dot_supported() {
#if defined(LOOM_HAVE_BF16_DOT)
  static const bool supported = detect();
  return supported;
#else
  return false;
#endif
}

bool bf16_attention_enabled() { return g_switch.load(std::memory_order_relaxed) && bf16_dot_supported(); }

void set_bf16_attention(bool on) { g_switch.store(on, std::memory_order_relaxed); }

namespace {

// bf16_gemm's loops without its checks (the tasks' tiles meet them by construction).
void gemm_rows(float* c, int64_t ldc, const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t m,
               int64_t n, int64_t pairs, bool accumulate) {
#if defined(LOOM_HAVE_BF16_DOT)
  for (int64_t j = 0; j < n; j += 64) {
    const int64_t nv = std::min<int64_t>(4, (n - j) / 16);
    for (int64_t i = 0; i < m; i += 4) {
      float* ci = c + i * ldc + j;
      const uint16_t* ai = a + i * lda;
      switch (nv) {
        case 4: rows4<4>(ci, ldc, ai, lda, b + j, ldb, pairs, accumulate); break;
        case 3: rows4<3>(ci, ldc, ai, lda, b + j, ldb, pairs, accumulate); break;
        case 2: rows4<2>(ci, ldc, ai, lda, b + j, ldb, pairs, accumulate); break;
        default: rows4<1>(ci, ldc, ai, lda, b + j, ldb, pairs, accumulate); break;
      }
    }
  }
#else
  LOOM_FAIL("[attention] bf16 products need AVX512-BF16, which this build's target does not have");
#endif
}

}  // namespace

void bf16_gemm(float* c, int64_t ldc, const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t m,
               int64_t n, int64_t k, bool accumulate) {
  LOOM_CHECK(bf16_dot_supported(),
             "[attention] bf16 products need AVX512-BF16, which this CPU or this build's target does not have");
  LOOM_CHECK(m % 4 == 0 && n % 16 == 0 && k % 2 == 0 && lda % 2 == 0, "[attention] bf16_gemm shape ", m, " x ", n,
             " x ", k, " (lda ", lda, ") is not a multiple of 4 x 16 x 2");
  gemm_rows(c, ldc, a, lda, b, ldb, m, n, k / 2, accumulate);
}

void bf16_band_gemm(float* c, int64_t ldc, const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t n,
                    bool accumulate, const Band& band, BandUse use, int64_t rows) {
  const bool cols = use == BandUse::kQueryCols;
  LOOM_CHECK(bf16_dot_supported(),
             "[attention] bf16 products need AVX512-BF16, which this CPU or this build's target does not have");
  LOOM_CHECK(rows >= 0 && rows <= kBlock && lda % 2 == 0 && n % (cols ? 2 : 16) == 0, "[attention] bf16_band_gemm: ",
             rows, " rows of a tile of ", kBlock, ", n ", n, ", lda ", lda, " (expected n a multiple of ",
             cols ? 2 : 16, ", lda even)");
  const Rows kind = use == BandUse::kReduceKeys ? Rows::kQueries : Rows::kKeys;
  for (int64_t r = 0; r < rows; r += 4) {
    const auto [lo, hi] = band.visible(kind, r, std::min<int64_t>(4, rows - r), kBlock);
    float* cr = c + r * ldc;
    const uint16_t* ar = a + r * lda;
    if (cols) {  // kBlock query columns (4 vectors) summed over n; none when no query is visible
      const int64_t vb = hi > lo ? lo / 16 : 0, ve = hi > lo ? (hi + 15) / 16 : 0;
      if (!accumulate)
        for (int64_t v = 0; v < 4; ++v)
          if (v < vb || v >= ve)
            for (int i = 0; i < 4; ++i) std::fill(cr + i * ldc + v * 16, cr + i * ldc + v * 16 + 16, 0.0f);
      if (ve > vb) gemm_rows(cr + vb * 16, ldc, ar, lda, b + vb * 16, ldb, 4, (ve - vb) * 16, n / 2, accumulate);
    } else {  // n columns summed over the visible pairs [lo / 2, ceil(hi / 2)) of the tile's kBlock rows of b
      const int64_t pb = lo / 2, pe = (hi + 1) / 2;
      if (pe > pb) {
        gemm_rows(cr, ldc, ar + 2 * pb, lda, b + pb * ldb, ldb, 4, n, pe - pb, accumulate);
      } else if (!accumulate) {
        for (int i = 0; i < 4; ++i) std::fill(cr + i * ldc, cr + i * ldc + n, 0.0f);
      }
    }
  }
}

// ---- tasks ----------------------------------------------------------------------------------------

namespace {

// Rows of one kv head for the bf16 products: plain bf16 rows of k and v (H2 elements each), and k and/or v
// pair-interleaved, filled as the query blocks need them (HeadRows' high-water mark), with the kBlock + 1
// rows after the loaded ones zeroed (the pairs interleaved from them never hold another task's rows).
struct Bf16HeadRows {
  uint16_t* k;
  uint16_t* v;
  uint32_t* kp;  // k pair-interleaved, or null when not needed
  uint32_t* vp;  // v pair-interleaved, or null when not needed
  int64_t h2;
  int64_t have = 0;

  void require(const uint16_t* x, const Geometry& g, int64_t grp, int64_t begin, int64_t end) {
    const int64_t lo = std::max(have, begin);
    if (end > lo) {
      for (int64_t r = lo; r <= end + kBlock; ++r) {
        uint16_t* kr = k + r * h2;
        uint16_t* vr = v + r * h2;
        if (r < end) {
          std::memcpy(kr, x + r * g.qkv_row + g.k_col(grp), size_t(g.HS) * sizeof(uint16_t));
          std::memcpy(vr, x + r * g.qkv_row + g.v_col(grp), size_t(g.HS) * sizeof(uint16_t));
          std::fill(kr + g.HS, kr + h2, uint16_t(0));
          std::fill(vr + g.HS, vr + h2, uint16_t(0));
        } else {
          std::fill(kr, kr + h2, uint16_t(0));
          std::fill(vr, vr + h2, uint16_t(0));
        }
      }
      const int64_t p0 = lo / 2, p1 = (end + kBlock + 1) / 2;
      if (kp) interleave_pairs(kp + p0 * h2, k + 2 * p0 * h2, h2, p1 - p0);
      if (vp) interleave_pairs(vp + p0 * h2, v + 2 * p0 * h2, h2, p1 - p0);
    }
    have = std::max(have, end);
  }
  template <typename E>
  void prefetch(PrefetchQueue& pf, const E* x, const Geometry& g, int64_t grp, int64_t begin, int64_t end) const {
    const int64_t lo = std::max(have, begin);
    pf.add(x, g.qkv_row, g.k_col(grp), lo, end - lo, g.HS);
    pf.add(x, g.qkv_row, g.v_col(grp), lo, end - lo, g.HS);
  }
};

int64_t bf16_width(const Geometry& g) { return (g.HS + 31) / 32 * 32; }
// Rows of the per-head buffers: loading up to key end zeroes rows [end, end + kBlock] (the last pair whole),
// at most T + kBlock + 1 rows; tiles read at most kBlock rows from an even key below T, and dK/dV rows below
// T + kBlock. Rounded up generously.
int64_t bf16_rows(const Geometry& g) { return g.T + 2 * kBlock + 2; }

// Rows [r0, r0 + n) of one head (columns [col, col + HS) of rows ld apart) into dst (kBlock x h2 bf16), zero
// padded; then its pair-interleaved transpose into dt (h2/2 x kBlock) and, if dp is given, its row pairs
// into dp (kBlock/2 x h2).
void stage_block(uint16_t* dst, uint32_t* dt, uint32_t* dp, const uint16_t* src, int64_t ld, int64_t col, int64_t r0,
                 int64_t n, int64_t hs, int64_t h2) {
  for (int64_t r = 0; r < kBlock; ++r) {
    uint16_t* d = dst + r * h2;
    if (r < n) {
      std::memcpy(d, src + (r0 + r) * ld + col, size_t(hs) * sizeof(uint16_t));
      std::fill(d + hs, d + h2, uint16_t(0));
    } else {
      std::fill(d, d + h2, uint16_t(0));
    }
  }
  transpose_u32(dt, reinterpret_cast<const uint32_t*>(dst), h2 / 2, h2 / 2);
  if (dp) interleave_pairs(dp, dst, h2, kBlock / 2);
}

// Multiplies rows j < kn of an S^T tile by the softmax scale and masks what the band hides.
void scale_scores(float* st, int64_t kn, float scale, const Band& band, bool masked) {
  for (int64_t j = 0; j < kn; ++j) {
    float* row = st + j * kBlock;
#pragma omp simd
    for (int64_t i = 0; i < kBlock; ++i) row[i] *= scale;
    if (masked) band.mask_row(row, j, kNegInf);
  }
}

struct Bf16ForwardScratch {
  int64_t h2;
  ScratchOf<uint16_t> k, v, q, p;  // head rows (bf16_rows x h2), query block (kBlock x h2), P tile
  ScratchOf<uint32_t> vp, qt;      // v pairs (bf16_rows/2 x h2), q^T pairs (h2/2 x kBlock)
  Scratch st, o, z;
  explicit Bf16ForwardScratch(const Geometry& g)
      : h2(bf16_width(g)),
        k(bf16_rows(g) * h2),
        v(bf16_rows(g) * h2),
        q(kBlock * h2),
        p(kBlock * kBlock),
        vp(bf16_rows(g) / 2 * h2),
        qt(h2 / 2 * kBlock),
        st(kBlock * kBlock),
        o(kBlock * h2),
        z(g.dropout ? kBlock * kBlock : 1) {}
};

// forward_task for bf16 on VDPBF16PS.
void forward_task_bf16(uint16_t* out, float* lse, const uint16_t* qkv, const Geometry& g, int64_t b, int64_t h,
                      int64_t qb0, int64_t qb1, Bf16ForwardScratch& s) {
  const uint16_t* x = qkv + b * g.T * g.qkv_row;
  const Geometry::RowSegments sg = g.segments(b);
  const int64_t grp = h / g.G, h2 = s.h2;
  float* st = s.st.get();
  float* o = s.o.get();
  const float* z = s.z.get();
  Bf16HeadRows kv{s.k.get(), s.v.get(), nullptr, s.vp.get(), h2};
  PrefetchQueue pf;
  for (int64_t qb = qb0; qb < qb1; ++qb) {
    const int64_t i0 = qb * kBlock, qn = std::min(kBlock, g.T - i0);
    const int64_t kbeg = g.key_begin(sg, i0) & ~int64_t(1), kend = g.key_end(sg, i0, qn);
    kv.require(x, g, grp, kbeg, kend);
    stage_block(s.q.get(), s.qt.get(), nullptr, x, g.qkv_row, g.q_col(h), i0, qn, g.HS, h2);
    pf.add(out, g.out_row, h * g.HS, b * g.T + i0, qn, g.HS, true);
    if (qb + 1 < qb1) {
      const int64_t ni0 = i0 + kBlock, nn = std::min(kBlock, g.T - ni0);
      pf.add(x, g.qkv_row, g.q_col(h), ni0, nn, g.HS);
      kv.prefetch(pf, x, g, grp, g.key_begin(sg, ni0) & ~int64_t(1), g.key_end(sg, ni0, nn));
    }
    pf.plan(2 * ((kend - kbeg + kBlock - 1) / kBlock));
    OnlineSoftmax sm;
    std::fill(o, o + kBlock * h2, 0.0f);
    for (int64_t j0 = kbeg; j0 < kend; j0 += kBlock) {
      const int64_t kn = std::min(kBlock, kend - j0);
      const Band band = g.band(sg, i0, j0);
      // k_j . q_i, then o += P v
      bf16_band_gemm(st, kBlock, kv.k + j0 * h2, h2, s.qt.get(), kBlock, h2, false, band, BandUse::kQueryCols, kn);
      pf.step();
      scale_scores(st, kn, g.scale, band, !band.all_visible(qn, kn));
      if (g.dropout) dropout_tile(s.z.get(), g.drop, g.mask_base(b, h, i0, j0), uint64_t(g.T), qn, kn, band);
      sm.update(st, kn, g.dropout ? z : nullptr);
      if (j0 != kbeg) sm.rescale(o, h2, qn);
      tile_to_bf16_transposed(s.p.get(), st, kn);
      bf16_band_gemm(o, h2, s.p.get(), kBlock, kv.vp + (j0 / 2) * h2, h2, h2, true, band, BandUse::kReduceKeys, qn);
      pf.step();
    }
    pf.drain();
    sm.finish<DType::kBF16>(out + (b * g.T + i0) * g.out_row + h * g.HS, g.out_row, lse + (b * g.NH + h) * g.T + i0,
                            o, h2, qn, g.HS);
  }
}

struct Bf16BackwardScratch {
  int64_t h2;
  ScratchOf<uint16_t> k, v, q, dout, p;  // head rows (bf16_rows x h2), query block rows (kBlock x h2), a tile
  ScratchOf<uint32_t> kp;                // k pairs (bf16_rows/2 x h2)
  ScratchOf<uint32_t> qt, doutt;         // q^T and dO^T pairs (h2/2 x kBlock)
  ScratchOf<uint32_t> qp, doutp;         // q and dO row pairs (kBlock/2 x h2)
  Scratch dk, dv;                        // bf16_rows x h2
  Scratch dout32, y;                     // dO widened (kBlock x HS) and one out row, for D_i
  Scratch st, dpt, dq, z;
  explicit Bf16BackwardScratch(const Geometry& g)
      : h2(bf16_width(g)),
        k(bf16_rows(g) * h2),
        v(bf16_rows(g) * h2),
        q(kBlock * h2),
        dout(kBlock * h2),
        p(kBlock * kBlock),
        kp(bf16_rows(g) / 2 * h2),
        qt(h2 / 2 * kBlock),
        doutt(h2 / 2 * kBlock),
        qp(kBlock / 2 * h2),
        doutp(kBlock / 2 * h2),
        dk(bf16_rows(g) * h2),
        dv(bf16_rows(g) * h2),
        dout32(kBlock * g.HS),
        y(g.HS),
        st(kBlock * kBlock),
        dpt(kBlock * kBlock),
        dq(kBlock * h2),
        z(g.dropout ? kBlock * kBlock : 1) {}
};

// backward_group for bf16 on VDPBF16PS.
void backward_group_bf16(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out,
                        const float* lse, const Geometry& g, int64_t b, int64_t grp, Bf16BackwardScratch& s) {
  const uint16_t* x = qkv + b * g.T * g.qkv_row;
  const uint16_t* dy = dout + b * g.T * g.out_row;
  const uint16_t* y = out + b * g.T * g.out_row;
  uint16_t* dx = dqkv + b * g.T * g.qkv_row;
  const Geometry::RowSegments sg = g.segments(b);
  const int64_t h2 = s.h2;
  Bf16HeadRows kv{s.k.get(), s.v.get(), s.kp.get(), nullptr, h2};
  PrefetchQueue pf;
  float* dk = s.dk.get();
  float* dv = s.dv.get();
  std::fill(dk, dk + bf16_rows(g) * h2, 0.0f);
  std::fill(dv, dv + bf16_rows(g) * h2, 0.0f);
  float* st = s.st.get();
  float* dpt = s.dpt.get();
  float* dq = s.dq.get();
  uint16_t* pt = s.p.get();
  const float* z = s.z.get();
  const int64_t nqb = (g.T + kBlock - 1) / kBlock;

  for (int64_t h = grp * g.G; h < (grp + 1) * g.G; ++h) {
    for (int64_t qb = 0; qb < nqb; ++qb) {
      const int64_t i0 = qb * kBlock, qn = std::min(kBlock, g.T - i0);
      const int64_t kbeg = g.key_begin(sg, i0) & ~int64_t(1), kend = g.key_end(sg, i0, qn);
      kv.require(x, g, grp, kbeg, kend);
      stage_block(s.q.get(), s.qt.get(), s.qp.get(), x, g.qkv_row, g.q_col(h), i0, qn, g.HS, h2);
      stage_block(s.dout.get(), s.doutt.get(), s.doutp.get(), dy, g.out_row, h * g.HS, i0, qn, g.HS, h2);
      for (int64_t i = 0; i < qn; ++i)
        widen_row<DType::kBF16>(s.dout32.get() + i * g.HS, dy + (i0 + i) * g.out_row + h * g.HS, g.HS);
      backward_prefetch(pf, kv, dx, x, dy, y, g, sg, grp, h, qb, ~int64_t(1));
      pf.plan(5 * ((kend - kbeg + kBlock - 1) / kBlock));
      alignas(64) float lse_i[kBlock], d_i[kBlock];
      block_stats<DType::kBF16>(lse_i, d_i, lse + (b * g.NH + h) * g.T + i0, s.dout32.get(), g.HS,
                                y + i0 * g.out_row + h * g.HS, g.out_row, s.y.get(), qn, g.HS);
      std::fill(dq, dq + kBlock * h2, 0.0f);

      for (int64_t j0 = kbeg; j0 < kend; j0 += kBlock) {
        const int64_t kn = std::min(kBlock, kend - j0);
        const Band band = g.band(sg, i0, j0);
        // k_j . q_i and v_j . dO_i; then dV += P^T dO, dK += dS^T q, dQ += dS k
        bf16_band_gemm(st, kBlock, kv.k + j0 * h2, h2, s.qt.get(), kBlock, h2, false, band, BandUse::kQueryCols, kn);
        bf16_band_gemm(dpt, kBlock, kv.v + j0 * h2, h2, s.doutt.get(), kBlock, h2, false, band, BandUse::kQueryCols,
                       kn);
        pf.step();
        scale_scores(st, kn, g.scale, band, false);
        if (g.dropout) dropout_tile(s.z.get(), g.drop, g.mask_base(b, h, i0, j0), uint64_t(g.T), qn, kn, band);
        grad_tile(st, dpt, kn, lse_i, d_i, g.dropout ? z : nullptr, g.scale, band, !band.all_visible(qn, kn));
        tile_to_bf16(pt, st, kn);
        bf16_band_gemm(dv + j0 * h2, h2, pt, kBlock, s.doutp.get(), h2, h2, true, band, BandUse::kReduceQueries, kn);
        pf.step();
        tile_to_bf16(pt, dpt, kn);
        bf16_band_gemm(dk + j0 * h2, h2, pt, kBlock, s.qp.get(), h2, h2, true, band, BandUse::kReduceQueries, kn);
        pf.step();
        tile_to_bf16_transposed(pt, dpt, kn);
        bf16_band_gemm(dq, h2, pt, kBlock, kv.kp + (j0 / 2) * h2, h2, h2, true, band, BandUse::kReduceKeys, qn);
        pf.step();
        pf.step();
      }
      pf.drain();
      for (int64_t i = 0; i < qn; ++i)
        narrow_row<DType::kBF16>(dx + (i0 + i) * g.qkv_row + g.q_col(h), dq + i * h2, g.HS);
    }
  }
  for (int64_t t = 0; t < g.T; ++t) {
    narrow_row<DType::kBF16>(dx + t * g.qkv_row + g.k_col(grp), dk + t * h2, g.HS);
    narrow_row<DType::kBF16>(dx + t * g.qkv_row + g.v_col(grp), dv + t * h2, g.HS);
  }
}

}  // namespace

void forward_bf16(uint16_t* out, float* lse, const uint16_t* qkv, const Geometry& g, int64_t runs) {
  const int64_t nqb = (g.T + kBlock - 1) / kBlock, tasks = g.B * g.NH * runs;
#pragma omp parallel if (tasks > 1)
  {
    Bf16ForwardScratch s(g);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {  // later runs (more keys) first, as on the f32 path
      const int64_t run = runs - 1 - task % runs, head = task / runs;
      forward_task_bf16(out, lse, qkv, g, head / g.NH, head % g.NH, run * nqb / runs, (run + 1) * nqb / runs, s);
    }
  }
}

void backward_bf16(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out, const float* lse,
                   const Geometry& g) {
  const int64_t tasks = g.B * g.NKV;
#pragma omp parallel if (tasks > 1)
  {
    Bf16BackwardScratch s(g);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task)
      backward_group_bf16(dqkv, dout, qkv, out, lse, g, task / g.NKV, task % g.NKV, s);
  }
}

}  // namespace loom::cpu::attn

// CPU attention core: attention_forward / attention_backward, FlashAttention-2 style (the problem geometry,
// scratch and prefetch queue are in attention_geometry.h/.cpp, the tile kernels in attention_tiles.cpp).
//
// Forward keeps, per query row, a running max m and sum l of exp(s - m) and rescales the output
// accumulator when m grows (online softmax), so only kBlock x kBlock score tiles ever exist; it saves
// lse = m + log(l). Backward recomputes P = exp(s - lse) tile by tile, uses D_i = rowsum(dO_i * O_i),
// and accumulates dq, dk, dv from the tiles: no T x T buffer anywhere, memory O(T * HS) per thread.
//
// Layout of the work (why it looks the way it does):
//   - Score tiles are stored transposed, S^T (keys x queries): the softmax statistics are then
//     per-column reductions that vectorise across queries, and every block product is "broadcast one
//     scalar, FMA a contiguous row" (attention_tiles.cpp).
//   - q/k/v/dO rows are copied into 64-byte aligned per-thread scratch with HS padded to a multiple of
//     16 floats (zeros), so the same kernels serve any head size (1, 5, 64, 128, ...). A head's k/v rows
//     are copied once per task, lazily, as the query blocks reach them.
//   - Forward tasks are (b, head, run of query blocks); backward tasks are (b, kv head), since the query
//     heads of one group share dk/dv: one task owns every dq/dk/dv element it writes, and dq/dk/dv are
//     overwritten, never accumulated across tasks.
//   - No element's arithmetic depends on the task split or on which thread runs it, so results are
//     bit-identical for any number of OpenMP threads.
//   - Key blocks that are fully masked (causal, sliding window, other documents) are never visited; in
//     blocks that straddle a mask edge the kernels skip the masked part (Band) and per-element masks clean
//     up the rest.
//   - Document segments (segment_ids, non-decreasing along T) make each position's visible keys one
//     contiguous range [segment start, segment end), so they fold into the same machinery: a query block's
//     key range is clipped to [segment start of its first query, segment end of its last query), and the
//     tile Band intersects its diagonal band with the per-row segment ranges. Without segments nothing
//     changes; with one segment per row the results are bit-identical to none (masking more never changes
//     a visible entry's arithmetic).
//   - Rows of qkv/out are ~3C floats apart, which the hardware prefetcher does not follow: the next
//     block's rows and the output rows are software-prefetched while the current block computes.
//   - Mixed precision: qkv, out, dout and dqkv may be bf16 or f16 (one dtype per call). Rows are converted
//     to f32 (exactly) when copied into scratch and rounded when stored, and everything in between is the
//     f32 code: results are the f32 op's on the widened inputs, rounded once to the output dtype. bf16 on
//     CPUs with AVX512-BF16 takes the VDPBF16PS path instead ("bf16 on VDPBF16PS" below): bf16 products,
//     with P and dS rounded to bf16 as on the GPU.
//   - Attention dropout (p > 0): the mask is a pure function of the element index (dropout_tile), so the
//     forward, the backward and a recomputed forward regenerate the same mask tile by tile. The softmax
//     statistics (m, l, lse) use the undropped probabilities; O = (P * Z / (1 - p)) V. Backward (FA-2 with
//     dropout): dV = (P * Z / (1 - p))^T dO, dP = (dO V^T) * Z / (1 - p), D_i = rowsum(dO_i * O_i),
//     dS = P * (dP - D). With p = 0 none of this runs: the code path is the one without dropout.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "backend/cpu/attention_bf16.h"
#include "backend/cpu/attention_geometry.h"
#include "backend/cpu/attention_tiles.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/fast_math.h"
#include "backend/cpu/lowp.h"
#include "loom/core/rng.h"

namespace loom::cpu {

namespace {

using attn::Band;
using attn::Dropout;
using attn::dropout_tile;
using attn::bf16_gemm;
using attn::Geometry;
using attn::kBlock;
using attn::kW;
using attn::make_geometry;
using attn::PrefetchQueue;
using attn::Rows;
using attn::interleave_pairs;
using attn::Scratch;
using attn::ScratchOf;
using attn::segment_ranges;
using attn::tile_abt;
using attn::tile_acc;
using attn::tile_to_bf16;
using attn::tile_to_bf16_transposed;
using attn::transpose_block;
using attn::transpose_u32;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// e^x for softmax arguments x = score - running max (or - lse), which are <= 0: exactly 0 below -87 (masked
// scores are -inf), max relative error ~2e-7 above. Half the work of a general exp because the range is
// one-sided: n = round(x log2 e) lies in [-126, 0], so 2^n is a normal number built straight from the bits of
// the rounding sum, with no overflow, subnormal or NaN paths. Rounding residue above 0 is clamped to 0.
inline float exp_nonpositive(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;     // 355/512: n * kLn2Hi is exact
  constexpr float kLn2Lo = -2.12194440e-4f;  // ln2 - kLn2Hi
  constexpr float kRound = 12582912.0f + 127.0f;  // 1.5 * 2^23 + exponent bias: t's low bits hold n + 127
  const float xc = std::min(std::max(x, -87.0f), 0.0f);
  const float t = xc * kLog2e + kRound;
  const float n = t - kRound;
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;  // |r| <= ln2 / 2
  const float p = exp_reduced_poly(r);
  const float two_n = std::bit_cast<float>(std::bit_cast<uint32_t>(t) << 23);
  return x < -87.0f ? 0.0f : p * two_n;
}

// ---- storage dtypes --------------------------------------------------------------------------------

// One element of qkv/out/dout/dqkv: an f32, or the bits of a bf16 or f16.
template <DType D>
using Elem = std::conditional_t<D == DType::kF32, float, uint16_t>;

// dst[0, n) = src[0, n) widened to f32 (exact).
template <DType D>
inline void widen_row(float* dst, const Elem<D>* src, int64_t n) {
  if constexpr (D == DType::kF32) std::memcpy(dst, src, size_t(n) * sizeof(float));
  else Lowp<D>::widen(dst, src, n);
}

// dst[0, n) = src[0, n) rounded to the dtype (nearest even); f32 is a copy.
template <DType D>
inline void narrow_row(Elem<D>* dst, const float* src, int64_t n) {
  if constexpr (D == DType::kF32) std::memcpy(dst, src, size_t(n) * sizeof(float));
  else Lowp<D>::narrow(dst, src, n);
}

// Copies rows [r0, r0 + n) of one head (columns [col, col + HS) of rows with stride ld) into dst
// (kBlock x HSP, row-major, f32), zeroing the padding columns and rows n..kBlock.
template <DType D>
void copy_rows(float* dst, const Elem<D>* src, int64_t ld, int64_t col, int64_t r0, int64_t n, const Geometry& g,
               int64_t dst_rows = kBlock) {
  for (int64_t r = 0; r < dst_rows; ++r) {
    float* d = dst + r * g.HSP;
    if (r < n) {
      widen_row<D>(d, src + (r0 + r) * ld + col, g.HS);
      std::fill(d + g.HS, d + g.HSP, 0.0f);
    } else {
      std::fill(d, d + g.HSP, 0.0f);
    }
  }
}

// Rows of one kv head, copied into scratch (at their absolute row index) the first time a query block
// needs them. The keys a query block needs only move forward (key_begin and key_end never decrease), so a
// high-water mark is enough; the next block's new rows are prefetched while the current block computes.
struct HeadRows {
  float* k;
  float* v;
  int64_t have = 0;  // rows below this are present (or were skipped as never needed)

  template <DType D>
  void require(const Elem<D>* x, const Geometry& g, int64_t grp, int64_t begin, int64_t end) {
    const int64_t lo = std::max(have, begin);
    if (end > lo) {
      copy_rows<D>(k + lo * g.HSP, x, g.qkv_row, g.k_col(grp), lo, end - lo, g, end - lo);
      copy_rows<D>(v + lo * g.HSP, x, g.qkv_row, g.v_col(grp), lo, end - lo, g, end - lo);
    }
    have = std::max(have, end);
  }
  template <typename E>
  void prefetch(PrefetchQueue& pf, const E* x, const Geometry& g, int64_t grp, int64_t begin,
                int64_t end) const {
    const int64_t lo = std::max(have, begin);
    pf.add(x, g.qkv_row, g.k_col(grp), lo, end - lo, g.HS);
    pf.add(x, g.qkv_row, g.v_col(grp), lo, end - lo, g.HS);
  }
};

// ---- forward -------------------------------------------------------------------------------------

// The online softmax of one query block, vectorised across the queries (columns of the S^T tiles): running
// max m and sum l of the undropped probabilities per query, and the factor alpha that rescales the output
// accumulator when m grows.
struct OnlineSoftmax {
  alignas(64) float m[kBlock], l[kBlock], alpha[kBlock];
  OnlineSoftmax() {
    std::fill(m, m + kBlock, kNegInf);
    std::fill(l, l + kBlock, 0.0f);
  }

  // Rows j < kn of st hold scores (masked entries -inf); they become P, times the dropout tile z (kept
  // entries 1 / (1 - p), dropped 0) when z is given.
  void update(float* st, int64_t kn, const float* z) {
    alignas(64) float msafe[kBlock], mb[kBlock];
    std::copy(m, m + kBlock, mb);
    for (int64_t j = 0; j < kn; ++j) {
      const float* row = st + j * kBlock;
#pragma omp simd
      for (int64_t i = 0; i < kBlock; ++i) mb[i] = std::max(mb[i], row[i]);
    }
#pragma omp simd
    for (int64_t i = 0; i < kBlock; ++i) {
      msafe[i] = mb[i] == kNegInf ? 0.0f : mb[i];  // query with no visible key yet: keep everything at 0
      alpha[i] = exp_nonpositive(m[i] - msafe[i]);
      m[i] = mb[i];
      l[i] *= alpha[i];
    }
    if (!z) {
      for (int64_t j = 0; j < kn; ++j) {
        float* row = st + j * kBlock;
#pragma omp simd
        for (int64_t i = 0; i < kBlock; ++i) {
          row[i] = exp_nonpositive(row[i] - msafe[i]);
          l[i] += row[i];
        }
      }
    } else {
      // The normaliser l sums the undropped probabilities; the tile that multiplies V is dropped and scaled.
      for (int64_t j = 0; j < kn; ++j) {
        float* row = st + j * kBlock;
        const float* zr = z + j * kBlock;
#pragma omp simd
        for (int64_t i = 0; i < kBlock; ++i) {
          const float e = exp_nonpositive(row[i] - msafe[i]);
          l[i] += e;
          row[i] = e * zr[i];
        }
      }
    }
  }

  // Rows i < qn of the output accumulator (ld floats apart) times alpha.
  void rescale(float* o, int64_t ld, int64_t qn) const {
    for (int64_t i = 0; i < qn; ++i) {
      float* orow = o + i * ld;
      const float a = alpha[i];
#pragma omp simd
      for (int64_t d = 0; d < ld; ++d) orow[d] *= a;
    }
  }

  // out row i (ld_out elements apart) = o row i (ld_o floats apart) / l, rounded once to D; lse[i] = m + log l.
  template <DType D>
  void finish(Elem<D>* out, int64_t ld_out, float* lse, float* o, int64_t ld_o, int64_t qn, int64_t hs) const {
    for (int64_t i = 0; i < qn; ++i) {
      const float inv = 1.0f / l[i];
      Elem<D>* dst = out + i * ld_out;
      float* orow = o + i * ld_o;
      if constexpr (D == DType::kF32) {
#pragma omp simd
        for (int64_t d = 0; d < hs; ++d) dst[d] = orow[d] * inv;
      } else {  // the same f32 products, rounded once
#pragma omp simd
        for (int64_t d = 0; d < hs; ++d) orow[d] *= inv;
        narrow_row<D>(dst, orow, hs);
      }
      lse[i] = m[i] + std::log(l[i]);
    }
  }
};

struct ForwardScratch {
  Scratch k, v;            // one kv head: T x HSP
  Scratch q, qt, st, o;    // one query block
  Scratch z;               // dropout mask tile (kBlock x kBlock, S^T layout); unused without dropout
  explicit ForwardScratch(const Geometry& g)
      : k(g.T * g.HSP),
        v(g.T * g.HSP),
        q(kBlock * g.HSP),
        qt(g.HSP * kBlock),
        st(kBlock * kBlock),
        o(kBlock * g.HSP),
        z(g.dropout ? kBlock * kBlock : 1) {}
};

// Query blocks [qb0, qb1) of head h of batch row b.
template <DType D>
void forward_task(Elem<D>* out, float* lse, const Elem<D>* qkv, const Geometry& g, int64_t b, int64_t h,
                  int64_t qb0, int64_t qb1, ForwardScratch& s) {
  const Elem<D>* x = qkv + b * g.T * g.qkv_row;
  const Geometry::RowSegments sg = g.segments(b);
  const int64_t grp = h / g.G;
  float* qt = s.qt.get();
  float* st = s.st.get();
  float* o = s.o.get();
  const float* z = s.z.get();
  HeadRows kv{s.k.get(), s.v.get()};
  PrefetchQueue pf;
  for (int64_t qb = qb0; qb < qb1; ++qb) {
    const int64_t i0 = qb * kBlock, qn = std::min(kBlock, g.T - i0);
    const int64_t kbeg = g.key_begin(sg, i0), kend = g.key_end(sg, i0, qn);
    kv.require<D>(x, g, grp, kbeg, kend);
    copy_rows<D>(s.q.get(), x, g.qkv_row, g.q_col(h), i0, qn, g);
    transpose_block(qt, s.q.get(), g.HSP, g.scale);  // scores come out scaled
    pf.add(out, g.out_row, h * g.HS, b * g.T + i0, qn, g.HS, true);
    if (qb + 1 < qb1) {
      const int64_t ni0 = i0 + kBlock, nn = std::min(kBlock, g.T - ni0);
      pf.add(x, g.qkv_row, g.q_col(h), ni0, nn, g.HS);
      kv.prefetch(pf, x, g, grp, g.key_begin(sg, ni0), g.key_end(sg, ni0, nn));
    }
    pf.plan(2 * ((kend - kbeg + kBlock - 1) / kBlock));

    OnlineSoftmax sm;
    std::fill(o, o + kBlock * g.HSP, 0.0f);
    for (int64_t j0 = kbeg; j0 < kend; j0 += kBlock) {
      const int64_t kn = std::min(kBlock, kend - j0);
      const float* kj = kv.k + j0 * g.HSP;
      const float* vj = kv.v + j0 * g.HSP;
      const Band band = g.band(sg, i0, j0);
      tile_abt(st, kj, qt, kn, g.HSP, band);  // st[j][i] = scale * k_j . q_i
      pf.step();
      if (!band.all_visible(qn, kn))
        for (int64_t j = 0; j < kn; ++j) band.mask_row(st + j * kBlock, j, kNegInf);
      if (g.dropout) dropout_tile(s.z.get(), g.drop, g.mask_base(b, h, i0, j0), uint64_t(g.T), qn, kn, band);
      sm.update(st, kn, g.dropout ? z : nullptr);
      if (j0 != kbeg) sm.rescale(o, g.HSP, qn);  // the first block finds o at zero
      tile_acc(o, st, 1, kBlock, vj, kn, qn, g.HSP, band, Rows::kQueries);  // o[i] += sum_j p[i][j] v_j
      pf.step();
    }
    pf.drain();

    sm.finish<D>(out + (b * g.T + i0) * g.out_row + h * g.HS, g.out_row, lse + (b * g.NH + h) * g.T + i0, o,
                 g.HSP, qn, g.HS);
  }
}

// ---- backward ------------------------------------------------------------------------------------

// Rows j < kn of the tiles S^T (scores, already scaled) and dP^T become P^T and dS^T of the raw scores:
// P = exp(S - lse), dS = P * (dP - D) * scale; with the dropout tile z, dP of the dropped probabilities is
// dP * Z / (1 - p), and P^T becomes P * Z / (1 - p) for dV. Entries the band hides are set to 0 when masked.
void grad_tile(float* st, float* dpt, int64_t kn, const float* lse_i, const float* d_i, const float* z, float scale,
               const Band& band, bool masked) {
  for (int64_t j = 0; j < kn; ++j) {
    float* prow = st + j * kBlock;
    float* drow = dpt + j * kBlock;
#pragma omp simd
    for (int64_t i = 0; i < kBlock; ++i) prow[i] = exp_nonpositive(prow[i] - lse_i[i]);
    if (!z) {
#pragma omp simd
      for (int64_t i = 0; i < kBlock; ++i) drow[i] = prow[i] * (drow[i] - d_i[i]) * scale;
    } else {
      const float* zr = z + j * kBlock;
#pragma omp simd
      for (int64_t i = 0; i < kBlock; ++i) {
        drow[i] = prow[i] * (drow[i] * zr[i] - d_i[i]) * scale;
        prow[i] *= zr[i];
      }
    }
    if (masked) {
      band.mask_row(prow, j, 0.0f);
      band.mask_row(drow, j, 0.0f);
    }
  }
}

// Prefetches of backward query block qb of head h: its dq rows (and, on the group's last head, its dk and dv
// rows, which are written at the end), and the next query block's rows (of the next head after the last
// block), which arrive while this one computes. key_mask clears the low bits of a block's first key (the
// bf16 path starts key tiles at even keys).
template <typename E, typename KV>
void backward_prefetch(PrefetchQueue& pf, const KV& kv, E* dx, const E* x, const E* dy, const E* y, const Geometry& g,
                       const Geometry::RowSegments& sg, int64_t grp, int64_t h, int64_t qb, int64_t key_mask) {
  const int64_t nqb = (g.T + kBlock - 1) / kBlock;
  const int64_t i0 = qb * kBlock, qn = std::min(kBlock, g.T - i0);
  pf.add(dx, g.qkv_row, g.q_col(h), i0, qn, g.HS, true);
  if (h == (grp + 1) * g.G - 1) {  // spread the dk/dv prefetch over the last head
    pf.add(dx, g.qkv_row, g.k_col(grp), i0, qn, g.HS, true);
    pf.add(dx, g.qkv_row, g.v_col(grp), i0, qn, g.HS, true);
  }
  const int64_t nh = qb + 1 < nqb ? h : h + 1, ni0 = qb + 1 < nqb ? i0 + kBlock : 0;
  if (nh < (grp + 1) * g.G) {
    const int64_t nn = std::min(kBlock, g.T - ni0);
    pf.add(x, g.qkv_row, g.q_col(nh), ni0, nn, g.HS);
    pf.add(dy, g.out_row, nh * g.HS, ni0, nn, g.HS);
    pf.add(y, g.out_row, nh * g.HS, ni0, nn, g.HS);
    kv.prefetch(pf, x, g, grp, g.key_begin(sg, ni0) & key_mask, g.key_end(sg, ni0, nn));
  }
}

// D_i = dO_i . O_i for the rows i < qn of a query block, in f32 from the widened rows (dout: kBlock x ld f32,
// out: rows out_row elements apart); lse_i and d_i of the padding rows i >= qn are +inf and 0, so their P
// and dS are exactly 0.
template <DType D>
void block_stats(float* lse_i, float* d_i, const float* lse, const float* dout, int64_t ld, const Elem<D>* out,
                 int64_t out_row, float* widened, int64_t qn, int64_t hs) {
  for (int64_t i = 0; i < kBlock; ++i) {
    if (i < qn) {
      lse_i[i] = lse[i];
      const float* yr;
      if constexpr (D == DType::kF32) {
        yr = out + i * out_row;
      } else {
        widen_row<D>(widened, out + i * out_row, hs);
        yr = widened;
      }
      const float* dyr = dout + i * ld;
      float acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < hs; ++d) acc += yr[d] * dyr[d];
      d_i[i] = acc;
    } else {
      lse_i[i] = std::numeric_limits<float>::infinity();
      d_i[i] = 0;
    }
  }
}

struct BackwardScratch {
  Scratch k, v, dk, dv;        // one kv head: T x HSP
  Scratch q, qt, dout, doutt;  // one query block
  Scratch st, dpt, dq;
  Scratch y;                   // one output row widened to f32 (bf16/f16 only)
  Scratch z;                   // dropout mask tile (kBlock x kBlock, S^T layout); unused without dropout
  explicit BackwardScratch(const Geometry& g)
      : k(g.T * g.HSP),
        v(g.T * g.HSP),
        dk(g.T * g.HSP),
        dv(g.T * g.HSP),
        q(kBlock * g.HSP),
        qt(g.HSP * kBlock),
        dout(kBlock * g.HSP),
        doutt(g.HSP * kBlock),
        st(kBlock * kBlock),
        dpt(kBlock * kBlock),
        dq(kBlock * g.HSP),
        y(g.dtype == DType::kF32 ? 1 : g.HSP),
        z(g.dropout ? kBlock * kBlock : 1) {}
};

// All query heads of group grp for batch row b: writes dq of those heads and dk, dv of the group.
template <DType D>
void backward_group(Elem<D>* dqkv, const Elem<D>* dout, const Elem<D>* qkv, const Elem<D>* out, const float* lse,
                    const Geometry& g, int64_t b, int64_t grp, BackwardScratch& s) {
  const Elem<D>* x = qkv + b * g.T * g.qkv_row;
  const Elem<D>* dy = dout + b * g.T * g.out_row;
  const Elem<D>* y = out + b * g.T * g.out_row;
  Elem<D>* dx = dqkv + b * g.T * g.qkv_row;
  const Geometry::RowSegments sg = g.segments(b);
  HeadRows kv{s.k.get(), s.v.get()};
  PrefetchQueue pf;
  std::fill(s.dk.get(), s.dk.get() + g.T * g.HSP, 0.0f);
  std::fill(s.dv.get(), s.dv.get() + g.T * g.HSP, 0.0f);
  float* st = s.st.get();
  float* dpt = s.dpt.get();
  float* dq = s.dq.get();
  const float* z = s.z.get();
  const int64_t nqb = (g.T + kBlock - 1) / kBlock;

  for (int64_t h = grp * g.G; h < (grp + 1) * g.G; ++h) {
    for (int64_t qb = 0; qb < nqb; ++qb) {
      const int64_t i0 = qb * kBlock, qn = std::min(kBlock, g.T - i0);
      const int64_t kbeg = g.key_begin(sg, i0), kend = g.key_end(sg, i0, qn);
      kv.require<D>(x, g, grp, kbeg, kend);
      copy_rows<D>(s.q.get(), x, g.qkv_row, g.q_col(h), i0, qn, g);
      transpose_block(s.qt.get(), s.q.get(), g.HSP, g.scale);  // scores come out scaled
      copy_rows<D>(s.dout.get(), dy, g.out_row, h * g.HS, i0, qn, g);
      transpose_block(s.doutt.get(), s.dout.get(), g.HSP, 1.0f);
      backward_prefetch(pf, kv, dx, x, dy, y, g, sg, grp, h, qb, ~int64_t(0));
      pf.plan(5 * ((kend - kbeg + kBlock - 1) / kBlock));
      alignas(64) float lse_i[kBlock], d_i[kBlock];
      block_stats<D>(lse_i, d_i, lse + (b * g.NH + h) * g.T + i0, s.dout.get(), g.HSP, y + i0 * g.out_row + h * g.HS,
                     g.out_row, s.y.get(), qn, g.HS);
      std::fill(dq, dq + kBlock * g.HSP, 0.0f);

      for (int64_t j0 = kbeg; j0 < kend; j0 += kBlock) {
        const int64_t kn = std::min(kBlock, kend - j0);
        const float* kj = kv.k + j0 * g.HSP;
        const float* vj = kv.v + j0 * g.HSP;
        const Band band = g.band(sg, i0, j0);
        tile_abt(st, kj, s.qt.get(), kn, g.HSP, band);  // s^T[j][i] = scale * k_j . q_i
        pf.step();
        tile_abt(dpt, vj, s.doutt.get(), kn, g.HSP, band);  // dP^T[j][i] = v_j . dO_i
        pf.step();
        if (g.dropout) dropout_tile(s.z.get(), g.drop, g.mask_base(b, h, i0, j0), uint64_t(g.T), qn, kn, band);
        grad_tile(st, dpt, kn, lse_i, d_i, g.dropout ? z : nullptr, g.scale, band, !band.all_visible(qn, kn));
        tile_acc(s.dv.get() + j0 * g.HSP, st, kBlock, 1, s.dout.get(), qn, kn, g.HSP, band, Rows::kKeys);  // P^T dO
        pf.step();
        tile_acc(s.dk.get() + j0 * g.HSP, dpt, kBlock, 1, s.q.get(), qn, kn, g.HSP, band, Rows::kKeys);  // dS^T q
        pf.step();
        tile_acc(dq, dpt, 1, kBlock, kj, kn, qn, g.HSP, band, Rows::kQueries);  // dS k
        pf.step();
      }
      pf.drain();
      for (int64_t i = 0; i < qn; ++i) narrow_row<D>(dx + (i0 + i) * g.qkv_row + g.q_col(h), dq + i * g.HSP, g.HS);
    }
  }
  for (int64_t t = 0; t < g.T; ++t) {
    narrow_row<D>(dx + t * g.qkv_row + g.k_col(grp), s.dk.get() + t * g.HSP, g.HS);
    narrow_row<D>(dx + t * g.qkv_row + g.v_col(grp), s.dv.get() + t * g.HSP, g.HS);
  }
}

// ---- bf16 on VDPBF16PS -------------------------------------------------------------------------
//
// The same tasks, tiles and softmax as above, with every block product on AVX512-BF16 (attention_bf16.h):
// operands are the bf16 rows themselves (no widening), the products accumulate in f32, and P and dS are
// rounded to bf16 for the products that take them, as on the GPU. The scores come out unscaled and are
// multiplied by the softmax scale in f32 (the f32 path scales q before the product instead). Operand
// layouts: a product's left operand is plain rows (k, v rows; P^T and dS^T tiles straight from the S^T layout;
// P and dS transposed), its right operand pair-interleaved (q^T and dO^T by a 32-bit transpose of the block,
// v, k, q and dO rows by interleave_pairs). Head rows are padded with zeros to H2, a multiple of 32. Key
// tiles start at even keys (the pair layout of k and v is by absolute pairs): a block's first key is
// rounded down to even, which adds at most one key that no query of the block sees, masked like any other.
// Tiles are computed whole (no band skipping inside a tile): masked pairs and keys past the block's last one
// take part with zero coefficients (P = dS = 0; those key rows are zeros, or in backward, from a group's
// second head on, the later keys' own rows), and a tile's dK/dV rows past its last key receive +0. With
// finite inputs that changes nothing; a NaN or infinity in q, k, v or dO spreads (0 x NaN) to the other
// rows and columns of the tiles it enters, masked pairs and those later keys included, as in
// an unfused masked softmax followed by a matmul (the f32 path skips most masked pairs, in groups of 4 rows
// and 16 columns, so it spreads less there). A non-finite loss or gradient norm skips the step either way.

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
      bf16_gemm(st, kBlock, kv.k + j0 * h2, h2, s.qt.get(), kBlock, kBlock, kBlock, h2, false);  // k_j . q_i
      pf.step();
      scale_scores(st, kn, g.scale, band, !band.all_visible(qn, kn));
      if (g.dropout) dropout_tile(s.z.get(), g.drop, g.mask_base(b, h, i0, j0), uint64_t(g.T), qn, kn, band);
      sm.update(st, kn, g.dropout ? z : nullptr);
      if (j0 != kbeg) sm.rescale(o, h2, qn);
      tile_to_bf16_transposed(s.p.get(), st, kn);
      bf16_gemm(o, h2, s.p.get(), kBlock, kv.vp + (j0 / 2) * h2, h2, kBlock, h2, kBlock, true);  // o += P v
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
        bf16_gemm(st, kBlock, kv.k + j0 * h2, h2, s.qt.get(), kBlock, kBlock, kBlock, h2, false);      // k_j . q_i
        bf16_gemm(dpt, kBlock, kv.v + j0 * h2, h2, s.doutt.get(), kBlock, kBlock, kBlock, h2, false);  // v_j . dO_i
        pf.step();
        scale_scores(st, kn, g.scale, band, false);
        if (g.dropout) dropout_tile(s.z.get(), g.drop, g.mask_base(b, h, i0, j0), uint64_t(g.T), qn, kn, band);
        grad_tile(st, dpt, kn, lse_i, d_i, g.dropout ? z : nullptr, g.scale, band, !band.all_visible(qn, kn));
        tile_to_bf16(pt, st, kn);
        bf16_gemm(dv + j0 * h2, h2, pt, kBlock, s.doutp.get(), h2, kBlock, h2, kBlock, true);  // dV += P^T dO
        pf.step();
        tile_to_bf16(pt, dpt, kn);
        bf16_gemm(dk + j0 * h2, h2, pt, kBlock, s.qp.get(), h2, kBlock, h2, kBlock, true);  // dK += dS^T q
        pf.step();
        tile_to_bf16_transposed(pt, dpt, kn);
        bf16_gemm(dq, h2, pt, kBlock, kv.kp + (j0 / 2) * h2, h2, kBlock, h2, kBlock, true);  // dQ += dS k
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

// Calls fn(std::integral_constant<DType, D>) for the activation dtype of g.
template <typename Fn>
void with_dtype(const Geometry& g, Fn&& fn) {
  switch (g.dtype) {
    case DType::kF32: fn(std::integral_constant<DType, DType::kF32>{}); return;
    case DType::kBF16: fn(std::integral_constant<DType, DType::kBF16>{}); return;
    case DType::kF16: fn(std::integral_constant<DType, DType::kF16>{}); return;
    default: LOOM_FAIL("[attention] unsupported dtype ", dtype_name(g.dtype));
  }
}

}  // namespace

void CpuOps::do_attention_forward(TensorView out, TensorView lse, TensorView qkv, const AttentionParams& p,
                                  TensorView segment_ids) const {
  Geometry g = make_geometry(qkv, p);
  const std::vector<int32_t> seg = segment_ranges(segment_ids, g, "attention_forward");
  if (!seg.empty()) {
    g.seg_begin = seg.data();
    g.seg_end = seg.data() + g.B * g.T;
  }
  float* ls = lse.data<float>();
  // Tasks are (b, head, run of query blocks): a run shares one copy of the head's k/v rows. Runs are
  // split only as far as needed to give every thread several tasks; each query block's arithmetic is
  // the same whatever the split, so the thread count does not change the results.
  const int64_t nqb = (g.T + kBlock - 1) / kBlock;
  const int64_t bh = g.B * g.NH;
  const int64_t runs = std::clamp<int64_t>((4 * omp_get_max_threads() + bh - 1) / std::max<int64_t>(bh, 1), 1,
                                           std::max<int64_t>(nqb, 1));
  const int64_t tasks = bh * runs;
  with_dtype(g, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    const auto* x = static_cast<const Elem<D>*>(qkv.raw());
    auto* y = static_cast<Elem<D>*>(out.raw());
    if constexpr (D == DType::kBF16) {
      if (attn::bf16_attention_enabled()) {
#pragma omp parallel if (tasks > 1)
        {
          Bf16ForwardScratch s(g);
#pragma omp for schedule(dynamic, 1)
          for (int64_t task = 0; task < tasks; ++task) {
            const int64_t run = runs - 1 - task % runs, head = task / runs;
            forward_task_bf16(y, ls, x, g, head / g.NH, head % g.NH, run * nqb / runs, (run + 1) * nqb / runs, s);
          }
        }
        return;
      }
    }
#pragma omp parallel if (tasks > 1)
    {
      ForwardScratch s(g);
      // Later runs see more keys (causal): hand them out first so the tail of the loop is short.
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < tasks; ++task) {
        const int64_t run = runs - 1 - task % runs, head = task / runs;
        forward_task<D>(y, ls, x, g, head / g.NH, head % g.NH, run * nqb / runs, (run + 1) * nqb / runs, s);
      }
    }
  });
}

void CpuOps::do_attention_backward(TensorView dqkv, TensorView dout, TensorView qkv, TensorView out, TensorView lse,
                                   const AttentionParams& p, TensorView segment_ids) const {
  Geometry g = make_geometry(qkv, p);
  const std::vector<int32_t> seg = segment_ranges(segment_ids, g, "attention_backward");
  if (!seg.empty()) {
    g.seg_begin = seg.data();
    g.seg_end = seg.data() + g.B * g.T;
  }
  const int64_t tasks = g.B * g.NKV;
  const float* ls = lse.data<float>();
  with_dtype(g, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    auto* dx = static_cast<Elem<D>*>(dqkv.raw());
    const auto* dy = static_cast<const Elem<D>*>(dout.raw());
    const auto* x = static_cast<const Elem<D>*>(qkv.raw());
    const auto* y = static_cast<const Elem<D>*>(out.raw());
    if constexpr (D == DType::kBF16) {
      if (attn::bf16_attention_enabled()) {
#pragma omp parallel if (tasks > 1)
        {
          Bf16BackwardScratch s(g);
#pragma omp for schedule(dynamic, 1)
          for (int64_t task = 0; task < tasks; ++task)
            backward_group_bf16(dx, dy, x, y, ls, g, task / g.NKV, task % g.NKV, s);
        }
        return;
      }
    }
#pragma omp parallel if (tasks > 1)
    {
      BackwardScratch s(g);
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < tasks; ++task)
        backward_group<D>(dx, dy, x, y, ls, g, task / g.NKV, task % g.NKV, s);
    }
  });
}

}  // namespace loom::cpu

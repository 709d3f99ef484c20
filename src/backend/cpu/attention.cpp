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
//     CPUs with AVX512-BF16 takes the VDPBF16PS path instead (attention_bf16.cpp): bf16 products,
//     with P and dS rounded to bf16 as on the GPU.
//   - Attention dropout (p > 0): the mask is a pure function of the element index (dropout_tile), so the
//     forward, the backward and a recomputed forward regenerate the same mask tile by tile. The softmax
//     statistics (m, l, lse) use the undropped probabilities; O = (P * Z / (1 - p)) V. Backward (FA-2 with
//     dropout): dV = (P * Z / (1 - p))^T dO, dP = (dO V^T) * Z / (1 - p), D_i = rowsum(dO_i * O_i),
//     dS = P * (dP - D). With p = 0 none of this runs: the code path is the one without dropout.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "backend/cpu/attention_bf16.h"
#include "backend/cpu/attention_core.h"
#include "backend/cpu/cpu_ops.h"
#include "loom/core/rng.h"

namespace loom::cpu {

namespace {

using attn::backward_prefetch;
using attn::Band;
using attn::block_stats;
using attn::Dropout;
using attn::dropout_tile;
using attn::Elem;
using attn::Geometry;
using attn::grad_tile;
using attn::kBlock;
using attn::kNegInf;
using attn::kW;
using attn::make_geometry;
using attn::narrow_row;
using attn::OnlineSoftmax;
using attn::PrefetchQueue;
using attn::Rows;
using attn::Scratch;
using attn::segment_ranges;
using attn::tile_abt;
using attn::tile_acc;
using attn::transpose_block;
using attn::widen_row;

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
      if (attn::bf16_attention_enabled()) return attn::forward_bf16(y, ls, x, g, runs);
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
      if (attn::bf16_attention_enabled()) return attn::backward_bf16(dx, dy, x, y, ls, g);
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

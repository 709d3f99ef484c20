// Pieces of the CPU attention core shared by its f32 tile path (attention.cpp) and its bf16 VDPBF16PS path
// (attention_bf16.cpp): the one-sided exponential, the storage dtypes, the online softmax of a query block,
// the backward's P/dS pass, its per-block statistics and its prefetch plan. Internal to the CPU backend.
#pragma once
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "backend/cpu/attention_geometry.h"
#include "backend/cpu/attention_tiles.h"
#include "backend/cpu/fast_math.h"
#include "backend/cpu/lowp.h"

namespace loom::cpu::attn {

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

// ---- backward ------------------------------------------------------------------------------------

// Rows j < kn of the tiles S^T (scores, already scaled) and dP^T become P^T and dS^T of the raw scores:
// P = exp(S - lse), dS = P * (dP - D) * scale; with the dropout tile z, dP of the dropped probabilities is
// dP * Z / (1 - p), and P^T becomes P * Z / (1 - p) for dV. Entries the band hides are set to 0 when masked.
inline void grad_tile(float* st, float* dpt, int64_t kn, const float* lse_i, const float* d_i, const float* z, float scale,
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

// ---- the bf16 path (attention_bf16.cpp) --------------------------------------------------------------

// attention_forward / attention_backward on bf16 activations with VDPBF16PS products, for a geometry the
// entry points built; the forward's tasks are (b, head, run of query blocks) with `runs` runs per head, as
// on the f32 path. Only when bf16_attention_enabled().
void forward_bf16(uint16_t* out, float* lse, const uint16_t* qkv, const Geometry& g, int64_t runs);
void backward_bf16(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out, const float* lse,
                   const Geometry& g);

}  // namespace loom::cpu::attn

// Tile kernels of the CPU attention core; see attention_tiles.h for the layout conventions.
// Register blocking, per ISA (kRows x kVecs accumulators; checked in the generated code):
//   - AVX-512: 4 output rows x up to 4 vectors = 16 accumulators, plus the 4 vectors of the streamed operand
//     and one broadcast, fit the 32 zmm registers without spills;
//   - narrower ISAs (AVX2: 16 ymm registers, two per 16-float vector): 6 rows x 1 vector = 12 accumulators,
//     the streamed vector and a broadcast, the tile of AVX2 sgemm kernels. The AVX-512 blocking there spilled
//     on every FMA: 3.7 s of a GPT-2 124M step in attention against 0.2 s with this (bench/RESULTS.md).
// Every output element is the same sequence of FMAs over k either way: the blocking changes no bits.
#include "backend/cpu/attention_tiles.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>

#include "backend/cpu/lowp.h"
#include "backend/cpu/transpose16.h"
#include "backend/cpu/philox_simd.h"

namespace loom::cpu::attn {

namespace {

using Vec = float __attribute__((vector_size(64)));  // kW floats
using UVec = uint32_t __attribute__((vector_size(64)));
// The products' own vector (KVec) is the widest the target has: GCC keeps a vector wider than that in memory,
// so the 16-float Vec would make every accumulator a stack slot. Register blocking (see the header):
// kRows rows x up to kVecs Vecs (of kPer KVecs each).
#if defined(__AVX512F__)
using KVec = Vec;
constexpr int kRows = 4, kVecs = 4;
#else
using KVec = float __attribute__((vector_size(32)));
constexpr int kRows = 6, kVecs = 1;
#endif
constexpr int kKW = int(sizeof(KVec) / sizeof(float));  // floats per KVec
constexpr int kPer = int(kW) / kKW;                       // KVecs per Vec

template <typename V = Vec>
inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}
template <typename V>
inline void store(float* p, const V& v) {
  std::memcpy(p, &v, sizeof(V));
}

// f(RB, r) over groups of rows [r, r + RB) covering [0, rows): kRows at a time, then pairs (where kRows > 2),
// then single rows.
template <typename F>
inline void for_row_groups(int64_t rows, F&& f) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) f(std::integral_constant<int, kRows>{}, r);
  if constexpr (kRows > 2)
    for (; r + 2 <= rows; r += 2) f(std::integral_constant<int, 2>{}, r);
  for (; r < rows; ++r) f(std::integral_constant<int, 1>{}, r);
}

// f(NV) for n = NV Vecs, 1 <= n <= kVecs (only those widths are compiled).
template <typename F>
inline void with_vecs(int64_t n, F&& f) {
  if constexpr (kVecs >= 4)
    if (n == 4) return f(std::integral_constant<int, 4>{});
  if constexpr (kVecs >= 3)
    if (n == 3) return f(std::integral_constant<int, 3>{});
  if constexpr (kVecs >= 2)
    if (n == 2) return f(std::integral_constant<int, 2>{});
  f(std::integral_constant<int, 1>{});
}

// out[r][0 : NW*kW] = sum_k a[r][k] * bt[k][0 : NW*kW] for RB rows; out and bt rows are kBlock apart.
template <int RB, int NW>
inline void abt_rows(float* out, const float* a, const float* bt, int64_t hsp) {
  constexpr int NV = NW * kPer;
  KVec c[RB][NV] = {};
  for (int64_t k = 0; k < hsp; ++k) {
    KVec b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load<KVec>(bt + k * kBlock + v * kKW);
    for (int r = 0; r < RB; ++r) {
      const float s = a[r * hsp + k];
      for (int v = 0; v < NV; ++v) c[r][v] += s * b[v];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) store(out + r * kBlock + v * kKW, c[r][v]);
}

// Rows [r, r + RB) of tile_abt, restricted to the query vectors the band leaves visible, in chunks of up to
// kVecs vectors.
template <int RB>
inline void abt_group(float* out, const float* a, const float* bt, int64_t r, int64_t hsp, const Band& band) {
  const auto [qb, qe] = band.visible(Rows::kKeys, r, RB, kBlock);
  if (qb >= qe) return;  // no query is visible: the caller masks the whole rows
  const int64_t b = qb / kW, e = (qe + kW - 1) / kW;
  out += r * kBlock;
  a += r * hsp;
  for (int64_t v = b; v < e; v += kVecs)
    with_vecs(std::min<int64_t>(kVecs, e - v), [&]<int NV>(std::integral_constant<int, NV>) {
      abt_rows<RB, NV>(out + v * kW, a, bt + v * kW, hsp);
    });
}

// out[r][0 : NW*kW] += sum_{k in [kb, ke)} coef(r, k) * x[k][0 : NW*kW] for RB rows; coef(r, k) = c[r*cr + k*ck].
template <int RB, int NW>
inline void acc_rows(float* out, const float* c, int64_t cr, int64_t ck, const float* x, int64_t kb, int64_t ke,
                     int64_t hsp) {
  constexpr int NV = NW * kPer;
  KVec acc[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = load<KVec>(out + r * hsp + v * kKW);
  for (int64_t k = kb; k < ke; ++k) {
    KVec xv[NV];
    for (int v = 0; v < NV; ++v) xv[v] = load<KVec>(x + k * hsp + v * kKW);
    for (int r = 0; r < RB; ++r) {
      const float s = c[r * cr + k * ck];
      for (int v = 0; v < NV; ++v) acc[r][v] += s * xv[v];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) store(out + r * hsp + v * kKW, acc[r][v]);
}

// One chunk of NV Vecs of output columns of tile_acc, all rows.
template <int NV>
void acc_cols(float* out, const float* c, int64_t cr, int64_t ck, const float* x, int64_t kcount, int64_t rows,
              int64_t hsp, const Band& band, Rows kind) {
  for_row_groups(rows, [&]<int RB>(std::integral_constant<int, RB>, int64_t r) {
    const auto [kb, ke] = band.visible(kind, r, RB, kcount);
    acc_rows<RB, NV>(out + r * hsp, c + r * cr, cr, ck, x, kb, ke, hsp);
  });
}

}  // namespace

void tile_abt(float* out, const float* a, const float* bt, int64_t rows, int64_t hsp, const Band& band) {
  for_row_groups(rows, [&]<int RB>(std::integral_constant<int, RB>, int64_t r) {
    abt_group<RB>(out, a, bt, r, hsp, band);
  });
}

// Output columns go in chunks of up to kVecs vectors, so that a row group keeps its accumulators in registers.
void tile_acc(float* out, const float* c, int64_t cr, int64_t ck, const float* x, int64_t kcount, int64_t rows,
              int64_t hsp, const Band& band, Rows kind) {
  for (int64_t d0 = 0; d0 < hsp; d0 += kVecs * kW) {
    with_vecs(std::min<int64_t>(kVecs, (hsp - d0) / kW), [&]<int NV>(std::integral_constant<int, NV>) {
      acc_cols<NV>(out + d0, c, cr, ck, x + d0, kcount, rows, hsp, band, kind);
    });
  }
}

// One 16-query group at a time, lanes = queries: lane l's mask indices for keys kb, kb + 1, ... are
// consecutive, so its Philox blocks are too, starting at word r_l = (index of key kb) % 4 of its first
// block. Rows kb + 4g .. kb + 4g + 3 then read words r_l .. r_l + 3 of the concatenation of the lane's
// blocks g and g + 1 (a per-lane select), and come out as whole S^T row vectors: no transpose, and about
// one Philox block per 4 visible entries (plus one per group and row range for the offset).
void dropout_tile(float* z, const Dropout& d, uint64_t base, uint64_t stride, int64_t qn, int64_t kn,
                  const Band& band) {
  static_assert(kW == 16, "one Philox call covers 16 query lanes");
  const UVec thr = UVec{} + d.threshold;
  const Vec keep_value = Vec{} + d.scale, drop_value = Vec{};
  for (int64_t q0 = 0; q0 < qn; q0 += kW) {
    const auto [kb, ke] = band.visible(Rows::kQueries, q0, std::min(kW, qn - q0), kn);
    if (kb >= ke) continue;
    uint64_t block[kW];
    UVec r;
    uint32_t rmax = 0;
    for (int l = 0; l < kW; ++l) {
      const uint64_t idx = base + uint64_t(q0 + l) * stride + uint64_t(kb);
      block[l] = idx / 4;
      r[l] = uint32_t(idx % 4);
      rmax = std::max(rmax, r[l]);
    }
    const int64_t nblocks = (int64_t(rmax) + (ke - kb) + 3) / 4;  // blocks any lane needs
    alignas(64) uint32_t words[4][16];
    UVec cat[8] = {};  // words of blocks g (0..3) and g + 1 (4..7) of every lane
    philox4x32_x16(words, d.seed, d.stream, block);
    for (int w = 0; w < 4; ++w) std::memcpy(&cat[w], words[w], sizeof(UVec));
    for (int64_t g = 0; kb + 4 * g < ke; ++g) {
      if (g + 1 < nblocks) {
        for (int l = 0; l < kW; ++l) ++block[l];
        philox4x32_x16(words, d.seed, d.stream, block);
        for (int w = 0; w < 4; ++w) std::memcpy(&cat[4 + w], words[w], sizeof(UVec));
      }
      for (int t = 0; t < 4 && kb + 4 * g + t < ke; ++t) {
        const UVec w = r == 0 ? cat[t] : r == 1 ? cat[t + 1] : r == 2 ? cat[t + 2] : cat[t + 3];
        store(z + (kb + 4 * g + t) * kBlock + q0, w >= thr ? keep_value : drop_value);
      }
      for (int w = 0; w < 4; ++w) cat[w] = cat[4 + w];
    }
  }
}

// 16 x 16 register tiles: four butterfly stages of two-source shuffles instead of 256 scalar stores.
void transpose_block(float* dst, const float* src, int64_t hsp, float scale) {
  for (int64_t rb = 0; rb < kBlock; rb += kW) {
    for (int64_t cb = 0; cb < hsp; cb += kW) {
      Vec r[kW];
      for (int i = 0; i < kW; ++i) r[i] = load(src + (rb + i) * hsp + cb) * scale;
      transpose16(r);
      for (int i = 0; i < kW; ++i) store(dst + (cb + i) * kBlock + rb, r[i]);
    }
  }
}

// ---- staging for the bf16 products -----------------------------------------------------------------

void tile_to_bf16(uint16_t* dst, const float* src, int64_t valid) {
  const int64_t rows = std::clamp<int64_t>(valid, 0, kBlock);
  Lowp<DType::kBF16>::narrow(dst, src, rows * kBlock);
  std::fill(dst + rows * kBlock, dst + kBlock * kBlock, uint16_t(0));
}

// 16 x 16 register transposes into a 16-row f32 strip, each strip rounded by Lowp's bf16 narrowing.
void tile_to_bf16_transposed(uint16_t* dst, const float* src, int64_t valid) {
  alignas(64) float strip[kW * kBlock];  // dst rows cb .. cb + kW, in f32
  for (int64_t cb = 0; cb < kBlock; cb += kW) {
    for (int64_t rb = 0; rb < kBlock; rb += kW) {
      Vec r[kW];
      for (int i = 0; i < kW; ++i) r[i] = rb + i < valid ? load(src + (rb + i) * kBlock + cb) : Vec{};
      transpose16(r);
      for (int i = 0; i < kW; ++i) store(strip + i * kBlock + rb, r[i]);
    }
    Lowp<DType::kBF16>::narrow(dst + cb * kBlock, strip, kW * kBlock);
  }
}

}  // namespace loom::cpu::attn

// Tile kernels of the CPU attention core (attention.cpp): the five block products of FlashAttention and
// the q/dO tile transpose, on 64-byte aligned per-thread scratch.
// Conventions: a block is kBlock = 64 queries or keys; head rows are padded to hsp, a multiple of kW = 16
// floats, with zeros; score tiles are stored transposed, S^T[key][query], kBlock floats per row. Every
// product is "broadcast one scalar, FMA a contiguous row" with register blocking over rows (sized per ISA in
// attention_tiles.cpp) on the target's widest vectors, so it compiles to full-width FMAs kept in registers
// (the other kernels' 16-float vectors are split by GCC/Clang on ISAs narrower than AVX-512). No kernel's
// result depends on anything but its arguments (thread-count independent).
// Attention dropout masks (dropout_tile) come from the same pure function of the element index that
// dropout_keep (core/rng.h) defines, generated 16 queries at a time straight into the S^T layout.
#pragma once
#include <algorithm>
#include <cstdint>
#include <utility>

#include "backend/cpu/transpose16.h"

namespace loom::cpu::attn {

constexpr int64_t kW = 16;      // floats per vector
constexpr int64_t kBlock = 64;  // rows per query block and per key block
constexpr int64_t kFar = int64_t(1) << 40;  // an unbounded band edge

// The visible (query, key) pairs of one tile. With ii and jj the offsets of a query and a key inside their
// blocks, the causal/window rule is a diagonal band: the pair is visible iff lo < jj - ii <= hi (causal:
// hi = i0 - j0; window: lo = hi - window). With document segments (seg_begin set), a position p also sees
// only positions [seg_begin[p], seg_end[p]) (its own segment, a contiguous range because segment ids never
// decrease), so every key row and every query row of a tile keeps one contiguous visible range, and the
// range's ends never decrease with the row: the union over a run of rows is [first row's begin, last row's
// end). Kernels use it to skip work that is entirely masked; skipping adds nothing but exact zeros (P = 0),
// so results are the same as computing the full tile.
enum class Rows { kQueries, kKeys };  // what a tile's output rows are (its products run over the other side)

struct Band {
  int64_t lo = -kFar, hi = kFar;
  // Segments (optional): position p's segment is [seg_begin[p], seg_end[p]) (absolute positions of the batch
  // row); i0 and j0 are the tile's first query and first key.
  const int32_t* seg_begin = nullptr;
  const int32_t* seg_end = nullptr;
  int64_t i0 = 0, j0 = 0;

  // Queries visible to some key of [r, r + n): [query_begin(r), query_end(r, n)) (may be empty).
  int64_t query_begin(int64_t r) const {
    return seg_begin ? std::max(r - hi, seg_begin[j0 + r] - i0) : r - hi;
  }
  int64_t query_end(int64_t r, int64_t n) const {
    return seg_begin ? std::min(r + n - 1 - lo, seg_end[j0 + r + n - 1] - i0) : r + n - 1 - lo;
  }
  // Keys visible to some query of [r, r + n): [key_begin(r), key_end(r, n)) (may be empty).
  int64_t key_begin(int64_t r) const { return seg_begin ? std::max(r + lo + 1, seg_begin[i0 + r] - j0) : r + lo + 1; }
  int64_t key_end(int64_t r, int64_t n) const {
    return seg_begin ? std::min(r + n + hi, seg_end[i0 + r + n - 1] - j0) : r + n + hi;
  }
  // What rows [r, r + n) see of the other side of the tile, clamped to [0, limit): the queries when the rows
  // are keys, the keys when they are queries; empty when the two are equal. The kernels skip what is outside.
  std::pair<int64_t, int64_t> visible(Rows rows, int64_t r, int64_t n, int64_t limit) const {
    const int64_t b = std::clamp<int64_t>(rows == Rows::kKeys ? query_begin(r) : key_begin(r), 0, limit);
    return {b, std::clamp<int64_t>(rows == Rows::kKeys ? query_end(r, n) : key_end(r, n), b, limit)};
  }
  // True when all qn x kn pairs of the tile are visible (no per-element mask needed): the band holds them
  // all, and the last query's segment starts, and the first query's ends, outside the tile's keys.
  bool all_visible(int64_t qn, int64_t kn) const {
    return lo < 1 - qn && kn - 1 <= hi && (!seg_begin || (seg_begin[i0 + qn - 1] <= j0 && seg_end[i0] >= j0 + kn));
  }
  // Writes `value` into the entries of S^T row jj (queries 0..kBlock) that key jj cannot see.
  void mask_row(float* row, int64_t jj, float value) const {
    const int64_t b = std::clamp<int64_t>(query_begin(jj), 0, kBlock);
    const int64_t e = std::clamp<int64_t>(query_end(jj, 1), b, kBlock);
    std::fill(row, row + b, value);
    std::fill(row + e, row + kBlock, value);
  }
};

// out (rows x kBlock) = a (rows x hsp) · bt (hsp x kBlock), rows being keys and columns queries: S^T = K·Q^T
// and dP^T = V·dO^T. Query vectors that no key of a row group sees are not computed; they keep stale
// values, so callers must mask every invisible entry of a tile that is not all_visible.
void tile_abt(float* out, const float* a, const float* bt, int64_t rows, int64_t hsp, const Band& band);

// out (rows x hsp) += C (rows x kcount, element (r, k) at c[r*cr + k*ck]) · x (kcount x hsp), skipping the k
// outside the band (their coefficients are 0). O += P·V and dQ += dS·K have query rows; dV += P^T·dO and
// dK += dS^T·Q have key rows.
void tile_acc(float* out, const float* c, int64_t cr, int64_t ck, const float* x, int64_t kcount, int64_t rows,
              int64_t hsp, const Band& band, Rows kind);

// Attention dropout of one head (ops.h): entry (query i, key j) is kept iff the Philox word of mask index
// ((b * NH + h) * T + i) * T + j is >= threshold (dropout_keep's rule), and kept entries are scaled.
struct Dropout {
  uint64_t seed = 0, stream = 0;
  uint32_t threshold = 0;  // dropout_threshold(p)
  float scale = 1;         // 1 / (1 - p)
};

// z (S^T layout, kBlock floats per key row): z[jj][ii] = d.scale if the tile entry (query ii, key jj), whose
// mask index is base + ii * stride + jj, is kept and 0 if dropped, for every ii < qn, jj < kn the band leaves
// visible. Other entries keep their previous values (callers start from finite ones, and zero the invisible
// part of their tiles anyway).
void dropout_tile(float* z, const Dropout& d, uint64_t base, uint64_t stride, int64_t qn, int64_t kn,
                  const Band& band);

// dst (hsp x kBlock) = scale * src^T for src (kBlock x hsp) row-major.
void transpose_block(float* dst, const float* src, int64_t hsp, float scale);

// Operand staging for the bf16 products (attention_bf16.h), bf16 values as their 16-bit patterns (with
// transpose_u32 and interleave_pairs of transpose16.h):
// dst (kBlock x kBlock bf16) = src (kBlock x kBlock f32) rounded to nearest even; rows >= valid are 0.
void tile_to_bf16(uint16_t* dst, const float* src, int64_t valid);
// dst (kBlock x kBlock bf16) = src^T rounded to nearest even; dst columns >= valid (src rows) are 0.
void tile_to_bf16_transposed(uint16_t* dst, const float* src, int64_t valid);

}  // namespace loom::cpu::attn

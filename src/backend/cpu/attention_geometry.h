// The CPU attention core's problem description and scratch (attention.cpp stages the rows and runs the tiles
// and tasks): Geometry (the grouped qkv layout, masks, dropout, document segments), 64-byte aligned scratch,
// and the software prefetch queue for head rows. None of it is on the arithmetic path (the one float
// operation, the dropout scale 1 / (1 - p), is a single rounding wherever it is compiled), so this split
// changes no result bit. make_geometry and segment_ranges are defined in attention_geometry.cpp.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "backend/cpu/attention_tiles.h"
#include "loom/backend/ops.h"

namespace loom::cpu::attn {

// 64-byte aligned scratch of n elements of E, zero-initialised.
template <typename E>
struct ScratchOf {
  struct Free {
    void operator()(E* p) const { std::free(p); }
  };
  std::unique_ptr<E[], Free> mem;
  explicit ScratchOf(int64_t n) {
    const size_t bytes = (size_t(std::max<int64_t>(n, 1)) * sizeof(E) + 63) / 64 * 64;
    mem.reset(static_cast<E*>(std::aligned_alloc(64, bytes)));
    LOOM_CHECK(mem != nullptr, "[attention] could not allocate ", bytes, " bytes of scratch");
    std::memset(mem.get(), 0, bytes);
  }
  E* get() const { return mem.get(); }
};
using Scratch = ScratchOf<float>;

// ---- problem geometry ----------------------------------------------------------------------------

struct Geometry {
  int64_t B, T, NH, NKV, G, HS, HSP;  // G = NH / NKV query heads per group; HSP = HS padded to kW
  int64_t qkv_row;                    // NKV * (G + 2) * HS: floats per (b, t) row of qkv
  int64_t out_row;                    // NH * HS
  float scale;
  bool causal;
  int64_t window;
  DType dtype;      // of qkv, out, dout, dqkv
  bool dropout;     // attention dropout on (p > 0)
  Dropout drop;
  // First mask index of the tile of head h of batch row b with queries from i0 and keys from j0; query
  // rows are T indices apart.
  uint64_t mask_base(int64_t b, int64_t h, int64_t i0, int64_t j0) const {
    return (uint64_t(b * NH + h) * uint64_t(T) + uint64_t(i0)) * uint64_t(T) + uint64_t(j0);
  }

  // Column offsets inside a qkv row (Megatron's grouped layout).
  int64_t q_col(int64_t h) const { return ((h / G) * (G + 2) + h % G) * HS; }
  int64_t k_col(int64_t g) const { return (g * (G + 2) + G) * HS; }
  int64_t v_col(int64_t g) const { return (g * (G + 2) + G + 1) * HS; }

  // Document segments of all rows, (B, T) each, or null: position t of row b sees [seg_begin, seg_end).
  const int32_t* seg_begin = nullptr;
  const int32_t* seg_end = nullptr;

  // The segments of batch row b, indexed by position (both null without segments).
  struct RowSegments {
    const int32_t* begin = nullptr;
    const int32_t* end = nullptr;
  };
  RowSegments segments(int64_t b) const {
    return seg_begin ? RowSegments{seg_begin + b * T, seg_end + b * T} : RowSegments{};
  }

  // Keys [begin, end) that can be visible to some query of [i0, i0 + n). Both ends never decrease with i0.
  int64_t key_begin(const RowSegments& sg, int64_t i0) const {
    const int64_t k = window > 0 ? std::max<int64_t>(0, i0 - window + 1) : 0;
    return sg.begin ? std::max<int64_t>(k, sg.begin[i0]) : k;
  }
  int64_t key_end(const RowSegments& sg, int64_t i0, int64_t n) const {
    const int64_t k = causal ? std::min(T, i0 + n) : T;
    return sg.end ? std::min<int64_t>(k, sg.end[i0 + n - 1]) : k;
  }
  // Visible pairs of the tile (queries from i0, keys from j0), and whether all qn x kn of them are.
  Band band(const RowSegments& sg, int64_t i0, int64_t j0) const {
    Band b;
    if (causal) b.hi = i0 - j0;
    if (window > 0) b.lo = i0 - j0 - window;
    b.seg_begin = sg.begin;
    b.seg_end = sg.end;
    b.i0 = i0;
    b.j0 = j0;
    return b;
  }
};

// The problem of a call whose arguments the OpTable entry point has checked.
Geometry make_geometry(TensorView qkv, const AttentionParams& p);

// Segment ranges from segment_ids (B, T) i32, non-decreasing along T: for each position, the first position
// of its segment and one past the last, stored as [begin (B*T) | end (B*T)]. Empty when no ids are given.
// The ids' shape and dtype were checked by the OpTable entry point; their order is checked here, where the
// CPU reads them anyway (the GPU kernels take the contract on trust rather than copy them to the host), and
// the int32 ranges are this backend's representation.
std::vector<int32_t> segment_ranges(TensorView segment_ids, const Geometry& g, const char* op);

// Row ranges to bring into cache ahead of use (rows are a stride apart, which the hardware prefetcher does
// not follow): the next block's operands, and output rows so that stores do not wait for their lines.
// The lines go out a slice at a time between tile kernels, overlapping with compute instead of stalling
// on full fill buffers.
class PrefetchQueue {
 public:
  // Rows [r0, r0 + n) of a head: elements [col, col + hs) of rows ld elements apart.
  template <typename E>
  void add(const E* base, int64_t ld, int64_t col, int64_t r0, int64_t n, int64_t hs, bool write = false) {
    if (n <= 0) return;
    LOOM_CHECK(count_ < kMaxRanges, "[attention] prefetch queue full");
    const int64_t lines = (hs * int64_t(sizeof(E)) + kLine - 1) / kLine;
    ranges_[count_++] = {reinterpret_cast<const char*>(base + r0 * ld + col), ld * int64_t(sizeof(E)), n, lines,
                         write};
    left_ += n * lines;
  }
  void plan(int64_t steps) { per_step_ = (left_ + steps - 1) / std::max<int64_t>(steps, 1); }  // spread over steps
  void step() { issue(per_step_); }
  void drain() {
    issue(left_);
    count_ = cur_ = 0;
    row_ = left_ = 0;
  }

 private:
  struct Range {
    const char* p;
    int64_t ld, rows, lines;  // ld in bytes
    bool write;
  };
  static constexpr int kMaxRanges = 8;
  static constexpr int64_t kLine = 64;  // bytes per cache line
  void issue(int64_t n) {
    while (n > 0 && cur_ < count_) {
      const Range& r = ranges_[cur_];
      const char* p = r.p + row_ * r.ld;
      for (int64_t l = 0; l < r.lines; ++l) {
        if (r.write) __builtin_prefetch(p + l * kLine, 1);
        else __builtin_prefetch(p + l * kLine, 0);
      }
      n -= r.lines;
      left_ -= r.lines;
      if (++row_ == r.rows) {
        row_ = 0;
        ++cur_;
      }
    }
  }
  Range ranges_[kMaxRanges];
  int count_ = 0, cur_ = 0;
  int64_t row_ = 0, left_ = 0, per_step_ = 0;
};

}  // namespace loom::cpu::attn

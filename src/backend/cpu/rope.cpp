// Rotary position embedding on the q and k heads of a grouped qkv tensor, in place (forward), and its transpose
// on dq and dk (backward). Each (b, t) row is rotated by the angles of its position p = position_ids[b, t] (or
// t): channel pairs (c, c + rotary_dim/2) — Hugging Face's rotate_half, Megatron's default — or (2c, 2c + 1)
// when interleaved, both with frequency index c:
//   forward   y1 = x1 cos − x2 sin,  y2 = x2 cos + x1 sin
//   backward  d1 = g1 cos + g2 sin,  d2 = g2 cos − g1 sin   (the rotation by −angle: sin → −sin, exact)
// Channels [rotary_dim, HS) of each head and the v heads are never read or written, so they keep their bits
// (in bf16/f16 too: only the rotated channels are widened and narrowed).
// In the grouped layout the G = NH/NKV query heads of a group are followed by its key head, so each group's
// rotated heads are G + 1 consecutive heads. Rows are independent: OpenMP splits the B·T rows statically and
// no element's arithmetic depends on the split. Positions are validated before anything is written.
// Mixed precision: qkv/dqkv may be f32, bf16 or f16; the cos/sin tables are f32; a bf16/f16 head's rotated
// part is widened into per-thread f32 scratch, rotated with the f32 code and narrowed once (RNE).
#include <cstdint>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/lowp.h"

namespace loom::cpu {

namespace {

constexpr int64_t kParallelMinElems = int64_t(1) << 14;  // rotated elements

struct RopeGeometry {
  int64_t B = 0, T = 0, NKV = 0, G = 0, HS = 0;
  int64_t rd = 0, half = 0;  // rotary_dim and its pairs
  int64_t row = 0;           // NKV * (G + 2) * HS: elements per (b, t) row of qkv
  bool interleaved = false;
  DType dt = DType::kF32;
  const float* cos = nullptr;  // (max_positions, half)
  const float* sin = nullptr;
  const int32_t* ids = nullptr;  // (B, T) or null: position t

  int64_t position(int64_t b, int64_t t) const { return ids ? int64_t(ids[b * T + t]) : t; }
  // First column of the h-th rotated head (0 <= h < NKV * (G + 1)) of a row: group h / (G + 1), and within
  // it query head h % (G + 1) (the key head when that is G).
  int64_t head_col(int64_t h) const { return ((h / (G + 1)) * (G + 2) + h % (G + 1)) * HS; }
};

// Shapes, dtypes and table sizes are checked by the OpTable entry point. The position id values are checked
// here because the CPU reads them from host memory anyway (the GPU kernel cannot without a copy and a sync;
// it leaves a row with an out-of-range id untouched instead), before anything is written.
RopeGeometry make_geometry(const char* op, TensorView qkv, TensorView cos, TensorView sin, const AttentionParams& p,
                           const RopeParams& r, TensorView position_ids) {
  RopeGeometry g;
  g.B = qkv.size(0);
  g.T = qkv.size(1);
  g.NKV = p.num_kv_heads;
  g.G = p.num_heads / p.num_kv_heads;
  g.HS = p.head_dim;
  g.rd = r.rotary_dim;
  g.half = r.rotary_dim / 2;
  g.row = g.NKV * (g.G + 2) * g.HS;
  g.interleaved = r.interleaved;
  g.dt = qkv.dtype();
  const int64_t max_pos = cos.size(0);
  g.cos = cos.data<float>();
  g.sin = sin.data<float>();
  if (position_ids.defined()) {
    g.ids = position_ids.data<int32_t>();
    for (int64_t i = 0; i < g.B * g.T; ++i)
      LOOM_CHECK(g.ids[i] >= 0 && g.ids[i] < max_pos, "[", op, "] position id ", g.ids[i], " at (", i / g.T, ", ",
                 i % g.T, ") is outside the ", max_pos, " positions [0, ", max_pos, ") of the cos/sin tables");
  }
  return g;
}

// Rotates the pairs of x[0, 2 * half) in place by the angles with cosines c and sines sign · s (sign = ±1,
// so the negation is exact and forward/backward share one code path).
template <bool Interleaved>
inline void rotate(float* x, const float* c, const float* s, int64_t half, float sign) {
  if constexpr (Interleaved) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[2 * i], x2 = x[2 * i + 1], sn = sign * s[i];
      x[2 * i] = x1 * c[i] - x2 * sn;
      x[2 * i + 1] = x2 * c[i] + x1 * sn;
    }
  } else {
    float* y = x + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = y[i], sn = sign * s[i];
      x[i] = x1 * c[i] - x2 * sn;
      y[i] = x2 * c[i] + x1 * sn;
    }
  }
}

template <bool Interleaved>
void apply(const RopeGeometry& g, void* data, float sign) {
  const int64_t BT = g.B * g.T, heads = g.NKV * (g.G + 1);
  const bool parallel = BT * heads * g.rd > kParallelMinElems;
  if (g.dt == DType::kF32) {
    float* x = static_cast<float*>(data);
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < BT; ++i) {
      const int64_t p = g.position(i / g.T, i % g.T);
      const float* c = g.cos + p * g.half;
      const float* s = g.sin + p * g.half;
      float* row = x + i * g.row;
      for (int64_t h = 0; h < heads; ++h) rotate<Interleaved>(row + g.head_col(h), c, s, g.half, sign);
    }
    return;
  }
  with_lowp(g.dt, [&](auto L) {
    using Lp = decltype(L);
    uint16_t* x = static_cast<uint16_t*>(data);
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < BT; ++i) {
      const int64_t p = g.position(i / g.T, i % g.T);
      const float* c = g.cos + p * g.half;
      const float* s = g.sin + p * g.half;
      uint16_t* row = x + i * g.row;
      float* buf = thread_scratch(0, size_t(g.rd));
      for (int64_t h = 0; h < heads; ++h) {
        uint16_t* head = row + g.head_col(h);
        Lp::widen(buf, head, g.rd);
        rotate<Interleaved>(buf, c, s, g.half, sign);
        Lp::narrow(head, buf, g.rd);
      }
    }
  });
}

void run(const char* op, TensorView qkv, TensorView cos, TensorView sin, const AttentionParams& p,
         const RopeParams& r, TensorView position_ids, float sign) {
  const RopeGeometry g = make_geometry(op, qkv, cos, sin, p, r, position_ids);
  if (g.interleaved) apply<true>(g, qkv.raw(), sign);
  else apply<false>(g, qkv.raw(), sign);
}

}  // namespace

void CpuOps::do_rope_forward(TensorView qkv, TensorView cos, TensorView sin, const AttentionParams& p,
                             const RopeParams& r, TensorView position_ids) const {
  run("rope_forward", qkv, cos, sin, p, r, position_ids, 1.0f);
}

void CpuOps::do_rope_backward(TensorView dqkv, TensorView cos, TensorView sin, const AttentionParams& p,
                              const RopeParams& r, TensorView position_ids) const {
  run("rope_backward", dqkv, cos, sin, p, r, position_ids, -1.0f);
}

}  // namespace loom::cpu

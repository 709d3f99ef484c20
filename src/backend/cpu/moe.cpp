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
//     rounded up to a multiple of kGroupRowQuantum, a few shapes that repeat. The row-independent products
//     (out, dinp) run in place on the extra rows too when they exist: those rows belong to later groups,
//     which are computed afterwards and overwrite them; otherwise (the end of the buffer) and for dweight
//     (a reduction over the rows) the group's rows are copied into per-thread scratch followed by zero
//     rows. (Cutting a group into a head of whole multiples and a small tail instead costs as much as the
//     pad: a tail product re-reads and re-packs the whole expert weight for a few rows.) The rounding
//     depends on the group size only: the same bits for every thread count.
#include <algorithm>
#include <cstring>
#include <vector>

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

// out (N, C) row n = Σ over its experts e (row_id_map[n, e] = r >= 0) of w · inp row r, w = probs[n, e] or 1
// (probs null): the permutation's adjoint and the weighted combine share it. f32 accumulation per row.
void combine_rows(const char* op, TensorView out, TensorView inp, const float* probs, TensorView row_id_map) {
  const int64_t N = row_id_map.size(0), E = row_id_map.size(1), C = out.size(1), M = inp.size(0);
  check_row_id_map(op, row_id_map, M);
  const int32_t* map = row_id_map.data<int32_t>();
  const DType dt = out.dtype();
#pragma omp parallel for schedule(static) if (N >= kParallelMinRows)
  for (int64_t n = 0; n < N; ++n) {
    float* acc = thread_scratch(0, size_t(C));
    float* row = thread_scratch(1, size_t(C));
    std::fill(acc, acc + C, 0.0f);
    for (int64_t e = 0; e < E; ++e) {
      const int32_t r = map[n * E + e];
      if (r < 0) continue;
      const float w = probs ? probs[n * E + e] : 1.0f;
      widen(row, elem_ptr(inp.raw(), dt, int64_t(r) * C), dt, C);
      for (int64_t c = 0; c < C; ++c) acc[c] += w * row[c];
    }
    narrow(elem_ptr(out.raw(), dt, n * C), dt, acc, C);
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
    float* dy = thread_scratch(0, size_t(C));
    float* row = thread_scratch(1, size_t(C));
    widen(dy, elem_ptr(dout.raw(), dt, n * C), dt, C);
    for (int64_t e = 0; e < E; ++e) {
      const int32_t r = map[n * E + e];
      if (r < 0) {
        if (dp) dp[n * E + e] = 0.0f;
        continue;
      }
      if (dp) {
        widen(row, elem_ptr(inp.raw(), dt, int64_t(r) * C), dt, C);
        double dot = 0;
        for (int64_t c = 0; c < C; ++c) dot += double(dy[c]) * double(row[c]);
        dp[n * E + e] = float(dot);
      }
      const float w = p[n * E + e];
      for (int64_t c = 0; c < C; ++c) row[c] = w * dy[c];
      narrow(elem_ptr(dinp.raw(), dt, int64_t(r) * C), dt, row, C);
    }
  }
}

namespace {

constexpr int64_t kGroupRowQuantum = 16;  // see the header

int64_t padded_rows(int64_t m) { return (m + kGroupRowQuantum - 1) / kGroupRowQuantum * kGroupRowQuantum; }

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

}  // namespace

void CpuOps::do_grouped_matmul_forward(TensorView out, TensorView inp, TensorView weight,
                                       const std::vector<int64_t>& group_sizes) const {
  const int64_t N = weight.size(1), K = weight.size(2);
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
                                        TensorView weight, const std::vector<int64_t>& group_sizes) const {
  const int64_t N = weight.size(1), K = weight.size(2);
  const bool pad = matmul_caches_shapes(dout.dtype());
  int64_t o = 0;
  for (size_t g = 0; g < group_sizes.size(); ++g) {
    const int64_t m = group_sizes[g];
    const TensorView w = weight.slice_flat(int64_t(g) * N * K, {N, K});
    const TensorView dw = dweight ? dweight.slice_flat(int64_t(g) * N * K, {N, K}) : TensorView();
    if (m > 0 && (!pad || padded_rows(m) == m)) {  // one product for both, in place
      do_matmul_backward(dinp ? dinp.slice_flat(o * K, {m, K}) : TensorView(), dw, TensorView(),
                         dout.slice_flat(o * N, {m, N}), inp.slice_flat(o * K, {m, K}), w);
    } else if (m > 0) {
      if (dinp)
        group_rows_product(dinp, dout, o, m, pad, [&](TensorView dx, TensorView dy) {
          do_matmul_backward(dx, TensorView(), TensorView(), dy, TensorView(), w);
        });
      if (dw) {
        const int64_t p = padded_rows(m);
        do_matmul_backward(TensorView(), dw, TensorView(), zero_padded_rows(2, dout, o, m, p),
                           zero_padded_rows(3, inp, o, m, p), w);
      }
    }
    o += m;
  }
}

}  // namespace loom::cpu

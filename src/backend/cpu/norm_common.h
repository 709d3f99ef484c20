// Pieces shared by the LayerNorm (norm.cpp) and RMSNorm (rmsnorm.cpp) CPU ops: parameter widening for the
// mixed-precision scheme (activations and parameters in one compute dtype, f32 statistics, parameter
// gradients in f32 or the compute dtype; the OpTable entry points check those rules) and the fixed-split
// parameter-gradient reduction.
// Reduction invariant: rows go in blocks of kReduceBlockRows; each block writes f32 partials (rows in order)
// to scratch, then each channel adds its block partials in block order in f64 and rounds once into the
// gradient. No sum's order depends on the thread count, so neither does any bit of the result.
#pragma once
#include <algorithm>
#include <array>
#include <vector>

#include "backend/cpu/lowp.h"
#include "backend/cpu/cpu_ops.h"

namespace loom::cpu::norm_common {

constexpr int64_t kParallelMinElems = int64_t(1) << 14;

// Optional per-row statistics buffer (f32, N elements, checked by the OpTable entry point): its data or null.
inline float* stats_ptr(const TensorView& t) { return t.defined() ? t.data<float>() : nullptr; }

// Parameter vector (C) as f32: the tensor's own data when f32, else widened into `buf`; null when absent.
inline const float* params_f32(const TensorView& t, std::vector<float>& buf) {
  if (!t.defined()) return nullptr;
  if (t.dtype() == DType::kF32) return t.data<float>();
  buf.resize(size_t(t.numel()));
  widen(buf.data(), t.raw(), t.dtype(), t.numel());
  return buf.data();
}

// Scratch for the block partials, kept across calls so the steady state makes no allocation.
inline float* partial_scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

inline int64_t num_blocks(int64_t N) { return (N + kReduceBlockRows - 1) / kReduceBlockRows; }

// Runs row(r, partial) for every row r < N, in row order within each block of kReduceBlockRows rows, blocks
// split across threads. partial points at the block's `width` zeroed floats of `partials` (nblocks x width),
// or is null when partials is.
template <typename Row>
void for_row_blocks(int64_t N, int64_t C, float* partials, int64_t width, Row&& row) {
  const int64_t nblocks = num_blocks(N);
#pragma omp parallel for schedule(static) if (N * C > kParallelMinElems)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    float* p = partials ? partials + blk * width : nullptr;
    if (p) std::fill(p, p + width, 0.0f);
    const int64_t r1 = std::min(N, (blk + 1) * kReduceBlockRows);
    for (int64_t r = blk * kReduceBlockRows; r < r1; ++r) row(r, p);
  }
}

// A parameter gradient (C) to accumulate into: f32 or bf16/f16 data, or absent (null data).
struct GradOut {
  void* data = nullptr;
  DType dtype = DType::kF32;
};
inline GradOut grad_out(const TensorView& t) { return t.defined() ? GradOut{t.raw(), t.dtype()} : GradOut{}; }

// grads[k][c] += Σ_blocks partials[blk][k * C + c] (f64 in block order, then old value + total rounded once),
// for the K gradients laid out side by side in each block's partial (nblocks x K x C).
template <size_t K>
void add_block_partials(const float* partials, int64_t nblocks, int64_t C, const std::array<GradOut, K>& grads) {
  constexpr int64_t kChunk = 64;  // channels per task, contiguous in every block's partial
  const int64_t nchunks = (C + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (nblocks * C > kParallelMinElems)
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const int64_t c0 = ch * kChunk, width = std::min(kChunk, C - c0);
    double sum[K][kChunk] = {};
    for (int64_t blk = 0; blk < nblocks; ++blk)
      for (size_t k = 0; k < K; ++k) {
        const float* p = partials + (blk * int64_t(K) + int64_t(k)) * C + c0;
        for (int64_t c = 0; c < width; ++c) sum[k][c] += double(p[c]);
      }
    for (size_t k = 0; k < K; ++k) {
      const GradOut& g = grads[k];
      if (!g.data) continue;
      if (g.dtype == DType::kF32) {
        float* p = static_cast<float*>(g.data) + c0;
        for (int64_t c = 0; c < width; ++c) p[c] = float(double(p[c]) + sum[k][c]);
      } else {
        uint16_t* p = static_cast<uint16_t*>(g.data) + c0;
        with_lowp(g.dtype, [&](auto L) {
          using Lp = decltype(L);
          for (int64_t c = 0; c < width; ++c) p[c] = Lp::enc(float(double(Lp::dec(p[c])) + sum[k][c]));
        });
      }
    }
  }
}

}  // namespace loom::cpu::norm_common

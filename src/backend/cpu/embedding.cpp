// Token + position embedding lookup and its gradient.
// Positions are t, or position_ids[b, t] when given (Megatron's --reset-position-ids restarts them at
// each document, so several tokens of a batch row may share a wpe row).
// Forward is a row gather, parallel over tokens. Backward scatters rows of dout into dwte (and into dwpe
// when position_ids are given); several tokens can hit the same row, so threads split the CHANNELS (chunks
// of kChunk) and each walks the tokens in (b, t) order: every element receives its additions in token order
// whatever the thread count. Without position_ids, dwpe[t] sums over b in order, parallel over t: the same
// order, hence the same bits, as position_ids = t. Token and position ids are validated before any
// parallel region (an exception cannot cross an OpenMP region) and before anything is written.
// Mixed precision: wte, wpe, out and dout share one compute dtype (f32, bf16 or f16); dwte/dwpe are f32 or
// that dtype. Sums are f32 in the same order as the f32 op and rounded once: out = RNE(te + pe); a bf16/f16
// gradient row is widened into an f32 accumulator (one per distinct row hit), receives its additions in
// token order and is narrowed once, so it equals the f32 op on the widened gradient, rounded.
#include <algorithm>

#include <cstring>
#include <unordered_map>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/lowp.h"

namespace loom::cpu {

namespace {

constexpr int64_t kChunk = 64;  // channels per backward task: 256 bytes of each row
constexpr int64_t kParallelMinElems = int64_t(1) << 14;

struct EmbShape {
  int64_t B = 0, T = 0, C = 0, V = 0;
};

// Shapes are checked by the OpTable entry point; the id values are checked here because the CPU reads them
// from host memory anyway (a GPU cannot without a copy and a sync: its kernels flag bad ids instead). Every
// token id must be in [0, V), and every position id, when given with a position table, in [0, maxpos) —
// checked before any parallel region (an exception cannot leave one) and before anything is written.
EmbShape check_ids(const char* op, TensorView tokens, TensorView table, TensorView pos, const char* pos_name,
                   TensorView position_ids) {
  EmbShape s;
  s.V = table.size(0);
  s.C = table.size(1);
  s.T = tokens.shape().cols();
  s.B = s.T == 0 ? 0 : tokens.numel() / s.T;
  const int32_t* tok = tokens.data<int32_t>();
  for (int64_t i = 0; i < s.B * s.T; ++i)
    LOOM_CHECK(tok[i] >= 0 && tok[i] < s.V, "[", op, "] token id ", tok[i], " at (", i / s.T, ", ", i % s.T,
               ") is outside the vocabulary [0, ", s.V, ")");
  if (pos.defined() && position_ids.defined()) {
    const int32_t* ids = position_ids.data<int32_t>();
    const int64_t maxpos = pos.size(0);
    for (int64_t i = 0; i < s.B * s.T; ++i)
      LOOM_CHECK(ids[i] >= 0 && ids[i] < maxpos, "[", op, "] position id ", ids[i], " at (", i / s.T, ", ",
                 i % s.T, ") is outside the ", maxpos, " positions [0, ", maxpos, ") of ", pos_name);
  }
  return s;
}

// grad (V, C) [rows ids[i]] += dout (BT, C) [row i] for i in order, per element; threads split channel
// chunks. grad is f32 or the compute dtype dt of dout.
void scatter_add_rows(void* grad, DType gdt, const int32_t* ids, const void* dout, DType dt, int64_t BT, int64_t C) {
  const int64_t nchunks = (C + kChunk - 1) / kChunk;
  if (gdt == DType::kF32 && dt == DType::kF32) {
    float* g = static_cast<float*>(grad);
    const float* dy = static_cast<const float*>(dout);
#pragma omp parallel for schedule(static) if (BT * C > kParallelMinElems)
    for (int64_t ch = 0; ch < nchunks; ++ch) {
      const int64_t c0 = ch * kChunk, width = std::min(kChunk, C - c0);
      for (int64_t i = 0; i < BT; ++i) {
        float* drow = g + int64_t(ids[i]) * C + c0;
        const float* yrow = dy + i * C + c0;
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) drow[c] += yrow[c];
      }
    }
    return;
  }
  with_lowp(dt, [&](auto L) {
    using Lp = decltype(L);
    const uint16_t* dy = static_cast<const uint16_t*>(dout);
    if (gdt == DType::kF32) {
      float* g = static_cast<float*>(grad);
#pragma omp parallel for schedule(static) if (BT * C > kParallelMinElems)
      for (int64_t ch = 0; ch < nchunks; ++ch) {
        const int64_t c0 = ch * kChunk, width = std::min(kChunk, C - c0);
        float yrow[kChunk];
        for (int64_t i = 0; i < BT; ++i) {
          float* drow = g + int64_t(ids[i]) * C + c0;
          Lp::widen(yrow, dy + i * C + c0, width);
#pragma omp simd
          for (int64_t c = 0; c < width; ++c) drow[c] += yrow[c];
        }
      }
      return;
    }
    // Low-precision gradient: one f32 accumulator row per distinct id, in first-hit order.
    std::vector<int32_t> slot(static_cast<size_t>(BT));
    std::vector<int32_t> rows;
    {
      std::unordered_map<int32_t, int32_t> seen;
      seen.reserve(size_t(BT) * 2);
      for (int64_t i = 0; i < BT; ++i) {
        auto [it, fresh] = seen.emplace(ids[i], int32_t(rows.size()));
        if (fresh) rows.push_back(ids[i]);
        slot[size_t(i)] = it->second;
      }
    }
    const int64_t U = int64_t(rows.size());
    float* acc = thread_scratch(3, size_t(U * C));  // (U, C), reused across calls
    uint16_t* g = static_cast<uint16_t*>(grad);
#pragma omp parallel for schedule(static) if (BT * C > kParallelMinElems)
    for (int64_t ch = 0; ch < nchunks; ++ch) {
      const int64_t c0 = ch * kChunk, width = std::min(kChunk, C - c0);
      float yrow[kChunk];
      for (int64_t u = 0; u < U; ++u) Lp::widen(acc + u * C + c0, g + int64_t(rows[size_t(u)]) * C + c0, width);
      for (int64_t i = 0; i < BT; ++i) {
        float* arow = acc + int64_t(slot[size_t(i)]) * C + c0;
        Lp::widen(yrow, dy + i * C + c0, width);
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) arow[c] += yrow[c];
      }
      for (int64_t u = 0; u < U; ++u) Lp::narrow(g + int64_t(rows[size_t(u)]) * C + c0, acc + u * C + c0, width);
    }
  });
}

}  // namespace

void CpuOps::do_embedding_forward(TensorView out, TensorView tokens, TensorView wte, TensorView wpe,
                                  TensorView position_ids) const {
  const EmbShape s = check_ids("embedding_forward", tokens, wte, wpe, "wpe", position_ids);
  const int32_t* pid = position_ids.defined() ? position_ids.data<int32_t>() : nullptr;
  const DType dt = wte.dtype();
  const int32_t* tok = tokens.data<int32_t>();
  const int64_t BT = s.B * s.T, C = s.C;
  if (dt == DType::kF32) {
    const float* te = wte.data<float>();
    const float* pe = wpe.defined() ? wpe.data<float>() : nullptr;
    float* o = out.data<float>();
#pragma omp parallel for schedule(static) if (BT * C > kParallelMinElems)
    for (int64_t i = 0; i < BT; ++i) {
      float* orow = o + i * C;
      const float* trow = te + int64_t(tok[i]) * C;
      if (pe) {
        const float* prow = pe + (pid ? int64_t(pid[i]) : i % s.T) * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) orow[c] = trow[c] + prow[c];
      } else {
        std::copy(trow, trow + C, orow);
      }
    }
    return;
  }
  with_lowp(dt, [&](auto L) {
    using Lp = decltype(L);
    const uint16_t* te = static_cast<const uint16_t*>(wte.raw());
    const uint16_t* pe = wpe.defined() ? static_cast<const uint16_t*>(wpe.raw()) : nullptr;
    uint16_t* o = static_cast<uint16_t*>(out.raw());
#pragma omp parallel for schedule(static) if (BT * C > kParallelMinElems)
    for (int64_t i = 0; i < BT; ++i) {
      uint16_t* orow = o + i * C;
      const uint16_t* trow = te + int64_t(tok[i]) * C;
      if (pe) {
        const uint16_t* prow = pe + (pid ? int64_t(pid[i]) : i % s.T) * C;
        float* tf = thread_scratch(0, size_t(C));
        float* pf = thread_scratch(1, size_t(C));
        Lp::widen(tf, trow, C);
        Lp::widen(pf, prow, C);
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) tf[c] += pf[c];
        Lp::narrow(orow, tf, C);
      } else {
        std::copy(trow, trow + C, orow);
      }
    }
  });
}

void CpuOps::do_embedding_backward(TensorView dwte, TensorView dwpe, TensorView dout, TensorView tokens,
                                   TensorView position_ids) const {
  const EmbShape s = check_ids("embedding_backward", tokens, dwte, dwpe, "dwpe", position_ids);
  const int32_t* pid = position_ids.defined() ? position_ids.data<int32_t>() : nullptr;
  const DType dt = dout.dtype();
  const int32_t* tok = tokens.data<int32_t>();
  const int64_t BT = s.B * s.T, C = s.C;
  scatter_add_rows(dwte.raw(), dwte.dtype(), tok, dout.raw(), dt, BT, C);
  if (!dwpe.defined()) return;
  if (pid) {  // positions repeat: the same channel split as dwte
    scatter_add_rows(dwpe.raw(), dwpe.dtype(), pid, dout.raw(), dt, BT, C);
    return;
  }
  if (dt != DType::kF32 || dwpe.dtype() != DType::kF32) {
    // Positions t = i mod T: the scatter visits each row's batch entries in b order, as below.
    std::vector<int32_t> ids(static_cast<size_t>(BT));
    for (int64_t i = 0; i < BT; ++i) ids[size_t(i)] = int32_t(i % s.T);
    scatter_add_rows(dwpe.raw(), dwpe.dtype(), ids.data(), dout.raw(), dt, BT, C);
    return;
  }
  // Position t is hit once per batch row: whole rows, parallel over t, b in order.
  float* dpe = dwpe.data<float>();
  const float* dy = dout.data<float>();
#pragma omp parallel for schedule(static) if (BT * C > kParallelMinElems)
  for (int64_t t = 0; t < s.T; ++t) {
    float* prow = dpe + t * C;
    for (int64_t b = 0; b < s.B; ++b) {
      const float* yrow = dy + (b * s.T + t) * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) prow[c] += yrow[c];
    }
  }
}

}  // namespace loom::cpu

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

// A host f32, bf16 or f16 tensor (the dtype rules between tensors are checked by the ops).
void expect_float(const TensorView& t, const char* op, const char* name) {
  LOOM_CHECK(t.defined(), "[", op, "] ", name, " is required");
  LOOM_CHECK(is_compute_dtype(t.dtype()) && t.device().is_cpu(), "[", op, "] expected a host f32, bf16 or f16 ",
             name, ", got ", t.desc());
}

struct EmbShape {
  int64_t B = 0, T = 0, C = 0, V = 0;
};

// tokens (B, T) or (T); table (V, C) with V from the table; checks every id is in [0, V).
EmbShape check_tokens(const char* op, TensorView tokens, TensorView table, const char* table_name, TensorView act,
                      const char* act_name) {
  LOOM_CHECK(tokens.defined() && tokens.dtype() == DType::kI32 && tokens.device().is_cpu(), "[", op,
             "] expected host i32 tokens, got ", tokens.desc());
  expect_float(table, op, table_name);
  expect_float(act, op, act_name);
  LOOM_CHECK(table.ndim() == 2, "[", op, "] expected ", table_name, " (V, C), got ", table.desc());
  EmbShape s;
  s.V = table.size(0);
  s.C = table.size(1);
  s.T = tokens.shape().cols();
  s.B = s.T == 0 ? 0 : tokens.numel() / s.T;
  LOOM_CHECK(act.numel() == s.B * s.T * s.C, "[", op, "] expected ", act_name, " (", s.B, ", ", s.T, ", ", s.C,
             "), got ", act.desc());
  const int32_t* tok = tokens.data<int32_t>();
  for (int64_t i = 0; i < s.B * s.T; ++i)
    LOOM_CHECK(tok[i] >= 0 && tok[i] < s.V, "[", op, "] token id ", tok[i], " at (", i / s.T, ", ", i % s.T,
               ") is outside the vocabulary [0, ", s.V, ")");
  return s;
}

// The position table (maxpos, C), when given, and the position ids, when given: same shape as tokens, each id
// in [0, maxpos). Without ids the positions are 0..T-1, so T must fit the table. Returns the ids or nullptr.
const int32_t* check_positions(const char* op, TensorView pos, const char* name, TensorView position_ids,
                               TensorView tokens, const EmbShape& s) {
  const int32_t* ids = nullptr;
  if (position_ids.defined()) {
    LOOM_CHECK(position_ids.dtype() == DType::kI32 && position_ids.device().is_cpu() &&
                   position_ids.shape() == tokens.shape(),
               "[", op, "] expected host i32 position_ids shaped like tokens ", tokens.shape().str(), ", got ",
               position_ids.desc());
    ids = position_ids.data<int32_t>();
  }
  if (!pos.defined()) return ids;  // no position table (e.g. RoPE models): the ids are not used here
  expect_float(pos, op, name);
  LOOM_CHECK(pos.ndim() == 2 && pos.size(1) == s.C, "[", op, "] expected ", name, " (maxpos, ", s.C, "), got ",
             pos.desc());
  const int64_t maxpos = pos.size(0);
  if (ids == nullptr) {
    LOOM_CHECK(maxpos >= s.T, "[", op, "] sequence length ", s.T, " exceeds the ", maxpos, " positions of ", name);
  } else {
    for (int64_t i = 0; i < s.B * s.T; ++i)
      LOOM_CHECK(ids[i] >= 0 && ids[i] < maxpos, "[", op, "] position id ", ids[i], " at (", i / s.T, ", ",
                 i % s.T, ") is outside the ", maxpos, " positions [0, ", maxpos, ") of ", name);
  }
  return ids;
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

// The compute dtype of an embedding call and the check that the other tensors follow the rules.
void check_dtypes(const char* op, DType dt, std::initializer_list<std::pair<const char*, const TensorView*>> same,
                  std::initializer_list<std::pair<const char*, const TensorView*>> grads) {
  for (const auto& [name, t] : same)
    LOOM_CHECK(!t->defined() || t->dtype() == dt, "[", op, "] ", name, " must have the compute dtype ", dtype_name(dt),
               ", got ", t->desc());
  for (const auto& [name, t] : grads)
    LOOM_CHECK(!t->defined() || t->dtype() == dt || t->dtype() == DType::kF32, "[", op, "] ", name,
               " must be f32 or the compute dtype ", dtype_name(dt), ", got ", t->desc());
}

}  // namespace

void CpuOps::embedding_forward(TensorView out, TensorView tokens, TensorView wte, TensorView wpe,
                               TensorView position_ids) const {
  const char* op = "embedding_forward";
  const EmbShape s = check_tokens(op, tokens, wte, "wte", out, "out");
  const int32_t* pid = check_positions(op, wpe, "wpe", position_ids, tokens, s);
  const DType dt = wte.dtype();
  check_dtypes(op, dt, {{"out", &out}, {"wpe", &wpe}}, {});
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

void CpuOps::embedding_backward(TensorView dwte, TensorView dwpe, TensorView dout, TensorView tokens,
                                TensorView position_ids) const {
  const char* op = "embedding_backward";
  const EmbShape s = check_tokens(op, tokens, dwte, "dwte", dout, "dout");
  const int32_t* pid = check_positions(op, dwpe, "dwpe", position_ids, tokens, s);
  const DType dt = dout.dtype();
  check_dtypes(op, dt, {}, {{"dwte", &dwte}, {"dwpe", &dwpe}});
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

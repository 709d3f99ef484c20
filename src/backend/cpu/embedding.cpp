// Token + position embedding lookup and its gradient.
// Positions are t, or position_ids[b, t] when given (Megatron's --reset-position-ids restarts them at
// each document, so several tokens of a batch row may share a wpe row).
// Forward is a row gather, parallel over tokens. Backward scatters rows of dout into dwte (and into dwpe
// when position_ids are given); several tokens can hit the same row, so threads split the CHANNELS (chunks
// of kChunk) and each walks the tokens in (b, t) order: every element receives its additions in token order
// whatever the thread count. Without position_ids, dwpe[t] sums over b in order, parallel over t: the same
// order, hence the same bits, as position_ids = t. Token and position ids are validated before any
// parallel region (an exception cannot cross an OpenMP region) and before anything is written.
#include <algorithm>

#include "backend/cpu/cpu_ops.h"

namespace loom::cpu {

namespace {

constexpr int64_t kChunk = 64;  // channels per backward task: 256 bytes of each row
constexpr int64_t kParallelMinElems = int64_t(1) << 14;

void expect_f32(const TensorView& t, const char* op, const char* name) {
  LOOM_CHECK(t.defined(), "[", op, "] ", name, " is required");
  LOOM_CHECK(t.dtype() == DType::kF32 && t.device().is_cpu(), "[", op, "] expected host f32 ", name, ", got ",
             t.desc());
}

struct EmbShape {
  int64_t B = 0, T = 0, C = 0, V = 0;
};

// tokens (B, T) or (T); table (V, C) with V from the table; checks every id is in [0, V).
EmbShape check_tokens(const char* op, TensorView tokens, TensorView table, const char* table_name, TensorView act,
                      const char* act_name) {
  LOOM_CHECK(tokens.defined() && tokens.dtype() == DType::kI32 && tokens.device().is_cpu(), "[", op,
             "] expected host i32 tokens, got ", tokens.desc());
  expect_f32(table, op, table_name);
  expect_f32(act, op, act_name);
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
  expect_f32(pos, op, name);
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

}  // namespace

void CpuOps::embedding_forward(TensorView out, TensorView tokens, TensorView wte, TensorView wpe,
                               TensorView position_ids) const {
  const EmbShape s = check_tokens("embedding_forward", tokens, wte, "wte", out, "out");
  const int32_t* pid = check_positions("embedding_forward", wpe, "wpe", position_ids, tokens, s);
  const int32_t* tok = tokens.data<int32_t>();
  const float* te = wte.data<float>();
  const float* pe = wpe.defined() ? wpe.data<float>() : nullptr;
  float* o = out.data<float>();
  const int64_t BT = s.B * s.T, C = s.C;
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
}

void CpuOps::embedding_backward(TensorView dwte, TensorView dwpe, TensorView dout, TensorView tokens,
                                TensorView position_ids) const {
  const EmbShape s = check_tokens("embedding_backward", tokens, dwte, "dwte", dout, "dout");
  const int32_t* pid = check_positions("embedding_backward", dwpe, "dwpe", position_ids, tokens, s);
  const int32_t* tok = tokens.data<int32_t>();
  const float* dy = dout.data<float>();
  const int64_t BT = s.B * s.T, C = s.C;
  float* dte = dwte.data<float>();
  float* dpe = dwpe.defined() ? dwpe.data<float>() : nullptr;
  const int64_t nchunks = (C + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (BT * C > kParallelMinElems)
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const int64_t c0 = ch * kChunk, width = std::min(kChunk, C - c0);
    for (int64_t i = 0; i < BT; ++i) {
      float* drow = dte + int64_t(tok[i]) * C + c0;
      const float* yrow = dy + i * C + c0;
#pragma omp simd
      for (int64_t c = 0; c < width; ++c) drow[c] += yrow[c];
    }
  }
  if (!dpe) return;
  if (pid) {  // positions repeat: the same channel split as dwte
#pragma omp parallel for schedule(static) if (BT * C > kParallelMinElems)
    for (int64_t ch = 0; ch < nchunks; ++ch) {
      const int64_t c0 = ch * kChunk, width = std::min(kChunk, C - c0);
      for (int64_t i = 0; i < BT; ++i) {
        float* prow = dpe + int64_t(pid[i]) * C + c0;
        const float* yrow = dy + i * C + c0;
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) prow[c] += yrow[c];
      }
    }
    return;
  }
  // Position t is hit once per batch row: whole rows, parallel over t, b in order.
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

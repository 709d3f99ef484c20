// Token + position embedding lookup and its gradient.
// Forward is a row gather, parallel over tokens. Backward scatters rows of dout into dwte; several tokens
// can hit the same vocabulary row, so threads split the CHANNELS (chunks of kChunk) and each walks the
// tokens in (b, t) order: every dwte element receives its additions in token order whatever the thread
// count. dwpe[t] sums over b in order, parallel over t. Token ids are validated before any parallel
// region (an exception cannot cross an OpenMP region).
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

void check_positions(const char* op, TensorView pos, const char* name, const EmbShape& s) {
  expect_f32(pos, op, name);
  LOOM_CHECK(pos.ndim() == 2 && pos.size(1) == s.C, "[", op, "] expected ", name, " (maxpos, ", s.C, "), got ",
             pos.desc());
  LOOM_CHECK(pos.size(0) >= s.T, "[", op, "] sequence length ", s.T, " exceeds the ", pos.size(0), " positions of ",
             name);
}

}  // namespace

void CpuOps::embedding_forward(TensorView out, TensorView tokens, TensorView wte, TensorView wpe) const {
  const EmbShape s = check_tokens("embedding_forward", tokens, wte, "wte", out, "out");
  if (wpe.defined()) check_positions("embedding_forward", wpe, "wpe", s);
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
      const float* prow = pe + (i % s.T) * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) orow[c] = trow[c] + prow[c];
    } else {
      std::copy(trow, trow + C, orow);
    }
  }
}

void CpuOps::embedding_backward(TensorView dwte, TensorView dwpe, TensorView dout, TensorView tokens) const {
  const EmbShape s = check_tokens("embedding_backward", tokens, dwte, "dwte", dout, "dout");
  if (dwpe.defined()) check_positions("embedding_backward", dwpe, "dwpe", s);
  const int32_t* tok = tokens.data<int32_t>();
  const float* dy = dout.data<float>();
  const int64_t BT = s.B * s.T, C = s.C;
  float* dte = dwte.data<float>();
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
  if (!dwpe.defined()) return;
  float* dpe = dwpe.data<float>();
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

// LayerNorm over the last dim (forward, backward, and the fused residual-add + LayerNorm forward).
// Rows are independent and split statically across threads; per-row statistics use lane_sum, whose
// order depends on C only, so a recomputed forward reproduces mean/rstd/out bit for bit and the fused
// residual_layernorm_forward equals residual_forward followed by layernorm_forward exactly.
// Backward: dinp ACCUMULATES (it is the residual stream's gradient); dweight/dbias accumulate through a
// fixed split: per block of kReduceBlockRows rows an f32 partial (rows in order) is written to scratch,
// then each channel adds its block partials in block order in f64. Thread count never changes a bit.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/fast_math.h"

namespace loom::cpu {

namespace {

constexpr int64_t kParallelMinElems = int64_t(1) << 14;

void expect_f32(const TensorView& t, const char* op, const char* name) {
  LOOM_CHECK(t.defined(), "[", op, "] ", name, " is required");
  LOOM_CHECK(t.dtype() == DType::kF32 && t.device().is_cpu(), "[", op, "] expected host f32 ", name, ", got ",
             t.desc());
}

void expect_numel(const TensorView& t, int64_t n, const char* op, const char* name) {
  LOOM_CHECK(t.numel() == n, "[", op, "] expected ", name, " with ", n, " elements, got ", t.desc());
}

// Optional statistics buffer: absent, or host f32 with one value per row.
float* stats_ptr(const TensorView& t, int64_t N, const char* op, const char* name) {
  if (!t.defined()) return nullptr;
  expect_f32(t, op, name);
  expect_numel(t, N, op, name);
  return t.data<float>();
}

// One row of LayerNorm: two passes over x (mean, then centred variance) and one writing out.
inline void layernorm_row(float* out, const float* x, const float* w, const float* b, int64_t C, float eps,
                          float* mean_out, float* rstd_out) {
  const float inv_c = 1.0f / float(C);
  const float m = lane_sum<float>(C, [&](int64_t i) { return x[i]; }) * inv_c;
  auto squared_deviation = [&](int64_t i) {
    const float d = x[i] - m;
    return d * d;
  };
  const float var = lane_sum<float>(C, squared_deviation) * inv_c;
  const float s = 1.0f / std::sqrt(var + eps);
  if (b) {
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) out[c] = (x[c] - m) * s * w[c] + b[c];
  } else {
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) out[c] = (x[c] - m) * s * w[c];
  }
  if (mean_out) *mean_out = m;
  if (rstd_out) *rstd_out = s;
}

struct LnArgs {
  int64_t N = 0, C = 0;
  const float* weight = nullptr;
  const float* bias = nullptr;  // optional
  float* mean = nullptr;        // optional
  float* rstd = nullptr;        // optional
};

LnArgs check_forward(const char* op, TensorView out, TensorView mean, TensorView rstd, TensorView inp,
                     TensorView weight, TensorView bias) {
  expect_f32(out, op, "out");
  expect_f32(inp, op, "inp");
  expect_f32(weight, op, "weight");
  LnArgs a;
  a.C = inp.shape().cols();
  LOOM_CHECK(a.C > 0, "[", op, "] empty last dim in ", inp.desc());
  a.N = inp.numel() / a.C;
  expect_numel(out, inp.numel(), op, "out");
  expect_numel(weight, a.C, op, "weight");
  a.weight = weight.data<float>();
  if (bias.defined()) {
    expect_f32(bias, op, "bias");
    expect_numel(bias, a.C, op, "bias");
    a.bias = bias.data<float>();
  }
  a.mean = stats_ptr(mean, a.N, op, "mean");
  a.rstd = stats_ptr(rstd, a.N, op, "rstd");
  return a;
}

// Scratch for the block partials of layernorm_backward, kept across calls so the steady state makes no
// page faults (the buffer is O(N/64 * C), about 1.5 MB for GPT-2 124M with 8k rows).
std::vector<float>& partial_scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf;
}

}  // namespace

void CpuOps::layernorm_forward(TensorView out, TensorView mean, TensorView rstd, TensorView inp, TensorView weight,
                               TensorView bias, float eps) const {
  const LnArgs a = check_forward("layernorm_forward", out, mean, rstd, inp, weight, bias);
  float* o = out.data<float>();
  const float* x = inp.data<float>();
#pragma omp parallel for schedule(static) if (a.N * a.C > kParallelMinElems)
  for (int64_t r = 0; r < a.N; ++r)
    layernorm_row(o + r * a.C, x + r * a.C, a.weight, a.bias, a.C, eps, a.mean ? a.mean + r : nullptr,
                  a.rstd ? a.rstd + r : nullptr);
}

void CpuOps::residual_layernorm_forward(TensorView residual, TensorView out, TensorView mean, TensorView rstd,
                                        TensorView a_in, TensorView b_in, TensorView weight, TensorView bias,
                                        float eps) const {
  const char* op = "residual_layernorm_forward";
  const LnArgs a = check_forward(op, out, mean, rstd, residual, weight, bias);
  expect_f32(a_in, op, "a");
  expect_f32(b_in, op, "b");
  expect_numel(a_in, a.N * a.C, op, "a");
  expect_numel(b_in, a.N * a.C, op, "b");
  float* res = residual.data<float>();
  float* o = out.data<float>();
  const float* pa = a_in.data<float>();
  const float* pb = b_in.data<float>();
#pragma omp parallel for schedule(static) if (a.N * a.C > kParallelMinElems)
  for (int64_t r = 0; r < a.N; ++r) {
    float* rr = res + r * a.C;
    const float* ra = pa + r * a.C;
    const float* rb = pb + r * a.C;
#pragma omp simd
    for (int64_t c = 0; c < a.C; ++c) rr[c] = ra[c] + rb[c];
    // The row was just written: the statistics passes read it from L1, not memory.
    layernorm_row(o + r * a.C, rr, a.weight, a.bias, a.C, eps, a.mean ? a.mean + r : nullptr,
                  a.rstd ? a.rstd + r : nullptr);
  }
}

void CpuOps::layernorm_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout, TensorView inp,
                                TensorView weight, TensorView mean, TensorView rstd) const {
  const char* op = "layernorm_backward";
  expect_f32(dout, op, "dout");
  expect_f32(inp, op, "inp");
  expect_f32(weight, op, "weight");
  const int64_t C = inp.shape().cols();
  LOOM_CHECK(C > 0, "[", op, "] empty last dim in ", inp.desc());
  const int64_t N = inp.numel() / C;
  expect_numel(dout, N * C, op, "dout");
  expect_numel(weight, C, op, "weight");
  LOOM_CHECK(mean.defined() && rstd.defined(), "[", op, "] mean and rstd saved by the forward are required");
  const float* mu = stats_ptr(mean, N, op, "mean");
  const float* rs = stats_ptr(rstd, N, op, "rstd");
  float* dx = nullptr;
  if (dinp.defined()) {
    expect_f32(dinp, op, "dinp");
    expect_numel(dinp, N * C, op, "dinp");
    dx = dinp.data<float>();
  }
  float* dw = nullptr;
  float* db = nullptr;
  if (dweight.defined()) {
    expect_f32(dweight, op, "dweight");
    expect_numel(dweight, C, op, "dweight");
    dw = dweight.data<float>();
  }
  if (dbias.defined()) {
    expect_f32(dbias, op, "dbias");
    expect_numel(dbias, C, op, "dbias");
    db = dbias.data<float>();
  }
  if (N == 0 || (!dx && !dw && !db)) return;

  const float* dy = dout.data<float>();
  const float* x = inp.data<float>();
  const float* w = weight.data<float>();
  const bool params = dw || db;
  const int64_t nblocks = (N + kReduceBlockRows - 1) / kReduceBlockRows;
  float* partial = params ? partial_scratch(size_t(nblocks * 2 * C)).data() : nullptr;  // (nblocks, 2, C)
  const float inv_c = 1.0f / float(C);

#pragma omp parallel for schedule(static) if (N * C > kParallelMinElems)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    float* pw = params ? partial + blk * 2 * C : nullptr;
    float* pb = params ? pw + C : nullptr;
    if (params) std::fill(pw, pw + 2 * C, 0.0f);
    const int64_t r1 = std::min(N, (blk + 1) * kReduceBlockRows);
    for (int64_t r = blk * kReduceBlockRows; r < r1; ++r) {
      const float* xr = x + r * C;
      const float* dyr = dy + r * C;
      const float m = mu[r], s = rs[r];
      if (dx) {
        // dinp = rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)),  dnorm = weight * dout.
        const float g_mean = lane_sum<float>(C, [&](int64_t c) { return w[c] * dyr[c]; }) * inv_c;
        const float gn_mean = lane_sum<float>(C, [&](int64_t c) { return w[c] * dyr[c] * ((xr[c] - m) * s); }) * inv_c;
        float* dxr = dx + r * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
          const float norm = (xr[c] - m) * s;
          dxr[c] += (w[c] * dyr[c] - g_mean - norm * gn_mean) * s;
        }
      }
      if (params) {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
          pw[c] += dyr[c] * ((xr[c] - m) * s);
          pb[c] += dyr[c];
        }
      }
    }
  }
  if (!params) return;
  constexpr int64_t kChunk = 64;  // channels per task, contiguous in every block's partial
  const int64_t nchunks = (C + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (nblocks * C > kParallelMinElems)
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const int64_t c0 = ch * kChunk, width = std::min(kChunk, C - c0);
    double sw[kChunk] = {}, sb[kChunk] = {};
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const float* pw = partial + blk * 2 * C + c0;
      const float* pb = pw + C;
      for (int64_t c = 0; c < width; ++c) {
        sw[c] += double(pw[c]);
        sb[c] += double(pb[c]);
      }
    }
    for (int64_t c = 0; c < width; ++c) {
      if (dw) dw[c0 + c] = float(double(dw[c0 + c]) + sw[c]);
      if (db) db[c0 + c] = float(double(db[c0 + c]) + sb[c]);
    }
  }
}

}  // namespace loom::cpu

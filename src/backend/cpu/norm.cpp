// LayerNorm over the last dim (forward, backward, and the fused residual-add + LayerNorm forward).
// Rows are independent and split statically across threads; per-row statistics use lane_sum, whose
// order depends on C only, so a recomputed forward reproduces mean/rstd/out bit for bit and the fused
// residual_layernorm_forward equals residual_forward followed by layernorm_forward exactly.
// Backward: dinp ACCUMULATES (it is the residual stream's gradient); dweight/dbias accumulate through a
// fixed split: per block of kReduceBlockRows rows an f32 partial (rows in order) is written to scratch,
// then each channel adds its block partials in block order in f64. Thread count never changes a bit.
// Mixed precision: inp/out/residual/a/b/dout/dinp and weight/bias share one compute dtype (f32, bf16 or
// f16); mean/rstd are f32; dweight/dbias are f32 or the compute dtype. A bf16/f16 row is widened into
// per-thread f32 scratch and goes through the same f32 row code, then is narrowed (RNE): results are
// the f32 op on the widened tensors, rounded once (dinp and bf16/f16 dweight/dbias: old value + update
// in f32, rounded once). The fused op lays the rounded residual row down first and normalises that, so
// it still equals residual_forward followed by layernorm_forward.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/fast_math.h"
#include "backend/cpu/lowp.h"

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

// A host tensor of the given dtype (the call's compute dtype, or f32 for statistics).
void expect_dtype(const TensorView& t, DType dt, const char* op, const char* name) {
  LOOM_CHECK(t.defined(), "[", op, "] ", name, " is required");
  LOOM_CHECK(t.device().is_cpu(), "[", op, "] expected a host tensor for ", name, ", got ", t.desc());
  LOOM_CHECK(t.dtype() == dt, "[", op, "] ", name, " must be ", dtype_name(dt),
             " (all activations and parameters of one call share the compute dtype), got ", t.desc());
}

// The compute dtype of a call, taken from its input activation.
DType compute_dtype(const TensorView& inp, const char* op) {
  LOOM_CHECK(inp.defined(), "[", op, "] inp is required");
  LOOM_CHECK(is_compute_dtype(inp.dtype()), "[", op, "] expected f32, bf16 or f16 inp, got ", inp.desc());
  return inp.dtype();
}

// A parameter gradient: f32 (main grads) or the compute dtype.
void expect_grad_dtype(const TensorView& t, DType dt, const char* op, const char* name) {
  LOOM_CHECK(t.device().is_cpu(), "[", op, "] expected a host tensor for ", name, ", got ", t.desc());
  LOOM_CHECK(t.dtype() == DType::kF32 || t.dtype() == dt, "[", op, "] ", name, " must be f32 or the compute dtype ",
             dtype_name(dt), ", got ", t.desc());
}

// Parameter vector (C) as f32: the tensor's own data when f32, else widened into `buf`.
const float* params_f32(const TensorView& t, std::vector<float>& buf) {
  if (!t.defined()) return nullptr;
  if (t.dtype() == DType::kF32) return t.data<float>();
  buf.resize(size_t(t.numel()));
  widen(buf.data(), t.raw(), t.dtype(), t.numel());
  return buf.data();
}

struct LnArgs {
  int64_t N = 0, C = 0;
  DType dt = DType::kF32;       // compute dtype
  const float* weight = nullptr;
  const float* bias = nullptr;  // optional
  float* mean = nullptr;        // optional
  float* rstd = nullptr;        // optional
  std::vector<float> weight_buf, bias_buf;  // widened parameters (bf16/f16 calls)
};

void check_forward(LnArgs& a, const char* op, TensorView out, TensorView mean, TensorView rstd, TensorView inp,
                   TensorView weight, TensorView bias) {
  a.dt = compute_dtype(inp, op);
  expect_dtype(out, a.dt, op, "out");
  expect_dtype(inp, a.dt, op, "inp");
  expect_dtype(weight, a.dt, op, "weight");
  a.C = inp.shape().cols();
  LOOM_CHECK(a.C > 0, "[", op, "] empty last dim in ", inp.desc());
  a.N = inp.numel() / a.C;
  expect_numel(out, inp.numel(), op, "out");
  expect_numel(weight, a.C, op, "weight");
  if (bias.defined()) {
    expect_dtype(bias, a.dt, op, "bias");
    expect_numel(bias, a.C, op, "bias");
  }
  a.mean = stats_ptr(mean, a.N, op, "mean");
  a.rstd = stats_ptr(rstd, a.N, op, "rstd");
  a.weight = params_f32(weight, a.weight_buf);
  a.bias = params_f32(bias, a.bias_buf);
}

// Scratch for the block partials of layernorm_backward, kept across calls so the steady state makes no
// page faults (the buffer is O(N/64 * C), about 1.5 MB for GPT-2 124M with 8k rows).
std::vector<float>& partial_scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf;
}

// One row of the backward. dxr (accumulated into) may be null; pw/pb (parameter partials) may be null.
inline void layernorm_backward_row(float* dxr, float* pw, float* pb, const float* xr, const float* dyr,
                                   const float* w, float m, float s, int64_t C, float inv_c) {
  if (dxr) {
    // dinp = rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)),  dnorm = weight * dout.
    const float g_mean = lane_sum<float>(C, [&](int64_t c) { return w[c] * dyr[c]; }) * inv_c;
    const float gn_mean = lane_sum<float>(C, [&](int64_t c) { return w[c] * dyr[c] * ((xr[c] - m) * s); }) * inv_c;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) {
      const float norm = (xr[c] - m) * s;
      dxr[c] += (w[c] * dyr[c] - g_mean - norm * gn_mean) * s;
    }
  }
  if (pw) {
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) {
      pw[c] += dyr[c] * ((xr[c] - m) * s);
      pb[c] += dyr[c];
    }
  }
}

// Adds the f64 total of channel c into a parameter gradient (f32, or bf16/f16 rounded once).
inline void add_total(void* g, DType dt, int64_t c, double total) {
  if (dt == DType::kF32) {
    float* p = static_cast<float*>(g);
    p[c] = float(double(p[c]) + total);
  } else {
    uint16_t* p = static_cast<uint16_t*>(g);
    with_lowp(dt, [&](auto L) { p[c] = decltype(L)::enc(float(double(decltype(L)::dec(p[c])) + total)); });
  }
}

}  // namespace

void CpuOps::layernorm_forward(TensorView out, TensorView mean, TensorView rstd, TensorView inp, TensorView weight,
                               TensorView bias, float eps) const {
  LnArgs a;
  check_forward(a, "layernorm_forward", out, mean, rstd, inp, weight, bias);
  if (a.dt == DType::kF32) {
    float* o = out.data<float>();
    const float* x = inp.data<float>();
#pragma omp parallel for schedule(static) if (a.N * a.C > kParallelMinElems)
    for (int64_t r = 0; r < a.N; ++r)
      layernorm_row(o + r * a.C, x + r * a.C, a.weight, a.bias, a.C, eps, a.mean ? a.mean + r : nullptr,
                    a.rstd ? a.rstd + r : nullptr);
    return;
  }
  with_lowp(a.dt, [&](auto L) {
    using Lp = decltype(L);
    uint16_t* o = static_cast<uint16_t*>(out.raw());
    const uint16_t* x = static_cast<const uint16_t*>(inp.raw());
#pragma omp parallel for schedule(static) if (a.N * a.C > kParallelMinElems)
    for (int64_t r = 0; r < a.N; ++r) {
      float* xf = thread_scratch(0, size_t(a.C));
      float* of = thread_scratch(1, size_t(a.C));
      Lp::widen(xf, x + r * a.C, a.C);
      layernorm_row(of, xf, a.weight, a.bias, a.C, eps, a.mean ? a.mean + r : nullptr, a.rstd ? a.rstd + r : nullptr);
      Lp::narrow(o + r * a.C, of, a.C);
    }
  });
}

void CpuOps::residual_layernorm_forward(TensorView residual, TensorView out, TensorView mean, TensorView rstd,
                                        TensorView a_in, TensorView b_in, TensorView weight, TensorView bias,
                                        float eps) const {
  const char* op = "residual_layernorm_forward";
  LnArgs a;
  check_forward(a, op, out, mean, rstd, residual, weight, bias);
  expect_dtype(a_in, a.dt, op, "a");
  expect_dtype(b_in, a.dt, op, "b");
  expect_numel(a_in, a.N * a.C, op, "a");
  expect_numel(b_in, a.N * a.C, op, "b");
  if (a.dt == DType::kF32) {
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
    return;
  }
  with_lowp(a.dt, [&](auto L) {
    using Lp = decltype(L);
    uint16_t* res = static_cast<uint16_t*>(residual.raw());
    uint16_t* o = static_cast<uint16_t*>(out.raw());
    const uint16_t* pa = static_cast<const uint16_t*>(a_in.raw());
    const uint16_t* pb = static_cast<const uint16_t*>(b_in.raw());
#pragma omp parallel for schedule(static) if (a.N * a.C > kParallelMinElems)
    for (int64_t r = 0; r < a.N; ++r) {
      float* fa = thread_scratch(0, size_t(a.C));
      float* fb = thread_scratch(1, size_t(a.C));
      float* of = thread_scratch(2, size_t(a.C));
      Lp::widen(fa, pa + r * a.C, a.C);
      Lp::widen(fb, pb + r * a.C, a.C);
#pragma omp simd
      for (int64_t c = 0; c < a.C; ++c) fa[c] += fb[c];
      // Normalise the residual as stored (rounded), as the unfused pair of ops would.
      Lp::narrow(res + r * a.C, fa, a.C);
      Lp::widen(fa, res + r * a.C, a.C);
      layernorm_row(of, fa, a.weight, a.bias, a.C, eps, a.mean ? a.mean + r : nullptr, a.rstd ? a.rstd + r : nullptr);
      Lp::narrow(o + r * a.C, of, a.C);
    }
  });
}

void CpuOps::layernorm_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout, TensorView inp,
                                TensorView weight, TensorView mean, TensorView rstd) const {
  const char* op = "layernorm_backward";
  const DType dt = compute_dtype(inp, op);
  expect_dtype(dout, dt, op, "dout");
  expect_dtype(weight, dt, op, "weight");
  const int64_t C = inp.shape().cols();
  LOOM_CHECK(C > 0, "[", op, "] empty last dim in ", inp.desc());
  const int64_t N = inp.numel() / C;
  expect_numel(dout, N * C, op, "dout");
  expect_numel(weight, C, op, "weight");
  LOOM_CHECK(mean.defined() && rstd.defined(), "[", op, "] mean and rstd saved by the forward are required");
  const float* mu = stats_ptr(mean, N, op, "mean");
  const float* rs = stats_ptr(rstd, N, op, "rstd");
  if (dinp.defined()) {
    expect_dtype(dinp, dt, op, "dinp");
    expect_numel(dinp, N * C, op, "dinp");
  }
  if (dweight.defined()) {
    expect_grad_dtype(dweight, dt, op, "dweight");
    expect_numel(dweight, C, op, "dweight");
  }
  if (dbias.defined()) {
    expect_grad_dtype(dbias, dt, op, "dbias");
    expect_numel(dbias, C, op, "dbias");
  }
  const bool has_dx = dinp.defined();
  if (N == 0 || (!has_dx && !dweight.defined() && !dbias.defined())) return;

  std::vector<float> weight_buf;
  const float* w = params_f32(weight, weight_buf);
  const bool params = dweight.defined() || dbias.defined();
  const int64_t nblocks = (N + kReduceBlockRows - 1) / kReduceBlockRows;
  float* partial = params ? partial_scratch(size_t(nblocks * 2 * C)).data() : nullptr;  // (nblocks, 2, C)
  const float inv_c = 1.0f / float(C);

  // Per block of rows: row(r, pw, pb) runs one row, accumulating into the block's partials.
  auto blocks = [&](auto&& row) {
#pragma omp parallel for schedule(static) if (N * C > kParallelMinElems)
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      float* pw = params ? partial + blk * 2 * C : nullptr;
      float* pb = params ? pw + C : nullptr;
      if (params) std::fill(pw, pw + 2 * C, 0.0f);
      const int64_t r1 = std::min(N, (blk + 1) * kReduceBlockRows);
      for (int64_t r = blk * kReduceBlockRows; r < r1; ++r) row(r, pw, pb);
    }
  };
  if (dt == DType::kF32) {
    const float* dy = dout.data<float>();
    const float* x = inp.data<float>();
    float* dx = has_dx ? dinp.data<float>() : nullptr;
    blocks([&](int64_t r, float* pw, float* pb) {
      layernorm_backward_row(dx ? dx + r * C : nullptr, pw, pb, x + r * C, dy + r * C, w, mu[r], rs[r], C, inv_c);
    });
  } else {
    with_lowp(dt, [&](auto L) {
      using Lp = decltype(L);
      const uint16_t* dy = static_cast<const uint16_t*>(dout.raw());
      const uint16_t* x = static_cast<const uint16_t*>(inp.raw());
      uint16_t* dx = has_dx ? static_cast<uint16_t*>(dinp.raw()) : nullptr;
      blocks([&](int64_t r, float* pw, float* pb) {
        float* xf = thread_scratch(0, size_t(C));
        float* dyf = thread_scratch(1, size_t(C));
        float* dxf = dx ? thread_scratch(2, size_t(C)) : nullptr;
        Lp::widen(xf, x + r * C, C);
        Lp::widen(dyf, dy + r * C, C);
        if (dx) Lp::widen(dxf, dx + r * C, C);
        layernorm_backward_row(dxf, pw, pb, xf, dyf, w, mu[r], rs[r], C, inv_c);
        if (dx) Lp::narrow(dx + r * C, dxf, C);
      });
    });
  }
  if (!params) return;
  void* dw = dweight.defined() ? dweight.raw() : nullptr;
  void* db = dbias.defined() ? dbias.raw() : nullptr;
  const DType dw_dt = dweight.defined() ? dweight.dtype() : DType::kF32;
  const DType db_dt = dbias.defined() ? dbias.dtype() : DType::kF32;
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
      if (dw) add_total(dw, dw_dt, c0 + c, sw[c]);
      if (db) add_total(db, db_dt, c0 + c, sb[c]);
    }
  }
}

}  // namespace loom::cpu

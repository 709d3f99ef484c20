// RMSNorm over the last dim (Llama's --normalization RMSNorm): forward, backward, and the fused residual-add +
// RMSNorm forward. out = x · rstd · weight with rstd = 1 / sqrt(mean(x²) + eps), all in f32 and rounded once
// (as Megatron/TE; Hugging Face's LlamaRMSNorm rounds x · rstd to the input dtype before the weight, which
// only differs in bf16/f16 by that extra rounding).
// Rows are independent and split statically across threads; mean(x²) uses lane_sum, whose order depends on
// C only, so a recomputed forward reproduces rstd/out bit for bit and the fused op equals residual_forward
// followed by rmsnorm_forward exactly.
// Backward: with n = x · rstd and g = weight · dout, dinp = rstd · (g − n · mean(g · n)). dinp ACCUMULATES
// (it is the residual stream's gradient); dweight accumulates Σ_rows dout · n through a fixed split: per block
// of kReduceBlockRows rows an f32 partial (rows in order) goes to scratch, then each channel adds its block
// partials in block order in f64. Thread count never changes a bit.
// Mixed precision (the same scheme as norm.cpp): inp/out/residual/a/b/dout/dinp and weight share one compute
// dtype (f32, bf16 or f16); rstd is f32; dweight is f32 or the compute dtype. A bf16/f16 row is widened into
// per-thread f32 scratch, run through the f32 row code and narrowed (RNE) once.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/fast_math.h"
#include "backend/cpu/lowp.h"

namespace loom::cpu {

namespace {

constexpr int64_t kParallelMinElems = int64_t(1) << 14;

void expect_numel(const TensorView& t, int64_t n, const char* op, const char* name) {
  LOOM_CHECK(t.numel() == n, "[", op, "] expected ", name, " with ", n, " elements, got ", t.desc());
}

// A host tensor of the call's compute dtype.
void expect_dtype(const TensorView& t, DType dt, const char* op, const char* name) {
  LOOM_CHECK(t.defined(), "[", op, "] ", name, " is required");
  LOOM_CHECK(t.device().is_cpu(), "[", op, "] expected a host tensor for ", name, ", got ", t.desc());
  LOOM_CHECK(t.dtype() == dt, "[", op, "] ", name, " must be ", dtype_name(dt),
             " (all activations and parameters of one call share the compute dtype), got ", t.desc());
}

DType compute_dtype(const TensorView& inp, const char* op, const char* name) {
  LOOM_CHECK(inp.defined(), "[", op, "] ", name, " is required");
  LOOM_CHECK(is_compute_dtype(inp.dtype()), "[", op, "] expected f32, bf16 or f16 ", name, ", got ", inp.desc());
  return inp.dtype();
}

// The per-row statistics buffer: absent (forward only), or host f32 with N elements.
float* rstd_ptr(const TensorView& t, int64_t N, const char* op) {
  if (!t.defined()) return nullptr;
  LOOM_CHECK(t.dtype() == DType::kF32 && t.device().is_cpu(), "[", op, "] expected host f32 rstd, got ", t.desc());
  expect_numel(t, N, op, "rstd");
  return t.data<float>();
}

// The weight (C) as f32: its own data when f32, else widened into `buf`.
const float* weight_f32(const TensorView& t, std::vector<float>& buf) {
  if (t.dtype() == DType::kF32) return t.data<float>();
  buf.resize(size_t(t.numel()));
  widen(buf.data(), t.raw(), t.dtype(), t.numel());
  return buf.data();
}

inline void rmsnorm_row(float* out, const float* x, const float* w, int64_t C, float eps, float* rstd_out) {
  const float ms = lane_sum<float>(C, [&](int64_t i) { return x[i] * x[i]; }) / float(C);
  const float s = 1.0f / std::sqrt(ms + eps);
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) out[c] = x[c] * s * w[c];
  if (rstd_out) *rstd_out = s;
}

struct RmsArgs {
  int64_t N = 0, C = 0;
  DType dt = DType::kF32;
  const float* weight = nullptr;
  float* rstd = nullptr;
  std::vector<float> weight_buf;
};

// Checks out/rstd/x/weight of a forward whose normalised input is x; fills a.
void check_forward(RmsArgs& a, const char* op, const char* x_name, TensorView out, TensorView rstd, TensorView x,
                   TensorView weight) {
  a.dt = compute_dtype(x, op, x_name);
  expect_dtype(out, a.dt, op, "out");
  expect_dtype(weight, a.dt, op, "weight");
  a.C = x.shape().cols();
  LOOM_CHECK(a.C > 0, "[", op, "] empty last dim in ", x_name, " ", x.desc());
  a.N = x.numel() / a.C;
  expect_numel(out, x.numel(), op, "out");
  expect_numel(weight, a.C, op, "weight");
  a.rstd = rstd_ptr(rstd, a.N, op);
  a.weight = weight_f32(weight, a.weight_buf);
}

std::vector<float>& partial_scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf;
}

// One row of the backward; dxr (accumulated into) and pw (this block's dweight partial) may be null.
inline void rmsnorm_backward_row(float* dxr, float* pw, const float* xr, const float* dyr, const float* w, float s,
                                 int64_t C, float inv_c) {
  if (dxr) {
    const float gn_mean = lane_sum<float>(C, [&](int64_t c) { return w[c] * dyr[c] * (xr[c] * s); }) * inv_c;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) dxr[c] += (w[c] * dyr[c] - (xr[c] * s) * gn_mean) * s;
  }
  if (pw) {
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) pw[c] += dyr[c] * (xr[c] * s);
  }
}

// Adds an f64 total into channel c of a parameter gradient (f32, or bf16/f16 rounded once).
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

void CpuOps::rmsnorm_forward(TensorView out, TensorView rstd, TensorView inp, TensorView weight, float eps) const {
  RmsArgs a;
  check_forward(a, "rmsnorm_forward", "inp", out, rstd, inp, weight);
  if (a.dt == DType::kF32) {
    float* o = out.data<float>();
    const float* x = inp.data<float>();
#pragma omp parallel for schedule(static) if (a.N * a.C > kParallelMinElems)
    for (int64_t r = 0; r < a.N; ++r)
      rmsnorm_row(o + r * a.C, x + r * a.C, a.weight, a.C, eps, a.rstd ? a.rstd + r : nullptr);
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
      rmsnorm_row(of, xf, a.weight, a.C, eps, a.rstd ? a.rstd + r : nullptr);
      Lp::narrow(o + r * a.C, of, a.C);
    }
  });
}

void CpuOps::residual_rmsnorm_forward(TensorView residual, TensorView out, TensorView rstd, TensorView a_in,
                                      TensorView b_in, TensorView weight, float eps) const {
  const char* op = "residual_rmsnorm_forward";
  RmsArgs a;
  check_forward(a, op, "residual", out, rstd, residual, weight);
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
      rmsnorm_row(o + r * a.C, rr, a.weight, a.C, eps, a.rstd ? a.rstd + r : nullptr);
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
      rmsnorm_row(of, fa, a.weight, a.C, eps, a.rstd ? a.rstd + r : nullptr);
      Lp::narrow(o + r * a.C, of, a.C);
    }
  });
}

void CpuOps::rmsnorm_backward(TensorView dinp, TensorView dweight, TensorView dout, TensorView inp, TensorView weight,
                              TensorView rstd) const {
  const char* op = "rmsnorm_backward";
  const DType dt = compute_dtype(inp, op, "inp");
  expect_dtype(dout, dt, op, "dout");
  expect_dtype(weight, dt, op, "weight");
  const int64_t C = inp.shape().cols();
  LOOM_CHECK(C > 0, "[", op, "] empty last dim in ", inp.desc());
  const int64_t N = inp.numel() / C;
  expect_numel(dout, N * C, op, "dout");
  expect_numel(weight, C, op, "weight");
  LOOM_CHECK(rstd.defined(), "[", op, "] rstd saved by the forward is required");
  const float* rs = rstd_ptr(rstd, N, op);
  if (dinp.defined()) {
    expect_dtype(dinp, dt, op, "dinp");
    expect_numel(dinp, N * C, op, "dinp");
  }
  if (dweight.defined()) {
    LOOM_CHECK(dweight.device().is_cpu(), "[", op, "] expected a host tensor for dweight, got ", dweight.desc());
    LOOM_CHECK(dweight.dtype() == DType::kF32 || dweight.dtype() == dt, "[", op,
               "] dweight must be f32 or the compute dtype ", dtype_name(dt), ", got ", dweight.desc());
    expect_numel(dweight, C, op, "dweight");
  }
  const bool has_dx = dinp.defined(), has_dw = dweight.defined();
  if (N == 0 || (!has_dx && !has_dw)) return;

  std::vector<float> weight_buf;
  const float* w = weight_f32(weight, weight_buf);
  const int64_t nblocks = (N + kReduceBlockRows - 1) / kReduceBlockRows;
  float* partial = has_dw ? partial_scratch(size_t(nblocks * C)).data() : nullptr;  // (nblocks, C)
  const float inv_c = 1.0f / float(C);

  // Per block of rows: row(r, pw) runs one row, accumulating into the block's dweight partial.
  auto blocks = [&](auto&& row) {
#pragma omp parallel for schedule(static) if (N * C > kParallelMinElems)
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      float* pw = has_dw ? partial + blk * C : nullptr;
      if (pw) std::fill(pw, pw + C, 0.0f);
      const int64_t r1 = std::min(N, (blk + 1) * kReduceBlockRows);
      for (int64_t r = blk * kReduceBlockRows; r < r1; ++r) row(r, pw);
    }
  };
  if (dt == DType::kF32) {
    const float* dy = dout.data<float>();
    const float* x = inp.data<float>();
    float* dx = has_dx ? dinp.data<float>() : nullptr;
    blocks([&](int64_t r, float* pw) {
      rmsnorm_backward_row(dx ? dx + r * C : nullptr, pw, x + r * C, dy + r * C, w, rs[r], C, inv_c);
    });
  } else {
    with_lowp(dt, [&](auto L) {
      using Lp = decltype(L);
      const uint16_t* dy = static_cast<const uint16_t*>(dout.raw());
      const uint16_t* x = static_cast<const uint16_t*>(inp.raw());
      uint16_t* dx = has_dx ? static_cast<uint16_t*>(dinp.raw()) : nullptr;
      blocks([&](int64_t r, float* pw) {
        float* xf = thread_scratch(0, size_t(C));
        float* dyf = thread_scratch(1, size_t(C));
        float* dxf = dx ? thread_scratch(2, size_t(C)) : nullptr;
        Lp::widen(xf, x + r * C, C);
        Lp::widen(dyf, dy + r * C, C);
        if (dx) Lp::widen(dxf, dx + r * C, C);
        rmsnorm_backward_row(dxf, pw, xf, dyf, w, rs[r], C, inv_c);
        if (dx) Lp::narrow(dx + r * C, dxf, C);
      });
    });
  }
  if (!has_dw) return;
  void* dw = dweight.raw();
  const DType dw_dt = dweight.dtype();
  constexpr int64_t kChunk = 64;  // channels per task, contiguous in every block's partial
  const int64_t nchunks = (C + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (nblocks * C > kParallelMinElems)
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const int64_t c0 = ch * kChunk, width = std::min(kChunk, C - c0);
    double sw[kChunk] = {};
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const float* pw = partial + blk * C + c0;
      for (int64_t c = 0; c < width; ++c) sw[c] += double(pw[c]);
    }
    for (int64_t c = 0; c < width; ++c) add_total(dw, dw_dt, c0 + c, sw[c]);
  }
}

}  // namespace loom::cpu

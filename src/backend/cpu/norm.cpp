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
#include "backend/cpu/norm_common.h"

namespace loom::cpu {

namespace {

using namespace norm_common;

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
  DType dt = DType::kF32;       // compute dtype
  const float* weight = nullptr;
  const float* bias = nullptr;  // optional
  float* mean = nullptr;        // optional
  float* rstd = nullptr;        // optional
  std::vector<float> weight_buf, bias_buf;  // widened parameters (bf16/f16 calls)
};

// The shapes and parameters of a forward whose normalised rows are x (inp, or the fused op's residual).
void forward_args(LnArgs& a, TensorView mean, TensorView rstd, TensorView x, TensorView weight, TensorView bias) {
  a.dt = x.dtype();
  a.C = x.shape().cols();
  a.N = x.numel() / a.C;
  a.mean = stats_ptr(mean);
  a.rstd = stats_ptr(rstd);
  a.weight = params_f32(weight, a.weight_buf);
  a.bias = params_f32(bias, a.bias_buf);
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

}  // namespace

void CpuOps::do_layernorm_forward(TensorView out, TensorView mean, TensorView rstd, TensorView inp, TensorView weight,
                                  TensorView bias, float eps) const {
  LnArgs a;
  forward_args(a, mean, rstd, inp, weight, bias);
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

void CpuOps::do_residual_layernorm_forward(TensorView residual, TensorView out, TensorView mean, TensorView rstd,
                                           TensorView a_in, TensorView b_in, TensorView weight, TensorView bias,
                                           float eps) const {
  LnArgs a;
  forward_args(a, mean, rstd, residual, weight, bias);
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

void CpuOps::do_layernorm_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout,
                                   TensorView inp, TensorView weight, TensorView mean, TensorView rstd) const {
  const DType dt = inp.dtype();
  const int64_t C = inp.shape().cols();
  const int64_t N = inp.numel() / C;
  const float* mu = stats_ptr(mean);
  const float* rs = stats_ptr(rstd);
  const bool has_dx = dinp.defined();
  if (N == 0 || (!has_dx && !dweight.defined() && !dbias.defined())) return;

  std::vector<float> weight_buf;
  const float* w = params_f32(weight, weight_buf);
  const bool params = dweight.defined() || dbias.defined();
  const int64_t nblocks = num_blocks(N);
  float* partial = params ? partial_scratch(size_t(nblocks * 2 * C)) : nullptr;  // (nblocks, 2, C)
  const float inv_c = 1.0f / float(C);

  // row(r, pw, pb) runs one row, accumulating into its block's dweight/dbias partials (null without params).
  auto blocks = [&](auto&& row) {
    for_row_blocks(N, C, partial, 2 * C, [&](int64_t r, float* p) { row(r, p, p ? p + C : nullptr); });
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
  if (params) add_block_partials<2>(partial, nblocks, C, {grad_out(dweight), grad_out(dbias)});
}

}  // namespace loom::cpu

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
#include "backend/cpu/norm_common.h"

namespace loom::cpu {

namespace {

using namespace norm_common;

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

// The shapes and parameters of a forward whose normalised rows are x (inp, or the fused op's residual).
void forward_args(RmsArgs& a, TensorView rstd, TensorView x, TensorView weight) {
  a.dt = x.dtype();
  a.C = x.shape().cols();
  a.N = x.numel() / a.C;
  a.rstd = stats_ptr(rstd);
  a.weight = params_f32(weight, a.weight_buf);
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

}  // namespace

void CpuOps::do_rmsnorm_forward(TensorView out, TensorView rstd, TensorView inp, TensorView weight, float eps) const {
  RmsArgs a;
  forward_args(a, rstd, inp, weight);
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

void CpuOps::do_residual_rmsnorm_forward(TensorView residual, TensorView out, TensorView rstd, TensorView a_in,
                                         TensorView b_in, TensorView weight, float eps) const {
  RmsArgs a;
  forward_args(a, rstd, residual, weight);
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

void CpuOps::do_rmsnorm_backward(TensorView dinp, TensorView dweight, TensorView dout, TensorView inp,
                                 TensorView weight, TensorView rstd) const {
  const DType dt = inp.dtype();
  const int64_t C = inp.shape().cols();
  const int64_t N = inp.numel() / C;
  const float* rs = stats_ptr(rstd);
  const bool has_dx = dinp.defined(), has_dw = dweight.defined();
  if (N == 0 || (!has_dx && !has_dw)) return;

  std::vector<float> weight_buf;
  const float* w = params_f32(weight, weight_buf);
  const int64_t nblocks = num_blocks(N);
  float* partial = has_dw ? partial_scratch(size_t(nblocks * C)) : nullptr;  // (nblocks, C)
  const float inv_c = 1.0f / float(C);

  // row(r, pw) runs one row, accumulating into its block's dweight partial (null without dweight).
  auto blocks = [&](auto&& row) { for_row_blocks(N, C, partial, C, row); };
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
  if (has_dw) add_block_partials<1>(partial, nblocks, C, {grad_out(dweight)});
}

}  // namespace loom::cpu

// CPU FP8 ops with per-tensor scaling: quantise (scale, saturate, round, amax), dequantise, and the
// delayed-scaling update (see loom/backend/ops.h for the contracts).
// Invariants:
//   - quantisation rounds x · scale (computed in f32, as Transformer Engine's kernels do) to the fp8
//     format with the core's saturating round-to-nearest-even (loom::f32_to_fp8_*): |values| beyond the
//     largest finite fp8 become ± that value, NaN stays NaN;
//   - amax is the max of |x| over the input, +inf when any element is NaN or infinite (std::max would
//     drop a NaN depending on the argument order, and MPI's MAX does not order NaN, so non-finite inputs
//     are tracked separately and recorded as +inf); independent of the thread count (max is exact);
//   - the scaling update is the issue's / DESIGN.md's rule, element by element in f32.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/lowp.h"
#include "loom/core/dtype.h"

namespace loom::cpu {

namespace {

constexpr int64_t kChunk = 1024;                     // elements widened to f32 at a time
constexpr int64_t kParallelMin = int64_t(1) << 15;  // elements; below this a thread team costs more than it saves

// f32 -> fp8 with saturation, bit-identical to the core's loom::f32_to_fp8_e4m3 / _e5m2 (checked over a
// sweep of the f32 range in test_fp8.cpp) but branch-light: normal results round to nearest even on the
// f32 bits (a carry out of the mantissa moves into the exponent by itself), subnormal ones scale exactly
// by a power of two and round with nearbyint, anything above the largest finite value (infinities
// included) saturates, NaN keeps its sign.
template <int kMbits, int kBias, uint32_t kNanBits, uint32_t kMaxBits>
inline uint8_t encode_fp8(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return uint8_t(sign | kNanBits);
  constexpr uint32_t kMinNormal = uint32_t(127 + 1 - kBias) << 23;  // 2^(1 - bias) as f32 bits
  if (a < kMinNormal) {
    // Units of the smallest subnormal, 2^(1 - bias - mbits); 2^mbits lands on the smallest normal.
    const float q = std::nearbyint(std::bit_cast<float>(a) * std::ldexp(1.0f, kMbits - 1 + kBias));
    return uint8_t(sign | uint32_t(q));
  }
  constexpr int kShift = 23 - kMbits;
  const uint32_t r = a + ((1u << (kShift - 1)) - 1u) + ((a >> kShift) & 1u);
  const uint32_t e = (r >> 23) - 127u + uint32_t(kBias);  // >= 1 here
  const uint32_t code = (e << kMbits) | ((r >> kShift) & ((1u << kMbits) - 1u));
  return uint8_t(sign | (a >= 0x7F800000u || e > 0x7Fu || code > kMaxBits ? kMaxBits : code));
}
inline uint8_t encode_e4m3(float x) { return encode_fp8<3, 7, 0x7F, 0x7E>(x); }
inline uint8_t encode_e5m2(float x) { return encode_fp8<2, 15, 0x7E, 0x7B>(x); }

}  // namespace

void CpuOps::do_fp8_quantize(TensorView out, TensorView inp, TensorView scale, TensorView amax) const {
  const int64_t n = inp.numel();
  const float s = *scale.data<float>();
  const bool e4m3 = out.dtype() == DType::kF8E4M3;
  auto* dst = static_cast<uint8_t*>(out.raw());
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  float local_max = 0.0f;
  bool non_finite = false;
#pragma omp parallel for schedule(static) if (n > kParallelMin) reduction(max : local_max) reduction(|| : non_finite)
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t i0 = c * kChunk, len = std::min(kChunk, n - i0);
    float* x = thread_scratch(0, size_t(kChunk));
    widen(x, elem_ptr(inp.raw(), inp.dtype(), i0), inp.dtype(), len);
    for (int64_t i = 0; i < len; ++i) {
      const float a = std::fabs(x[i]);
      if (!std::isfinite(a)) non_finite = true;
      else local_max = std::max(local_max, a);
      const float y = x[i] * s;
      dst[i0 + i] = e4m3 ? encode_e4m3(y) : encode_e5m2(y);
    }
  }
  float* am = amax.data<float>();
  if (non_finite || !std::isfinite(*am))
    *am = std::numeric_limits<float>::infinity();
  else
    *am = std::max(*am, local_max);
}

void CpuOps::do_fp8_dequantize(TensorView out, TensorView inp, TensorView scale_inv) const {
  const int64_t n = inp.numel();
  const float si = *scale_inv.data<float>();
  const bool e4m3 = inp.dtype() == DType::kF8E4M3;
  // The 256 values of the format, decoded and scaled once: each element is then a table lookup.
  float table[256];
  for (int v = 0; v < 256; ++v) table[v] = (e4m3 ? fp8_e4m3_to_f32(uint8_t(v)) : fp8_e5m2_to_f32(uint8_t(v))) * si;
  const auto* src = static_cast<const uint8_t*>(inp.raw());
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t i0 = c * kChunk, len = std::min(kChunk, n - i0);
    if (out.dtype() == DType::kF32) {
      float* y = out.data<float>() + i0;
      for (int64_t i = 0; i < len; ++i) y[i] = table[src[i0 + i]];
      continue;
    }
    float* y = thread_scratch(0, size_t(kChunk));
    for (int64_t i = 0; i < len; ++i) y[i] = table[src[i0 + i]];
    narrow(elem_ptr(out.raw(), out.dtype(), i0), out.dtype(), y, len);
  }
}

void CpuOps::do_fp8_update_scaling(TensorView amax_history, TensorView scale, TensorView scale_inv, float fp8_max,
                                   int margin, bool use_max) const {
  const int64_t L = amax_history.size(0), n = amax_history.size(1);
  float* h = amax_history.data<float>();
  float* sc = scale.data<float>();
  float* si = scale_inv.data<float>();
  const float two_m = std::ldexp(1.0f, margin);
  for (int64_t j = 0; j < n; ++j) {
    float amax = h[j];
    if (use_max)
      for (int64_t r = 1; r < L && !std::isnan(amax); ++r) {
        const float v = h[r * n + j];
        amax = std::isnan(v) ? v : std::max(amax, v);
      }
    if (amax > 0.0f && std::isfinite(amax)) {
      float s = (fp8_max / amax) / two_m;
      if (std::isinf(s)) s = std::numeric_limits<float>::max();
      sc[j] = s;
    }
    si[j] = 1.0f / sc[j];
  }
  // Roll: row r+1 <- row r (the oldest row drops out), row 0 <- 0 for the next step's amaxes.
  if (L > 1) std::memmove(h + n, h, size_t((L - 1) * n) * sizeof(float));
  std::fill(h, h + n, 0.0f);
}

// Emulation: dequantise both operands to f32 (exact: an fp8 value times a power-of-two-ish f32 scale
// inverse is what the tensor cores multiply too, up to the order of the scaling), one f32 GEMM with the
// bias, then the accumulate/round step. Bit-identical to quantise -> dequantise -> f32 matmul_forward.
void CpuOps::do_fp8_gemm(TensorView out, TensorView a, TensorView a_scale_inv, TensorView b, TensorView b_scale_inv,
                         TensorView bias, bool accumulate) const {
  const int64_t N = b.size(0), K = b.size(1);
  const int64_t M = a.shape().rows();  // leading dims flattened (well defined for K == 0 too)
  Tensor af = Tensor::empty({M, K}, DType::kF32), bf = Tensor::empty({N, K}, DType::kF32);
  fp8_dequantize(af, a.reshape({M, K}), a_scale_inv);
  fp8_dequantize(bf, b, b_scale_inv);
  Tensor biasf;
  if (bias.defined()) {
    biasf = Tensor::empty({N}, DType::kF32);
    cast(biasf, bias.reshape({N}));
  }
  const bool direct = out.dtype() == DType::kF32 && !accumulate;
  Tensor r = direct ? Tensor() : Tensor::empty({M, N}, DType::kF32);
  TensorView res = direct ? out.reshape({M, N}) : r.view();
  matmul_forward(res, af, bf, biasf);
  if (direct) return;
  if (accumulate) {
    Tensor old = Tensor::empty({M, N}, DType::kF32);
    cast(old, out.reshape({M, N}));
    residual_forward(r, old, r);
  }
  cast(out.reshape({M, N}), r);
}

void CpuOps::do_transpose(TensorView out, TensorView inp) const {
  const int64_t R = inp.size(0), C = inp.size(1);
  const size_t es = dtype_size(inp.dtype());
  constexpr int64_t kTile = 32;  // cache-sized tiles; each output element is written once
  auto run = [&](auto tag) {
    using E = decltype(tag);
    const E* src = static_cast<const E*>(inp.raw());
    E* dst = static_cast<E*>(out.raw());
#pragma omp parallel for collapse(2) schedule(static) if (R * C > kParallelMin)
    for (int64_t r0 = 0; r0 < R; r0 += kTile)
      for (int64_t c0 = 0; c0 < C; c0 += kTile)
        for (int64_t r = r0; r < std::min(R, r0 + kTile); ++r)
          for (int64_t c = c0; c < std::min(C, c0 + kTile); ++c) dst[c * R + r] = src[r * C + c];
  };
  if (es == 1) run(uint8_t{});
  else if (es == 2) run(uint16_t{});
  else run(uint32_t{});
}

}  // namespace loom::cpu

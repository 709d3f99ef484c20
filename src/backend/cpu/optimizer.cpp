// AdamW update and the f64 sum of squares for the global gradient norm.
// adamw_update is one fused pass over (param, grad, m, v) in chunks of kChunk elements (memory-bound:
// ~28 bytes per parameter moved once; with a compute copy to refresh, each chunk is rounded into it while
// still in L1, instead of a separate cast pass re-reading the f32 params). It follows torch.optim.AdamW
// (PyTorch 1.13 single-tensor path) operation by operation, rounding where PyTorch's kernels round:
//   p  = p * f32(1 - lr*wd)
//   m  = fma(f32(1-beta1), g, m * beta1)              (mul_, then add_(alpha): ATen uses fmadd)
//   v  = fma(f32(1-beta2) * g, g, v * beta2)          (mul_, then addcmul_: contracted to an FMA)
//   p  = p + (f32(-lr/bc1) * m) / (sqrt(v) / f32(sqrt(bc2)) + eps)   (addcdiv_)
// with bc_i = 1 - beta_i^step in f64. Checked against PyTorch 1.13 (Debian python3-torch) on this
// machine: param, exp_avg and exp_avg_sq bit-identical after 3 steps on 1M elements.
// Hyper-parameters arrive as f32; PyTorch computes the scalar coefficients from the Python (f64) values,
// so each is first widened to the shortest decimal that rounds to it (0.9f -> 0.9, not 0.899999976),
// which is the value the user wrote.
// sum_squares: f64 partial sums over fixed blocks of kSquareBlock elements, combined in block order,
// so the result depends on numel only, never on the thread count. Any float dtype: elements are widened
// exactly, so a bf16/f16/fp8 tensor gives the same sum as its f32 widening.
// adamw_update is f32 only (master weights and optimizer state are f32 under mixed precision).
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "backend/cpu/adamw_coefs.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/fast_math.h"
#include "backend/cpu/lowp.h"

namespace loom::cpu {

namespace {

// The shortest decimal that rounds to f, as a double (what a Python float literal would have been).
double decimal_value(float f) {
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf) - 1, f);
  *res.ptr = '\0';
  return std::strtod(buf, nullptr);
}

constexpr int64_t kChunk = 2048;        // AdamW elements per task; scratch stays in L1
constexpr int64_t kSquareBlock = 8192;  // sum_squares block: fixed, part of the result's definition
constexpr int64_t kParallelMin = int64_t(1) << 15;

// One chunk (n <= kChunk). sqrt(v) goes through sqrt_inplace so both loops vectorise. The two fused
// steps are explicit fma; no other product feeds an addition directly (a division or a fused op sits
// between), so FMA contraction by the compiler cannot change the rounding.
inline void adamw_chunk(float* __restrict param, float* __restrict grad, float* __restrict m, float* __restrict v,
                        int64_t n, const AdamWCoefs& k, bool zero_grad) {
  float denom[kChunk];
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * k.grad_scale;
    const float mi = std::fma(k.one_minus_beta1, g, m[i] * k.beta1);
    const float vi = std::fma(k.one_minus_beta2 * g, g, v[i] * k.beta2);
    m[i] = mi;
    v[i] = vi;
    denom[i] = vi;
    param[i] *= k.decay;
  }
  if (zero_grad) std::fill(grad, grad + n, 0.0f);
  sqrt_inplace(denom, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float d = denom[i] / k.bc2_sqrt + k.eps;
    param[i] = param[i] + (k.neg_step_size * m[i]) / d;
  }
}
// Dec(x) is the exact f32 (or f64) value of one stored element.
template <typename T, typename Dec>
double sum_squares_typed(const T* x, int64_t n, Dec&& dec) {
  const int64_t nblocks = (n + kSquareBlock - 1) / kSquareBlock;
  std::vector<double> partial(size_t(nblocks), 0.0);
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t b = 0; b < nblocks; ++b) {
    const T* xb = x + b * kSquareBlock;
    const int64_t len = std::min(kSquareBlock, n - b * kSquareBlock);
    partial[size_t(b)] = lane_sum<double>(len, [&](int64_t i) {
      const double d = double(dec(xb[i]));
      return d * d;
    });
  }
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

}  // namespace

AdamWCoefs adamw_coefs(const AdamWParams& p) {
  const double lr = decimal_value(p.lr), wd = decimal_value(p.weight_decay);
  const double b1 = decimal_value(p.beta1), b2 = decimal_value(p.beta2);
  const double bc1 = 1.0 - std::pow(b1, double(p.step));
  const double bc2 = 1.0 - std::pow(b2, double(p.step));
  AdamWCoefs c;
  c.decay = float(1.0 - lr * wd);
  c.beta1 = p.beta1;
  c.one_minus_beta1 = float(1.0 - b1);
  c.beta2 = p.beta2;
  c.one_minus_beta2 = float(1.0 - b2);
  c.neg_step_size = float(-(lr / bc1));
  c.bc2_sqrt = float(std::sqrt(bc2));
  c.eps = p.eps;
  c.grad_scale = p.grad_scale;
  return c;
}

void CpuOps::do_adamw_update(TensorView param, TensorView grad, TensorView m, TensorView v, const AdamWParams& p,
                             TensorView compute) const {
  const int64_t n = param.numel();
  const AdamWCoefs k = adamw_coefs(p);
  float* pp = param.data<float>();
  float* pg = grad.data<float>();
  float* pm = m.data<float>();
  float* pv = v.data<float>();
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  const bool zero_grad = p.zero_grad;
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t off = c * kChunk;
    const int64_t len = std::min(kChunk, n - off);
    adamw_chunk(pp + off, pg + off, pm + off, pv + off, len, k, zero_grad);
    if (compute.defined()) narrow(elem_ptr(compute.raw(), compute.dtype(), off), compute.dtype(), pp + off, len);
  }
}

double CpuOps::do_sum_squares(TensorView x) const {
  const int64_t n = x.numel();
  const auto* h = static_cast<const uint16_t*>(x.raw());
  const auto* q = static_cast<const uint8_t*>(x.raw());
  switch (x.dtype()) {
    case DType::kF32: return sum_squares_typed(x.data<float>(), n, [](float v) { return v; });
    case DType::kBF16: return sum_squares_typed(h, n, [](uint16_t v) { return bf16_decode(v); });
    case DType::kF16: return sum_squares_typed(h, n, [](uint16_t v) { return f16_decode(v); });
    case DType::kF8E4M3: return sum_squares_typed(q, n, [](uint8_t v) { return fp8_e4m3_to_f32(v); });
    case DType::kF8E5M2: return sum_squares_typed(q, n, [](uint8_t v) { return fp8_e5m2_to_f32(v); });
    default: LOOM_FAIL("[sum_squares] expected a float tensor (f32, bf16, f16, fp8), got ", x.desc());
  }
}

}  // namespace loom::cpu

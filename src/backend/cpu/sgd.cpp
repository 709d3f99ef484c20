// SGD update (Megatron's --optimizer sgd: torch.optim.SGD with dampening 0, no Nesterov) and the zero
// count behind --log-num-zeros-in-grad.
// sgd_update follows PyTorch 1.13's single-tensor SGD operation by operation, rounding where its CPU
// kernels round:
//   g   = grad * grad_scale                  (Loom's fused unscale / clip coefficient)
//   d   = fma(p, wd, g)                      (d_p.add(param, alpha=wd): ATen's vectorised fmadd)
//   buf = buf * momentum;  buf = buf + d     (mul_, then add_(d_p, alpha=1): two roundings)
//   p   = fma(d or buf, -lr, p)              (param.add_(d_p, alpha=-lr))
// PyTorch starts the buffer as clone(d) on its first step; a zero buffer gives the same bits
// (0 * momentum + d = d). This file is compiled with -ffp-contract=off (CMakeLists.txt): the product
// buf * momentum must be rounded before the add, which contraction into an FMA would not do; the two
// fused steps are explicit std::fma. Hyper-parameters reach PyTorch as Python floats and are rounded
// to f32 by the kernels (alpha.to<float>()), which is what the op receives.
// count_zeros tests the raw encoding: an element is zero when every bit but the sign is clear. abs_stats
// (--log-optimizer-states-to-tensorboard) sums |x| and sqrt|x| in f64 over fixed blocks combined in order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/lowp.h"

namespace loom::cpu {

namespace {

constexpr int64_t kChunk = 4096;
constexpr int64_t kParallelMin = int64_t(1) << 15;

template <bool kDecay, bool kMomentum>
void sgd_chunk(float* __restrict param, float* __restrict grad, float* __restrict buf, int64_t n, const SgdParams& p,
               float neg_lr) {
  const float gs = p.grad_scale, wd = p.weight_decay, mom = p.momentum;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float d = grad[i] * gs;
    if constexpr (kDecay) d = std::fma(param[i], wd, d);
    if constexpr (kMomentum) {
      const float b = buf[i] * mom + d;  // not contracted: -ffp-contract=off
      buf[i] = b;
      d = b;
    }
    param[i] = std::fma(d, neg_lr, param[i]);
  }
  if (p.zero_grad) std::fill(grad, grad + n, 0.0f);
}

template <typename U>
int64_t count_zero_bits(const U* x, int64_t n, U magnitude_mask) {
  int64_t zeros = 0;
#pragma omp parallel for simd schedule(static) reduction(+ : zeros) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) zeros += int64_t((x[i] & magnitude_mask) == 0);
  return zeros;
}

}  // namespace

void CpuOps::do_sgd_update(TensorView param, TensorView grad, TensorView momentum_buf, const SgdParams& p,
                           TensorView compute) const {
  const int64_t n = param.numel();
  float* pp = param.data<float>();
  float* pg = grad.data<float>();
  float* pb = p.momentum != 0.0f ? momentum_buf.data<float>() : nullptr;
  const float neg_lr = -p.lr;
  const bool decay = p.weight_decay != 0.0f, momentum = pb != nullptr;
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t off = c * kChunk, len = std::min(kChunk, n - off);
    float* b = momentum ? pb + off : nullptr;
    if (decay && momentum) sgd_chunk<true, true>(pp + off, pg + off, b, len, p, neg_lr);
    else if (decay) sgd_chunk<true, false>(pp + off, pg + off, b, len, p, neg_lr);
    else if (momentum) sgd_chunk<false, true>(pp + off, pg + off, b, len, p, neg_lr);
    else sgd_chunk<false, false>(pp + off, pg + off, b, len, p, neg_lr);
    if (compute.defined()) narrow(elem_ptr(compute.raw(), compute.dtype(), off), compute.dtype(), pp + off, len);
  }
}

AbsStats CpuOps::do_abs_stats(TensorView x) const {
  // Fixed blocks, partials combined in block order: the result depends on numel only.
  constexpr int64_t kBlock = 8192;
  const int64_t n = x.numel(), nblocks = (n + kBlock - 1) / kBlock;
  const float* p = x.data<float>();
  std::vector<AbsStats> part(static_cast<size_t>(nblocks));
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t b = 0; b < nblocks; ++b) {
    AbsStats s;
    const int64_t end = std::min(n, (b + 1) * kBlock);
    for (int64_t i = b * kBlock; i < end; ++i) {
      const double a = std::fabs(double(p[i]));
      s.sum_abs += a;
      s.sum_sqrt_abs += std::sqrt(a);
      if (std::isnan(a) || (!std::isnan(s.max_abs) && a > s.max_abs)) s.max_abs = a;  // a NaN sticks
    }
    part[size_t(b)] = s;
  }
  AbsStats out;
  for (const AbsStats& s : part) {
    out.sum_abs += s.sum_abs;
    out.sum_sqrt_abs += s.sum_sqrt_abs;
    if (std::isnan(s.max_abs) || (!std::isnan(out.max_abs) && s.max_abs > out.max_abs)) out.max_abs = s.max_abs;
  }
  return out;
}

int64_t CpuOps::do_count_zeros(TensorView x) const {
  const int64_t n = x.numel();
  switch (dtype_size(x.dtype())) {
    case 4: return count_zero_bits(static_cast<const uint32_t*>(x.raw()), n, uint32_t(0x7FFFFFFFu));
    case 2: return count_zero_bits(static_cast<const uint16_t*>(x.raw()), n, uint16_t(0x7FFFu));
    default: return count_zero_bits(static_cast<const uint8_t*>(x.raw()), n, uint8_t(0x7Fu));
  }
}

}  // namespace loom::cpu

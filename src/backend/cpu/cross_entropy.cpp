// Fused softmax cross-entropy: loss per row and, when dlogits_scale != 0, dlogits written IN PLACE over
// the logits (no second N x Vp buffer — for GPT-2 that buffer alone would be 1.6 GB at 8k rows).
// Per row: (1) max over the V real columns, (2) e_j = exp(x_j - max) summed (and stored in place when
// the gradient is wanted), (3) dlogits_j = (e_j / sum - [j == target]) * scale * mask. A row is ~200 KB
// and stays in L2 between the passes, so memory sees one read and one write of the logits.
// exp is fast_exp (vectorised polynomial, < 1 ulp; simd16::exp on AVX-512, the same bits); the sum is
// taken in blocks of kSumBlock columns with the fixed-order lane_sum, blocks added in f64: loss accuracy
// ~1e-7 relative, order fixed by V alone.
// loss_mask scales the gradient only; losses are reported for every row. A row with loss_mask == 0 may
// carry an out-of-range target (e.g. -1 padding): its loss and gradient are then 0.
// bf16/f16 logits: each row is widened into per-thread f32 scratch (its max taken in the same pass), goes
// through the same f32 row code and (when the gradient is wanted) is scaled and narrowed back in place (RNE)
// in one pass: losses equal the f32 op's on the widened logits exactly, dlogits are its dlogits rounded once.
#include <algorithm>
#include <cmath>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/fast_math.h"
#include "backend/cpu/lowp.h"

namespace loom::cpu {

namespace {

constexpr int64_t kSumBlock = 2048;

// Sum of exp(x[j] - mx) over one block [0, n), in lane_sum's lanes and order; with Store, e_j also
// overwrites x[j]. On AVX-512 the lanes are one register and the exponential is simd16::exp (the same bits
// as fast_exp, ~1.8x faster than the compiler's code for it).
template <bool Store>
float sum_exp_block(float* xb, int64_t n, float mx) {
#if defined(__AVX512F__)
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  simd16::for_blocks(n, [&](int64_t i, __mmask16 m) {
    const __m512 e = simd16::exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, xb + i), vmx));
    if constexpr (Store) _mm512_mask_storeu_ps(xb + i, m, e);
    acc = _mm512_mask_add_ps(acc, m, acc, e);
  });
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc);
  return lane_tree(lanes);
#else
  return lane_sum<float, true>(n, [&](int64_t j) {
    const float e = fast_exp(xb[j] - mx);
    if constexpr (Store) xb[j] = e;
    return e;
  });
#endif
}

// Sum of exp(x[j] - mx) over [0, V) in blocks; with Store, e_j also overwrites x[j].
template <bool Store>
double sum_exp(float* x, int64_t V, float mx) {
  double total = 0;
  for (int64_t j0 = 0; j0 < V; j0 += kSumBlock)
    total += double(sum_exp_block<Store>(x + j0, std::min(kSumBlock, V - j0), mx));
  return total;
}

// Steps (2) and the loss of one row whose max over [0, V) is mx; with backward, e_j overwrites x[j].
struct RowSum {
  float loss;
  double sum;
};
inline RowSum ce_loss(float* x, int64_t V, float mx, int32_t t, bool valid, bool backward) {
  const float x_t = valid ? x[t] : 0.0f;  // read before the row is overwritten
  const double sum = backward ? sum_exp<true>(x, V, mx) : sum_exp<false>(x, V, mx);
  return {valid ? float(double(mx) + std::log(sum) - double(x_t)) : 0.0f, sum};
}

// Step (3) on an f32 row: x[0..Vp) becomes the row's dlogits (coef = scale * mask).
inline void ce_grad(float* x, int64_t V, int64_t Vp, int32_t t, float coef, double sum) {
  if (coef == 0.0f) {
    std::fill(x, x + Vp, 0.0f);
    return;
  }
  const float inv = float(double(coef) / sum);
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) x[j] *= inv;
  x[t] -= coef;
  std::fill(x + V, x + Vp, 0.0f);
}

// The 16-bit rows are widened into f32 scratch with their max taken in the same pass, and their dlogits are
// scaled and rounded back in one pass: the same arithmetic as widen + lane_max and ce_grad + narrow (max
// in lane_max's lanes and order, so even the sign of a zero max is the same), two passes over the row fewer.
template <typename Lp>
float widen_max(float* x, const uint16_t* src, int64_t n) {
#if defined(LOOM_LOWP_AVX512)
  auto load = [](const uint16_t* p) { return Lp::kBF16 ? bf16x16_load(p) : f16x16_load(p); };
  __m512 m = _mm512_set1_ps(Lp::dec(src[0]));
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load(src + i);
    _mm512_storeu_ps(x + i, v);
    // v > m ? v : m, as lane_max (the masked form: GCC 12 warns about _mm512_max_ps's undefined pass-through)
    m = _mm512_mask_max_ps(m, 0xFFFF, v, m);
  }
  if (i < n) {
    const int r = int(n - i);
    const __m512 v = Lp::kBF16 ? bf16x16_load_n(src + i, r) : f16x16_load_n(src + i, r);
    _mm512_mask_storeu_ps(x + i, lane_mask(r), v);
    m = _mm512_mask_max_ps(m, lane_mask(r), v, m);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, m);
  float mx = lanes[0];
  for (int l = 1; l < 16; ++l) mx = lanes[l] > mx ? lanes[l] : mx;
  return mx;
#else
  Lp::widen(x, src, n);
  return lane_max(x, n);
#endif
}

template <typename Lp>
void grad_narrow(uint16_t* dst, const float* x, int64_t V, int64_t Vp, int32_t t, float coef, double sum) {
  if (coef == 0.0f) {
    std::fill(dst, dst + Vp, Lp::enc(0.0f));
    return;
  }
  const float inv = float(double(coef) / sum);
  int64_t i = 0;
#if defined(LOOM_LOWP_AVX512)
  const __m512 vinv = _mm512_set1_ps(inv);
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), vinv);
    if constexpr (Lp::kBF16) bf16x16_store(dst + i, v);
    else f16x16_store(dst + i, v);
  }
#endif
  for (; i < V; ++i) dst[i] = Lp::enc(x[i] * inv);
  // ce_grad's two roundings, x[t] * inv and then - coef; the volatile keeps GCC (which contracts in C++
  // even with -std=c++20) from fusing them into one fms.
  const volatile float scaled = x[t] * inv;
  dst[t] = Lp::enc(scaled - coef);
  std::fill(dst + V, dst + Vp, Lp::enc(0.0f));
}

}  // namespace

void CpuOps::do_cross_entropy_forward_backward(TensorView losses, TensorView logits, TensorView targets,
                                               int64_t vocab_size, TensorView loss_mask, float dlogits_scale) const {
  const char* op = "cross_entropy_forward_backward";
  const int64_t Vp = logits.shape().cols();
  const int64_t V = vocab_size;
  const int64_t N = logits.numel() / Vp;
  const float* mask = loss_mask.defined() ? loss_mask.data<float>() : nullptr;
  const int32_t* tgt = targets.data<int32_t>();
  // The target values are checked by each backend where it can read them (here: host memory), all before any
  // row is touched; shapes and dtypes were checked by the OpTable entry point.
  for (int64_t n = 0; n < N; ++n) {
    const bool masked_out = mask && mask[n] == 0.0f;
    LOOM_CHECK(masked_out || (tgt[n] >= 0 && tgt[n] < V), "[", op, "] target ", tgt[n], " of row ", n,
               " is outside the vocabulary [0, ", V, ") and the row is not masked out");
  }

  float* loss = losses.data<float>();
  const bool backward = dlogits_scale != 0.0f;
  auto coef_of = [&](int64_t n, bool valid) { return valid ? dlogits_scale * (mask ? mask[n] : 1.0f) : 0.0f; };
  if (logits.dtype() == DType::kF32) {
    float* x_all = logits.data<float>();
#pragma omp parallel for schedule(static) if (N > 1)
    for (int64_t n = 0; n < N; ++n) {
      const int32_t t = tgt[n];
      const bool valid = t >= 0 && t < V;
      float* x = x_all + n * Vp;
      const RowSum r = ce_loss(x, V, lane_max(x, V), t, valid, backward);
      loss[n] = r.loss;
      if (backward) ce_grad(x, V, Vp, t, coef_of(n, valid), r.sum);
    }
    return;
  }
  with_lowp(logits.dtype(), [&](auto L) {
    using Lp = decltype(L);
    uint16_t* x_all = static_cast<uint16_t*>(logits.raw());
#pragma omp parallel for schedule(static) if (N > 1)
    for (int64_t n = 0; n < N; ++n) {
      const int32_t t = tgt[n];
      const bool valid = t >= 0 && t < V;
      float* x = thread_scratch(0, size_t(V));
      uint16_t* row = x_all + n * Vp;
      const RowSum r = ce_loss(x, V, widen_max<Lp>(x, row, V), t, valid, backward);
      loss[n] = r.loss;
      if (backward) grad_narrow<Lp>(row, x, V, Vp, t, coef_of(n, valid), r.sum);
    }
  });
}

}  // namespace loom::cpu

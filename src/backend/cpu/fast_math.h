// Vectorisable scalar math for the CPU ops: written with plain arithmetic and bit casts only, so that a
// loop calling them under `#pragma omp simd` compiles to straight-line SIMD code (libm's expf does not
// vectorise without -ffast-math). Accuracy is stated per function and checked in test_cpu_math.cpp.
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

// `omp simd` for loops of the transcendental activations (GeLU, SiLU and their gradients: ~30 flops per
// element). GCC's -march=native on AVX-512 CPUs prefers 256-bit vectors; these compute-bound loops run
// about twice as fast on full 512-bit ones. Per-element results do not depend on the vector width.
#if defined(__AVX512F__)
#define LOOM_SIMD_ACTIVATION _Pragma("omp simd simdlen(16)")
#else
#define LOOM_SIMD_ACTIVATION _Pragma("omp simd")
#endif

namespace loom::cpu {

// exp(x) for f32, error < 1 ulp over the normal range (0.89 ulp max measured on 23M inputs).
// Range reduction x = n ln2 + r with |r| <= ln2/2 (Cody-Waite split of ln2 so n * kLn2Hi is exact),
// degree-7 Taylor polynomial for e^r (truncation error r^8/8! < 6e-9, below half an ulp), and 2^n
// applied as two normal powers of two so results that are subnormal or overflow come out right (0 for
// x -> -inf, inf for x > ~88.72). NaN propagates.
// e^r for |r| <= ln2 / 2: Taylor polynomial to r^7 (truncation error < 6e-9), shared by the exp variants.
inline float exp_reduced_poly(float r) {
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p;
}

inline float fast_exp(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;     // 355/512: 9 significant bits
  constexpr float kLn2Lo = -2.12194440e-4f;  // ln2 - kLn2Hi
  constexpr float kRound = 12582912.0f;      // 1.5 * 2^23: adding it rounds to an integer (ties even)
  x = x < -110.0f ? -110.0f : x;             // below: exp underflows to 0 anyway
  x = x > 89.0f ? 89.0f : x;                 // above: exp overflows to inf anyway
  const float n = (x * kLog2e + kRound) - kRound;
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  const float p = exp_reduced_poly(r);
  const int32_t ni = int32_t(n == n ? n : 0.0f);  // in [-159, 129]; NaN (p is NaN too) kept out of the cast
  const int32_t n1 = ni >> 1, n2 = ni - n1;
  const float s1 = std::bit_cast<float>(uint32_t(n1 + 127) << 23);
  const float s2 = std::bit_cast<float>(uint32_t(n2 + 127) << 23);
  return (p * s1) * s2;
}

// 1 / (1 + e^-x) without cancellation for either sign (e^-x -> inf gives 0, e^-x -> 0 gives 1).
inline float fast_sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }

// sigmoid(x) and 1 - sigmoid(x) = e · sigmoid(x) with e = exp(-x): no cancellation when sigmoid(x) is close
// to 1 (derivatives need the second).
struct SigmoidPair {
  float s, one_minus_s;
};
inline SigmoidPair fast_sigmoid_pair(float x) {
  const float e = fast_exp(-x);
  const float s = 1.0f / (1.0f + e);
  return {s, e < INFINITY ? e * s : 1.0f};  // e = inf: s = 0 and e * s would be NaN
}

// GeLU, tanh form, rewritten with 0.5 (1 + tanh(u)) = sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x³): no
// cancellation for large |x|. gelu_forward/gelu_backward and GeGLU use these, so they agree bit for bit.
inline constexpr float kGeluK0 = 0.7978845608028654f;  // sqrt(2 / pi)
inline constexpr float kGeluK1 = 0.044715f;

inline float fast_gelu(float x) {
  const float u = kGeluK0 * (x + kGeluK1 * x * x * x);
  return x * fast_sigmoid(2.0f * u);
}

// gelu(x) and its derivative d/dx [x s(2u)] = s + 2 x s (1 - s) u', s = sigmoid(2u) (one exponential).
inline void fast_gelu_and_grad(float x, float& a, float& da) {
  const float u = kGeluK0 * (x + kGeluK1 * x * x * x);
  const float du = kGeluK0 * (1.0f + 3.0f * kGeluK1 * x * x);
  const SigmoidPair sg = fast_sigmoid_pair(2.0f * u);
  a = x * sg.s;
  da = sg.s + 2.0f * x * sg.s * sg.one_minus_s * du;
}

#if defined(__AVX512F__)
// fast_exp and the activations above (the GeLU / GLU kernels, the cross-entropy's exponentials), 16 lanes
// at a time in AVX-512 intrinsics, operation for operation the same roundings as the scalar forms compiled
// under `omp simd` (GCC contracts a * b + c into one FMA; these write the FMAs out), so every lane gives the
// scalar function's bits (test_cpu_math.cpp checks ~2^27 inputs per function). Faster where it differs:
// the clamps are vmaxps/vminps and 2^n is applied by vscalefps, which rounds p · 2^n once, as
// (p · s1) · s2 does (p · s1 is exact); no masks, blends or integer shifts. GeLU's forward runs ~1.8x as
// fast as the compiler's code for the scalar form.
namespace simd16 {

// The maskz forms with a full mask avoid GCC 12's -Wmaybe-uninitialized false positive on the plain ones.
constexpr __mmask16 kAll = 0xFFFF;

inline __m512 exp(__m512 x) {
  x = _mm512_maskz_max_ps(kAll, _mm512_set1_ps(-110.0f), x);  // (x < -110) ? -110 : x, NaN kept (2nd operand)
  x = _mm512_maskz_min_ps(kAll, _mm512_set1_ps(89.0f), x);
  const __m512 round = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), round), round);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(kAll, p, n);
}

inline __m512 neg(__m512 x) {  // -x: the sign bit flipped, as the scalar forms' unary minus
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
}

inline __m512 sigmoid(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp(neg(x))));
}

inline void sigmoid_pair(__m512 x, __m512& s, __m512& one_minus_s) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = exp(neg(x));
  s = _mm512_div_ps(one, _mm512_add_ps(one, e));
  const __mmask16 finite = _mm512_cmp_ps_mask(e, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
  one_minus_s = _mm512_mask_mul_ps(one, finite, e, s);
}

// SiLU (SwiGLU's activation) x · sigmoid(x), and with its derivative s + x s (1 - s), as glu.cpp's scalar
// forms compute them.
inline __m512 silu(__m512 x) { return _mm512_mul_ps(x, sigmoid(x)); }

inline void silu_and_grad(__m512 x, __m512& a, __m512& da) {
  __m512 s, oms;
  sigmoid_pair(x, s, oms);
  a = _mm512_mul_ps(x, s);
  da = _mm512_fmadd_ps(a, oms, s);
}

// 2u, u = sqrt(2/pi) (x + 0.044715 x^3), as fast_gelu computes it.
inline __m512 gelu_2u(__m512 x) {
  const __m512 cubic = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(kGeluK1), x), x), x, x);
  return _mm512_mul_ps(_mm512_set1_ps(2.0f), _mm512_mul_ps(_mm512_set1_ps(kGeluK0), cubic));
}

inline __m512 gelu(__m512 x) { return _mm512_mul_ps(x, sigmoid(gelu_2u(x))); }

inline void gelu_and_grad(__m512 x, __m512& a, __m512& da) {
  constexpr float k3 = 3.0f * kGeluK1;
  const __m512 du = _mm512_mul_ps(_mm512_set1_ps(kGeluK0),
                                  _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(k3), x), x, _mm512_set1_ps(1.0f)));
  __m512 s, oms;
  sigmoid_pair(gelu_2u(x), s, oms);
  a = _mm512_mul_ps(x, s);
  const __m512 t = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(2.0f), x), s), oms);
  da = _mm512_fmadd_ps(t, du, s);
}

// f(i, mask) over 16-element blocks of [0, n), the last one masked to the elements that exist.
template <typename F>
inline void for_blocks(int64_t n, F&& f) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) f(i, __mmask16(0xFFFF));
  if (i < n) f(i, __mmask16((1u << (n - i)) - 1u));
}

}  // namespace simd16
#endif

// acc[0] + ... + acc[15] by the fixed pairwise tree lane_sum ends with (lane l + w into lane l, w = 8, 4, 2, 1).
template <typename Acc>
inline Acc lane_tree(Acc (&acc)[16]) {
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// Sum of f(i) over i in [0, n) in an order fixed by n alone: 16 lanes (lane l takes i = l mod 16 over the
// full groups of 16, then the tail), combined by a fixed pairwise tree. The compiler maps the lanes onto
// SIMD registers, and the result does not depend on alignment, vector width or thread count — so a
// recomputed forward (other buffers, other alignment) reproduces its statistics bit for bit. kWide asks for
// all 16 lanes in one 512-bit vector on AVX-512 (LOOM_SIMD_ACTIVATION) where f is an exponential or similar;
// for plain loads GCC's default 256-bit code is faster (a LayerNorm forward took 8-14% longer with 512).
template <typename Acc, bool kWide = false, typename F>
inline Acc lane_sum(int64_t n, F&& f) {
  constexpr int kLanes = 16;
  Acc acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    if constexpr (kWide) {
      LOOM_SIMD_ACTIVATION
      for (int l = 0; l < kLanes; ++l) acc[l] += f(i + l);
    } else {
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) acc[l] += f(i + l);
    }
  }
  for (int l = 0; i + l < n; ++l) acc[l] += f(i + l);
  return lane_tree(acc);
}

// max of x[0..n), n >= 1. `#pragma omp simd reduction(max:)` over std::max stays scalar in GCC 12;
// explicit lanes with `omp simd` on the lane loop compile to vmaxps. NaN inputs are skipped (compare
// false); callers that must propagate NaN do so through later arithmetic on the same values.
inline float lane_max(const float* x, int64_t n) {
  constexpr int kLanes = 16;
  float m[kLanes];
  for (int l = 0; l < kLanes; ++l) m[l] = x[0];
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) m[l] = x[i + l] > m[l] ? x[i + l] : m[l];
  }
  for (int l = 0; i + l < n; ++l) m[l] = x[i + l] > m[l] ? x[i + l] : m[l];
  float r = m[0];
  for (int l = 1; l < kLanes; ++l) r = m[l] > r ? m[l] : r;
  return r;
}

// x[i] = sqrt(x[i]), correctly rounded. libm's sqrtf keeps an errno path that stops GCC vectorising any
// loop calling it (the build does not pass -fno-math-errno), so the SIMD instruction is used directly.
inline void sqrt_inplace(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  // The maskz form with a full mask avoids a GCC 12 -Wmaybe-uninitialized false positive.
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_maskz_sqrt_ps(0xFFFF, _mm512_loadu_ps(x + i)));
#elif defined(__AVX__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_sqrt_ps(_mm256_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) x[i] = std::sqrt(x[i]);
}

}  // namespace loom::cpu

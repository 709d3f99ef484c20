// bf16 / f16 <-> f32 conversion for the CPU ops (mixed precision): scalar codecs, 16-lane AVX-512
// loads/stores, whole-row widen/narrow, a compile-time dtype dispatch and per-thread f32 scratch.
// Invariants (checked in test_lowp_ops.cpp over every 16-bit pattern and the cast test's hard inputs):
//   - widening is exact; narrowing is round-to-nearest-even and returns exactly the bits of the core
//     conversions loom::f32_to_bf16 / loom::f32_to_f16, subnormals included (the AVX512-BF16
//     instruction VCVTNEPS2BF16 flushes f32 subnormals to zero, so a vector holding one is narrowed
//     with integer RNE instead);
//     NaN narrows to a quiet NaN with the sign kept (bf16: the top payload bits, f16: 0x7E00);
//   - the vector and scalar forms agree bit for bit, so results never depend on where a row's tail
//     falls or on the buffer's alignment.
// The lowp ops are written as "widen the row (or chunk) into f32 scratch, run the f32 kernel, narrow":
// their result is, by construction, the f32 op run on the widened inputs, rounded once.
#pragma once
#include <bit>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "loom/core/check.h"
#include "loom/core/dtype.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define LOOM_LOWP_AVX512 1
#endif

namespace loom::cpu {

// ---- scalar codecs (branch-free, so loops calling them vectorise) -----------------------------

inline float bf16_decode(uint16_t x) { return std::bit_cast<float>(uint32_t(x) << 16); }

// f32 -> bf16, identical to loom::f32_to_bf16 (RNE; NaN quietened with its sign kept).
inline uint16_t bf16_encode(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x0040u;
  return uint16_t((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

// f16 -> f32, exact. The 15 magnitude bits shifted into an f32's exponent/mantissa field give the value
// scaled by 2^-112 (for subnormals too: f32's exponent range covers them), so one multiply by 2^112
// finishes the job; inf/NaN (exponent 31) are rebuilt with an all-ones f32 exponent.
inline float f16_decode(uint16_t x) {
  const uint32_t sign = uint32_t(x & 0x8000u) << 16;
  const uint32_t mag = x & 0x7FFFu;
  const float scaled = std::bit_cast<float>(mag << 13) * 0x1p112f;
  const uint32_t bits = mag >= 0x7C00u ? ((mag << 13) | 0x7F800000u) : std::bit_cast<uint32_t>(scaled);
  return std::bit_cast<float>(sign | bits);
}

// f32 -> f16, identical to loom::f32_to_f16 (RNE, overflow to inf, NaN -> sign | 0x7E00), branch-free.
inline uint16_t f16_encode(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // Normal range: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even; a
  // mantissa carry moves into the exponent, which is what rounding up to the next binade means.
  const uint32_t normal = (a - 0x38000000u + 0x0FFFu + ((a >> 13) & 1u)) >> 13;
  // Subnormal range (|x| < 2^-14): the f16 bits are round(|x| * 2^24) = round(m * 2^(e - 126)).
  const uint32_t e = a >> 23;
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t ec = e < 125u ? e : 125u;  // keeps the shift in [1, 31] for lanes the select discards
  const uint32_t shift = 126u - ec < 31u ? 126u - ec : 31u;
  const uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  const uint32_t sub = q + uint32_t(rem > half || (rem == half && (q & 1u)));
  uint32_t bits = a < 0x38800000u ? sub : normal;
  bits = a >= 0x477FF000u ? 0x7C00u : bits;  // >= 65520 rounds past the largest finite value
  bits = a > 0x7F800000u ? 0x7E00u : bits;
  return uint16_t(sign | bits);
}

// ---- 16 lanes (AVX-512) -------------------------------------------------------------------------
// *_n forms touch only the first n (0..16) elements in memory; loaded lanes >= n are 0.
// Full-mask maskz forms where GCC 12's plain intrinsics trip -Wmaybe-uninitialized (same instructions).
#if defined(LOOM_LOWP_AVX512)
inline __mmask16 lane_mask(int n) { return __mmask16(n >= 16 ? 0xFFFFu : (1u << n) - 1u); }

inline __m512 bf16x16_widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, h), 16));
}
// Integer RNE (the core conversion's arithmetic), used where the instruction below would flush.
inline __m256i bf16x16_narrow_int(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i hi = _mm512_maskz_srli_epi32(0xFFFF, u, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_maskz_srli_epi32(0xFFFF, _mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x0040)));
  return _mm512_maskz_cvtepi32_epi16(0xFFFF, r);
}
inline __m256i bf16x16_narrow(__m512 v) {
#if defined(__AVX512BF16__)
  // VCVTNEPS2BF16 rounds to nearest even and quietens NaN exactly as the core conversion does, but
  // flushes f32 subnormals to zero: a vector holding one (rare) takes the integer rounding.
  const __m512i u = _mm512_castps_si512(v);
  const __mmask16 sub = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7F800000)) &
                        _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x007FFFFF));
  if (sub) return bf16x16_narrow_int(v);
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  return bf16x16_narrow_int(v);
#endif
}
inline __m512 f16x16_widen(__m256i h) { return _mm512_maskz_cvtph_ps(0xFFFF, h); }
inline __m256i f16x16_narrow(__m512 v) {
  const __m256i h = _mm512_maskz_cvtps_ph(0xFFFF, v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // VCVTPS2PH keeps NaN payload bits; the core conversion returns the canonical sign | 0x7E00.
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m256i canon = _mm256_or_si256(_mm256_and_si256(h, _mm256_set1_epi16(int16_t(0x8000))),
                                        _mm256_set1_epi16(0x7E00));
  return _mm256_mask_blend_epi16(nan, h, canon);
}

inline __m512 bf16x16_load(const uint16_t* p) { return bf16x16_widen(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512 bf16x16_load_n(const uint16_t* p, int n) {
  return bf16x16_widen(_mm256_maskz_loadu_epi16(lane_mask(n), p));
}
inline void bf16x16_store(uint16_t* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, bf16x16_narrow(v)); }
inline void bf16x16_store_n(uint16_t* p, __m512 v, int n) {
  _mm256_mask_storeu_epi16(p, lane_mask(n), bf16x16_narrow(v));
}
inline __m512 f16x16_load(const uint16_t* p) { return f16x16_widen(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512 f16x16_load_n(const uint16_t* p, int n) {
  return f16x16_widen(_mm256_maskz_loadu_epi16(lane_mask(n), p));
}
inline void f16x16_store(uint16_t* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, f16x16_narrow(v)); }
inline void f16x16_store_n(uint16_t* p, __m512 v, int n) {
  _mm256_mask_storeu_epi16(p, lane_mask(n), f16x16_narrow(v));
}
#endif

// ---- compile-time dtype traits ------------------------------------------------------------------
// Lowp<D> for D = kBF16 / kF16: storage type T (uint16_t), scalar dec/enc, and widen/narrow of n
// contiguous elements. (f32 is handled by the callers' existing f32 code, never through Lowp.)
template <DType D>
struct Lowp {
  static_assert(D == DType::kBF16 || D == DType::kF16, "Lowp is for bf16 and f16 only");
  using T = uint16_t;
  static constexpr DType kDType = D;
  static constexpr bool kBF16 = D == DType::kBF16;
  static float dec(T x) { return kBF16 ? bf16_decode(x) : f16_decode(x); }
  static T enc(float x) { return kBF16 ? bf16_encode(x) : f16_encode(x); }
  static void widen(float* dst, const T* src, int64_t n) {
    int64_t i = 0;
#if defined(LOOM_LOWP_AVX512)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, kBF16 ? bf16x16_load(src + i) : f16x16_load(src + i));
    if (i < n) {
      const int r = int(n - i);
      _mm512_mask_storeu_ps(dst + i, lane_mask(r), kBF16 ? bf16x16_load_n(src + i, r) : f16x16_load_n(src + i, r));
    }
#else
    for (; i < n; ++i) dst[i] = dec(src[i]);
#endif
  }
  static void narrow(T* dst, const float* src, int64_t n) {
    int64_t i = 0;
#if defined(LOOM_LOWP_AVX512)
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(src + i);
      if constexpr (kBF16) bf16x16_store(dst + i, v);
      else f16x16_store(dst + i, v);
    }
    if (i < n) {
      const int r = int(n - i);
      const __m512 v = _mm512_maskz_loadu_ps(lane_mask(r), src + i);
      if constexpr (kBF16) bf16x16_store_n(dst + i, v, r);
      else f16x16_store_n(dst + i, v, r);
    }
#else
    for (; i < n; ++i) dst[i] = enc(src[i]);
#endif
  }
};

// ---- runtime dtype -> row conversion --------------------------------------------------------------

inline bool is_lowp(DType dt) { return dt == DType::kBF16 || dt == DType::kF16; }
// f32, bf16 or f16: the dtypes activations and parameters may have.
inline bool is_compute_dtype(DType dt) { return dt == DType::kF32 || is_lowp(dt); }

// Address of element i of a buffer whose elements are dtype_size(dt) bytes.
inline const void* elem_ptr(const void* base, DType dt, int64_t i) {
  return static_cast<const char*>(base) + i * int64_t(dtype_size(dt));
}
inline void* elem_ptr(void* base, DType dt, int64_t i) {
  return static_cast<char*>(base) + i * int64_t(dtype_size(dt));
}

// dst[0..n) = src[0..n) as f32 (exact); src is f32, bf16 or f16.
inline void widen(float* dst, const void* src, DType dt, int64_t n) {
  switch (dt) {
    case DType::kF32:
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<const float*>(src)[i];
      return;
    case DType::kBF16: Lowp<DType::kBF16>::widen(dst, static_cast<const uint16_t*>(src), n); return;
    case DType::kF16: Lowp<DType::kF16>::widen(dst, static_cast<const uint16_t*>(src), n); return;
    default: LOOM_FAIL("[widen] expected f32, bf16 or f16, got ", dtype_name(dt));
  }
}

// dst[0..n) = src[0..n) rounded (RNE) to dt (f32: copied).
inline void narrow(void* dst, DType dt, const float* src, int64_t n) {
  switch (dt) {
    case DType::kF32:
      for (int64_t i = 0; i < n; ++i) static_cast<float*>(dst)[i] = src[i];
      return;
    case DType::kBF16: Lowp<DType::kBF16>::narrow(static_cast<uint16_t*>(dst), src, n); return;
    case DType::kF16: Lowp<DType::kF16>::narrow(static_cast<uint16_t*>(dst), src, n); return;
    default: LOOM_FAIL("[narrow] expected f32, bf16 or f16, got ", dtype_name(dt));
  }
}

// Calls f(Lowp<kBF16>{}) or f(Lowp<kF16>{}) for a low-precision dt (callers handle f32 themselves).
template <typename F>
decltype(auto) with_lowp(DType dt, F&& f) {
  if (dt == DType::kBF16) return f(Lowp<DType::kBF16>{});
  LOOM_CHECK(dt == DType::kF16, "[with_lowp] expected bf16 or f16, got ", dtype_name(dt));
  return f(Lowp<DType::kF16>{});
}

// ---- per-thread scratch -------------------------------------------------------------------------
// f32 buffer `slot` (0..7) of the calling thread with room for n floats, kept across calls (OpenMP
// threads persist, so the steady state allocates nothing). Contents are undefined on return; two
// slots never alias. A buffer must not be held across a call into another op that may take the same
// slot on the same thread (the CPU ops use them only inside one op call, and never call each other
// while holding one).
inline float* thread_scratch(int slot, size_t n) {
  thread_local std::vector<float> bufs[8];
  std::vector<float>& b = bufs[slot];
  if (b.size() < n) b.resize(n);
  return b.data();
}

}  // namespace loom::cpu

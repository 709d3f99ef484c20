// VDPBF16PS block products of the CPU attention core (attention_bf16.h).
// Register blocking as in attention_tiles.cpp: 4 rows of c x up to 4 vectors of 16 lanes = 16 accumulators,
// the 4 vectors of B's current pair row and one broadcast pair of a fit the 32 AVX-512 registers. Compiled
// for AVX512-BF16 whatever the build's -march (the function attributes below) and chosen at run time.
#include "backend/cpu/attention_bf16.h"

#include <atomic>
#include <cstring>

#include "loom/core/check.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LOOM_HAVE_BF16_DOT 1
#endif

namespace loom::cpu::attn {

namespace {

std::atomic<bool> g_switch{true};

#if defined(LOOM_HAVE_BF16_DOT)
// c[r][0 : NV*16] (+)= sum_p a_pair[r][p] . b_pair[p][0 : NV*16] for 4 rows.
template <int NV>
__attribute__((target("avx512f,avx512bf16"))) void rows4(float* c, int64_t ldc, const uint16_t* a,
                                                                 int64_t lda, const uint32_t* b, int64_t ldb,
                                                                 int64_t pairs, bool accumulate) {
  __m512 acc[4][NV];
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? _mm512_loadu_ps(c + r * ldc + v * 16) : _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + p * ldb + v * 16);
    for (int r = 0; r < 4; ++r) {
      uint32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * p, sizeof(pair));
      const __m512bh av = (__m512bh)_mm512_set1_epi32(int(pair));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + r * ldc + v * 16, acc[r][v]);
}

bool detect() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16"); }
#endif

}  // namespace

bool bf16_dot_supported() {
#if defined(LOOM_HAVE_BF16_DOT)
  static const bool supported = detect();
  return supported;
#else
  return false;
#endif
}

bool bf16_attention_enabled() { return g_switch.load(std::memory_order_relaxed) && bf16_dot_supported(); }

void set_bf16_attention(bool on) { g_switch.store(on, std::memory_order_relaxed); }

void bf16_gemm(float* c, int64_t ldc, const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t m,
               int64_t n, int64_t k, bool accumulate) {
#if defined(LOOM_HAVE_BF16_DOT)
  LOOM_CHECK(bf16_dot_supported(), "[attention] bf16 products need AVX512-BF16, which this CPU does not have");
  LOOM_CHECK(m % 4 == 0 && n % 16 == 0 && k % 2 == 0 && lda % 2 == 0, "[attention] bf16_gemm shape ", m, " x ", n,
             " x ", k, " (lda ", lda, ") is not a multiple of 4 x 16 x 2");
  const int64_t pairs = k / 2;
  for (int64_t j = 0; j < n; j += 64) {
    const int64_t nv = std::min<int64_t>(4, (n - j) / 16);
    for (int64_t i = 0; i < m; i += 4) {
      float* ci = c + i * ldc + j;
      const uint16_t* ai = a + i * lda;
      switch (nv) {
        case 4: rows4<4>(ci, ldc, ai, lda, b + j, ldb, pairs, accumulate); break;
        case 3: rows4<3>(ci, ldc, ai, lda, b + j, ldb, pairs, accumulate); break;
        case 2: rows4<2>(ci, ldc, ai, lda, b + j, ldb, pairs, accumulate); break;
        default: rows4<1>(ci, ldc, ai, lda, b + j, ldb, pairs, accumulate); break;
      }
    }
  }
#else
  LOOM_FAIL("[attention] bf16 products need AVX512-BF16, which this build's target does not have");
#endif
}

}  // namespace loom::cpu::attn

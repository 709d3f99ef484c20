// Philox4x32-10 for 16 counters at once, for the CPU dropout kernels (dropout.cpp, attention dropout in
// attention_tiles.cpp). The words are exactly loom::philox4x32's (core/rng.h) — the mask rule stays the
// one of dropout_keep — only computed 16 blocks per call: with AVX-512 the 32x32->64 products run as
// vpmuludq on even and odd lanes (~4x the scalar throughput; GCC 12 turns the portable loop into slow
// 64-bit vpmullq); elsewhere each lane calls the scalar function. test_dropout.cpp checks both users
// against dropout_keep element by element.
#pragma once
#include <cstdint>
#include <cstring>
#include <utility>

#include "loom/core/rng.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace loom::cpu {

// words[w][l] = philox4x32(seed, stream, block[l])[w] for l in [0, 16).
inline void philox4x32_x16(uint32_t (&words)[4][16], uint64_t seed, uint64_t stream, const uint64_t (&block)[16]) {
#if defined(__AVX512F__)
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // as in core/rng.cpp
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  const __m512i b0 = _mm512_loadu_si512(block), b1 = _mm512_loadu_si512(block + 8);
  const __m512i lo_idx = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i hi_idx = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  __m512i c0 = _mm512_permutex2var_epi32(b0, lo_idx, b1);  // counter: (block lo, block hi, stream lo, hi)
  __m512i c1 = _mm512_permutex2var_epi32(b0, hi_idx, b1);
  __m512i c2 = _mm512_set1_epi32(int32_t(uint32_t(stream)));
  __m512i c3 = _mm512_set1_epi32(int32_t(uint32_t(stream >> 32)));
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  const __m512i m0 = _mm512_set1_epi32(int32_t(kM0)), m1 = _mm512_set1_epi32(int32_t(kM1));
  // Low and high halves of the 64-bit products a * m, lane by lane. (The maskz forms with full masks avoid
  // GCC 12 -Wmaybe-uninitialized false positives in the plain intrinsics.)
  auto mul = [](__m512i a, __m512i m, __m512i& lo, __m512i& hi) {
    const __m512i even = _mm512_maskz_mul_epu32(0xFF, a, m);
    const __m512i odd = _mm512_maskz_mul_epu32(0xFF, _mm512_maskz_srli_epi64(0xFF, a, 32), m);
    lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_maskz_slli_epi64(0xFF, odd, 32));
    hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_maskz_srli_epi64(0xFF, even, 32), odd);
  };
  for (int r = 0; r < 10; ++r) {
    __m512i lo0, hi0, lo1, hi1;
    mul(c0, m0, lo0, hi0);
    mul(c2, m1, lo1, hi1);
    c0 = _mm512_ternarylogic_epi32(hi1, c1, _mm512_set1_epi32(int32_t(k0)), 0x96);  // three-way xor
    c2 = _mm512_ternarylogic_epi32(hi0, c3, _mm512_set1_epi32(int32_t(k1)), 0x96);
    c1 = lo1;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  _mm512_storeu_si512(words[0], c0);
  _mm512_storeu_si512(words[1], c1);
  _mm512_storeu_si512(words[2], c2);
  _mm512_storeu_si512(words[3], c3);
#else
  for (int l = 0; l < 16; ++l) {
    const auto w = philox4x32(seed, stream, block[l]);
    for (int k = 0; k < 4; ++k) words[k][l] = w[k];
  }
#endif
}

using U32x16 = uint32_t __attribute__((vector_size(64)));

namespace philox_detail {
// Pair-wise interleaves (vectors by reference: no ABI note on targets without AVX-512):
// spread: out = a[H], b[H], a[H+1], b[H+1], ..., a[H+7], b[H+7] (H = 0 or 8);
// pairs:  out = a[H], a[H+1], b[H], b[H+1], a[H+2], a[H+3], b[H+2], b[H+3], ... (pairs of a and b alternate).
template <size_t H, size_t... J>
inline void spread(U32x16& out, const U32x16& a, const U32x16& b, std::index_sequence<J...>) {
  out = __builtin_shufflevector(a, b, int(J % 2 ? 16 + H + J / 2 : H + J / 2)...);
}
template <size_t H, size_t... J>
inline void pairs(U32x16& out, const U32x16& a, const U32x16& b, std::index_sequence<J...>) {
  out = __builtin_shufflevector(a, b, int((J / 2) % 2 ? 16 + H + 2 * (J / 4) + J % 2 : H + 2 * (J / 4) + J % 2)...);
}
}  // namespace philox_detail

// The 64 words of blocks [first, first + 16) in element order: out[4 * l + w] = word w of block first + l,
// i.e. out[e] is the word dropout_keep compares for element index 4 * first + e.
inline void philox_words_x64(uint32_t (&out)[64], uint64_t seed, uint64_t stream, uint64_t first) {
  using namespace philox_detail;
  uint64_t block[16];
  for (int l = 0; l < 16; ++l) block[l] = first + uint64_t(l);
  alignas(64) uint32_t words[4][16];
  philox4x32_x16(words, seed, stream, block);
  // 4 x 16 -> 16 x 4 transpose in two rounds of two-source shuffles.
  U32x16 c[4], w01[2], w23[2], r;
  for (int w = 0; w < 4; ++w) std::memcpy(&c[w], words[w], sizeof(U32x16));
  constexpr auto kSeq = std::make_index_sequence<16>{};
  spread<0>(w01[0], c[0], c[1], kSeq);  // blocks 0..7, words 0 and 1
  spread<8>(w01[1], c[0], c[1], kSeq);  // blocks 8..15
  spread<0>(w23[0], c[2], c[3], kSeq);
  spread<8>(w23[1], c[2], c[3], kSeq);
  for (int h = 0; h < 2; ++h) {
    pairs<0>(r, w01[h], w23[h], kSeq);  // blocks 8h .. 8h + 3
    std::memcpy(out + 32 * h, &r, sizeof(U32x16));
    pairs<8>(r, w01[h], w23[h], kSeq);  // blocks 8h + 4 .. 8h + 7
    std::memcpy(out + 32 * h + 16, &r, sizeof(U32x16));
  }
}

}  // namespace loom::cpu

// The layouts the bf16 products read, built from bf16 rows seen as 16-bit patterns: 16 x 16 register
// transposes of 32-bit elements (GCC/Clang vector extensions, shuffles only: one zmm register per row on
// AVX-512, split by the compiler on narrower ISAs), the 64-row block transpose built on them, the
// interleaving of row pairs, and whole-matrix transposes. Header-only so that each caller (attention's
// staging, the matmul's weight packing and swapped products) inlines its own copy: no call per block, and a
// profile charges the time to the caller.
#pragma once
#include <cstdint>
#include <cstring>
#include <utility>

namespace loom::cpu {

namespace transpose_detail {

constexpr int kLanes = 16;

// One butterfly stage of a 16 x 16 transpose: for rows i and i | 2^K, exchanges the elements whose row and
// column differ in bit K. After stages 0..3 every element (i, j) has moved to (j, i).
template <int K, typename V, size_t... J>
inline V butterfly_lo(const V& a, const V& b, std::index_sequence<J...>) {
  return __builtin_shufflevector(a, b, int(((J >> K) & 1) ? kLanes + (J ^ (1u << K)) : J)...);
}
template <int K, typename V, size_t... J>
inline V butterfly_hi(const V& a, const V& b, std::index_sequence<J...>) {
  return __builtin_shufflevector(a, b, int(((J >> K) & 1) ? kLanes + J : (J ^ (1u << K)))...);
}
template <int K, typename V>
inline void butterfly(V (&r)[kLanes]) {
  for (int i = 0; i < kLanes; ++i) {
    if ((i >> K) & 1) continue;
    const int j = i | (1 << K);
    const V lo = butterfly_lo<K>(r[i], r[j], std::make_index_sequence<kLanes>{});
    const V hi = butterfly_hi<K>(r[i], r[j], std::make_index_sequence<kLanes>{});
    r[i] = lo;
    r[j] = hi;
  }
}

}  // namespace transpose_detail

// r[i][j] -> r[j][i] for 16 vectors of 16 32-bit lanes, bitwise.
template <typename V>
inline void transpose16(V (&r)[16]) {
  transpose_detail::butterfly<0>(r);
  transpose_detail::butterfly<1>(r);
  transpose_detail::butterfly<2>(r);
  transpose_detail::butterfly<3>(r);
}

// dst[c][i] = src[i][c] for rows [r0, r1) and columns [c0, c1) of src, element by element (the edges of the
// transposes below).
template <typename T>
inline void transpose_elements(T* dst, int64_t ldd, const T* src, int64_t lds, int64_t r0, int64_t r1, int64_t c0,
                               int64_t c1) {
  for (int64_t i = r0; i < r1; ++i)
    for (int64_t c = c0; c < c1; ++c) dst[c * ldd + i] = src[i * lds + c];
}

// dst (cols x rows, ldd elements per row) = src^T for src (rows x cols, lds elements per row) of 32-bit
// elements: 16 x 16 register transposes, the edges element by element.
inline void transpose_matrix(uint32_t* dst, int64_t ldd, const uint32_t* src, int64_t lds, int64_t rows,
                             int64_t cols) {
  using UVec = uint32_t __attribute__((vector_size(64)));
  const int64_t r16 = rows / 16 * 16, c16 = cols / 16 * 16;
  for (int64_t rb = 0; rb < r16; rb += 16) {
    for (int64_t cb = 0; cb < c16; cb += 16) {
      UVec r[16];
      for (int i = 0; i < 16; ++i) std::memcpy(&r[i], src + (rb + i) * lds + cb, sizeof(UVec));
      transpose16(r);
      for (int i = 0; i < 16; ++i) std::memcpy(dst + (cb + i) * ldd + rb, &r[i], sizeof(UVec));
    }
    transpose_elements(dst, ldd, src, lds, rb, rb + 16, c16, cols);
  }
  transpose_elements(dst, ldd, src, lds, r16, rows, int64_t(0), cols);
}

// The same for 16-bit elements (bf16 / f16 patterns). Rows 2p and 2p + 1 of src interleaved are, read as
// 32-bit elements, the transpose of dst's 32-bit column p: each 32 x 16 block is interleaved into 16
// vectors, transposed as 32-bit elements and stored as 16 rows of 32 16-bit elements.
inline void transpose_matrix(uint16_t* dst, int64_t ldd, const uint16_t* src, int64_t lds, int64_t rows,
                             int64_t cols) {
  using UVec = uint32_t __attribute__((vector_size(64)));
  using HVec = uint16_t __attribute__((vector_size(32)));
  const int64_t r32 = rows / 32 * 32, c16 = cols / 16 * 16;
  for (int64_t rb = 0; rb < r32; rb += 32) {
    for (int64_t cb = 0; cb < c16; cb += 16) {
      UVec r[16];
      for (int i = 0; i < 16; ++i) {
        HVec lo, hi;
        std::memcpy(&lo, src + (rb + 2 * i) * lds + cb, sizeof(HVec));
        std::memcpy(&hi, src + (rb + 2 * i + 1) * lds + cb, sizeof(HVec));
        r[i] = __builtin_convertvector(lo, UVec) | __builtin_convertvector(hi, UVec) << 16;
      }
      transpose16(r);
      for (int i = 0; i < 16; ++i) std::memcpy(dst + (cb + i) * ldd + rb, &r[i], sizeof(UVec));
    }
    transpose_elements(dst, ldd, src, lds, rb, rb + 32, c16, cols);
  }
  transpose_elements(dst, ldd, src, lds, r32, rows, int64_t(0), cols);
}

// dst (w x 64, 64 elements per row) = src^T for src (64 x w, lds elements per row) of 32-bit elements; w a
// multiple of 16. Applied to bf16 rows seen as pairs, it gives the pair-interleaved layout of the block
// transposed (attention's staging, the blocked weight layout of matmul.cpp).
inline void transpose_u32(uint32_t* dst, const uint32_t* src, int64_t lds, int64_t w) {
  transpose_matrix(dst, 64, src, lds, 64, w);
}

// dst row p (ldd 32-bit elements apart) = columns [0, width) of src rows 2p and 2p + 1 (lds bf16 elements
// apart) interleaved, dst[p][j] = src[2p][j] | src[2p + 1][j] << 16, for p < pairs: the pair-interleaved
// layout of row-major rows.
inline void interleave_pairs(uint32_t* dst, int64_t ldd, const uint16_t* src, int64_t lds, int64_t width,
                             int64_t pairs) {
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* r0 = src + 2 * p * lds;
    const uint16_t* r1 = r0 + lds;
    uint32_t* d = dst + p * ldd;
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) d[j] = uint32_t(r0[j]) | uint32_t(r1[j]) << 16;
  }
}

// The same over whole rows of ld elements, dst rows ld apart too.
inline void interleave_pairs(uint32_t* dst, const uint16_t* src, int64_t ld, int64_t pairs) {
  interleave_pairs(dst, ld, src, ld, ld, pairs);
}

}  // namespace loom::cpu

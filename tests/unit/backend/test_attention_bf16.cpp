// The bf16 attention path's kernels against their definitions (attention_bf16.h, attention_tiles.h):
//   - the staging helpers (32-bit transpose, pair interleave, f32 -> bf16 tiles plain and transposed) bit for
//     bit against scalar loops, bf16 rounding against bf16_encode (ties to even, NaN kept quiet, overflow to
//     infinity, subnormals kept);
//   - bf16_gemm against an f64 sum of the exact bf16 products (each f32 lane sums pairs of exact products,
//     so the error is the f32 accumulation's: <= pairs * 2^-23 * sum |a b|), with and without accumulate, for
//     every n width the kernel blocks differently (16, 32, 48, 64, 96);
//   - bf16_gemm is a function of its arguments: the same call on copies at other addresses gives the same
//     bits.
// Skipped on CPUs without AVX512-BF16 (the op then takes the f32 path, tested in test_attention_lowp.cpp).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_test_util.h"
#include "backend/cpu/attention_bf16.h"
#include "backend/cpu/attention_tiles.h"
#include "backend/cpu/lowp.h"

namespace loom::cpu::attn {
namespace {

template <typename E>
struct Aligned {
  std::vector<E> v;
  E* p;
  explicit Aligned(size_t n, size_t offset_bytes = 0) : v(n + 64 / sizeof(E) + 64) {
    auto addr = reinterpret_cast<uintptr_t>(v.data());
    addr = (addr + 63) / 64 * 64 + offset_bytes;
    p = reinterpret_cast<E*>(addr);
  }
};

uint16_t bits16(uint32_t seed_index) { return uint16_t((seed_index * 2654435761u) >> 7); }

TEST(AttentionBf16Staging, TransposeU32) {
  for (int64_t w : {16, 32, 64}) {
    const int64_t lds = w + 16;
    std::vector<uint32_t> src(size_t(kBlock * lds)), dst(size_t(w * kBlock), 0);
    for (size_t i = 0; i < src.size(); ++i) src[i] = uint32_t(i * 2654435761u);
    transpose_u32(dst.data(), src.data(), lds, w);
    for (int64_t r = 0; r < kBlock; ++r)
      for (int64_t c = 0; c < w; ++c) ASSERT_EQ(dst[size_t(c * kBlock + r)], src[size_t(r * lds + c)]) << r << " " << c;
  }
}

TEST(AttentionBf16Staging, InterleavePairs) {
  const int64_t ld = 96, pairs = 7;
  std::vector<uint16_t> src(size_t(2 * pairs * ld));
  for (size_t i = 0; i < src.size(); ++i) src[i] = bits16(uint32_t(i));
  std::vector<uint32_t> dst(size_t(pairs * ld), 0);
  interleave_pairs(dst.data(), src.data(), ld, pairs);
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t j = 0; j < ld; ++j)
      ASSERT_EQ(dst[size_t(p * ld + j)],
                uint32_t(src[size_t(2 * p * ld + j)]) | uint32_t(src[size_t((2 * p + 1) * ld + j)]) << 16);
}

// A tile whose values exercise every rounding case: ties (even and odd), NaN (quiet and signalling),
// infinities, overflow, subnormals, zeros of both signs, and ordinary values.
std::vector<float> rounding_tile() {
  std::vector<float> t = attn_test::randn(kBlock * kBlock, 7);
  const float specials[] = {std::bit_cast<float>(0x3F808000u),  // tie, even stays
                            std::bit_cast<float>(0x3F818000u),  // tie, odd rounds up
                            std::bit_cast<float>(0x7FC00001u),  std::bit_cast<float>(0x7F800001u),
                            std::bit_cast<float>(0xFF800001u),  std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::max(),
                            std::bit_cast<float>(0x00012345u),  std::bit_cast<float>(0x80008000u),
                            0.0f, -0.0f, 1e-40f, 3.0e38f};
  for (size_t i = 0; i < std::size(specials); ++i) t[i * 37] = specials[i];
  return t;
}

TEST(AttentionBf16Staging, TileToBf16PlainAndTransposed) {
  const std::vector<float> t = rounding_tile();
  for (int64_t valid : {int64_t(64), int64_t(37), int64_t(1)}) {
    std::vector<uint16_t> plain(size_t(kBlock * kBlock), 0xFFFF), tr(size_t(kBlock * kBlock), 0xFFFF);
    tile_to_bf16(plain.data(), t.data(), valid);
    tile_to_bf16_transposed(tr.data(), t.data(), valid);
    for (int64_t r = 0; r < kBlock; ++r) {
      for (int64_t c = 0; c < kBlock; ++c) {
        const uint16_t want = r < valid ? bf16_encode(t[size_t(r * kBlock + c)]) : 0;
        ASSERT_EQ(plain[size_t(r * kBlock + c)], want) << valid << " " << r << " " << c;
        ASSERT_EQ(tr[size_t(c * kBlock + r)], want) << valid << " " << r << " " << c;
      }
    }
  }
}

// f64 reference of c = [c0 +] a . B from the plain (unpaired) B, and the bound on f32 accumulation.
void reference(const std::vector<uint16_t>& a, int64_t lda, const std::vector<uint16_t>& bplain, int64_t m, int64_t n,
               int64_t k, const std::vector<float>& c0, bool accumulate, std::vector<double>& want,
               std::vector<double>& bound) {
  want.assign(size_t(m * n), 0.0);
  bound.assign(size_t(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = accumulate ? double(c0[size_t(i * n + j)]) : 0.0, mag = std::abs(s);
      for (int64_t p = 0; p < k; ++p) {
        const double prod =
            double(bf16_decode(a[size_t(i * lda + p)])) * double(bf16_decode(bplain[size_t(p * n + j)]));
        s += prod;
        mag += std::abs(prod);
      }
      want[size_t(i * n + j)] = s;
      bound[size_t(i * n + j)] = double(k) * std::ldexp(1.0, -23) * mag + 1e-38;
    }
  }
}

TEST(AttentionBf16Gemm, MatchesExactProductsWithinF32Accumulation) {
  if (!bf16_dot_supported()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  for (int64_t n : {16, 32, 48, 64, 96}) {
    for (bool accumulate : {false, true}) {
      const int64_t m = 64, k = 96, lda = k + 32;
      std::vector<uint16_t> a(size_t(m * lda)), bplain(size_t(k * n));
      const auto af = attn_test::randn(int64_t(a.size()), uint32_t(n));
      const auto bf = attn_test::randn(int64_t(bplain.size()), uint32_t(n + 1));
      for (size_t i = 0; i < a.size(); ++i) a[i] = bf16_encode(af[i]);
      for (size_t i = 0; i < bplain.size(); ++i) bplain[i] = bf16_encode(bf[i]);
      std::vector<uint32_t> b(size_t(k / 2 * n));
      interleave_pairs(b.data(), bplain.data(), n, k / 2);
      const std::vector<float> c0 = attn_test::randn(m * n, 99);
      std::vector<float> c = c0;
      bf16_gemm(c.data(), n, a.data(), lda, b.data(), n, m, n, k, accumulate);
      std::vector<double> want, bound;
      reference(a, lda, bplain, m, n, k, c0, accumulate, want, bound);
      for (size_t i = 0; i < c.size(); ++i)
        ASSERT_LE(std::abs(double(c[i]) - want[i]), bound[i]) << "n " << n << " acc " << accumulate << " at " << i;
    }
  }
}

TEST(AttentionBf16Gemm, ResultDependsOnlyOnTheArguments) {
  if (!bf16_dot_supported()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  const int64_t m = 64, n = 64, k = 64;
  std::vector<uint16_t> a0(size_t(m * k));
  std::vector<uint32_t> b0(size_t(k / 2 * n));
  const auto af = attn_test::randn(int64_t(a0.size()), 5), bf = attn_test::randn(int64_t(2 * b0.size()), 6);
  for (size_t i = 0; i < a0.size(); ++i) a0[i] = bf16_encode(af[i]);
  for (size_t i = 0; i < b0.size(); ++i)
    b0[i] = uint32_t(bf16_encode(bf[2 * i])) | uint32_t(bf16_encode(bf[2 * i + 1])) << 16;
  std::vector<float> first;
  for (size_t off : {size_t(0), size_t(4), size_t(36)}) {
    Aligned<uint16_t> a(a0.size(), off);
    Aligned<uint32_t> b(b0.size(), off);
    Aligned<float> c(size_t(m * n), off);
    std::memcpy(a.p, a0.data(), a0.size() * sizeof(uint16_t));
    std::memcpy(b.p, b0.data(), b0.size() * sizeof(uint32_t));
    bf16_gemm(c.p, n, a.p, k, b.p, n, m, n, k, false);
    std::vector<float> got(c.p, c.p + m * n);
    if (first.empty()) first = got;
    EXPECT_EQ(0, std::memcmp(first.data(), got.data(), got.size() * sizeof(float))) << off;
  }
}

}  // namespace
}  // namespace loom::cpu::attn

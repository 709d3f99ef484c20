// The bf16 attention path's kernels against their definitions (attention_bf16.h, attention_tiles.h):
//   - the staging helpers (32-bit transpose, pair interleave, f32 -> bf16 tiles plain and transposed) bit for
//     bit against scalar loops, bf16 rounding against bf16_encode (ties to even, NaN kept quiet, overflow to
//     infinity, subnormals kept);
//   - bf16_gemm against an f64 sum of the exact bf16 products (each f32 lane sums pairs of exact products,
//     so the error is the f32 accumulation's: <= pairs * 2^-23 * sum |a b|), with and without accumulate, for
//     every n width the kernel blocks differently (16, 32, 48, 64, 96);
//   - bf16_gemm is a function of its arguments: the same call on copies at other addresses gives the same
//     bits;
//   - bf16_band_gemm (the tasks' products, restricted to a tile's band) gives bf16_gemm's bits on the whole tile.
// Skipped on CPUs without AVX512-BF16 (the op then takes the f32 path, tested in test_attention_lowp.cpp).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
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

// bf16_band_gemm against bf16_gemm on the whole tile, over causal tiles on and off the diagonal, sliding windows,
// document segments, and tiles cut short (rows < kBlock):
//   - kQueryCols: every entry of the computed rows either has the whole product's bits, or is 0 and hidden by the
//     band from its key (so the callers' masking overwrites it);
//   - kReduceQueries / kReduceKeys with a's hidden entries zeroed, as P and dS are: the whole product's bits in
//     rows [0, rows), with and without accumulate;
//   - rows past the last group of 4 that holds one of [0, rows) untouched.
TEST(AttentionBf16Gemm, BandRestrictedEqualsWholeTile) {
  if (!bf16_dot_supported()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  // Segments of a 200-position row: [0, 37), [37, 90), [90, 200).
  std::vector<int32_t> seg_begin(200), seg_end(200);
  for (int32_t p = 0; p < 200; ++p) {
    seg_begin[size_t(p)] = p < 37 ? 0 : p < 90 ? 37 : 90;
    seg_end[size_t(p)] = p < 37 ? 37 : p < 90 ? 90 : 200;
  }
  struct Case {
    const char* name;
    int64_t lo, hi, i0, j0;
    bool segments;
  };
  const Case cases[] = {
      {"causal diagonal", -kFar, 0, 64, 64, false},  {"causal below", -kFar, 64, 128, 64, false},
      {"causal odd start", -kFar, 1, 64, 62, false}, {"window 40", -41, -1, 64, 64, false},
      {"window crossing", 10, 70, 128, 64, false},   {"segments", -kFar, 0, 64, 64, true},
      {"segments below", -kFar, 64, 128, 64, true},  {"segments non-causal", -kFar, kFar, 64, 0, true},
  };
  uint32_t seed = 40;
  for (const Case& cs : cases) {
    Band band;
    band.lo = cs.lo, band.hi = cs.hi, band.i0 = cs.i0, band.j0 = cs.j0;
    if (cs.segments) band.seg_begin = seg_begin.data(), band.seg_end = seg_end.data();
    // Whether query ii of the tile sees key jj (the definition attention_tiles.h gives for Band).
    auto visible = [&](int64_t ii, int64_t jj) {
      if (!(cs.lo < jj - ii && jj - ii <= cs.hi)) return false;
      if (!cs.segments) return true;
      const int64_t q = cs.i0 + ii, k = cs.j0 + jj;
      return seg_begin[size_t(q)] <= k && k < seg_end[size_t(q)];
    };
    for (int64_t rows : {int64_t(64), int64_t(37), int64_t(6)}) {
      for (int64_t h2 : {int64_t(32), int64_t(64), int64_t(96)}) {
        SCOPED_TRACE(std::string(cs.name) + " rows " + std::to_string(rows) + " h2 " + std::to_string(h2));
        auto random_bits = [&](int64_t count) {
          const auto f = attn_test::randn(count, ++seed);
          std::vector<uint16_t> r(static_cast<size_t>(count));
          for (size_t i = 0; i < r.size(); ++i) r[i] = bf16_encode(f[i]);
          return r;
        };
        auto pairs_of = [](const std::vector<uint16_t>& plain, int64_t cols, int64_t pairs) {
          std::vector<uint32_t> r(static_cast<size_t>(pairs * cols));
          interleave_pairs(r.data(), plain.data(), cols, pairs);
          return r;
        };
        // kQueryCols: S^T (keys x queries) = k (keys x h2) . q^T (h2 x queries).
        {
          const auto a = random_bits(kBlock * h2);
          const auto b = pairs_of(random_bits(h2 * kBlock), kBlock, h2 / 2);
          std::vector<float> whole(size_t(kBlock * kBlock)), got(size_t(kBlock * kBlock), 12345.0f);
          bf16_gemm(whole.data(), kBlock, a.data(), h2, b.data(), kBlock, kBlock, kBlock, h2, false);
          bf16_band_gemm(got.data(), kBlock, a.data(), h2, b.data(), kBlock, h2, false, band, BandUse::kQueryCols,
                         rows);
          const int64_t computed = (rows + 3) / 4 * 4;
          for (int64_t jj = 0; jj < kBlock; ++jj) {
            for (int64_t ii = 0; ii < kBlock; ++ii) {
              const float g = got[size_t(jj * kBlock + ii)], w = whole[size_t(jj * kBlock + ii)];
              if (jj >= computed) {
                ASSERT_EQ(g, 12345.0f) << "row " << jj << " past the computed ones was written";
              } else if (jj >= rows) {
                continue;  // the last group's rows past `rows`: unspecified
              } else if (std::bit_cast<uint32_t>(g) != std::bit_cast<uint32_t>(w)) {
                ASSERT_EQ(g, 0.0f) << "key " << jj << " query " << ii << ": neither the product nor a skipped 0";
                ASSERT_FALSE(visible(ii, jj)) << "key " << jj << " sees query " << ii << " but it was skipped";
              }
            }
          }
        }
        // kReduceQueries (key rows, over queries) and kReduceKeys (query rows, over keys).
        for (BandUse use : {BandUse::kReduceQueries, BandUse::kReduceKeys}) {
          for (bool accumulate : {false, true}) {
            auto a = random_bits(kBlock * kBlock);
            for (int64_t r = 0; r < kBlock; ++r)
              for (int64_t k = 0; k < kBlock; ++k) {
                const bool vis = use == BandUse::kReduceQueries ? visible(k, r) : visible(r, k);
                if (!vis) a[size_t(r * kBlock + k)] = 0;
              }
            const auto b = pairs_of(random_bits(kBlock * h2), h2, kBlock / 2);
            const std::vector<float> c0 = attn_test::randn(kBlock * h2, ++seed);
            std::vector<float> whole = c0, got = c0;
            bf16_gemm(whole.data(), h2, a.data(), kBlock, b.data(), h2, kBlock, h2, kBlock, accumulate);
            bf16_band_gemm(got.data(), h2, a.data(), kBlock, b.data(), h2, h2, accumulate, band, use, rows);
            const int64_t computed = (rows + 3) / 4 * 4;
            for (int64_t r = 0; r < kBlock; ++r)
              for (int64_t j = 0; j < h2; ++j) {
                if (r >= rows && r < computed) continue;  // the last group's rows past `rows`: unspecified
                const float want = r < rows ? whole[size_t(r * h2 + j)] : c0[size_t(r * h2 + j)];
                ASSERT_EQ(std::bit_cast<uint32_t>(got[size_t(r * h2 + j)]), std::bit_cast<uint32_t>(want))
                    << (use == BandUse::kReduceQueries ? "kReduceQueries" : "kReduceKeys") << " acc " << accumulate
                    << " row " << r << " col " << j;
              }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace loom::cpu::attn

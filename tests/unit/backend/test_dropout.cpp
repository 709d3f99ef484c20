// CPU dropout (dropout_forward / dropout_backward) and the vectorised Philox words behind it and behind
// attention dropout:
//   - philox4x32_x16 / philox_words_x64 equal philox4x32 word for word (counters crossing 2^32, any
//     seed/stream), and dropout_tile's S^T mask tiles equal dropout_keep entry by entry (any start offset
//     mod 4, row strides not a multiple of 4, partial tiles, causal/window bands);
//   - dropout_forward in f32, bf16 and f16 equals the definition exactly: keep[i] = dropout_keep(seed,
//     stream, i, dropout_threshold(p)), kept values round(x * f32(1 / (1 - p))), dropped values 0; sizes
//     around the 64-element chunk and the parallel threshold;
//   - backward uses the forward's mask (dinp nonzero exactly where out is nonzero), in-place aliasing gives
//     the out-of-place result, p = 0 is a copy, the kept fraction is within 5 standard deviations of 1 - p,
//     other seeds/streams give other masks, results are bit-identical for 1 and 2 threads; argument checks.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "backend/cpu/attention_tiles.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/philox_simd.h"
#include "loom/core/dtype.h"
#include "loom/core/rng.h"

namespace loom::cpu {
namespace {

std::vector<float> randn(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(gen);
  return v;
}

// ---- Philox words --------------------------------------------------------------------------------------

TEST(PhiloxSimd, MatchesScalarPhilox) {
  const uint64_t seeds[] = {0, 1, 0xFFFFFFFFull, 0x123456789ABCDEF0ull, ~0ull};
  const uint64_t streams[] = {0, 7, 0x100000000ull, hash_stream("dropout"), ~0ull};
  // First blocks around 2^32 (the high counter word changes inside one batch) and at the top of the range.
  const uint64_t firsts[] = {0, 5, 0xFFFFFFF8ull, 0x1FFFFFFFFull - 3, ~0ull - 15};
  for (uint64_t seed : seeds)
    for (uint64_t stream : streams)
      for (uint64_t first : firsts) {
        uint64_t block[16];
        for (int l = 0; l < 16; ++l) block[l] = first + uint64_t(l) * (l % 2 ? 1 : 0x100000001ull);  // scattered
        uint32_t words[4][16];
        philox4x32_x16(words, seed, stream, block);
        uint32_t seq[64];
        philox_words_x64(seq, seed, stream, first);
        for (int l = 0; l < 16; ++l) {
          const auto w = philox4x32(seed, stream, block[l]);
          const auto s = philox4x32(seed, stream, first + uint64_t(l));
          for (int k = 0; k < 4; ++k) {
            ASSERT_EQ(words[k][l], w[k]) << "seed " << seed << " stream " << stream << " lane " << l;
            ASSERT_EQ(seq[4 * l + k], s[k]) << "seed " << seed << " stream " << stream << " element " << 4 * l + k;
          }
        }
      }
}

// dropout_tile against dropout_keep, entry by entry, on tiles of attention geometry: mask index of (query
// ii, key jj) = base + ii * stride + jj.
TEST(PhiloxSimd, AttentionDropoutTileMatchesDropoutKeep) {
  attn::Dropout d{77, 5, dropout_threshold(0.37f), 1.0f / (1.0f - 0.37f)};
  std::mt19937_64 gen(3);
  struct TileSpec {
    int64_t qn, kn, hi, lo;  // band: visible iff lo < jj - ii <= hi
  };
  const TileSpec shapes[] = {{64, 64, attn::kFar, -attn::kFar}, {64, 64, 0, -attn::kFar}, {17, 5, attn::kFar, -attn::kFar},
                          {64, 37, 20, -10},                 {1, 64, attn::kFar, -attn::kFar}, {50, 64, -3, -40},
                          {64, 64, 64, 30}};
  int64_t checked = 0;
  for (uint64_t stride : {uint64_t(1), uint64_t(5), uint64_t(64), uint64_t(130), uint64_t(257)}) {
    for (const TileSpec& s : shapes) {
      for (int rep = 0; rep < 4; ++rep) {
        const uint64_t base = gen() % (uint64_t(1) << 40) + uint64_t(rep);  // every offset mod 4
        attn::Band band;
        band.hi = s.hi;
        band.lo = s.lo;
        std::vector<float> z(size_t(attn::kBlock * attn::kBlock), -1.0f);
        attn::dropout_tile(z.data(), d, base, stride, s.qn, s.kn, band);
        for (int64_t jj = 0; jj < s.kn; ++jj)
          for (int64_t ii = 0; ii < s.qn; ++ii) {
            if (!(s.lo < jj - ii && jj - ii <= s.hi)) continue;
            const bool keep = dropout_keep(d.seed, d.stream, base + uint64_t(ii) * stride + uint64_t(jj), d.threshold);
            ASSERT_EQ(z[size_t(jj * attn::kBlock + ii)], keep ? d.scale : 0.0f)
                << "stride " << stride << " base " << base << " ii " << ii << " jj " << jj;
            ++checked;
          }
      }
    }
  }
  EXPECT_GT(checked, 100000);
}

// ---- dropout_forward / dropout_backward ----------------------------------------------------------------

uint16_t encode(DType dt, float x) { return dt == DType::kBF16 ? f32_to_bf16(x) : f32_to_f16(x); }
float decode(DType dt, uint16_t x) { return dt == DType::kBF16 ? bf16_to_f32(x) : f16_to_f32(x); }

// A float tensor of dtype dt (f32, bf16, f16) kept as bytes, with f32 access for checks.
struct Buf {
  DType dt;
  std::vector<uint8_t> bytes;
  Buf(DType d, int64_t n) : dt(d), bytes(size_t(n) * dtype_size(d)) {}
  int64_t n() const { return int64_t(bytes.size() / dtype_size(dt)); }
  float get(int64_t i) const {
    if (dt == DType::kF32) {
      float x;
      std::memcpy(&x, bytes.data() + 4 * i, 4);
      return x;
    }
    uint16_t x;
    std::memcpy(&x, bytes.data() + 2 * i, 2);
    return decode(dt, x);
  }
  void set(int64_t i, float v) {
    if (dt == DType::kF32) {
      std::memcpy(bytes.data() + 4 * i, &v, 4);
    } else {
      const uint16_t x = encode(dt, v);
      std::memcpy(bytes.data() + 2 * i, &x, 2);
    }
  }
  TensorView view() { return TensorView(bytes.data(), dt, Shape{n()}); }
};

Buf random_buf(DType dt, int64_t n, uint32_t seed) {
  Buf b(dt, n);
  const auto v = randn(n, seed);
  for (int64_t i = 0; i < n; ++i) b.set(i, v[size_t(i)]);
  return b;
}

// The definition, element by element: keep ? round(x * scale) : 0 (scale = f32 1 / (1 - p)).
void expect_definition(const Buf& out, const Buf& inp, float p, uint64_t seed, uint64_t stream) {
  const uint32_t threshold = dropout_threshold(p);
  const float scale = 1.0f / (1.0f - p);
  int64_t bad = 0;
  for (int64_t i = 0; i < inp.n(); ++i) {
    const bool keep = dropout_keep(seed, stream, uint64_t(i), threshold);
    Buf want(out.dt, 1);
    want.set(0, keep ? inp.get(i) * scale : 0.0f);
    bad += std::memcmp(out.bytes.data() + size_t(i) * dtype_size(out.dt), want.bytes.data(), dtype_size(out.dt)) != 0;
  }
  EXPECT_EQ(bad, 0) << dtype_name(out.dt) << " n " << inp.n() << " p " << p;
}

TEST(CpuDropout, ForwardMatchesDefinition) {
  CpuOps ops;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16})
    for (int64_t n : {int64_t(1), int64_t(5), int64_t(63), int64_t(64), int64_t(65), int64_t(1000), int64_t(40003)})
      for (float p : {0.1f, 0.5f, 0.9f}) {
        Buf inp = random_buf(dt, n, uint32_t(n));
        Buf out(dt, n);
        ops.dropout_forward(out.view(), inp.view(), p, 11, 22);
        expect_definition(out, inp, p, 11, 22);
      }
}

// A piece drawn at its offset equals the same elements of the whole tensor's dropout, for offsets at and
// off Philox block boundaries (4 elements) and pieces crossing the 64-element chunks.
TEST(CpuDropout, PieceAtItsOffsetEqualsTheWholeTensor) {
  CpuOps ops;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const int64_t n = 5000;
    Buf inp = random_buf(dt, n, 3);
    Buf whole(dt, n);
    ops.dropout_forward(whole.view(), inp.view(), 0.4f, 7, 8);
    for (int64_t off : {int64_t(0), int64_t(1), int64_t(3), int64_t(4), int64_t(61), int64_t(130), int64_t(4001)})
      for (int64_t len : {int64_t(1), int64_t(7), int64_t(64), int64_t(200), int64_t(999)}) {
        if (off + len > n) continue;
        Buf piece(dt, len), src(dt, len);
        const size_t esz = size_t(dtype_size(dt));
        std::memcpy(src.bytes.data(), inp.bytes.data() + size_t(off) * esz, size_t(len) * esz);
        ops.dropout_forward(piece.view(), src.view(), 0.4f, 7, 8, uint64_t(off));
        ASSERT_EQ(std::memcmp(piece.bytes.data(), whole.bytes.data() + size_t(off) * esz, size_t(len) * esz), 0)
            << dtype_name(dt) << " offset " << off << " length " << len;
        Buf grad(dt, len);
        ops.dropout_backward(grad.view(), src.view(), 0.4f, 7, 8, uint64_t(off));
        ASSERT_EQ(grad.bytes, piece.bytes) << "backward, offset " << off;
      }
  }
}

// Backward regenerates the forward's mask: with nonzero inputs, dinp is nonzero exactly where out is, and
// both are x / (1 - p) there (out of the input, dinp of the incoming gradient).
TEST(CpuDropout, BackwardUsesTheForwardMask) {
  CpuOps ops;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    const int64_t n = 70001;
    Buf inp = random_buf(dt, n, 1), dout = random_buf(dt, n, 2);
    for (int64_t i = 0; i < n; ++i) {  // no zeros, so a zero output means a dropped element
      if (inp.get(i) == 0.0f) inp.set(i, 1.0f);
      if (dout.get(i) == 0.0f) dout.set(i, 1.0f);
    }
    Buf out(dt, n), dinp(dt, n);
    ops.dropout_forward(out.view(), inp.view(), 0.3f, 5, 6);
    ops.dropout_backward(dinp.view(), dout.view(), 0.3f, 5, 6);
    int64_t mismatched = 0, kept = 0;
    for (int64_t i = 0; i < n; ++i) {
      mismatched += (out.get(i) != 0.0f) != (dinp.get(i) != 0.0f);
      kept += out.get(i) != 0.0f;
    }
    EXPECT_EQ(mismatched, 0) << dtype_name(dt);
    EXPECT_GT(kept, n / 2);
    expect_definition(dinp, dout, 0.3f, 5, 6);
  }
}

TEST(CpuDropout, InPlaceEqualsOutOfPlace) {
  CpuOps ops;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16})
    for (int64_t n : {int64_t(77), int64_t(100000)}) {
      Buf inp = random_buf(dt, n, 9);
      Buf out(dt, n), inplace = inp;
      ops.dropout_forward(out.view(), inp.view(), 0.25f, 1, 2);
      ops.dropout_forward(inplace.view(), inplace.view(), 0.25f, 1, 2);
      EXPECT_EQ(out.bytes, inplace.bytes) << dtype_name(dt) << " n " << n;
      Buf grad = inp;
      ops.dropout_backward(grad.view(), grad.view(), 0.25f, 1, 2);
      EXPECT_EQ(out.bytes, grad.bytes) << dtype_name(dt) << " n " << n;
    }
}

TEST(CpuDropout, ZeroProbabilityIsACopy) {
  CpuOps ops;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    Buf inp = random_buf(dt, 1001, 4);
    Buf out = random_buf(dt, 1001, 5);
    ops.dropout_forward(out.view(), inp.view(), 0.0f, 1, 2);
    EXPECT_EQ(out.bytes, inp.bytes);
    Buf same = inp;
    ops.dropout_backward(same.view(), same.view(), 0.0f, 1, 2);
    EXPECT_EQ(same.bytes, inp.bytes);
  }
}

// Kept fraction of 2^22 elements within 5 standard deviations of 1 - p; other seeds and streams give other
// masks (two independent masks agree on a fraction p^2 + (1 - p)^2 of the elements, not all).
TEST(CpuDropout, KeptFractionAndIndependentMasks) {
  CpuOps ops;
  const int64_t n = int64_t(1) << 22;
  std::vector<float> ones(static_cast<size_t>(n), 1.0f), out(static_cast<size_t>(n)), other(static_cast<size_t>(n));
  TensorView tin(ones.data(), DType::kF32, Shape{n}), tout(out.data(), DType::kF32, Shape{n});
  TensorView tother(other.data(), DType::kF32, Shape{n});
  for (float p : {0.1f, 0.5f, 0.9f}) {
    ops.dropout_forward(tout, tin, p, 100, 200);
    int64_t kept = 0;
    for (float v : out) kept += v != 0.0f;
    const double q = 1.0 - double(p), sd = std::sqrt(q * (1.0 - q) / double(n));
    EXPECT_NEAR(double(kept) / double(n), q, 5.0 * sd) << p;
    for (auto [seed, stream] : {std::pair<uint64_t, uint64_t>{101, 200}, std::pair<uint64_t, uint64_t>{100, 201}}) {
      ops.dropout_forward(tother, tin, p, seed, stream);
      int64_t agree = 0;
      for (int64_t i = 0; i < n; ++i) agree += (out[size_t(i)] != 0.0f) == (other[size_t(i)] != 0.0f);
      const double expect = double(p) * double(p) + q * q;
      EXPECT_NEAR(double(agree) / double(n), expect, 0.01) << p << " seed " << seed << " stream " << stream;
    }
  }
}

TEST(CpuDropout, BitIdenticalAcrossThreadCounts) {
  CpuOps ops;
  const int saved = omp_get_max_threads();
  for (DType dt : {DType::kF32, DType::kBF16}) {
    Buf inp = random_buf(dt, 300007, 8);
    Buf one(dt, inp.n()), two(dt, inp.n());
    omp_set_num_threads(1);
    ops.dropout_forward(one.view(), inp.view(), 0.2f, 3, 4);
    omp_set_num_threads(2);
    ops.dropout_forward(two.view(), inp.view(), 0.2f, 3, 4);
    EXPECT_EQ(one.bytes, two.bytes) << dtype_name(dt);
  }
  omp_set_num_threads(saved);
}

// Values that do not survive: a dropped inf or NaN gives 0; a kept one stays inf / NaN.
TEST(CpuDropout, NonFiniteInputs) {
  CpuOps ops;
  const int64_t n = 256;
  std::vector<float> inp(static_cast<size_t>(n), std::numeric_limits<float>::infinity()), out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; i += 2) inp[size_t(i)] = std::numeric_limits<float>::quiet_NaN();
  ops.dropout_forward(TensorView(out.data(), DType::kF32, Shape{n}), TensorView(inp.data(), DType::kF32, Shape{n}),
                      0.5f, 1, 1);
  const uint32_t threshold = dropout_threshold(0.5f);
  for (int64_t i = 0; i < n; ++i) {
    if (dropout_keep(1, 1, uint64_t(i), threshold)) EXPECT_FALSE(std::isfinite(out[size_t(i)])) << i;
    else EXPECT_EQ(out[size_t(i)], 0.0f) << i;
  }
}

TEST(CpuDropout, RejectsBadArguments) {
  CpuOps ops;
  std::vector<float> a(100), b(100);
  std::vector<uint16_t> h(100);
  TensorView ta(a.data(), DType::kF32, Shape{100}), tb(b.data(), DType::kF32, Shape{100});
  EXPECT_NO_THROW(ops.dropout_forward(tb, ta, 0.5f, 1, 2));
  EXPECT_NO_THROW(ops.dropout_forward(TensorView(b.data(), DType::kF32, Shape{10, 10}), ta, 0.5f, 1, 2));
  for (float p : {1.0f, -0.5f, std::numeric_limits<float>::quiet_NaN()})
    EXPECT_THROW(ops.dropout_forward(tb, ta, p, 1, 2), Error) << p;
  EXPECT_THROW(ops.dropout_forward(TensorView(h.data(), DType::kBF16, Shape{100}), ta, 0.5f, 1, 2), Error);
  EXPECT_THROW(ops.dropout_forward(TensorView(b.data(), DType::kF32, Shape{99}), ta, 0.5f, 1, 2), Error);
  std::vector<int32_t> ids(100);
  TensorView ti(ids.data(), DType::kI32, Shape{100});
  EXPECT_THROW(ops.dropout_forward(ti, ti, 0.5f, 1, 2), Error);
  // Partial overlap (shifted by one element) is neither in place nor disjoint.
  EXPECT_THROW(ops.dropout_backward(TensorView(a.data() + 1, DType::kF32, Shape{50}),
                                    TensorView(a.data(), DType::kF32, Shape{50}), 0.5f, 1, 2),
               Error);
  EXPECT_THROW(ops.dropout_backward(TensorView(), ta, 0.5f, 1, 2), Error);
}

}  // namespace
}  // namespace loom::cpu

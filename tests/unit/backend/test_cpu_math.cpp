// The vectorisable helpers behind the CPU ops (backend/cpu/fast_math.h): fast_exp accuracy over the whole
// f32 range, lane_sum's order being a function of n alone, sqrt_inplace being correctly rounded, and the
// AVX-512 forms of the activations (simd16) giving the scalar forms' bits.
#include <bit>

#include "backend/cpu/fast_math.h"
#include "cpu_test_util.h"

namespace loom::test {
namespace {

// Distance in units in the last place of the f32 nearest to `want`.
double ulps(float got, double want) {
  const float w = float(want);
  const double ulp = double(std::nextafter(std::fabs(w), INFINITY)) - std::fabs(double(w));
  return std::fabs(double(got) - want) / ulp;
}

TEST(CpuFastMath, ExpIsWithinOneUlpOverTheNormalRange) {
  // Every 97th f32 in [-87.3, 88.7] (exp normal) plus a dense sweep around 0 and the range-reduction
  // boundaries k*ln2/2.
  std::vector<float> xs;
  for (uint32_t b = std::bit_cast<uint32_t>(88.7f); b >= 97; b -= 97) xs.push_back(std::bit_cast<float>(b));
  for (uint32_t b = std::bit_cast<uint32_t>(87.3f); b >= 97; b -= 97) xs.push_back(-std::bit_cast<float>(b));
  for (int k = -250; k <= 250; ++k)
    for (int d = -3; d <= 3; ++d) {
      const float x = float(k * 0.34657359027997264);
      xs.push_back(std::nextafter(x, d < 0 ? -INFINITY : INFINITY) + float(d) * 1e-7f);
    }
  double worst = 0;
  float worst_x = 0;
  for (float x : xs) {
    const double e = ulps(loom::cpu::fast_exp(x), std::exp(double(x)));
    if (e > worst) worst = e, worst_x = x;
  }
  EXPECT_LE(worst, 1.0) << "at x = " << worst_x;  // measured: 0.89 ulp
  std::printf("fast_exp: %zu inputs, max error %.3f ulp at x = %.9g\n", xs.size(), worst, worst_x);
}

TEST(CpuFastMath, ExpEdgeCases) {
  using loom::cpu::fast_exp;
  EXPECT_EQ(fast_exp(0.0f), 1.0f);
  EXPECT_EQ(fast_exp(-INFINITY), 0.0f);
  EXPECT_EQ(fast_exp(-1000.0f), 0.0f);
  EXPECT_EQ(fast_exp(INFINITY), INFINITY);
  EXPECT_EQ(fast_exp(89.0f), INFINITY);
  EXPECT_TRUE(std::isnan(fast_exp(NAN)));
  // Subnormal results: within one subnormal step (2^-149) of the true value.
  for (float x : {-88.0f, -95.0f, -100.0f, -103.0f}) EXPECT_NEAR(fast_exp(x), std::exp(double(x)), 1.5e-45) << x;
  EXPECT_FLOAT_EQ(fast_exp(88.5f), float(std::exp(88.5)));
}

TEST(CpuFastMath, LaneSumOrderDependsOnlyOnLength) {
  std::vector<float> buf(1000 + 16);
  std::mt19937 g(1);
  std::uniform_real_distribution<float> d(-1e3f, 1e3f);
  std::vector<float> data(1000);
  for (float& v : data) v = d(g);
  for (int64_t n : {0, 1, 15, 16, 17, 217, 1000}) {
    float first = 0;
    for (int shift = 0; shift < 16; ++shift) {
      std::copy(data.begin(), data.begin() + n, buf.begin() + shift);
      const float* p = buf.data() + shift;
      const float s = loom::cpu::lane_sum<float>(n, [&](int64_t i) { return p[i]; });
      if (shift == 0) first = s;
      EXPECT_EQ(std::bit_cast<uint32_t>(s), std::bit_cast<uint32_t>(first)) << "n " << n << " shift " << shift;
    }
    double exact = 0;
    for (int64_t i = 0; i < n; ++i) exact += data[i];
    EXPECT_NEAR(first, exact, 1e-2) << n;  // f32 partial sums reach ~1e4: each rounding is up to ~5e-4
  }
}

TEST(CpuFastMath, SqrtInplaceIsCorrectlyRounded) {
  std::vector<float> x;
  std::mt19937 g(2);
  for (int i = 0; i < 100003; ++i) x.push_back(std::bit_cast<float>(uint32_t(g() & 0x7FFFFFFFu)));  // non-negative
  std::vector<float> y = x;
  loom::cpu::sqrt_inplace(y.data(), int64_t(y.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    const float want = std::sqrt(x[i]);
    ASSERT_TRUE(std::bit_cast<uint32_t>(y[i]) == std::bit_cast<uint32_t>(want) ||
                (std::isnan(want) && std::isnan(y[i])))
        << x[i];
  }
}

// The GeLU, GeGLU and SwiGLU kernels and the cross-entropy's exponentials run simd16's forms on AVX-512
// builds and the scalar ones elsewhere;
// both must give the same bits (NaN as NaN), so that a model's numbers do not depend on which one a build
// has. Every 32nd f32 bit pattern (2^27 inputs: all exponents, both signs, NaN and infinities) through exp,
// gelu, gelu_and_grad, silu and silu_and_grad (the forms glu.cpp calls), the scalar side as the kernels
// compile it (a loop under LOOM_SIMD_ACTIVATION). All 2^32 inputs were compared once (bench/RESULTS.md).
#if defined(__AVX512F__)
namespace scalar_forms {
__attribute__((noinline)) void run(std::vector<float> (&out)[7], const std::vector<float>& x) {
  const int64_t n = int64_t(x.size());
  LOOM_SIMD_ACTIVATION
  for (int64_t i = 0; i < n; ++i) {
    float a, da;
    out[0][size_t(i)] = cpu::fast_gelu(x[size_t(i)]);
    cpu::fast_gelu_and_grad(x[size_t(i)], a, da);
    out[1][size_t(i)] = a;
    out[2][size_t(i)] = da;
    out[3][size_t(i)] = x[size_t(i)] * cpu::fast_sigmoid(x[size_t(i)]);
    const cpu::SigmoidPair sg = cpu::fast_sigmoid_pair(x[size_t(i)]);
    out[4][size_t(i)] = x[size_t(i)] * sg.s;
    out[5][size_t(i)] = sg.s + x[size_t(i)] * sg.s * sg.one_minus_s;
    out[6][size_t(i)] = cpu::fast_exp(x[size_t(i)]);
  }
}
}  // namespace scalar_forms

TEST(CpuFastMath, Simd16ActivationsGiveTheScalarBits) {
  namespace v = cpu::simd16;
  const char* names[7] = {"gelu", "gelu_and_grad a", "gelu_and_grad da", "silu", "silu_and_grad a",
                          "silu_and_grad da", "exp"};
  int64_t differ[7] = {};
  constexpr int64_t kBlock = int64_t(1) << 16, kStride = 32;
  std::vector<float> x(static_cast<size_t>(kBlock)), want[7], got[7];
  for (int k = 0; k < 7; ++k) want[k].resize(size_t(kBlock)), got[k].resize(size_t(kBlock));
  for (int64_t first = 0; first < (int64_t(1) << 32); first += kBlock * kStride) {
    for (int64_t i = 0; i < kBlock; ++i) x[size_t(i)] = std::bit_cast<float>(uint32_t(first + i * kStride + (i & 31)));
    scalar_forms::run(want, x);
    for (int64_t i = 0; i < kBlock; i += 16) {
      const __m512 xv = _mm512_loadu_ps(&x[size_t(i)]);
      __m512 a, da, sa, sda;
      v::gelu_and_grad(xv, a, da);
      v::silu_and_grad(xv, sa, sda);
      const __m512 r[7] = {v::gelu(xv), a, da, v::silu(xv), sa, sda, v::exp(xv)};
      for (int k = 0; k < 7; ++k) _mm512_storeu_ps(&got[k][size_t(i)], r[k]);
    }
    for (int k = 0; k < 7; ++k)
      for (int64_t i = 0; i < kBlock; ++i) {
        const float w = want[k][size_t(i)], g = got[k][size_t(i)];
        if (std::bit_cast<uint32_t>(w) != std::bit_cast<uint32_t>(g) && !(std::isnan(w) && std::isnan(g))) {
          if (differ[k] == 0)
            ADD_FAILURE() << names[k] << "(" << x[size_t(i)] << "): scalar " << w << ", simd16 " << g;
          ++differ[k];
        }
      }
  }
  for (int k = 0; k < 7; ++k) EXPECT_EQ(differ[k], 0) << names[k];
}
#endif

}  // namespace
}  // namespace loom::test

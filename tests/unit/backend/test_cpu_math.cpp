// The vectorisable helpers behind the CPU ops (backend/cpu/fast_math.h): fast_exp accuracy over the whole
// f32 range, lane_sum's order being a function of n alone, and sqrt_inplace being correctly rounded.
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

}  // namespace
}  // namespace loom::test

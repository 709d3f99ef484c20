// MockDataset: tokens in range, deterministic in (seed, sample), roughly uniform.
#include <gtest/gtest.h>

#include <vector>

#include "loom/core/check.h"
#include "loom/data/mock_dataset.h"

using namespace loom;

TEST(MockDataset, InRangeDeterministicAndUniform) {
  MockDataset m(97, 1000, 5, 100);
  MockDataset other(97, 1000, 6, 100);
  std::vector<int32_t> a(1001), b(1001), c(1001);
  std::vector<int64_t> counts(97);
  int same = 0;
  for (int k = 0; k < 100; ++k) {
    m.sample(k, a.data());
    m.sample(k, b.data());
    other.sample(k, c.data());
    EXPECT_EQ(a, b);
    same += a == c;
    for (int32_t x : a) {
      ASSERT_GE(x, 0);
      ASSERT_LT(x, 97);
      ++counts[size_t(x)];
    }
  }
  EXPECT_EQ(same, 0);
  for (int64_t n : counts) EXPECT_NEAR(double(n), 100100.0 / 97, 200.0);  // ~6 sigma
  EXPECT_THROW(m.sample(100, a.data()), Error);
  EXPECT_THROW(MockDataset(0, 8, 1, 1), UserError);
}

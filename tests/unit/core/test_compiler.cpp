// The build's code generation on constant initialisers: GCC 12 with -march=native on AVX-512 CPUs turns
// std::vector<int64_t>{1, 1, 1, 0} into four 1s (SLP vectorisation; CMakeLists.txt turns it off for GCC < 13).
// Shapes and counts are built from such lists throughout Loom, so a build that gets them wrong must fail
// here rather than somewhere far away. The values go through a noinline function so the compiler cannot
// fold the check away.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "loom/core/shape.h"

namespace {

__attribute__((noinline)) std::vector<int64_t> copy_of(const std::vector<int64_t>& v) { return v; }
__attribute__((noinline)) loom::Shape shape_copy(const loom::Shape& s) { return s; }

}  // namespace

TEST(Compiler, SmallConstantInitialisersKeepTheirValues) {
  const std::vector<int64_t> v = copy_of({1, 1, 1, 0});
  ASSERT_EQ(v.size(), 4u);
  EXPECT_EQ(v[0], 1);
  EXPECT_EQ(v[1], 1);
  EXPECT_EQ(v[2], 1);
  EXPECT_EQ(v[3], 0);
  const std::vector<int64_t> w = copy_of({0, 2, 2, 2, 2, 2, 2, 7});
  EXPECT_EQ(w, (std::vector<int64_t>{0, 2, 2, 2, 2, 2, 2, 7}));
  EXPECT_EQ(w[7], 7);
  EXPECT_EQ(w[0], 0);
  const loom::Shape s = shape_copy(loom::Shape{3, 3, 3, 1});
  ASSERT_EQ(s.ndim(), 4);
  EXPECT_EQ(s[3], 1);
  EXPECT_EQ(s.numel(), 27);
}

// ParameterSet layout and initialisation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <omp.h>

#include "loom/nn/modules.h"

using namespace loom;

TEST(ParameterSet, ContiguousLayoutAndViews) {
  auto ctx = make_cpu_context();
  ParameterSet ps;
  Linear lin(ps, "mlp.linear_fc1", 3, 5, true, 0.02f);
  LayerNorm ln(ps, "ln", 5, 1e-5f);
  ps.allocate(*ctx);
  ASSERT_EQ(ps.all().size(), 4u);
  EXPECT_EQ(ps.numel(), 15 + 5 + 5 + 5);
  EXPECT_EQ(ps.find("mlp.linear_fc1.weight")->shape, Shape({5, 3}));
  EXPECT_EQ(ps.find("mlp.linear_fc1.bias")->offset, 15);
  EXPECT_TRUE(ps.find("mlp.linear_fc1.bias")->no_weight_decay);
  EXPECT_FALSE(ps.find("mlp.linear_fc1.weight")->no_weight_decay);
  EXPECT_TRUE(ps.find("ln.weight")->no_weight_decay);
  EXPECT_EQ(ps.find("ln.weight")->value.raw(), static_cast<float*>(ps.values().raw()) + 20);
  EXPECT_EQ(ps.find("ln.bias")->grad.raw(), static_cast<float*>(ps.grads().raw()) + 25);
  EXPECT_THROW(ps.add("x", {1}, InitKind::kZeros, 0, true), Error);  // after allocate
}

TEST(ParameterSet, InitIsKeyedByNameNotOrderOrThreads) {
  auto ctx = make_cpu_context();
  ParameterSet a, b;
  a.add("w1", {64, 33}, InitKind::kNormal, 0.02f, false);
  a.add("w2", {7}, InitKind::kNormal, 0.5f, false);
  a.add("ones", {4}, InitKind::kOnes, 0, true);
  b.add("w2", {7}, InitKind::kNormal, 0.5f, false);  // other order
  b.add("w1", {64, 33}, InitKind::kNormal, 0.02f, false);
  a.allocate(*ctx);
  b.allocate(*ctx);
  omp_set_num_threads(1);
  a.initialize(1234);
  omp_set_num_threads(2);
  b.initialize(1234);
  for (const char* n : {"w1", "w2"}) {
    const Parameter& pa = *a.find(n);
    const Parameter& pb = *b.find(n);
    ASSERT_EQ(0, std::memcmp(pa.value.raw(), pb.value.raw(), size_t(pa.value.nbytes()))) << n;
  }
  // Statistics of the normal init.
  const Parameter& w1 = *a.find("w1");
  double s = 0, s2 = 0;
  for (int64_t i = 0; i < w1.value.numel(); ++i) {
    s += w1.value.data<float>()[i];
    s2 += double(w1.value.data<float>()[i]) * w1.value.data<float>()[i];
  }
  const double n = double(w1.value.numel()), mean = s / n, sd = std::sqrt(s2 / n - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.003);
  EXPECT_NEAR(sd, 0.02, 0.002);
  EXPECT_EQ(a.find("ones")->value.data<float>()[3], 1.0f);
  // Different seed -> different values.
  b.initialize(1235);
  EXPECT_NE(0, std::memcmp(w1.value.raw(), b.find("w1")->value.raw(), size_t(w1.value.nbytes())));
}

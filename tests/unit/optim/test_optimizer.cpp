// LR schedule against Megatron's formulas, clipping rule, AdamW range handling.
#include <gtest/gtest.h>

#include <cmath>

#include "loom/optim/optimizer.h"

using namespace loom;

TEST(LRSchedule, WarmupThenCosineInSamples) {
  LRSchedule s{1e-2, 1e-3, 9, 30, LRDecayStyle::kCosine};
  EXPECT_DOUBLE_EQ(s.lr_at(0), 0.0);               // iteration 1 with warmup trains at lr 0 (Megatron)
  EXPECT_DOUBLE_EQ(s.lr_at(3), 1e-2 * 3 / 9);
  EXPECT_DOUBLE_EQ(s.lr_at(9), 1e-2);              // end of warmup reaches the peak
  const double mid = 1e-3 + 0.5 * (std::cos(M_PI * 0.5) + 1) * (1e-2 - 1e-3);
  EXPECT_NEAR(s.lr_at(9 + 21 / 2.0), mid, 1e-3);   // not an integer step: check a real one below
  EXPECT_DOUBLE_EQ(s.lr_at(20), 1e-3 + 0.5 * (std::cos(M_PI * 11.0 / 21.0) + 1) * (1e-2 - 1e-3));
  EXPECT_DOUBLE_EQ(s.lr_at(30), 1e-3);
  EXPECT_DOUBLE_EQ(s.lr_at(31), 1e-3);             // after decay: min_lr
}

TEST(LRSchedule, LinearAndConstant) {
  LRSchedule lin{1.0, 0.0, 0, 100, LRDecayStyle::kLinear};
  EXPECT_DOUBLE_EQ(lin.lr_at(0), 1.0);
  EXPECT_DOUBLE_EQ(lin.lr_at(25), 0.75);
  EXPECT_DOUBLE_EQ(lin.lr_at(100), 0.0);
  LRSchedule con{0.5, 0.1, 10, 100, LRDecayStyle::kConstant};
  EXPECT_DOUBLE_EQ(con.lr_at(5), 0.25);  // warmup still applies
  EXPECT_DOUBLE_EQ(con.lr_at(500), 0.5);
  EXPECT_THROW(parse_lr_decay_style("cosin"), UserError);
}

TEST(Clip, MegatronRule) {
  EXPECT_FLOAT_EQ(clip_coefficient(0.5, 1.0f), 1.0f);            // below the threshold: untouched
  EXPECT_FLOAT_EQ(clip_coefficient(4.0, 1.0f), float(1.0 / (4.0 + 1e-6)));
  EXPECT_FLOAT_EQ(clip_coefficient(1e9, 0.0f), 1.0f);            // 0 disables
}

TEST(AdamW, RangesApplyWeightDecaySeparately) {
  auto ctx = make_cpu_context();
  Tensor p = Tensor::empty({4}, DType::kF32), g = Tensor::empty({4}, DType::kF32);
  for (int i = 0; i < 4; ++i) {
    p.data<float>()[i] = 1.0f;
    g.data<float>()[i] = 0.0f;  // zero gradient: only weight decay moves the parameter
  }
  AdamW opt(*ctx, 4, {{0, 2, true}, {2, 2, false}}, AdamWConfig{});
  opt.step(p, g, 0.1f, 0.5f, 1.0f, false);
  EXPECT_FLOAT_EQ(p.data<float>()[0], 1.0f - 0.1f * 0.5f);
  EXPECT_FLOAT_EQ(p.data<float>()[1], 1.0f - 0.1f * 0.5f);
  EXPECT_FLOAT_EQ(p.data<float>()[2], 1.0f);
  EXPECT_FLOAT_EQ(p.data<float>()[3], 1.0f);
  EXPECT_EQ(opt.num_steps(), 1);
  EXPECT_THROW(AdamW(*ctx, 4, {{0, 3, true}}, AdamWConfig{}), Error);  // ranges must cover the buffer
}

TEST(AdamW, GradScaleAndZeroGrad) {
  auto ctx = make_cpu_context();
  Tensor p1 = Tensor::zeros({3}, DType::kF32), g1 = Tensor::empty({3}, DType::kF32);
  Tensor p2 = Tensor::zeros({3}, DType::kF32), g2 = Tensor::empty({3}, DType::kF32);
  const float gv[3] = {0.3f, -2.0f, 5.0f};
  for (int i = 0; i < 3; ++i) {
    g1.data<float>()[i] = gv[i] * 0.25f;  // pre-scaled gradient
    g2.data<float>()[i] = gv[i];          // scaled by grad_scale inside the update
  }
  AdamW a(*ctx, 3, {{0, 3, true}}, AdamWConfig{0.9f, 0.95f, 1e-8f});
  AdamW b(*ctx, 3, {{0, 3, true}}, AdamWConfig{0.9f, 0.95f, 1e-8f});
  a.step(p1, g1, 1e-2f, 0.1f, 1.0f, false);
  b.step(p2, g2, 1e-2f, 0.1f, 0.25f, true);
  for (int i = 0; i < 3; ++i) {
    EXPECT_FLOAT_EQ(p1.data<float>()[i], p2.data<float>()[i]);
    EXPECT_FLOAT_EQ(b.exp_avg().data<float>()[i], a.exp_avg().data<float>()[i]);
    EXPECT_EQ(g2.data<float>()[i], 0.0f);  // zeroed in the same pass
    EXPECT_NE(g1.data<float>()[i], 0.0f);
  }
}

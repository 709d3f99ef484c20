// Decay-style names, clipping rule, AdamW range handling and checkpoint restore.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "loom/optim/optimizer.h"

using namespace loom;

TEST(LRDecayStyle, ParseNames) {
  EXPECT_EQ(parse_lr_decay_style("cosine"), LRDecayStyle::kCosine);
  EXPECT_EQ(parse_lr_decay_style("WSD"), LRDecayStyle::kWSD);
  EXPECT_EQ(parse_lr_decay_style("inverse-square-root"), LRDecayStyle::kInverseSquareRoot);
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

namespace {

Tensor copy_of(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype());
  std::copy(t.data<float>(), t.data<float>() + t.numel(), c.data<float>());
  return c;
}

// Deterministic, step-dependent gradients so the three continued steps differ from each other.
void fill_grads(Tensor& g, int step) {
  for (int64_t i = 0; i < g.numel(); ++i) g.data<float>()[i] = std::sin(0.7f * float(i) + 1.3f * float(step)) * 0.01f;
}

}  // namespace

TEST(AdamW, CheckpointRestoreIsBitExact) {
  auto ctx = make_cpu_context();
  const int64_t n = 37;
  const std::vector<ParamRange> ranges{{0, 30, true}, {30, 7, false}};
  const AdamWConfig cfg{0.9f, 0.95f, 1e-8f};
  Tensor p = Tensor::empty({n}, DType::kF32), g = Tensor::empty({n}, DType::kF32);
  for (int64_t i = 0; i < n; ++i) p.data<float>()[i] = 0.02f * float(i % 11) - 0.1f;
  AdamW a(*ctx, n, ranges, cfg);
  for (int s = 0; s < 4; ++s) {
    fill_grads(g, s);
    a.step(p, g, 1e-2f, 0.1f, 0.5f, true);
  }
  // The checkpoint: params, m, v, step count.
  const Tensor saved_p = copy_of(p), saved_m = copy_of(a.exp_avg()), saved_v = copy_of(a.exp_avg_sq());
  const int64_t saved_step = a.num_steps();
  ASSERT_EQ(saved_step, 4);

  auto continue_3 = [&](AdamW& opt, Tensor& params) {
    for (int s = 4; s < 7; ++s) {
      fill_grads(g, s);
      opt.step(params, g, 1e-2f, 0.1f, 0.5f, true);
    }
  };
  continue_3(a, p);

  auto restore = [&](bool with_step) {
    auto fresh = std::make_unique<AdamW>(*ctx, n, ranges, cfg);
    std::copy(saved_m.data<float>(), saved_m.data<float>() + n, fresh->exp_avg_mut().data<float>());
    std::copy(saved_v.data<float>(), saved_v.data<float>() + n, fresh->exp_avg_sq_mut().data<float>());
    if (with_step) fresh->set_num_steps(saved_step);
    return fresh;
  };
  Tensor q = copy_of(saved_p);
  auto b = restore(true);
  EXPECT_EQ(b->num_steps(), 4);
  continue_3(*b, q);
  EXPECT_EQ(b->num_steps(), 7);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(q.data<float>()[i], p.data<float>()[i]) << i;
    EXPECT_EQ(b->exp_avg().data<float>()[i], a.exp_avg().data<float>()[i]) << i;
    EXPECT_EQ(b->exp_avg_sq().data<float>()[i], a.exp_avg_sq().data<float>()[i]) << i;
  }
  // Without the step count the bias correction restarts and the parameters diverge: the count matters.
  Tensor r = copy_of(saved_p);
  auto c = restore(false);
  continue_3(*c, r);
  int64_t differ = 0;
  for (int64_t i = 0; i < n; ++i) differ += r.data<float>()[i] != p.data<float>()[i];
  EXPECT_GT(differ, 0);
}

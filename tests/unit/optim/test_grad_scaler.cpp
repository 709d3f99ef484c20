// Grad scalers: Megatron's dynamic loss-scale rules step by step (hysteresis is refilled only when the
// scale grows, never by a clean step alone), the min_scale floor, growth after exactly
// --loss-scale-window clean steps, flag checks, the scaler choice, and the checkpoint state round trip.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "loom/core/check.h"
#include "loom/optim/grad_scaler.h"

using namespace loom;

namespace {

template <typename F>
void expect_user_error(F fn, std::initializer_list<const char*> needles) {
  try {
    fn();
    ADD_FAILURE() << "no UserError thrown";
  } catch (const UserError& e) {
    const std::string msg = e.what();
    for (const char* n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
  }
}

DynamicGradScalerConfig cfg(double initial, double min, int64_t window, int64_t hysteresis) {
  DynamicGradScalerConfig c;
  c.initial_scale = initial;
  c.min_scale = min;
  c.growth_interval = window;
  c.hysteresis = hysteresis;
  return c;
}

}  // namespace

TEST(DynamicGradScaler, HysteresisDelaysBackoff) {
  DynamicGradScaler s(cfg(1024, 1, 100, 2));
  EXPECT_EQ(s.scale(), 1024.0f);
  EXPECT_EQ(s.hysteresis_tracker(), 2);
  s.update(true);  // first overflow spends hysteresis only
  EXPECT_EQ(s.scale(), 1024.0f);
  EXPECT_EQ(s.hysteresis_tracker(), 1);
  s.update(true);  // second: backoff
  EXPECT_EQ(s.scale(), 512.0f);
  EXPECT_EQ(s.hysteresis_tracker(), 0);
  s.update(true);  // hysteresis spent: every further overflow halves, the tracker keeps falling
  EXPECT_EQ(s.scale(), 256.0f);
  EXPECT_EQ(s.hysteresis_tracker(), -1);
}

TEST(DynamicGradScaler, CleanStepDoesNotRefillHysteresis) {
  DynamicGradScaler s(cfg(1024, 1, 4, 2));
  s.update(true);  // hysteresis 2 -> 1
  s.update(false);
  s.update(false);
  s.update(false);  // three clean steps, short of the window of 4
  EXPECT_EQ(s.hysteresis_tracker(), 1);
  EXPECT_EQ(s.growth_tracker(), 3);
  s.update(true);  // not two consecutive overflows, but Megatron backs off anyway
  EXPECT_EQ(s.scale(), 512.0f);
  EXPECT_EQ(s.growth_tracker(), 0);  // an overflow restarts the growth count
  for (int i = 0; i < 4; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 1024.0f);  // grew after the window ...
  EXPECT_EQ(s.hysteresis_tracker(), 2);  // ... which refills the hysteresis
  s.update(true);
  EXPECT_EQ(s.scale(), 1024.0f);  // so one overflow is tolerated again
}

TEST(DynamicGradScaler, GrowsAfterExactlyWindowCleanSteps) {
  DynamicGradScaler s(cfg(8, 1, 3, 100));
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 8.0f);
  s.update(false);
  EXPECT_EQ(s.scale(), 16.0f);
  EXPECT_EQ(s.growth_tracker(), 0);
  s.update(false);
  s.update(false);
  s.update(true);  // interrupts the run (hysteresis 100: no backoff)
  EXPECT_EQ(s.scale(), 16.0f);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 16.0f);
  s.update(false);
  EXPECT_EQ(s.scale(), 32.0f);
  for (int i = 0; i < 3 * 5; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 1024.0f);
}

TEST(DynamicGradScaler, ScaleFloorsAtMinScale) {
  DynamicGradScaler s(cfg(12, 2, 1000, 1));
  s.update(true);
  EXPECT_EQ(s.scale(), 6.0f);
  s.update(true);
  EXPECT_EQ(s.scale(), 3.0f);
  s.update(true);
  EXPECT_EQ(s.scale(), 2.0f);  // max(1.5, 2)
  s.update(true);
  EXPECT_EQ(s.scale(), 2.0f);
}

TEST(DynamicGradScaler, MegatronDefaultsAndInverse) {
  DynamicGradScaler s{DynamicGradScalerConfig{}};
  EXPECT_EQ(s.scale(), 4294967296.0f);
  EXPECT_EQ(s.inv_scale(), std::ldexp(1.0f, -32));
  EXPECT_EQ(s.config().growth_interval, 1000);
  EXPECT_EQ(s.hysteresis_tracker(), 2);
  EXPECT_TRUE(s.is_dynamic());
  ConstantGradScaler c(3.0);
  EXPECT_EQ(c.inv_scale(), float(1.0 / 3.0));
}

TEST(ConstantGradScaler, NeverChanges) {
  ConstantGradScaler s(128.0);
  for (int i = 0; i < 5; ++i) s.update(i % 2 == 0);
  EXPECT_EQ(s.scale(), 128.0f);
  EXPECT_FALSE(s.is_dynamic());
  s.load_state(GradScalerState{4.0f, 3, 1});  // Megatron's constant scaler ignores saved state
  EXPECT_EQ(s.scale(), 128.0f);
  EXPECT_EQ(s.state().scale, 128.0f);
}

TEST(GradScaler, FlagChecks) {
  expect_user_error([] { DynamicGradScaler(cfg(0, 1, 1000, 2)); }, {"--initial-loss-scale"});
  expect_user_error([] { DynamicGradScaler(cfg(1e39, 1, 1000, 2)); }, {"--initial-loss-scale", "FP32"});
  expect_user_error([] { DynamicGradScaler(cfg(1024, 0, 1000, 2)); }, {"--min-loss-scale"});
  expect_user_error([] { DynamicGradScaler(cfg(1024, 2048, 1000, 2)); }, {"--min-loss-scale", "--initial-loss-scale"});
  expect_user_error([] { DynamicGradScaler(cfg(1024, 1, 0, 2)); }, {"--loss-scale-window"});
  expect_user_error([] { DynamicGradScaler(cfg(1024, 1, 1000, 0)); }, {"--hysteresis"});
  expect_user_error([] { ConstantGradScaler{0.0}; }, {"--loss-scale"});
  expect_user_error([] { ConstantGradScaler{double(INFINITY)}; }, {"--loss-scale"});
  expect_user_error([] { make_grad_scaler(true, false, -1.0, {}); }, {"--loss-scale"});
}

TEST(GradScaler, MegatronChoiceOfScaler) {
  auto fp16 = make_grad_scaler(true, false, 0.0, {});
  ASSERT_NE(fp16, nullptr);
  EXPECT_TRUE(fp16->is_dynamic());
  auto fp16_static = make_grad_scaler(true, false, 256.0, {});
  ASSERT_NE(fp16_static, nullptr);
  EXPECT_FALSE(fp16_static->is_dynamic());
  EXPECT_EQ(fp16_static->scale(), 256.0f);
  auto bf16_static = make_grad_scaler(false, true, 8.0, {});
  ASSERT_NE(bf16_static, nullptr);
  EXPECT_FALSE(bf16_static->is_dynamic());
  EXPECT_EQ(make_grad_scaler(false, true, 0.0, {}), nullptr);
  EXPECT_EQ(make_grad_scaler(false, false, 0.0, {}), nullptr);
}

TEST(GradScalerState, RoundTripResumesIdentically) {
  const DynamicGradScalerConfig c = cfg(65536, 1, 3, 2);
  DynamicGradScaler run(c);
  const bool pattern[] = {false, true, true, true, false, false};  // leaves growth 2, hysteresis -1
  for (bool f : pattern) run.update(f);
  const GradScalerState saved = run.state();
  EXPECT_EQ(saved.scale, 16384.0f);
  EXPECT_EQ(saved.growth_tracker, 2);
  EXPECT_EQ(saved.hysteresis_tracker, -1);
  const GradScalerState back = GradScalerState::from_json(saved.to_json());
  EXPECT_EQ(back, saved);

  DynamicGradScaler resumed(c);
  resumed.load_state(back);
  const bool more[] = {false, true, false, false, false, true, true, false};
  for (bool f : more) {
    run.update(f);
    resumed.update(f);
    EXPECT_EQ(resumed.state(), run.state());
  }
  // A non-power-of-two scale survives JSON bit for bit.
  const GradScalerState odd{float(1.0 / 3.0), 0, 2};
  EXPECT_EQ(GradScalerState::from_json(odd.to_json()).scale, odd.scale);
}

TEST(GradScalerState, SmallerWindowOnResumeStillGrows) {
  GradScalerState s{64.0f, 7, 2};
  DynamicGradScaler d(cfg(1024, 1, 4, 2));
  d.load_state(s);
  EXPECT_EQ(d.growth_tracker(), 3);  // clamped below the new window of 4
  d.update(false);
  EXPECT_EQ(d.scale(), 128.0f);
}

TEST(GradScalerState, MalformedJson) {
  expect_user_error([] { GradScalerState::from_json("[1]", "ckpt/grad_scaler.json"); },
                    {"ckpt/grad_scaler.json", "object"});
  expect_user_error([] { GradScalerState::from_json(R"({"scale": 2.0, "growth_tracker": 0})"); },
                    {"hysteresis_tracker"});
  expect_user_error(
      [] { GradScalerState::from_json(R"({"scale": -2.0, "growth_tracker": 0, "hysteresis_tracker": 2})"); },
      {"scale"});
  expect_user_error(
      [] { GradScalerState::from_json(R"({"scale": 2.0, "growth_tracker": -1, "hysteresis_tracker": 2})"); },
      {"growth_tracker"});
}

// StepRunner: one iteration's loss is the mean of the model's forward over the step's micro-batches, the
// update moves the weights, the scheduler and the dropout counter; an inf/NaN step changes no weight and
// no schedule; the gradient seed follows Megatron's loss (token mean per micro-batch, mean over them).
#include <gtest/gtest.h>

#include <cmath>

#include "train/step_runner.h"
#include "unit/train/trainer_parts_util.h"

namespace loom {
namespace {

using parts_test::build_tiny_run;
using parts_test::master_weights;

TEST(StepRunner, LossIsTheMeanForwardAndTheStepMovesEverything) {
  TrainingRun run;
  build_tiny_run(run);
  ASSERT_EQ(run.nmb, 2);
  // The loss the step must report, from the initial weights on the same micro-batches (dropout is off).
  double want = 0;
  {
    Loader ref(run.train_ds, run.loader_config(0));
    for (int64_t m = 0; m < run.nmb; ++m) {
      const std::optional<Batch> b = ref.next();
      ASSERT_TRUE(b.has_value());
      ForwardOptions fo;
      fo.training = false;
      want += run.chunks.front()->forward(run.model_batch(*b), 0.0f, fo);
    }
    want /= double(run.nmb);
  }
  const std::vector<float> before = master_weights(run);
  Timers timers(0);
  StepRunner steps(run, timers);
  Loader loader(run.train_ds, run.loader_config(0));
  const double lr0 = run.sched->lr();
  const StepOutcome s = steps.step(loader);
  EXPECT_EQ(s.loss, want);
  EXPECT_FALSE(s.skipped);
  EXPECT_TRUE(std::isfinite(s.grad_norm) && s.grad_norm > 0) << s.grad_norm;
  EXPECT_EQ(s.lr, lr0);
  EXPECT_EQ(s.loss_scale, 1.0);
  EXPECT_EQ(run.sched->num_steps(), run.gbs);  // stepped by the global batch (samples)
  EXPECT_EQ(run.progress.micro_batches_done, uint64_t(run.nmb));
  EXPECT_EQ(run.dopt->num_steps(), 1);
  const std::vector<float> after = master_weights(run);
  ASSERT_EQ(after.size(), before.size());
  size_t changed = 0;
  for (size_t i = 0; i < after.size(); ++i) changed += after[i] != before[i];
  EXPECT_GT(changed, after.size() / 2);
  // The next step reads the next micro-batches and trains on: another loss.
  const StepOutcome s2 = steps.step(loader);
  EXPECT_NE(s2.loss, s.loss);
  EXPECT_EQ(run.progress.micro_batches_done, uint64_t(2 * run.nmb));
}

// FP16 from a loss scale of 2^40: the FP16 gradients overflow, the step is skipped (Megatron's
// found_inf): no weight, Adam step or schedule moves, and the hysteresis (2) halves the scale only on the
// second overflow.
TEST(StepRunner, OverflowSkipsTheUpdate) {
  TrainingRun run;
  build_tiny_run(run, "--fp16 --initial-loss-scale 1099511627776");
  const std::vector<float> before = master_weights(run);
  Timers timers(0);
  StepRunner steps(run, timers);
  Loader loader(run.train_ds, run.loader_config(0));
  const StepOutcome s = steps.step(loader);
  EXPECT_TRUE(s.skipped);
  EXPECT_TRUE(std::isnan(s.grad_norm));
  EXPECT_EQ(s.loss_scale, 1099511627776.0);
  EXPECT_TRUE(std::isfinite(s.loss));
  EXPECT_EQ(master_weights(run), before);
  EXPECT_EQ(run.sched->num_steps(), 0);
  EXPECT_EQ(run.dopt->num_steps(), 0);
  EXPECT_EQ(run.loss_scale(), 1099511627776.0);  // hysteresis 2: the first overflow keeps the scale
  const StepOutcome s2 = steps.step(loader);
  EXPECT_TRUE(s2.skipped);
  EXPECT_EQ(run.loss_scale(), 549755813888.0);
  EXPECT_EQ(master_weights(run), before);
}

TEST(StepRunner, GradientSeedIsMegatronsLoss) {
  TrainingRun run;
  build_tiny_run(run);
  Timers timers(0);
  const StepRunner steps(run, timers);
  Loader loader(run.train_ds, run.loader_config(0));
  std::optional<Batch> b = loader.next();
  ASSERT_TRUE(b.has_value());
  // No --eod-mask-loss: every token counts.
  EXPECT_EQ(steps.micro_batch_dloss(*b, 8.0), float(8.0 / (double(run.B * run.T) * double(run.nmb))));
  // With the mask: the unmasked tokens only; none at all gives no gradient.
  run.batch_opts.eod_mask_loss = true;
  float* mask = b->loss_mask.data<float>();
  for (int64_t i = 0; i < run.B * run.T; ++i) mask[i] = i < 5 ? 1.0f : 0.0f;
  EXPECT_EQ(steps.micro_batch_dloss(*b, 1.0), float(1.0 / (5.0 * double(run.nmb))));
  for (int64_t i = 0; i < run.B * run.T; ++i) mask[i] = 0.0f;
  EXPECT_EQ(steps.micro_batch_dloss(*b, 1.0), 0.0f);
}

// Every step marks the gradients as zero (DistributedOptimizer::start_step), so each linear weight's first
// write stores its gradient: with LOOM_CHECK_GRAD_OVERWRITE's check on, every such write finds its buffer
// holding zeros (none was added to before it: also the tied word embedding, which the output layer's matmul
// and the embedding's scatter both write, over two micro-batches), for the ZeRO layouts of a world of one
// and bf16; after each step the linear weights' marks are taken and the norms' (always-adding writers) are
// not. (That a stored gradient equals the added one is tests/unit/backend/test_cpu_grad_write.cpp's; that
// training matches PyTorch with it, the golden tests'.)
TEST(StepRunner, FirstWritesOfAStepStoreTheLinearGradients) {
  const bool checks = grad_overwrite_checks();
  set_grad_overwrite_checks(true);
  for (const std::string extra : {"", "--untie-embeddings-and-output-weights",
                                  "--data-parallel-sharding-strategy optim_grads",
                                  "--data-parallel-sharding-strategy optim_grads_params", "--bf16"}) {
    SCOPED_TRACE(extra);
    TrainingRun run;
    build_tiny_run(run, extra);
    Timers timers(0);
    StepRunner steps(run, timers);
    Loader loader(run.train_ds, run.loader_config(0));
    for (int i = 0; i < 2; ++i) {
      StepOutcome s;
      ASSERT_NO_THROW(s = steps.step(loader));
      EXPECT_FALSE(s.skipped);
      int linears = 0;
      for (const Parameter& p : run.models().front()->params().all()) {
        const bool linear = p.name.find("linear_") != std::string::npos && p.name.ends_with(".weight");
        if (linear) {
          ++linears;
          EXPECT_FALSE(p.grad_zero) << p.name << ": the step's first write did not take the mark";
        }
        if (p.name.find("layernorm") != std::string::npos) {
          EXPECT_TRUE(p.grad_zero) << p.name;
        }
      }
      EXPECT_GE(linears, 8);
    }
  }
  set_grad_overwrite_checks(checks);
}

}  // namespace
}  // namespace loom

// Evaluator: the loss is the mean of the model's forward over --eval-iters global batches read from the
// given position; it reads and advances the position, changes no weight, and names the dataset when it
// runs out. MLPerf's metric is the mean of the per-sequence masked means (hand-computed sums, sequences
// without loss tokens left out, context-parallel positions), and the evaluator's equals the per-sequence
// means of the model's per-token losses.
#include <gtest/gtest.h>

#include <cmath>

#include "loom/core/check.h"
#include "loom/parallel/context_parallel.h"
#include "train/evaluator.h"
#include "unit/train/trainer_parts_util.h"

namespace loom {
namespace {

using parts_test::build_tiny_run;
using parts_test::master_weights;

double manual_loss(TrainingRun& run, const std::shared_ptr<const SampleDataset>& ds, int64_t from) {
  Loader loader(ds, run.loader_config(from));
  double sum = 0;
  int64_t n = 0;
  for (int64_t it = 0; it < run.cfg.eval.eval_iters; ++it) {
    double step = 0;  // as the schedule sums: per iteration, then over iterations
    for (int64_t m = 0; m < run.nmb; ++m, ++n) {
      const std::optional<Batch> b = loader.next();
      EXPECT_TRUE(b.has_value());
      if (!b) return NAN;
      ForwardOptions fo;
      fo.training = false;
      step += run.chunks.front()->forward(run.model_batch(*b), 0.0f, fo);
    }
    sum += step;
  }
  return sum / double(n);
}

TEST(Evaluator, MeanForwardOverEvalItersFromThePosition) {
  TrainingRun run;
  build_tiny_run(run, "--eval-interval 3");  // the validation set holds 3 evaluations
  ASSERT_TRUE(run.valid_ds && run.test_ds);
  Evaluator ev(run);
  const std::vector<float> weights = master_weights(run);
  int64_t consumed = 0;
  const double first = ev.evaluate(run.valid_ds, false, consumed).lm_loss;
  EXPECT_EQ(consumed, run.cfg.eval.eval_iters * run.gbs);
  EXPECT_EQ(first, manual_loss(run, run.valid_ds, 0));
  // The next validation reads on from where the last one stopped (Megatron's consumed_valid_samples).
  const double second = ev.evaluate(run.valid_ds, false, consumed).lm_loss;
  EXPECT_EQ(consumed, 2 * run.cfg.eval.eval_iters * run.gbs);
  EXPECT_EQ(second, manual_loss(run, run.valid_ds, run.cfg.eval.eval_iters * run.gbs));
  EXPECT_NE(first, second);
  int64_t test_consumed = 0;
  EXPECT_EQ(ev.evaluate(run.test_ds, true, test_consumed).lm_loss, manual_loss(run, run.test_ds, 0));
  EXPECT_EQ(master_weights(run), weights);
}

TEST(Evaluator, DataRunningOutNamesTheDataset) {
  TrainingRun run;
  build_tiny_run(run);
  Evaluator ev(run);
  int64_t consumed = 0;
  // The test set is sized for one evaluation (--eval-iters global batches): a second pass runs out.
  ev.evaluate(run.test_ds, true, consumed);
  try {
    ev.evaluate(run.test_ds, true, consumed);
    ADD_FAILURE() << "expected a UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(run.test_ds->description()), std::string::npos) << e.what();
  }
}

// ---- MLPerf's per-sequence metric ----------------------------------------------------------------------

TEST(SequenceLoss, PerSequenceMaskedMeansByHand) {
  // B = 3 sequences of T = 4 tokens; the second has no token in the loss.
  const float losses[12] = {1, 2, 3, 4, /**/ 9, 9, 9, 9, /**/ 0.5f, 1.5f, 100, 2};
  const float mask[12] = {1, 1, 0, 1, /**/ 0, 0, 0, 0, /**/ 1, 1, 0, 0};
  std::vector<double> sums(6, 0.0);
  add_sequence_loss_sums(losses, mask, 3, 4, {}, sums.data());
  EXPECT_EQ(sums, (std::vector<double>{7, 3, 0, 0, 2, 2}));
  const auto [mean_sum, n] = sum_of_sequence_means(sums);
  EXPECT_EQ(n, 2);
  EXPECT_DOUBLE_EQ(mean_sum, 7.0 / 3.0 + 1.0);  // MLPerf's metric: (7/3 + 1) / 2
  // Megatron's token mean over the micro-batch would be 9/5: the metric weighs sequences, not tokens.
  EXPECT_NE(mean_sum / double(n), 9.0 / 5.0);
  // Without a mask every token counts.
  std::vector<double> all(6, 0.0);
  add_sequence_loss_sums(losses, nullptr, 3, 4, {}, all.data());
  EXPECT_EQ(all, (std::vector<double>{10, 4, 36, 4, 104, 4}));
  // A masked-out NaN stays out of its sequence's sum.
  const float nan_losses[4] = {1, NAN, 3, 5};
  const float nan_mask[4] = {1, 0, 1, 0};
  std::vector<double> one(2, 0.0);
  add_sequence_loss_sums(nan_losses, nan_mask, 1, 4, {}, one.data());
  EXPECT_EQ(one, (std::vector<double>{4, 2}));
  EXPECT_EQ(sum_of_sequence_means({0, 0, 0, 0}).second, 0);  // no sequence with a loss token
}

TEST(SequenceLoss, ContextParallelRanksAddUpToTheWholeSequence) {
  // CP = 2, T = 8: rank 0 holds positions {0, 1, 6, 7}, rank 1 {2, 3, 4, 5} (chunks i and 2·CP-1-i).
  const int64_t B = 2, T = 8;
  std::vector<float> losses(size_t(B * T)), mask(size_t(B * T));
  for (int64_t i = 0; i < B * T; ++i) {
    losses[size_t(i)] = 0.25f * float(i + 1);
    mask[size_t(i)] = (i * 7) % 3 == 0 ? 0.0f : 1.0f;
  }
  std::vector<double> whole(size_t(2 * B), 0.0), split(size_t(2 * B), 0.0);
  add_sequence_loss_sums(losses.data(), mask.data(), B, T, {}, whole.data());
  for (int r = 0; r < 2; ++r) {
    const std::vector<int32_t> pos = cp_local_positions(T, 2, r);
    std::vector<float> local(size_t(B) * pos.size());
    for (int64_t b = 0; b < B; ++b)
      for (size_t t = 0; t < pos.size(); ++t) local[size_t(b) * pos.size() + t] = losses[size_t(b * T + pos[t])];
    add_sequence_loss_sums(local.data(), mask.data(), B, T, pos, split.data());
  }
  EXPECT_EQ(split, whole);
}

TEST(Evaluator, SequenceMetricIsTheMeanOfPerSequenceMeans) {
  TrainingRun run;
  build_tiny_run(run, "--eval-interval 3");
  Evaluator ev(run);
  int64_t consumed = 0;
  const EvalResult r = ev.evaluate(run.valid_ds, false, consumed);
  // By hand: every sequence's mean token loss from the model's per-token losses (mock data: no mask).
  Loader loader(run.valid_ds, run.loader_config(0));
  double sum = 0;
  int64_t n = 0;
  for (int64_t mb = 0; mb < run.cfg.eval.eval_iters * run.nmb; ++mb) {
    const std::optional<Batch> b = loader.next();
    ASSERT_TRUE(b.has_value());
    ForwardOptions fo;
    fo.training = false;
    run.chunks.front()->forward(run.model_batch(*b), 0.0f, fo);
    const float* lp = run.chunks.front()->losses().data<float>();
    for (int64_t row = 0; row < run.B; ++row, ++n) {
      double s = 0;
      for (int64_t t = 0; t < run.T; ++t) s += lp[row * run.T + t];
      sum += s / double(run.T);
    }
  }
  EXPECT_EQ(r.sequences, run.cfg.eval.eval_iters * run.gbs);
  EXPECT_EQ(r.sequences, n);
  EXPECT_NEAR(r.sequence_loss, sum / double(n), 1e-12);
  // Equal sequence lengths and no mask: the same as Megatron's micro-batch mean, up to rounding.
  EXPECT_NEAR(r.sequence_loss, r.lm_loss, 1e-6 * r.lm_loss);
}

}  // namespace
}  // namespace loom

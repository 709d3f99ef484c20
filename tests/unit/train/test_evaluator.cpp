// Evaluator: the loss is the mean of the model's forward over --eval-iters global batches read from the
// given position; it reads and advances the position, changes no weight, and names the dataset when it
// runs out.
#include <gtest/gtest.h>

#include <cmath>

#include "loom/core/check.h"
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
  const double first = ev.evaluate(run.valid_ds, false, consumed);
  EXPECT_EQ(consumed, run.cfg.eval.eval_iters * run.gbs);
  EXPECT_EQ(first, manual_loss(run, run.valid_ds, 0));
  // The next validation reads on from where the last one stopped (Megatron's consumed_valid_samples).
  const double second = ev.evaluate(run.valid_ds, false, consumed);
  EXPECT_EQ(consumed, 2 * run.cfg.eval.eval_iters * run.gbs);
  EXPECT_EQ(second, manual_loss(run, run.valid_ds, run.cfg.eval.eval_iters * run.gbs));
  EXPECT_NE(first, second);
  int64_t test_consumed = 0;
  EXPECT_EQ(ev.evaluate(run.test_ds, true, test_consumed), manual_loss(run, run.test_ds, 0));
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

}  // namespace
}  // namespace loom

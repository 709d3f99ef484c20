// Validation and test loss (Megatron's evaluate): --eval-iters global batches of a dataset through the
// pipeline schedule, forward only, the last stage's mean averaged over data-parallel replicas. FP8 scales
// are neither used stale nor moved: the weights are re-quantised first and evaluation amaxes discarded.
// Private to the train layer.
#pragma once
#include "train/training_run.h"

namespace loom {

class Evaluator {
 public:
  explicit Evaluator(TrainingRun& run);
  // The mean lm loss over --eval-iters global batches of `ds` from `consumed_samples` on (advanced by the
  // samples read). UserError naming the dataset when it runs out.
  double evaluate(const std::shared_ptr<const SampleDataset>& ds, bool test_set, int64_t& consumed_samples);

 private:
  TrainingRun& run_;
};

}  // namespace loom

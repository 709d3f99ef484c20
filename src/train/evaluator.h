// Validation and test loss (Megatron's evaluate): --eval-iters global batches of a dataset through the
// pipeline schedule, forward only, the last stage's mean averaged over data-parallel replicas. FP8 scales
// are neither used stale nor moved: the weights are re-quantised first and evaluation amaxes discarded.
//
// The same pass also gives MLPerf's validation metric (llama2_70b_lora's eval_accuracy, --target-eval-loss):
// the mean over the evaluated sequences of each sequence's mean masked-token loss, sum(loss · mask) /
// sum(mask) per sequence, sequences without a token in the loss left out. It weighs every sequence alike,
// where Megatron's loss weighs micro-batches alike (the two agree when every sequence has the same number
// of loss tokens). The per-token losses are read after each micro-batch's forward on the last stage; a
// context-parallel rank holds part of each sequence, so the per-sequence sums are added over the CP group
// (in f32: exact for the mask counts, 2^-24 relative for the loss sums) before the division; the sum of the
// means and their count are then added over the data-parallel group. Private to the train layer.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "train/training_run.h"

namespace loom {

// One evaluation (the same values on every rank).
struct EvalResult {
  double lm_loss = 0;        // Megatron's: the mean over micro-batches of their mean masked-token loss
  double sequence_loss = 0;  // MLPerf's: the mean over sequences of their mean masked-token loss (NaN: none)
  int64_t sequences = 0;     // sequences with at least one token in the loss, over all ranks
};

class Evaluator {
 public:
  explicit Evaluator(TrainingRun& run);
  // --eval-iters global batches of `ds` from `consumed_samples` on (advanced by the samples read).
  // UserError naming the dataset when it runs out.
  EvalResult evaluate(const std::shared_ptr<const SampleDataset>& ds, bool test_set, int64_t& consumed_samples);

 private:
  TrainingRun& run_;
};

// Adds, for each of the B sequences of a micro-batch, sum(loss · mask) to sums[2b] and sum(mask) to
// sums[2b + 1], over the tokens one rank holds. losses (B, Tl) f32; mask (B, T) f32, or null when every
// token is in the loss; positions: the global position of each of the Tl local tokens (context
// parallelism), or empty when the rank holds whole sequences (Tl = T).
void add_sequence_loss_sums(const float* losses, const float* mask, int64_t B, int64_t T,
                            const std::vector<int32_t>& positions, double* sums);

// (sum over sequences with sum(mask) > 0 of sum(loss · mask) / sum(mask), their number) from the pairs
// add_sequence_loss_sums wrote.
std::pair<double, int64_t> sum_of_sequence_means(const std::vector<double>& sums);

}  // namespace loom

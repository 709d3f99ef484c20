// One training iteration (Megatron's train_step): this rank's micro-batches through the pipeline schedule
// (gradient accumulation with one stage), the gradient reduction over data-parallel replicas, the FP8
// scaling update, and Megatron's MixedPrecisionOptimizer.step — unscale, clip by the global norm, skip the
// update on inf/NaN, AdamW, scheduler step. Private to the train layer.
//
// Loss bookkeeping (equal for every layout with the same global batch): every data-parallel rank trains
// its own nmb micro-batches; each micro-batch's forward prepares d(mean loss) / nmb (times the FP16 loss
// scale), the model makes the per-rank gradient of a context-parallel split add up over its CP group, and
// the optimizer averages over the dp_cp group (DP · CP ranks) — so the averaged gradient is the gradient
// of the mean loss over the global batch. The logged loss is the mean over micro-batches of the last
// pipeline stage, averaged over the data-parallel group.
#pragma once
#include "loom/train/timers.h"
#include "train/training_run.h"

namespace loom {

class StepRunner {
 public:
  StepRunner(TrainingRun& run, Timers& timers);
  // Trains one iteration on the loader's next nmb micro-batches; advances the dropout counter.
  StepOutcome step(Loader& loader);
  // The gradient seed of one micro-batch: loss_scale / (unmasked tokens · micro-batches), so the step's
  // gradient is that of Megatron's loss (per-micro-batch token mean, averaged over micro-batches).
  float micro_batch_dloss(const Batch& b, double loss_scale) const;

 private:
  // --check-for-nan-in-loss-and-grad and the FP16 loss-scale floor: UserError naming the iteration.
  void check_finite(double loss, double grad_norm);
  TrainingRun& run_;
  Timers& timers_;
  int64_t overflows_at_floor_ = 0;  // consecutive FP16 overflows with the loss scale at --min-loss-scale
};

}  // namespace loom

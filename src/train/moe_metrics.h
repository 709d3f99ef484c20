// Mixture-of-experts figures and the expert-bias update of a training step (moe_metrics.cpp). Private to
// the train layer.
#pragma once
#include "train/training_run.h"

namespace loom {

// Collective over data- and pipeline-parallel groups; resets the models' statistics. Not present for a
// dense model.
StepOutcome::Moe collect_moe_figures(TrainingRun& run);
// --moe-router-enable-expert-bias: after the optimizer step (collective over the data-parallel group).
void update_expert_biases(TrainingRun& run);

}  // namespace loom

// The training loop of `loom train`: builds data, model and optimizer from a validated TrainConfig and
// runs train_iters steps of (micro-batches forward/backward with gradient accumulation, global-norm
// clipping, AdamW, LR schedule), printing Megatron's log lines.
#pragma once
#include <iosfwd>
#include <vector>

#include "loom/train/config.h"

namespace loom {

struct TrainResult {
  std::vector<double> losses;       // mean lm loss of every iteration
  std::vector<double> grad_norms;   // pre-clip global gradient norm of every iteration
  int64_t skipped_iterations = 0;   // steps skipped for a non-finite gradient
  int64_t nan_iterations = 0;       // iterations whose loss was NaN
  int64_t peak_bytes = 0;           // allocator high-water mark
};

// Runs training; log lines go to `log`. Throws UserError for bad input before any heavy allocation.
TrainResult run_training(const TrainConfig& cfg, std::ostream& log);

}  // namespace loom

// The training loop of `loom train` (Megatron's pretrain_gpt.py): builds data, model and optimizer from a
// validated TrainConfig, optionally resumes from a checkpoint, and runs iterations of (micro-batches
// forward/backward with gradient accumulation, FP16 loss scaling, global-norm clipping, AdamW, the LR and
// weight-decay schedules), with periodic evaluation, checkpoints, exit conditions and Megatron's log lines
// (plus TensorBoard events and a JSONL metrics file when asked).
#pragma once
#include <iosfwd>
#include <string>
#include <vector>

#include "loom/train/config.h"

namespace loom {

struct TrainResult {
  int64_t start_iteration = 0;      // iteration the run started from (0, or the loaded checkpoint's)
  int64_t final_iteration = 0;      // last iteration completed
  std::vector<double> losses;       // mean lm loss of every iteration this process ran
  std::vector<double> grad_norms;   // pre-clip global gradient norm (NaN for a skipped iteration)
  std::vector<double> loss_scales;  // loss scale used by every iteration (1 without FP16)
  std::vector<double> learning_rates;  // learning rate every iteration trained with
  std::vector<std::pair<int64_t, double>> valid_losses;  // (iteration, loss) of every validation
  // (iteration, MLPerf's mean per-sequence loss) of every periodic validation (--target-eval-loss checks it)
  std::vector<std::pair<int64_t, double>> valid_sequence_losses;
  double final_valid_loss = 0, final_test_loss = 0;  // NaN when not evaluated
  int64_t skipped_iterations = 0;   // steps skipped (inf/NaN gradients)
  int64_t nan_iterations = 0;       // skipped steps whose loss was NaN/inf
  int64_t peak_bytes = 0;           // allocator high-water mark
  // "train-iters", "train-tokens", "exit-interval", "exit-duration", "signal", "target-eval-loss"
  std::string exit_reason;
};

// Runs training; log lines go to `log`. Throws UserError for bad input before any heavy allocation.
TrainResult run_training(const TrainConfig& cfg, std::ostream& log);

// Megatron's FLOPs of one iteration for the TFLOPs figure, as executed: 3 passes over the model (the
// 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) count) plus a second forward of every transformer layer with
// full recomputation (giving the paper's 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) for GPT-2; with
// --recompute-method block only the first N layers) or of the attention core with selective recomputation.
double iteration_flops(const GPTConfig& m, int64_t global_batch, int64_t seq_length, const RecomputeConfig& r);

}  // namespace loom

// What a training run reports, in Megatron's formats (training.py's training_log and
// evaluate_and_print_results), from the printing (last) rank: the iteration line every --log-interval,
// the timers, the memory lines, TensorBoard scalars and the JSON Lines metrics file, the per-iteration
// communication block (--timing-log-level 2), and the Nsight profiler window (--profile).
//
// Iteration line (losses averaged over the interval's non-skipped iterations, the time over all of them):
//  [date] iteration  i/ N | consumed samples: S | consumed tokens: K | elapsed time per iteration (ms): t |
//  [throughput per GPU (TFLOP/s/GPU): x |] learning rate: lr | global batch size: G | lm loss: L |
//  loss scale: s | grad norm: g | [params norm: p |] number of skipped iterations: k |
//  number of nan iterations: n | samples per second: r | TFLOPs: f |
// As in Megatron, the learning rate printed is the scheduler's value after this iteration's step and the
// grad norm is the last iteration's (absent when it was skipped). Private to the train layer.
#pragma once
#include <memory>
#include <optional>
#include <ostream>
#include <string>

#include "loom/train/metrics_jsonl.h"
#include "loom/train/tensorboard.h"
#include "loom/train/timers.h"
#include "train/training_run.h"

namespace loom {

// "2026-11-26 14:30:06", local time.
std::string now_string();

class TrainingLog {
 public:
  TrainingLog(const TrainingRun& run, std::ostream& log);
  ~TrainingLog();
  Timers& timers() { return timers_; }
  // Opens TensorBoard and the metrics file on the printing rank (appending when resuming).
  void open_writers();
  // After each iteration (collective: --log-params-norm reduces over the world when it is due).
  void iteration(const StepOutcome& s, double step_ms);
  // A validation (or test) result: the boxed lines, TensorBoard and JSONL.
  void evaluation(const std::string& prefix, double loss, bool test_set);
  // --profile: starts/stops the capture and the NVTX ranges at the window's iterations (GPU runs).
  void update_profiler();
  void stop_profiler();
  // The "[after training is done] memory" line; returns the run's allocator peak.
  int64_t final_memory();
  void flush();

 private:
  void write_tensorboard_step(const StepOutcome& s, double params_norm,
                              const std::optional<OptimizerStateStats>& states);
  std::string communication_block();

  const TrainingRun& run_;
  std::ostream& log_;
  Timers timers_;
  std::unique_ptr<TensorBoardWriter> tb_;
  std::unique_ptr<MetricsJsonlWriter> jsonl_;
  bool profiling_ = false;
  bool memory_reported_ = false;
  // Log interval accumulators (Megatron's total_loss_dict).
  double interval_loss_ = 0, interval_ms_ = 0;
  double interval_lb_ = 0, interval_z_ = 0, interval_imbalance_ = 0;  // MoE router figures (sums)
  int64_t interval_moe_ = 0;
  int64_t interval_iters_ = 0, interval_advanced_ = 0, interval_skipped_ = 0, interval_nan_ = 0;
};

}  // namespace loom

// The trainer's state, shared by trainer.cpp (setup, loop, evaluation, logs) and trainer_checkpoint.cpp
// (save/load). Private to the train layer.
#pragma once
#include <chrono>
#include <memory>
#include <optional>
#include <ostream>
#include <string>

#include "loom/ckpt/safetensors.h"
#include "loom/ckpt/sharded.h"
#include "loom/data/loader.h"
#include "loom/model/gpt.h"
#include "loom/optim/distributed_optimizer.h"
#include "loom/optim/grad_scaler.h"
#include "loom/optim/optimizer.h"
#include "loom/optim/scheduler.h"
#include "loom/train/metrics_jsonl.h"
#include "loom/train/tensorboard.h"
#include "loom/train/timers.h"
#include "loom/train/trainer.h"

namespace loom {

inline constexpr const char* kLoomVersion = "0.1.0";

class Trainer {
 public:
  // world: the job's communicator (init_world); log: this rank's log stream (only the last rank prints).
  Trainer(const TrainConfig& cfg, std::ostream& log, std::unique_ptr<Communicator> world);
  ~Trainer();
  TrainResult run();

 private:
  struct StepOutcome {
    double loss = 0;        // mean over micro-batches (unscaled)
    double grad_norm = 0;   // NaN when skipped
    double loss_scale = 1;  // the scale this step used
    double lr = 0;          // the learning rate this step trained with
    bool skipped = false;
  };

  void build_data();
  void build_model();
  // This rank's model chunks (its pipeline stage, or its virtual stages with interleaving; one chunk in a
  // single process) and the distributed optimizer over them (no sharding in a world of one).
  void build_model_chunks(const ModelOptions& base);
  // One iteration: the step's micro-batches through the pipeline schedule (gradient accumulation with one
  // stage), the gradient reduction, and Megatron's MixedPrecisionOptimizer.step (skip on inf/NaN).
  StepOutcome train_step();
  double evaluate(const std::shared_ptr<const SampleDataset>& ds, int64_t& consumed_samples);
  double evaluate_pipeline(const std::shared_ptr<const SampleDataset>& ds, int64_t& consumed_samples);
  void evaluate_and_print(const std::string& prefix, bool test_set, bool periodic);
  void training_log(const StepOutcome& s);
  // Polls the device's input-error flags (an embedding's out-of-range id) and fails naming the iterations
  // since the last poll; called at each log interval, at the end of training and by save_checkpoint.
  void check_device_inputs();
  void write_tensorboard_step(const StepOutcome& s, double params_norm);
  // Checkpoints (trainer_checkpoint.cpp): one format for every layout.
  void save_checkpoint();
  void load_checkpoint();
  void load_checkpoint_pieces(const ShardedCheckpoint& ck, bool load_optim);
  std::string metadata_json() const;
  ShardingStrategy sharding_strategy() const;
  double params_norm() const;
  std::string communication_block();  // --timing-log-level 2, distributed: per-iteration communication
  // FP8: this rank's model instances (the model, or its pipeline chunks); their scaling state as named
  // host tensors (checkpoints; `holder` keeps them alive), and its restoration from a checkpoint.
  std::vector<GPTModel*> models() const;
  NamedTensors fp8_state_tensors(std::vector<Tensor>& holder) const;
  void load_fp8_state(const ShardedCheckpoint& ck);  // the sites the checkpoint has
  void fp8_after_backward();  // reduce this step's amaxes over TP and DP x CP, update the scales

  // The gradient seed of one micro-batch: loss_scale / (unmasked tokens · micro-batches), so the step's
  // gradient is that of Megatron's loss (per-micro-batch token mean, averaged over micro-batches).
  float micro_batch_dloss(const Batch& b, double loss_scale) const;

  ModelOptions model_options() const;
  GPTBatch to_model_batch(const Batch& b) const;
  // The run's device (--device; the CUDA device of this rank's local rank), validated.
  std::unique_ptr<DeviceContext> make_device_context() const;
  // --profile: starts/stops the profiler capture and the NVTX ranges at the window's iterations (GPU runs).
  void update_profiler();
  bool profiling_ = false;
  LoaderConfig loader_config(int64_t consumed_samples) const;  // this rank's micro-batches from there on
  double elapsed_minutes() const;

  TrainConfig cfg_;
  std::ostream& log_;
  std::unique_ptr<Communicator> world_;  // until ParallelState takes it
  std::unique_ptr<ParallelState> ps_;
  bool distributed_ = false;  // world size > 1
  int dp_ = 1;
  int64_t gbs_ = 0, nmb_ = 0, B_ = 0, T_ = 0;
  std::unique_ptr<DeviceContext> ctx_;
  // Device copies of the current micro-batch (tokens, labels, loss mask, position ids, segment ids) when the
  // run computes on a GPU; the loader's batches live in host memory.
  mutable Tensor dev_batch_[5];
  int64_t base_bytes_ = 0;  // allocator bytes held before this run (earlier runs in the same process)

  std::shared_ptr<const SampleDataset> train_ds_, valid_ds_, test_ds_;
  BatchOptions batch_opts_;
  std::unique_ptr<Loader> train_loader_;

  std::vector<std::unique_ptr<GPTModel>> chunks_;  // this rank's model chunks
  std::unique_ptr<DistributedOptimizer> dopt_;
  std::unique_ptr<OptimizerParamScheduler> sched_;
  std::unique_ptr<GradScaler> scaler_;

  Timers timers_;
  std::unique_ptr<TensorBoardWriter> tb_;
  std::unique_ptr<MetricsJsonlWriter> jsonl_;
  std::chrono::steady_clock::time_point start_time_;

  // Progress (restored from checkpoints).
  int64_t iteration_ = 0;
  int64_t inputs_checked_through_ = 0;  // iterations whose device input flags were polled clean
  int64_t consumed_train_ = 0;
  int64_t consumed_valid_ = 0;
  uint64_t dropout_seed_ = 0;
  uint64_t micro_batches_done_ = 0;  // dropout mask counter: one per micro-batch trained

  // Log interval accumulators (Megatron's total_loss_dict).
  double interval_loss_ = 0, interval_ms_ = 0;
  int64_t interval_iters_ = 0, interval_advanced_ = 0, interval_skipped_ = 0, interval_nan_ = 0;
  bool memory_reported_ = false;
  double last_step_ms_ = 0;

  TrainResult result_;
};

}  // namespace loom

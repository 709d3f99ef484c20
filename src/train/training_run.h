// One training run's state and its set-up, private to the train layer. The set-up (training_setup.cpp)
// builds a TrainingRun in Megatron's order — rank grid and device, data, model and optimizer — and the
// parts of the trainer work on it:
//   StepRunner        (step_runner.h)        one iteration: schedule, gradient sync, optimizer step
//   Evaluator         (evaluator.h)          validation / test loss, MLPerf's per-sequence metric
//   TrainingLog       (training_log.h)       Megatron's log lines, TensorBoard, JSONL, timers, profiler
//   CheckpointManager (checkpoint_manager.h) --save / --load in the one checkpoint format
//   MlperfRunLog      (loom/train/mlperf_log.h) --mlperf-log's :::MLLOG events (global rank 0)
// and Trainer::run (trainer.cpp) is the loop that calls them, as Megatron's train().
// A single process is a world of one: one model chunk, the DistributedOptimizer without sharding, the
// pipeline schedule with one stage; there is no second code path.
#pragma once
#include <cmath>
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "loom/data/loader.h"
#include "loom/dist/parallel_state.h"
#include "loom/model/gpt.h"
#include "loom/optim/distributed_optimizer.h"
#include "loom/optim/grad_scaler.h"
#include "loom/optim/scheduler.h"
#include "loom/train/config.h"

namespace loom {

inline constexpr const char* kLoomVersion = "0.1.0";

// Where training stands; saved in and restored from checkpoints.
struct TrainingProgress {
  int64_t iteration = 0;
  int64_t consumed_train = 0;        // samples
  int64_t consumed_valid = 0;        // samples read by periodic validation
  uint64_t dropout_seed = 0;         // Philox key of the dropout masks
  uint64_t micro_batches_done = 0;   // dropout mask counter: one per micro-batch trained
  int64_t inputs_checked_through = 0;  // iterations whose device input flags were polled clean
};

// What one iteration did (Megatron's train_step results).
struct StepOutcome {
  double loss = 0;        // mean over micro-batches (unscaled), averaged over data-parallel replicas
  double grad_norm = 0;   // NaN when skipped
  double loss_scale = 1;  // the scale this step used
  double lr = 0;          // the learning rate this step trained with
  bool skipped = false;   // inf/NaN gradients: no optimizer or scheduler step
  double num_zeros = NAN; // --log-num-zeros-in-grad: zeros in the gradients (NaN when skipped or not asked)
  // Mixture of experts (empty otherwise): the router figures of this step's micro-batches, reduced over
  // the data-parallel replicas and pipeline stages (moe_metrics.cpp).
  struct Moe {
    bool present = false;
    double load_balancing_loss = NAN, z_loss = NAN;  // mean over MoE layers (NaN: coefficient 0)
    double load_imbalance = NAN;  // max over layers of max_e tokens / mean_e tokens (1 = balanced)
    std::vector<int64_t> layers;                // the MoE layers (global indices)
    std::vector<double> layer_lb, layer_z;      // per MoE layer
    std::vector<std::vector<double>> tokens;    // per MoE layer: tokens per expert over the global batch
  } moe;
};

struct TrainingRun {
  TrainConfig cfg;  // as resolved by the set-up (vocabulary, padded vocabulary, dropout)
  std::unique_ptr<ParallelState> ps;
  bool distributed = false;  // world size > 1
  int dp = 1;
  int64_t gbs = 0, nmb = 0, B = 0, T = 0;  // global batch, micro-batches per rank, micro-batch, sequence
  int64_t last_iteration = 0;  // --train-iters, or earlier where --train-tokens is reached
  std::unique_ptr<DeviceContext> ctx;
  int64_t base_bytes = 0;  // allocator bytes held before this run (earlier runs in the same process)

  std::shared_ptr<const SampleDataset> train_ds, valid_ds, test_ds;
  BatchOptions batch_opts;

  std::vector<std::unique_ptr<GPTModel>> chunks;  // this rank's model chunks (pipeline stage(s))
  std::unique_ptr<DistributedOptimizer> dopt;     // DDP / ZeRO over the chunks (no sharding alone)
  std::unique_ptr<OptimizerParamScheduler> sched;
  std::unique_ptr<GradScaler> scaler;  // FP16 dynamic / constant loss scaling; null otherwise

  TrainingProgress progress;

  std::vector<GPTModel*> models() const;
  ShardingStrategy sharding() const;
  double loss_scale() const { return scaler ? double(scaler->scale()) : 1.0; }
  bool is_printer() const { return ps->rank() == ps->world_size() - 1; }  // Megatron prints from the last rank
  // This rank's micro-batches of a dataset from `consumed_samples` on.
  LoaderConfig loader_config(int64_t consumed_samples) const;
  // The model's view of a loader batch: the fields the flags use; on a GPU, device copies (one micro-batch
  // in flight at a time: one pipeline stage runs forward then backward of each micro-batch).
  GPTBatch model_batch(const Batch& b) const;
  // Polls the device's input-error flags (an embedding's out-of-range id) and fails naming the iterations
  // since the last poll; called at log intervals, at the end of training and before every save.
  void check_device_inputs();

 private:
  mutable Tensor dev_batch_[5];  // device staging of tokens, labels, loss mask, position ids, segment ids
};

// ---- set-up (training_setup.cpp), in Megatron's order; every step fails with a UserError naming the
// flag or file before expensive work ----

// The rank grid (world: the job's communicator), the batch geometry and the run's device.
void setup_parallel_and_device(TrainingRun& run, const TrainConfig& cfg, std::unique_ptr<Communicator> world,
                               std::ostream& log);
// Refuses a model whose parameters, optimizer state and activations cannot fit this process's share of
// the device (memory_fit.cpp), with the figures, before any data or model is built.
void check_model_fits(const TrainingRun& run);
// Megatron's train/validation/test datasets (sized for the run) and the batch options; sets the vocabulary.
void setup_data(TrainingRun& run, std::ostream& log);
// This rank's model chunks, the distributed optimizer (initialised from --seed), the LR/WD scheduler and
// the loss scaler.
void setup_model_and_optimizer(TrainingRun& run, std::ostream& log);

}  // namespace loom

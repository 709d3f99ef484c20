// The trainer: Megatron's pretrain() / train() loop over the parts of a training run (training_run.h):
// set-up (rank grid, device, data, model and optimizer), checkpoint load, then per iteration the step
// runner, the training log, periodic evaluation (and --target-eval-loss), and the exit conditions in
// Megatron's order — signal, save interval, duration, exit interval — with the final save and evaluations
// at the end. Global rank 0 writes the --mlperf-log events (loom/train/mlperf_log.h) around all of it.
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <source_location>
#include <string>

#include "loom/core/allocator.h"
#include "loom/core/exit_signals.h"
#include "loom/data/npy_packed_dataset.h"
#include "loom/train/mlperf_log.h"
#include "loom/train/trainer.h"
#include "train/checkpoint_manager.h"
#include "train/evaluator.h"
#include "train/step_runner.h"
#include "train/training_log.h"

namespace loom {

namespace {

// torchrun and the deepspeed launcher start one process per rank with RANK / WORLD_SIZE / LOCAL_RANK and
// expect torch.distributed to connect them; Loom's processes join through MPI, so under such a launcher
// each would train alone (and write the same checkpoints). Say how to launch instead.
void check_launcher(int mpi_world_size) {
  const char* ws = std::getenv("WORLD_SIZE");
  const int env_world = ws ? std::atoi(ws) : 0;
  if (mpi_world_size != 1 || env_world <= 1) return;
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  const int per_node = local ? std::atoi(local) : 0;
  const std::string npernode =
      per_node > 0 && per_node < env_world ? " --npernode " + std::to_string(per_node) : std::string();
  const std::string nodes =
      per_node > 0 && per_node < env_world ? " --nodes=" + std::to_string(env_world / per_node) : std::string();
  user_error("this process was started by a torchrun/deepspeed-style launcher (WORLD_SIZE=", env_world,
             std::getenv("RANK") ? std::string(", RANK=") + std::getenv("RANK") : std::string(),
             std::getenv("LOCAL_RANK") ? std::string(", LOCAL_RANK=") + std::getenv("LOCAL_RANK") : std::string(),
             ") but is alone in its MPI world: Loom's ranks join through MPI. Launch with\n  mpirun -np ", env_world,
             npernode, " loom train <the same flags>\nor, under SLURM,\n  srun", nodes, " --ntasks=", env_world,
             " loom train <the same flags>\n(--local-rank / --local_rank from the launcher may stay; docs/migrating.md)");
}

// A float flag as the decimal it was given as (0.9f would otherwise print as 0.8999999761581421).
double as_decimal(float f) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, f);
  return std::strtod(std::string(buf, r.ptr).c_str(), nullptr);
}

// The run's figures for the MLPerf log's hyperparameter keys.
MlperfRunInfo mlperf_run_info(const TrainingRun& run) {
  const TrainConfig& cfg = run.cfg;
  MlperfRunInfo i;
  i.global_batch_size = run.gbs;
  i.gradient_accumulation_steps = run.nmb;
  i.max_sequence_length = run.T;
  // MLPerf counts the training set's records (NeMo's packed .npy files hold the MLPerf data); other
  // datasets are sized to the samples the run draws.
  const auto* npy = dynamic_cast<const NpyPackedDataset*>(run.train_ds.get());
  i.train_samples = npy ? npy->records() : run.train_ds->size();
  i.eval_samples = cfg.eval.eval_iters * run.gbs;
  i.seed = int64_t(cfg.seed);
  i.adamw = cfg.optim.optimizer == OptimizerKind::kAdam;
  i.base_learning_rate = cfg.optim.lr;
  i.adamw_beta_1 = as_decimal(cfg.optim.adam.beta1);
  i.adamw_beta_2 = as_decimal(cfg.optim.adam.beta2);
  i.adamw_epsilon = as_decimal(cfg.optim.adam.eps);
  i.weight_decay = cfg.optim.weight_decay;
  i.gradient_clip_norm = cfg.optim.clip_grad;
  i.warmup_steps = (run.sched->config().lr_warmup_steps + run.gbs - 1) / run.gbs;  // the schedule counts samples
  i.training_steps = cfg.batch.train_iters;
  i.warmup_factor = double(i.warmup_steps) / double(i.training_steps);
  i.decay_schedule = lr_decay_style_name(cfg.optim.lr_decay_style);
  if (cfg.lora.enabled()) i.lora = LoraConfig{cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout};
  return i;
}

// "<ranks>x<device>", e.g. "8xNVIDIA H100 80GB HBM3" or "2xCPU": the default --mlperf-submission-platform.
std::string default_platform(const TrainingRun& run) {
  std::string device = "CPU";
  if (!run.ctx->device().is_cpu()) {
    const std::string d = run.ctx->description();  // "cuda:0 (NVIDIA H100 80GB HBM3, 132 SMs, ...)"
    const size_t open = d.find(" (");
    device = open == std::string::npos ? d : d.substr(open + 2, d.find(',', open) - open - 2);
  }
  return std::to_string(run.ps->world_size()) + "x" + device;
}

}  // namespace

namespace {

class Trainer {
 public:
  // world: the job's communicator (init_world); log: this rank's log stream (only the last rank prints).
  Trainer(const TrainConfig& cfg, std::ostream& log, std::unique_ptr<Communicator> world)
      : cfg_(cfg), log_(log), world_(std::move(world)), start_time_(std::chrono::steady_clock::now()) {}
  TrainResult run();

 private:
  double elapsed_minutes() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time_).count() / 60.0;
  }
  // Validation (or test) loss over --eval-iters batches, logged; periodic ones are recorded by iteration.
  // NaN values when there is nothing to evaluate.
  EvalResult evaluate_and_print(const std::string& prefix, bool test_set, bool periodic);
  // A periodic validation with the MLPerf events around it; true when it reached --target-eval-loss.
  bool periodic_evaluation();

  const TrainConfig& cfg_;
  std::ostream& log_;
  std::unique_ptr<Communicator> world_;  // until the run's ParallelState takes it
  std::chrono::steady_clock::time_point start_time_;
  TrainingRun run_;
  std::unique_ptr<TrainingLog> tlog_;
  std::unique_ptr<Evaluator> evaluator_;
  std::unique_ptr<MlperfRunLog> mlperf_;  // global rank 0 with --mlperf-log
  TrainResult result_;
};

EvalResult Trainer::evaluate_and_print(const std::string& prefix, bool test_set, bool periodic) {
  const TrainConfig& cfg = run_.cfg;
  const std::shared_ptr<const SampleDataset>& ds = test_set ? run_.test_ds : run_.valid_ds;
  if (!ds || cfg.eval.eval_iters == 0) return {NAN, NAN, 0};
  // The test set is read from its start every time; so is the validation set when a target is checked
  // (MLPerf scores the same set at every evaluation), otherwise it moves on as in Megatron.
  int64_t from_start = 0;
  int64_t& consumed = test_set || cfg.eval.target_eval_loss ? from_start : run_.progress.consumed_valid;
  const EvalResult e = evaluator_->evaluate(ds, test_set, consumed);
  tlog_->evaluation(prefix, e.lm_loss, test_set);
  if (!test_set && (cfg.eval.target_eval_loss || !cfg.mlperf.log.empty())) {
    char metric[32];
    std::snprintf(metric, sizeof metric, "%.6f", e.sequence_loss);
    log_ << " > MLPerf validation metric (mean per-sequence loss over " << e.sequences << " sequences): " << metric;
    if (cfg.eval.target_eval_loss) log_ << " (--target-eval-loss " << *cfg.eval.target_eval_loss << ")";
    log_ << "\n";
  }
  if (test_set) {
    result_.final_test_loss = e.lm_loss;
  } else if (periodic) {
    result_.valid_losses.emplace_back(run_.progress.iteration, e.lm_loss);
    result_.valid_sequence_losses.emplace_back(run_.progress.iteration, e.sequence_loss);
  } else {
    result_.final_valid_loss = e.lm_loss;
  }
  return e;
}

bool Trainer::periodic_evaluation() {
  const TrainConfig& cfg = run_.cfg;
  const TrainingProgress& progress = run_.progress;
  if (!run_.valid_ds || cfg.eval.eval_iters == 0) return false;
  if (mlperf_) mlperf_->eval_start(progress.consumed_train);
  const EvalResult e = evaluate_and_print("iteration " + std::to_string(progress.iteration), false, true);
  const bool reached = cfg.eval.target_eval_loss && e.sequence_loss <= *cfg.eval.target_eval_loss;
  if (mlperf_) mlperf_->eval_result(progress.consumed_train, e.sequence_loss,
                                    !reached && progress.iteration < run_.last_iteration);
  if (reached) {
    char metric[32];
    std::snprintf(metric, sizeof metric, "%.6f", e.sequence_loss);
    log_ << "[" << now_string() << "] target reached at iteration " << progress.iteration
         << " (consumed samples: " << progress.consumed_train << "): MLPerf validation metric " << metric
         << " <= --target-eval-loss " << *cfg.eval.target_eval_loss << "; exiting program\n";
  }
  return reached;
}

TrainResult Trainer::run() {
  CheckpointManager::check_load_flags(cfg_);  // cheap checks of --load before any data or model is built
  CheckpointManager::check_save_dir(cfg_);
  setup_parallel_and_device(run_, cfg_, std::move(world_), log_);
  check_model_fits(run_);
  // MLPerf's init interval starts here: the flags are valid, data, model and checkpoint are still to come.
  if (run_.ps->rank() == 0 && !cfg_.mlperf.log.empty())
    mlperf_ = std::make_unique<MlperfRunLog>(run_.cfg.mlperf, default_platform(run_), std::function<int64_t()>(),
                                             std::source_location::current());
  setup_data(run_, log_);
  const ParallelState& ps = *run_.ps;
  if (cfg_.eval.target_eval_loss && !run_.valid_ds)
    user_error("--target-eval-loss needs a validation set: a --split with a validation part (e.g. 90,10,0), or "
               "--valid-data-path with --train-data-path");
  log_ << "using world size: " << ps.world_size() << ", data-parallel size: " << run_.dp
       << ", context-parallel size: " << ps.cp_size() << ", tensor-model-parallel size: " << ps.tp_size()
       << ", pipeline-model-parallel size: " << ps.pp_size() << "\n";
  log_ << "setting number of micro-batches to constant " << run_.nmb << "\n";
  setup_model_and_optimizer(run_, log_);
  CheckpointManager checkpoints(run_, log_);
  checkpoints.load();
  cpu_allocator().empty_cache();  // model building's and the load's large temporaries are not asked for again
  const TrainConfig& cfg = run_.cfg;
  TrainingProgress& progress = run_.progress;
  result_.start_iteration = progress.iteration;
  tlog_ = std::make_unique<TrainingLog>(run_, log_);
  tlog_->open_writers();
  evaluator_ = std::make_unique<Evaluator>(run_);
  StepRunner steps(run_, tlog_->timers());
  std::unique_ptr<Loader> train_loader;
  if (progress.iteration < run_.last_iteration)
    train_loader = std::make_unique<Loader>(run_.train_ds, run_.loader_config(progress.consumed_train));

  // --exit-signal-handler: SIGTERM/SIGINT are recorded (loom/core/exit_signals.h); the loop checks after each
  // iteration.
  std::optional<ExitSignalScope> signals;
  if (cfg.exit.exit_signal_handler) signals.emplace();
  if (mlperf_) mlperf_->init_done(mlperf_run_info(run_), progress.consumed_train);
  log_ << "training ...\n" << std::flush;
  result_.exit_reason = run_.last_iteration < cfg.batch.train_iters ? "train-tokens" : "train-iters";
  bool exiting = false;
  progress.inputs_checked_through = progress.iteration;
  while (progress.iteration < run_.last_iteration) {
    tlog_->update_profiler();
    const auto t0 = std::chrono::steady_clock::now();
    const StepOutcome s = steps.step(*train_loader);
    const double step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    ++progress.iteration;
    progress.consumed_train += run_.gbs;
    result_.losses.push_back(s.loss);
    result_.grad_norms.push_back(s.grad_norm);
    result_.loss_scales.push_back(s.loss_scale);
    result_.learning_rates.push_back(s.lr);
    if (s.skipped) {
      ++result_.skipped_iterations;
      if (!std::isfinite(s.loss)) ++result_.nan_iterations;
    }
    if (progress.iteration % cfg.logging.log_interval == 0 || progress.iteration == run_.last_iteration)
      run_.check_device_inputs();
    tlog_->iteration(s, step_ms);
    if (mlperf_ && progress.iteration % cfg.logging.log_interval == 0)
      mlperf_->train_loss(progress.consumed_train, s.loss, s.lr);

    if (progress.iteration % cfg.eval.eval_interval == 0 && periodic_evaluation()) {
      checkpoints.save();
      result_.exit_reason = "target-eval-loss";
      exiting = true;
      break;
    }

    // Megatron's order: signal, save interval, duration, exit interval.
    bool saved = false;
    if (cfg.exit.exit_signal_handler && exit_signal() != 0) {
      checkpoints.save();
      log_ << "[" << now_string() << "] exiting program after receiving "
           << (exit_signal() == SIGINT ? "SIGINT" : "SIGTERM") << ".\n";
      result_.exit_reason = "signal";
      exiting = true;
      break;
    }
    if (!cfg.checkpoint.save.empty() && cfg.checkpoint.save_interval &&
        progress.iteration % *cfg.checkpoint.save_interval == 0) {
      checkpoints.save();
      saved = true;
    }
    if (cfg.exit.exit_duration_in_mins && elapsed_minutes() > *cfg.exit.exit_duration_in_mins) {
      if (!saved) checkpoints.save();
      log_ << "[" << now_string() << "] exiting program after " << elapsed_minutes() << " minutes\n";
      result_.exit_reason = "exit-duration";
      exiting = true;
      break;
    }
    if (cfg.exit.exit_interval && progress.iteration % *cfg.exit.exit_interval == 0) {
      if (!saved) checkpoints.save();
      log_ << "[" << now_string() << "] exiting program at iteration " << progress.iteration << "\n";
      result_.exit_reason = "exit-interval";
      exiting = true;
      break;
    }
  }
  tlog_->stop_profiler();  // when the run ended inside the profiling window
  // MLPerf's timed run ends here: success only when the target was reached.
  if (mlperf_) mlperf_->run_stop(progress.consumed_train, result_.exit_reason == "target-eval-loss");
  result_.final_iteration = progress.iteration;
  result_.final_valid_loss = result_.final_test_loss = NAN;
  // A run that skipped every step trained nothing: an error, unless FP16's dynamic scale is still backing off
  // from its start (a short run or a resumed segment can overflow throughout; the floor check in the step
  // runner stops one that cannot recover).
  const int64_t ran = progress.iteration - result_.start_iteration;
  if (ran > 0 && result_.skipped_iterations == ran) {
    const bool backing_off = run_.scaler && run_.scaler->is_dynamic() && !run_.scaler->at_floor();
    const std::string what = "every one of the " + std::to_string(ran) + " iterations run (" +
                             std::to_string(result_.start_iteration + 1) + " to " + std::to_string(progress.iteration) +
                             ") was skipped for non-finite gradients, so nothing was trained";
    if (backing_off) {
      log_ << " > WARNING: " << what << "; the FP16 loss scale backed off to " << run_.scaler->scale()
           << " (start lower with --initial-loss-scale, or train longer)\n";
    } else {
      tlog_->flush();
      user_error(what, ". No final checkpoint was written");
    }
  }
  if (!exiting) {
    log_ << "[after training is done] " << now_string() << "\n";
    const bool just_saved = cfg.checkpoint.save_interval && progress.iteration % *cfg.checkpoint.save_interval == 0;
    if (progress.iteration > result_.start_iteration && !just_saved) checkpoints.save();
    evaluate_and_print("iteration " + std::to_string(progress.iteration) + " on validation set", false, false);
    evaluate_and_print("iteration " + std::to_string(progress.iteration) + " on test set", true, false);
  }
  result_.peak_bytes = tlog_->final_memory();
  tlog_->flush();
  return result_;
}

}  // namespace

TrainResult run_training(const TrainConfig& cfg, std::ostream& log) {
  std::unique_ptr<Communicator> world =
      init_world(std::chrono::milliseconds(int64_t(cfg.dist.timeout_minutes * 60000.0)));
  check_launcher(world->size());
  // Megatron prints the iteration lines from the last rank (the last pipeline stage knows the loss); Loom
  // prints everything from there so that an mpirun log reads like a single process's.
  std::ostream null_stream(nullptr);
  const bool printer = world->rank() == world->size() - 1;
  Trainer t(cfg, printer ? log : null_stream, std::move(world));
  return t.run();
}

}  // namespace loom

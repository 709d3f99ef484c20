// The training run's reports in Megatron's formats (see training_log.h).
#include "train/training_log.h"

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <ctime>

namespace loom {

namespace {

std::string fmt(const char* f, auto... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, f, args...);
  return buf;
}

int64_t max_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return int64_t(ru.ru_maxrss) * 1024;
}

const std::vector<std::string>& timer_names() {
  static const std::vector<std::string> names = {
      "forward-backward", "forward-compute", "backward-compute", "batch-generator", "optimizer-clip-main-grad",
      "optimizer-inner-step", "optimizer",
      // the gradient reduction (the FP16 -> FP32 main-grad copy of a single FP16 process included) and the
      // pipeline's point-to-point phases
      "grads-all-reduce", "forward-recv", "forward-send", "backward-recv", "backward-send"};
  return names;
}

}  // namespace

std::string now_string() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", std::localtime(&t));
  return buf;
}

double iteration_flops(const GPTConfig& m, int64_t global_batch, int64_t seq_length, const RecomputeConfig& r) {
  // The model's exact counts (GQA, gated MLPs, --kv-channels; GPT-2: 24·b·s·h² + 4·b·s²·h per layer).
  double flops = m.flops_per_step(global_batch, seq_length);
  if (r.granularity == "full") {
    // uniform: every layer runs forward twice; block: the first N layers only.
    const int64_t n = r.method == "block" ? std::min(r.num_layers.value_or(0), m.num_layers) : m.num_layers;
    for (int64_t l = 0; l < n; ++l) flops += m.layer_forward_flops(global_batch, seq_length, l);
  }
  if (r.granularity == "selective")  // QKᵀ and PV of every layer again
    flops += double(m.num_layers) * m.attention_core_forward_flops(global_batch, seq_length);
  return flops;
}

TrainingLog::TrainingLog(const TrainingRun& run, std::ostream& log)
    : run_(run), log_(log), timers_(run.cfg.logging.timing_log_level, parse_timing_log_option(run.cfg.logging.timing_log_option)) {
  // GPU timers must see the device's work: synchronise at each start/stop.
  if (!run_.ctx->device().is_cpu()) timers_.set_hooks({[this] { run_.ctx->synchronize(); }, {}, {}});
}

TrainingLog::~TrainingLog() = default;

void TrainingLog::open_writers() {
  // Written by the printing (last) rank only, like the log.
  if (!run_.is_printer()) return;
  const LoggingConfig& lc = run_.cfg.logging;
  if (!lc.tensorboard_dir.empty())
    tb_ = std::make_unique<TensorBoardWriter>(lc.tensorboard_dir, lc.tensorboard_queue_size);
  if (!lc.metrics_jsonl.empty())
    jsonl_ = std::make_unique<MetricsJsonlWriter>(lc.metrics_jsonl, /*append=*/run_.progress.iteration > 0);
  reset_comm_stats();  // the communication lines count training steps, not the set-up
}

void TrainingLog::update_profiler() {
  const TrainConfig& cfg = run_.cfg;

  const LoggingConfig& lc = cfg.logging;
  if (!lc.profile) return;
  const bool mine = std::find(lc.profile_ranks.begin(), lc.profile_ranks.end(), run_.ps->rank()) != lc.profile_ranks.end();
  if (!mine) return;
  const bool in_window = run_.progress.iteration >= lc.profile_step_start && run_.progress.iteration < lc.profile_step_end &&
                         run_.progress.iteration < run_.last_iteration;
  if (in_window && !profiling_) {
    run_.ctx->profiler_start();
    run_.ctx->range_push(lc.profile_name.empty() ? "loom" : lc.profile_name.c_str());  // spans the window
    timers_.set_hooks({[this] { run_.ctx->synchronize(); }, [this](const std::string& n) { run_.ctx->range_push(n.c_str()); },
                       [this] { run_.ctx->range_pop(); }});
    profiling_ = true;
    log_ << " > profiling iterations " << lc.profile_step_start << " to " << lc.profile_step_end - 1
         << " (cudaProfilerStart, NVTX range '" << (lc.profile_name.empty() ? "loom" : lc.profile_name)
         << "' with a range per timer)\n";
  } else if (!in_window && profiling_) {
    timers_.set_hooks({[this] { run_.ctx->synchronize(); }, {}, {}});
    run_.ctx->range_pop();
    run_.ctx->profiler_stop();
    profiling_ = false;
  }
}

void TrainingLog::stop_profiler() {
  if (!profiling_) return;
  timers_.set_hooks({[this] { run_.ctx->synchronize(); }, {}, {}});
  run_.ctx->range_pop();
  run_.ctx->profiler_stop();
  profiling_ = false;
}

void TrainingLog::write_tensorboard_step(const StepOutcome& s, double params_norm,
                                         const std::optional<OptimizerStateStats>& states) {
  const TrainConfig& cfg = run_.cfg;

  if (!tb_ || run_.progress.iteration % cfg.logging.tensorboard_log_interval != 0) return;
  const double samples = double(run_.progress.consumed_train);
  auto both = [&](const std::string& tag, double v) {
    tb_->add_scalar(tag, v, run_.progress.iteration);
    tb_->add_scalar(tag + " vs samples", v, int64_t(samples));
  };
  if (cfg.logging.log_learning_rate_to_tensorboard) both("learning-rate", run_.sched->lr());
  if (cfg.logging.log_batch_size_to_tensorboard) both("batch-size", double(run_.gbs));
  both("lm loss", s.loss);  // every iteration, skipped ones included, as Megatron
  if (s.moe.present) {  // Megatron's MoE tags (per layer with --moe-per-layer-logging)
    if (!std::isnan(s.moe.load_balancing_loss)) both("load_balancing_loss", s.moe.load_balancing_loss);
    if (!std::isnan(s.moe.z_loss)) both("z_loss", s.moe.z_loss);
    both("expert_load_imbalance", s.moe.load_imbalance);
    if (cfg.moe.per_layer_logging)
      for (size_t k = 0; k < s.moe.layers.size(); ++k) {
        const std::string l = std::to_string(s.moe.layers[k]);
        if (!std::isnan(s.moe.load_balancing_loss)) tb_->add_scalar("moe/load_balancing_loss_layer_" + l, s.moe.layer_lb[k], run_.progress.iteration);
        if (!std::isnan(s.moe.z_loss)) tb_->add_scalar("moe/z_loss_layer_" + l, s.moe.layer_z[k], run_.progress.iteration);
      }
  }
  // As Megatron: the scale after this iteration's update, the value the log line prints.
  if (cfg.logging.log_loss_scale_to_tensorboard) both("loss-scale", run_.loss_scale());
  if (!s.skipped) both("grad-norm", s.grad_norm);
  if (!std::isnan(s.num_zeros)) both("num-zeros", s.num_zeros);
  if (cfg.logging.log_params_norm) both("params-norm", params_norm);
  if (cfg.logging.log_world_size_to_tensorboard) both("world-size", double(run_.ps->world_size()));
  if (states) {
    const OptimizerStateStats& o = *states;
    auto put = [&](const char* tag, double v) { tb_->add_scalar(std::string("optimizer/") + tag, v, run_.progress.iteration); };
    if (o.has_variance) {
      put("variance_l2", o.variance_l2);
      put("variance_sqrt_l2", o.variance_sqrt_l2);
      put("variance_l1", o.variance_l1);
      put("variance_sqrt_l1", o.variance_sqrt_l1);
      put("variance_abs_max", o.variance_abs_max);
      put("variance_sqrt_abs_max", o.variance_sqrt_abs_max);
    }
    if (o.has_momentum) {
      put("momentum_l2", o.momentum_l2);
      put("momentum_l1", o.momentum_l1);
      put("momentum_abs_max", o.momentum_abs_max);
    }
    put("weight_l2", o.weight_l2);
    put("weight_l1", o.weight_l1);
    put("weight_abs_max", o.weight_abs_max);
  }
  if (cfg.logging.log_memory_to_tensorboard) {
    const AllocStats m = run_.ctx->memory_stats();
    tb_->add_scalar("mem-reserved-bytes", double(m.reserved_bytes), run_.progress.iteration);
    tb_->add_scalar("mem-allocated-bytes", double(m.current_bytes), run_.progress.iteration);
    tb_->add_scalar("mem-max-allocated-bytes", double(m.peak_bytes), run_.progress.iteration);
  }
}

void TrainingLog::iteration(const StepOutcome& s, double step_ms) {
  const TrainConfig& cfg = run_.cfg;

  if (s.skipped) {
    ++interval_skipped_;
    if (!std::isfinite(s.loss)) ++interval_nan_;
  } else {
    interval_loss_ += s.loss;
    if (s.moe.present) {
      interval_lb_ += s.moe.load_balancing_loss;
      interval_z_ += s.moe.z_loss;
      interval_imbalance_ += s.moe.load_imbalance;
      ++interval_moe_;
    }
    ++interval_advanced_;
  }
  interval_ms_ += step_ms;
  ++interval_iters_;
  // The parameter norm is collective in a distributed run: every rank computes it when the printing rank
  // needs it (TensorBoard or the log line), once for both.
  const bool tb_now = !cfg.logging.tensorboard_dir.empty() && run_.progress.iteration % cfg.logging.tensorboard_log_interval == 0;
  const bool log_now = run_.progress.iteration % cfg.logging.log_interval == 0;
  const bool params_norm_on = cfg.logging.log_params_norm;
  const double params_norm = params_norm_on && (tb_now || log_now) ? run_.dopt->param_norm() : 0.0;
  // --log-optimizer-states-to-tensorboard: collective as well, at TensorBoard points.
  std::optional<OptimizerStateStats> states;
  if (cfg.logging.log_optimizer_states_to_tensorboard && tb_now) states = run_.dopt->state_stats();
  write_tensorboard_step(s, params_norm, states);
  if (!log_now) return;

  const double avg_ms = interval_ms_ / double(interval_iters_);
  const double avg_loss = interval_loss_ / double(std::max<int64_t>(1, interval_advanced_));
  const double flops = iteration_flops(cfg.model, run_.gbs, run_.T, cfg.recompute);
  const double tflops = flops / (avg_ms / 1000.0) / double(run_.ps->world_size()) / 1e12;
  const double samples_per_s = double(run_.gbs) / (avg_ms / 1000.0);

  std::string line = " [" + now_string() + "]";
  line += fmt(" iteration %8lld/%8lld |", (long long)run_.progress.iteration, (long long)cfg.batch.train_iters);
  line += fmt(" consumed samples: %12lld |", (long long)run_.progress.consumed_train);
  line += fmt(" consumed tokens: %12lld |", (long long)(run_.progress.consumed_train * run_.T));
  line += fmt(" elapsed time per iteration (ms): %.1f |", avg_ms);
  if (cfg.logging.log_throughput) line += fmt(" throughput per GPU (TFLOP/s/GPU): %.1f |", tflops);
  line += fmt(" learning rate: %.6E |", run_.sched->lr());
  line += fmt(" global batch size: %5lld |", (long long)run_.gbs);
  if (interval_advanced_ > 0) line += fmt(" lm loss: %.6E |", avg_loss);
  if (interval_moe_ > 0) {  // Megatron's MoE loss keys, then Loom's load-imbalance figure
    const double n = double(interval_moe_);
    if (!std::isnan(interval_lb_)) line += fmt(" load_balancing_loss: %.6E |", interval_lb_ / n);
    if (!std::isnan(interval_z_)) line += fmt(" z_loss: %.6E |", interval_z_ / n);
    line += fmt(" expert load imbalance: %.3f |", interval_imbalance_ / n);
  }
  line += fmt(" loss scale: %.1f |", run_.loss_scale());
  if (!s.skipped) line += fmt(" grad norm: %.3f |", s.grad_norm);
  if (!std::isnan(s.num_zeros)) line += fmt(" num zeros: %.1f |", s.num_zeros);
  if (params_norm_on) line += fmt(" params norm: %.3f |", params_norm);
  line += fmt(" number of skipped iterations: %3lld |", (long long)interval_skipped_);
  line += fmt(" number of nan iterations: %3lld |", (long long)interval_nan_);
  line += fmt(" samples per second: %.3f |", samples_per_s);
  line += fmt(" TFLOPs: %.2f |", tflops);
  log_ << line << "\n";

  if (tb_ && cfg.logging.log_timers_to_tensorboard) {
    tb_->add_scalar("iteration-time", avg_ms / 1000.0, run_.progress.iteration);
    if (cfg.logging.log_throughput) tb_->add_scalar("throughput", tflops, run_.progress.iteration);
    for (const auto& [name, ms] : timers_.values_ms(timer_names(), double(interval_iters_)))
      tb_->add_scalar(name + "-time", ms, run_.progress.iteration);
  }
  const std::string timers_block =
      timers_.log(timer_names(), double(interval_iters_), run_.distributed ? &run_.ps->world() : nullptr);
  if (!timers_block.empty()) log_ << timers_block << "\n";
  if (run_.distributed && cfg.logging.timing_log_level >= 2) log_ << communication_block();
  if (cfg.logging.timing_log_level >= 2 && s.moe.present)  // this iteration's routing, per MoE layer
    for (size_t k = 0; k < s.moe.layers.size(); ++k) {
      std::string t = fmt(" > MoE layer %lld tokens per expert:", (long long)s.moe.layers[k]);
      for (double x : s.moe.tokens[k]) t += fmt(" %.0f", x);
      log_ << t << "\n";
    }
  if (!memory_reported_) {
    const AllocStats m = run_.ctx->memory_stats();
    // This (the printing) rank's memory; Megatron prints the same line per rank.
    log_ << fmt("[Rank %d] (after %lld iterations) memory (MB) | allocated: %.1f | max allocated: %.1f | "
                "reserved: %.1f | max resident: %.1f\n",
                run_.ps->rank(), (long long)run_.progress.iteration, double(m.current_bytes - run_.base_bytes) / 1048576.0,
                double(m.peak_bytes - run_.base_bytes) / 1048576.0, double(m.reserved_bytes - run_.base_bytes) / 1048576.0, double(max_rss_bytes()) / 1048576.0);
    // ZeRO-2/3 allocate gradient buckets and gathered parameters around each use: their peak so far.
    if (run_.dopt->sharding() != ShardingStrategy::kNone)
      log_ << fmt("[Rank %d] (after %lld iterations) ZeRO bucket buffers (MB) | max allocated: %.1f\n", run_.ps->rank(),
                  (long long)run_.progress.iteration, double(run_.dopt->memory().buffers_peak) / 1048576.0);
    memory_reported_ = true;
  }
  log_ << std::flush;
  if (jsonl_) {
    std::vector<std::pair<std::string, double>> f = {
        {"iteration", double(run_.progress.iteration)},
        {"consumed samples", double(run_.progress.consumed_train)},
        {"consumed tokens", double(run_.progress.consumed_train * run_.T)},
        {"elapsed time per iteration (ms)", avg_ms},
        {"learning rate", run_.sched->lr()},
        {"global batch size", double(run_.gbs)},
        {"lm loss", interval_advanced_ > 0 ? avg_loss : NAN},
        {"loss scale", run_.loss_scale()},
        {"grad norm", s.skipped ? NAN : s.grad_norm},
        {"number of skipped iterations", double(interval_skipped_)},
        {"number of nan iterations", double(interval_nan_)},
        {"samples per second", samples_per_s},
        {"TFLOPs", tflops}};
    if (cfg.logging.log_num_zeros_in_grad) f.emplace_back("num zeros", s.num_zeros);
    if (params_norm_on) f.emplace_back("params norm", params_norm);
    jsonl_->write(f);
  }
  if (tb_) tb_->flush();
  interval_loss_ = interval_ms_ = 0;
  interval_lb_ = interval_z_ = interval_imbalance_ = 0;
  interval_moe_ = 0;
  interval_iters_ = interval_advanced_ = interval_skipped_ = interval_nan_ = 0;
}

// What this (the printing) rank communicated since the last log line, per iteration: calls, payload
// (nccl-tests' size convention, see comm_stats) and the time it was blocked waiting — with overlapped
// reductions that is the exposed communication time. Evaluation and checkpoint traffic in the interval
// is included. Resets the counters.
std::string TrainingLog::communication_block() {

  const std::vector<CommStat> stats = comm_stats();
  reset_comm_stats();
  if (stats.empty() || interval_iters_ == 0) return "";
  const double n = double(interval_iters_);
  std::string out = fmt("communication on rank %d per iteration (group operation: calls | MB | ms waiting):\n",
                        run_.ps->rank());
  for (const CommStat& c : stats)
    out += fmt("    %s %s: %.1f | %.3f | %.2f\n", c.group.c_str(), c.op.c_str(), double(c.calls) / n,
               double(c.bytes) / n / 1048576.0, c.wait_seconds * 1000.0 / n);
  return out;
}

void TrainingLog::evaluation(const std::string& prefix, double loss, bool test_set) {
  const TrainConfig& cfg = run_.cfg;
  const double ppl = std::exp(std::min(20.0, loss));
  const std::string body =
      " validation loss at " + prefix + " | lm loss value: " + fmt("%.6E", loss) + " | lm loss PPL: " + fmt("%.6E", ppl) + " | ";
  const std::string rule(body.size() + 1, '-');
  log_ << rule << "\n" << body << "\n" << rule << "\n" << std::flush;
  if (tb_ && !test_set) {
    tb_->add_scalar("lm loss validation", loss, run_.progress.iteration);
    tb_->add_scalar("lm loss validation vs samples", loss, run_.progress.consumed_train);
    if (cfg.logging.log_validation_ppl_to_tensorboard) {
      tb_->add_scalar("lm loss validation ppl", ppl, run_.progress.iteration);
      tb_->add_scalar("lm loss validation ppl vs samples", ppl, run_.progress.consumed_train);
    }
    tb_->flush();
  }
  if (jsonl_)
    jsonl_->write({{"iteration", double(run_.progress.iteration)},
                   {test_set ? "test lm loss" : "validation lm loss", loss},
                   {test_set ? "test lm loss PPL" : "validation lm loss PPL", ppl}});
}

int64_t TrainingLog::final_memory() {
  const AllocStats mem = run_.ctx->memory_stats();
  log_ << fmt("[after training is done] memory (MB) | allocated: %.1f | max allocated: %.1f | max resident: %.1f\n",
              double(mem.current_bytes - run_.base_bytes) / 1048576.0,
              double(mem.peak_bytes - run_.base_bytes) / 1048576.0, double(max_rss_bytes()) / 1048576.0)
       << std::flush;
  return mem.peak_bytes - run_.base_bytes;
}

void TrainingLog::flush() {
  if (tb_) tb_->flush();
}

}  // namespace loom

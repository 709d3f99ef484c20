// The trainer loop and its Megatron-format logging (Megatron-LM's training.py: train_step,
// training_log, evaluate_and_print_results, the checkpoint/exit logic of train()).
//
// Iteration line (one per --log-interval; losses averaged over the interval's non-skipped iterations,
// the time over all of them, as Megatron does):
//  [date] iteration  i/ N | consumed samples: S | consumed tokens: K | elapsed time per iteration (ms): t |
//  [throughput per GPU (TFLOP/s/GPU): x |] learning rate: lr | global batch size: G | lm loss: L |
//  loss scale: s | grad norm: g | [params norm: p |] number of skipped iterations: k |
//  number of nan iterations: n | samples per second: r | TFLOPs: f |
// As in Megatron, the learning rate printed is the scheduler's value after this iteration's step, the
// grad norm is the last iteration's (absent when it was skipped), and an iteration whose gradients hold
// inf/NaN does not step the optimizer or the scheduler.
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <ctime>

#include "loom/data/mock_dataset.h"
#include "loom/train/model_io.h"
#include "train/trainer_impl.h"

namespace loom {

namespace {

std::string fmt(const char* f, auto... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, f, args...);
  return buf;
}

std::string now_string() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", std::localtime(&t));
  return buf;
}

int64_t max_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return int64_t(ru.ru_maxrss) * 1024;
}

// --exit-signal-handler: the handler only records the signal; the loop checks it after each iteration.
std::atomic<int> g_signal{0};
extern "C" void on_exit_signal(int sig) { g_signal.store(sig); }

class SignalGuard {
 public:
  explicit SignalGuard(bool enable) : enabled_(enable) {
    if (!enabled_) return;
    g_signal.store(0);
    struct sigaction sa {};
    sa.sa_handler = on_exit_signal;
    // SA_RESTART: a log write blocked on a full pipe must resume, not fail with EINTR (which would put
    // std::cout into a failed state and silently drop the rest of the log).
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, &old_term_);
    sigaction(SIGINT, &sa, &old_int_);
  }
  ~SignalGuard() {
    if (!enabled_) return;
    sigaction(SIGTERM, &old_term_, nullptr);
    sigaction(SIGINT, &old_int_, nullptr);
  }

 private:
  bool enabled_;
  struct sigaction old_term_ {}, old_int_ {};
};

const std::vector<std::string>& timer_names() {
  static const std::vector<std::string> names = {
      "forward-backward", "forward-compute", "backward-compute", "batch-generator", "optimizer-copy-to-main-grad",
      "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad", "optimizer-inner-step",
      "optimizer-copy-main-to-model-params", "optimizer",
      // distributed runs: the gradient reduction and the pipeline's point-to-point phases
      "grads-all-reduce", "forward-recv", "forward-send", "backward-recv", "backward-send"};
  return names;
}

}  // namespace

double iteration_flops(const GPTConfig& m, int64_t global_batch, int64_t seq_length, const RecomputeConfig& r) {
  // The model's exact counts (GQA, gated MLPs, --kv-channels; GPT-2: 24·b·s·h² + 4·b·s²·h per layer).
  double flops = m.flops_per_step(global_batch, seq_length);
  if (r.granularity == "full") {
    // uniform: every layer runs forward twice; block: the first N layers only.
    const int64_t n = r.method == "block" ? std::min(r.num_layers.value_or(0), m.num_layers) : m.num_layers;
    flops += double(n) * m.layer_forward_flops(global_batch, seq_length);
  }
  if (r.granularity == "selective")  // QKᵀ and PV of every layer again
    flops += double(m.num_layers) * m.attention_core_forward_flops(global_batch, seq_length);
  return flops;
}

Trainer::Trainer(const TrainConfig& cfg, std::ostream& log, std::unique_ptr<Communicator> world)
    : cfg_(cfg), log_(log), world_(std::move(world)), timers_(cfg.logging.timing_log_level),
      start_time_(std::chrono::steady_clock::now()) {}

Trainer::~Trainer() = default;

double Trainer::elapsed_minutes() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time_).count() / 60.0;
}

ModelOptions Trainer::model_options() const {
  ModelOptions o;
  o.compute_dtype = cfg_.precision.compute_dtype();
  o.grad_dtype = cfg_.precision.grad_dtype();
  if (!cfg_.recompute.granularity.empty()) o.recompute_granularity = parse_recompute_granularity(cfg_.recompute.granularity);
  if (!cfg_.recompute.method.empty()) o.recompute_method = parse_recompute_method(cfg_.recompute.method);
  o.recompute_num_layers = cfg_.recompute.num_layers.value_or(0);
  o.fp8 = cfg_.precision.fp8_recipe();
  return o;
}

void Trainer::build_data() {
  // Megatron's train_valid_test_num_samples.
  const int64_t train_samples = cfg_.batch.train_iters * gbs_;
  const int64_t eval_iters = cfg_.eval.eval_iters;
  const int64_t valid_samples = (cfg_.batch.train_iters / cfg_.eval.eval_interval + 1) * eval_iters * gbs_;
  const int64_t test_samples = eval_iters * gbs_;
  if (cfg_.data.mock_data) {
    const int64_t V = *cfg_.data.vocab_size;
    train_ds_ = std::make_shared<MockDataset>(V, T_, cfg_.seed, train_samples);
    // Distinct seeds: the validation and test tokens are not the training tokens.
    if (valid_samples > 0) valid_ds_ = std::make_shared<MockDataset>(V, T_, cfg_.seed + 1, valid_samples);
    if (test_samples > 0) test_ds_ = std::make_shared<MockDataset>(V, T_, cfg_.seed + 2, test_samples);
    cfg_.model.vocab_size = V;
  } else {
    const std::unique_ptr<Tokenizer> tokenizer = make_tokenizer(cfg_.data.tokenizer);
    cfg_.model.vocab_size = tokenizer->vocab_size();
    GPTDatasetConfig dcfg;
    dcfg.seq_length = T_;
    dcfg.seed = cfg_.seed;
    dcfg.data_cache_path = cfg_.data.data_cache_path;
    if (cfg_.data.train_data_path.empty()) {
      dcfg.split = cfg_.data.split;
      auto ds = build_gpt_datasets(cfg_.data.data_path, {train_samples, valid_samples, test_samples}, dcfg);
      train_ds_ = ds[0];
      valid_ds_ = ds[1];
      test_ds_ = ds[2];
      if (!train_ds_) user_error("--split '", cfg_.data.split, "' gives the training split no documents");
    } else {
      // --train-data-path / --valid-data-path / --test-data-path: each used whole for its purpose.
      dcfg.split = "1,0,0";
      train_ds_ = build_gpt_datasets(cfg_.data.train_data_path, {train_samples, 0, 0}, dcfg)[0];
      if (!cfg_.eval.valid_data_path.empty() && valid_samples > 0)
        valid_ds_ = build_gpt_datasets(cfg_.eval.valid_data_path, {valid_samples, 0, 0}, dcfg)[0];
      if (!cfg_.eval.test_data_path.empty() && test_samples > 0)
        test_ds_ = build_gpt_datasets(cfg_.eval.test_data_path, {test_samples, 0, 0}, dcfg)[0];
    }
    batch_opts_.reset_position_ids = cfg_.data.reset_position_ids;
    batch_opts_.reset_attention_mask = cfg_.data.reset_attention_mask;
    batch_opts_.eod_mask_loss = cfg_.data.eod_mask_loss;
    batch_opts_.eod = tokenizer->eod();
    batch_opts_.vocab_size = tokenizer->vocab_size();
    log_ << "> built " << tokenizer->name() << " tokenizer (vocabulary " << tokenizer->vocab_size() << ")\n";
  }
  // Logged only now: a bad --data-path or tokenizer file fails before anything is printed.
  log_ << " > datasets target sizes (minimum size):\n"
       << "    train:      " << train_samples << "\n    validation: " << valid_samples
       << "\n    test:       " << test_samples << "\n";
  log_ << "data: train " << train_ds_->description() << "\n";
  if (valid_ds_) log_ << "data: validation " << valid_ds_->description() << "\n";
  if (test_ds_) log_ << "data: test " << test_ds_->description() << "\n";
}

namespace {
// The node-local rank from the launcher (OpenMPI, SLURM, torchrun-style), else the global rank.
int local_rank(int global_rank) {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID", "LOCAL_RANK"})
    if (const char* v = std::getenv(var); v && *v) return std::atoi(v);
  return global_rank;
}
}  // namespace

std::unique_ptr<DeviceContext> Trainer::make_device_context() const {
  const std::string& dev = cfg_.device;
  // auto: distributed runs stay on the CPU until the trainer builds NCCL groups (build_model says so).
  const bool want_cuda = dev == "cuda" || (dev == "auto" && cuda_available() && !distributed_);
  if (!want_cuda) return make_cpu_context();
  if (distributed_)
    user_error("--device ", dev, ": distributed training on GPUs (NCCL process groups for every parallel group) is "
               "not wired into the trainer yet; run distributed jobs with --device cpu, or a single GPU process");
  const int count = cuda_device_count();
  if (count == 0)
    user_error("--device cuda: no CUDA GPU is visible (no driver, or CUDA_VISIBLE_DEVICES hides them all)");
  return make_cuda_context(local_rank(ps_->rank()) % count);
}

void Trainer::update_profiler() {
  const LoggingConfig& lc = cfg_.logging;
  if (!lc.profile) return;
  const bool mine = std::find(lc.profile_ranks.begin(), lc.profile_ranks.end(), ps_->rank()) != lc.profile_ranks.end();
  if (!mine) return;
  const bool in_window = iteration_ >= lc.profile_step_start && iteration_ < lc.profile_step_end &&
                         iteration_ < cfg_.batch.train_iters;
  if (in_window && !profiling_) {
    ctx_->profiler_start();
    timers_.set_hooks({[this] { ctx_->synchronize(); }, [this](const std::string& n) { ctx_->range_push(n.c_str()); },
                       [this] { ctx_->range_pop(); }});
    profiling_ = true;
    log_ << " > profiling iterations " << lc.profile_step_start << " to " << lc.profile_step_end - 1
         << " (cudaProfilerStart, NVTX ranges per timer)\n";
  } else if (!in_window && profiling_) {
    timers_.set_hooks({[this] { ctx_->synchronize(); }, {}, {}});
    ctx_->profiler_stop();
    profiling_ = false;
  }
}

void Trainer::build_model() {
  cfg_.model.padded_vocab_size =
      padded_vocab_size(cfg_.model.vocab_size, cfg_.data.make_vocab_size_divisible_by, ps_->tp_size());
  cfg_.model.hidden_dropout = cfg_.recompute.hidden_dropout;
  cfg_.model.attention_dropout = cfg_.recompute.attention_dropout;
  log_ << " > padded vocab (size: " << cfg_.model.vocab_size << ") with "
       << cfg_.model.padded_vocab_size - cfg_.model.vocab_size << " dummy tokens (new size: "
       << cfg_.model.padded_vocab_size << ")\n";
  if (cfg_.device == "auto" && distributed_ && cuda_available())
    log_ << " > --device auto: a GPU is visible, but distributed runs compute on the CPU until multi-GPU "
            "training lands\n";
  // The allocator is process-wide: count this run's bytes only (what earlier runs in the same process,
  // e.g. tests, still hold is the baseline).
  ctx_->reset_peak_memory();
  base_bytes_ = ctx_->memory_stats().current_bytes;
  log_ << "device: " << ctx_->description() << "\n";
  const ModelOptions mo = model_options();
  if (mo.fp8)
    log_ << " > fp8: " << fp8_format_name(mo.fp8->format) << " (E4M3 forward, "
         << (mo.fp8->format == Fp8Format::kHybrid ? "E5M2" : "E4M3") << " gradients), delayed scaling: margin "
         << mo.fp8->margin << ", amax history " << mo.fp8->amax_history_len << " ("
         << amax_compute_algo_name(mo.fp8->amax_compute_algo) << "), weight gradients "
         << (mo.fp8->wgrad ? "in fp8" : "in " + std::string(dtype_name(mo.compute_dtype)))
         << (ctx_->device().is_cpu() ? "; emulated on the CPU (quantise, dequantise, f32 GEMM)" : "") << "\n";
  build_model_chunks(mo);

  // Megatron's get_optimizer_param_scheduler, in samples.
  SchedulerConfig sc;
  const int64_t decay_iters = cfg_.optim.lr_decay_iters.value_or(cfg_.batch.train_iters);
  sc.init_lr = cfg_.optim.lr_warmup_init;
  sc.max_lr = cfg_.optim.lr;
  sc.min_lr = cfg_.optim.min_lr;
  sc.lr_decay_steps = decay_iters * gbs_;
  sc.lr_warmup_steps = cfg_.optim.lr_warmup_fraction
                           ? int64_t(*cfg_.optim.lr_warmup_fraction * double(sc.lr_decay_steps))
                           : cfg_.optim.lr_warmup_iters * gbs_;
  sc.lr_decay_style = cfg_.optim.lr_decay_style;
  sc.wsd_decay_steps = cfg_.optim.lr_wsd_decay_iters.value_or(0) * gbs_;
  sc.lr_wsd_decay_style = parse_wsd_decay_style(cfg_.optim.lr_wsd_decay_style);
  sc.wd_incr_style = parse_wd_incr_style(cfg_.optim.weight_decay_incr_style);
  if (sc.wd_incr_style == WDIncrStyle::kConstant) {
    if (cfg_.optim.start_weight_decay || cfg_.optim.end_weight_decay)
      user_error("--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or cosine");
    sc.start_wd = sc.end_wd = cfg_.optim.weight_decay;
  } else {
    if (!cfg_.optim.start_weight_decay || !cfg_.optim.end_weight_decay)
      user_error("--weight-decay-incr-style ", cfg_.optim.weight_decay_incr_style,
                 " needs --start-weight-decay and --end-weight-decay");
    sc.start_wd = *cfg_.optim.start_weight_decay;
    sc.end_wd = *cfg_.optim.end_weight_decay;
  }
  sc.wd_incr_steps = cfg_.batch.train_iters * gbs_;
  sc.override_opt_param_scheduler = cfg_.optim.override_opt_param_scheduler;
  sc.use_checkpoint_opt_param_scheduler = cfg_.optim.use_checkpoint_opt_param_scheduler;
  sched_ = std::make_unique<OptimizerParamScheduler>(sc);

  DynamicGradScalerConfig gs;
  gs.initial_scale = cfg_.precision.initial_loss_scale;
  gs.min_scale = cfg_.precision.min_loss_scale;
  gs.growth_interval = cfg_.precision.loss_scale_window;
  gs.hysteresis = cfg_.precision.hysteresis;
  scaler_ = make_grad_scaler(cfg_.precision.fp16, cfg_.precision.bf16, cfg_.precision.loss_scale.value_or(0.0), gs);
}

LoaderConfig Trainer::loader_config(int64_t consumed_samples) const {
  LoaderConfig lc;
  lc.global_batch_size = gbs_;
  lc.micro_batch_size = B_;
  lc.dp_rank = ps_->dp_rank();
  lc.dp_size = dp_;
  lc.consumed_samples = consumed_samples;
  lc.batch = batch_opts_;
  return lc;
}

GPTBatch Trainer::to_model_batch(const Batch& b) const {
  GPTBatch gb{b.tokens, b.labels, {}, {}, {}};
  if (batch_opts_.eod_mask_loss) gb.loss_mask = b.loss_mask;
  if (batch_opts_.reset_position_ids) gb.position_ids = b.position_ids;
  if (batch_opts_.reset_attention_mask) gb.segment_ids = b.segment_ids;
  if (ctx_->device().is_cpu()) return gb;
  // One micro-batch in flight at a time on the device (one pipeline stage: forward then backward of each
  // micro-batch, GPU runs being single-process for now): reuse the staging tensors.
  TensorView* fields[5] = {&gb.tokens, &gb.targets, &gb.loss_mask, &gb.position_ids, &gb.segment_ids};
  for (int i = 0; i < 5; ++i) {
    const TensorView src = *fields[i];
    if (!src.defined()) continue;
    Tensor& dst = dev_batch_[i];
    if (!dst.defined() || dst.shape() != src.shape() || dst.dtype() != src.dtype())
      dst = ctx_->empty(src.shape(), src.dtype());
    ctx_->copy(dst, src);
    *fields[i] = dst;
  }
  return gb;
}

float Trainer::micro_batch_dloss(const Batch& b, double loss_scale) const {
  // Megatron's per-micro-batch loss is the mean over its unmasked tokens, averaged over micro-batches;
  // the FP16 loss scale multiplies the gradient seed.
  double mask_sum = double(B_ * T_);
  if (batch_opts_.eod_mask_loss) {
    mask_sum = 0;
    const float* mp = b.loss_mask.data<float>();
    for (int64_t i = 0; i < B_ * T_; ++i) mask_sum += mp[i];
  }
  return mask_sum > 0 ? float(loss_scale / (mask_sum * double(nmb_))) : 0.0f;
}

double Trainer::evaluate(const std::shared_ptr<const SampleDataset>& ds, int64_t& consumed_samples) {
  // FP8: the weights changed since the last step's quantisation, and evaluation amaxes must not steer
  // the training scales.
  for (GPTModel* m : models()) m->fp8_begin_step();
  const double loss = evaluate_pipeline(ds, consumed_samples);
  for (GPTModel* m : models()) m->fp8_discard_amaxes();
  return loss;
}

void Trainer::evaluate_and_print(const std::string& prefix, bool test_set, bool periodic) {
  const std::shared_ptr<const SampleDataset>& ds = test_set ? test_ds_ : valid_ds_;
  if (!ds || cfg_.eval.eval_iters == 0) return;
  int64_t test_consumed = 0;
  const double loss = evaluate(ds, test_set ? test_consumed : consumed_valid_);
  const double ppl = std::exp(std::min(20.0, loss));
  const std::string body =
      " validation loss at " + prefix + " | lm loss value: " + fmt("%.6E", loss) + " | lm loss PPL: " + fmt("%.6E", ppl) + " | ";
  const std::string rule(body.size() + 1, '-');
  log_ << rule << "\n" << body << "\n" << rule << "\n" << std::flush;
  if (test_set)
    result_.final_test_loss = loss;
  else if (periodic)
    result_.valid_losses.emplace_back(iteration_, loss);
  else
    result_.final_valid_loss = loss;
  if (tb_ && !test_set) {
    tb_->add_scalar("lm loss validation", loss, iteration_);
    tb_->add_scalar("lm loss validation vs samples", loss, consumed_train_);
    if (cfg_.logging.log_validation_ppl_to_tensorboard) {
      tb_->add_scalar("lm loss validation ppl", ppl, iteration_);
      tb_->add_scalar("lm loss validation ppl vs samples", ppl, consumed_train_);
    }
    tb_->flush();
  }
  if (jsonl_)
    jsonl_->write({{"iteration", double(iteration_)},
                   {test_set ? "test lm loss" : "validation lm loss", loss},
                   {test_set ? "test lm loss PPL" : "validation lm loss PPL", ppl}});
}

void Trainer::write_tensorboard_step(const StepOutcome& s, double params_norm) {
  if (!tb_ || iteration_ % cfg_.logging.tensorboard_log_interval != 0) return;
  const double samples = double(consumed_train_);
  auto both = [&](const std::string& tag, double v) {
    tb_->add_scalar(tag, v, iteration_);
    tb_->add_scalar(tag + " vs samples", v, int64_t(samples));
  };
  if (cfg_.logging.log_learning_rate_to_tensorboard) both("learning-rate", sched_->lr());
  if (cfg_.logging.log_batch_size_to_tensorboard) both("batch-size", double(gbs_));
  both("lm loss", s.loss);  // every iteration, skipped ones included, as Megatron
  // As Megatron: the scale after this iteration's update, the value the log line prints.
  if (cfg_.logging.log_loss_scale_to_tensorboard) both("loss-scale", scaler_ ? double(scaler_->scale()) : 1.0);
  if (!s.skipped) both("grad-norm", s.grad_norm);
  if (cfg_.logging.log_params_norm) both("params-norm", params_norm);
  if (cfg_.logging.log_memory_to_tensorboard) {
    const AllocStats m = ctx_->memory_stats();
    tb_->add_scalar("mem-reserved-bytes", double(m.reserved_bytes), iteration_);
    tb_->add_scalar("mem-allocated-bytes", double(m.current_bytes), iteration_);
    tb_->add_scalar("mem-max-allocated-bytes", double(m.peak_bytes), iteration_);
  }
}

void Trainer::check_device_inputs() {
  const std::string err = ctx_->take_input_errors();
  if (!err.empty())
    user_error("the training batches of iteration", iteration_ > inputs_checked_through_ + 1 ? "s " : " ",
               inputs_checked_through_ + 1,
               iteration_ > inputs_checked_through_ + 1 ? ".." + std::to_string(iteration_) : std::string(),
               ": ", err,
               ". The data holds ids the model cannot embed: check --vocab-size / the tokenizer against the "
               "data, and --max-position-embeddings against --seq-length");
  inputs_checked_through_ = iteration_;
}

void Trainer::training_log(const StepOutcome& s) {
  if (s.skipped) {
    ++interval_skipped_;
    if (!std::isfinite(s.loss)) ++interval_nan_;
  } else {
    interval_loss_ += s.loss;
    ++interval_advanced_;
  }
  interval_ms_ += last_step_ms_;
  ++interval_iters_;
  // The parameter norm is collective in a distributed run: every rank computes it when the printing rank
  // needs it (TensorBoard or the log line), once for both.
  const bool tb_now = !cfg_.logging.tensorboard_dir.empty() && iteration_ % cfg_.logging.tensorboard_log_interval == 0;
  const bool log_now = iteration_ % cfg_.logging.log_interval == 0;
  const bool params_norm_on = cfg_.logging.log_params_norm;
  const double params_norm = params_norm_on && (tb_now || log_now) ? this->params_norm() : 0.0;
  write_tensorboard_step(s, params_norm);
  if (!log_now) return;

  const double avg_ms = interval_ms_ / double(interval_iters_);
  const double avg_loss = interval_loss_ / double(std::max<int64_t>(1, interval_advanced_));
  const double flops = iteration_flops(cfg_.model, gbs_, T_, cfg_.recompute);
  const double tflops = flops / (avg_ms / 1000.0) / double(ps_->world_size()) / 1e12;
  const double samples_per_s = double(gbs_) / (avg_ms / 1000.0);

  std::string line = " [" + now_string() + "]";
  line += fmt(" iteration %8lld/%8lld |", (long long)iteration_, (long long)cfg_.batch.train_iters);
  line += fmt(" consumed samples: %12lld |", (long long)consumed_train_);
  line += fmt(" consumed tokens: %12lld |", (long long)(consumed_train_ * T_));
  line += fmt(" elapsed time per iteration (ms): %.1f |", avg_ms);
  if (cfg_.logging.log_throughput) line += fmt(" throughput per GPU (TFLOP/s/GPU): %.1f |", tflops);
  line += fmt(" learning rate: %.6E |", sched_->lr());
  line += fmt(" global batch size: %5lld |", (long long)gbs_);
  if (interval_advanced_ > 0) line += fmt(" lm loss: %.6E |", avg_loss);
  line += fmt(" loss scale: %.1f |", scaler_ ? double(scaler_->scale()) : 1.0);
  if (!s.skipped) line += fmt(" grad norm: %.3f |", s.grad_norm);
  if (params_norm_on) line += fmt(" params norm: %.3f |", params_norm);
  line += fmt(" number of skipped iterations: %3lld |", (long long)interval_skipped_);
  line += fmt(" number of nan iterations: %3lld |", (long long)interval_nan_);
  line += fmt(" samples per second: %.3f |", samples_per_s);
  line += fmt(" TFLOPs: %.2f |", tflops);
  log_ << line << "\n";

  if (tb_ && cfg_.logging.log_timers_to_tensorboard) {
    tb_->add_scalar("iteration-time", avg_ms / 1000.0, iteration_);
    if (cfg_.logging.log_throughput) tb_->add_scalar("throughput", tflops, iteration_);
    for (const auto& [name, ms] : timers_.values_ms(timer_names(), double(interval_iters_)))
      tb_->add_scalar(name + "-time", ms, iteration_);
  }
  const std::string timers_block =
      timers_.log(timer_names(), double(interval_iters_), distributed_ ? &ps_->world() : nullptr);
  if (!timers_block.empty()) log_ << timers_block << "\n";
  if (distributed_ && cfg_.logging.timing_log_level >= 2) log_ << communication_block();
  if (!memory_reported_) {
    const AllocStats m = ctx_->memory_stats();
    // This (the printing) rank's memory; Megatron prints the same line per rank.
    log_ << fmt("[Rank %d] (after %lld iterations) memory (MB) | allocated: %.1f | max allocated: %.1f | "
                "reserved: %.1f | max resident: %.1f\n",
                ps_->rank(), (long long)iteration_, double(m.current_bytes - base_bytes_) / 1048576.0,
                double(m.peak_bytes - base_bytes_) / 1048576.0, double(m.reserved_bytes - base_bytes_) / 1048576.0, double(max_rss_bytes()) / 1048576.0);
    // ZeRO-2/3 allocate gradient buckets and gathered parameters around each use: their peak so far.
    if (dopt_->sharding() != ShardingStrategy::kNone)
      log_ << fmt("[Rank %d] (after %lld iterations) ZeRO bucket buffers (MB) | max allocated: %.1f\n", ps_->rank(),
                  (long long)iteration_, double(dopt_->memory().buffers_peak) / 1048576.0);
    memory_reported_ = true;
  }
  log_ << std::flush;
  if (jsonl_) {
    std::vector<std::pair<std::string, double>> f = {
        {"iteration", double(iteration_)},
        {"consumed samples", double(consumed_train_)},
        {"consumed tokens", double(consumed_train_ * T_)},
        {"elapsed time per iteration (ms)", avg_ms},
        {"learning rate", sched_->lr()},
        {"global batch size", double(gbs_)},
        {"lm loss", interval_advanced_ > 0 ? avg_loss : NAN},
        {"loss scale", scaler_ ? double(scaler_->scale()) : 1.0},
        {"grad norm", s.skipped ? NAN : s.grad_norm},
        {"number of skipped iterations", double(interval_skipped_)},
        {"number of nan iterations", double(interval_nan_)},
        {"samples per second", samples_per_s},
        {"TFLOPs", tflops}};
    if (params_norm_on) f.emplace_back("params norm", params_norm);
    jsonl_->write(f);
  }
  if (tb_) tb_->flush();
  interval_loss_ = interval_ms_ = 0;
  interval_iters_ = interval_advanced_ = interval_skipped_ = interval_nan_ = 0;
}

// What this (the printing) rank communicated since the last log line, per iteration: calls, payload
// (nccl-tests' size convention, see comm_stats) and the time it was blocked waiting — with overlapped
// reductions that is the exposed communication time. Evaluation and checkpoint traffic in the interval
// is included. Resets the counters.
std::string Trainer::communication_block() {
  const std::vector<CommStat> stats = comm_stats();
  reset_comm_stats();
  if (stats.empty() || interval_iters_ == 0) return "";
  const double n = double(interval_iters_);
  std::string out = fmt("communication on rank %d per iteration (group operation: calls | MB | ms waiting):\n",
                        ps_->rank());
  for (const CommStat& c : stats)
    out += fmt("    %s %s: %.1f | %.3f | %.2f\n", c.group.c_str(), c.op.c_str(), double(c.calls) / n,
               double(c.bytes) / n / 1048576.0, c.wait_seconds * 1000.0 / n);
  return out;
}

std::vector<GPTModel*> Trainer::models() const {
  std::vector<GPTModel*> out;
  for (const auto& m : chunks_) out.push_back(m.get());
  return out;
}

NamedTensors Trainer::fp8_state_tensors(std::vector<Tensor>& holder) const {
  NamedTensors out;
  holder.clear();
  for (GPTModel* m : models())
    for (int s = 0; s < m->fp8_num_sites(); ++s) holder.push_back(m->fp8_state(s));
  size_t k = 0;
  for (GPTModel* m : models())
    for (int s = 0; s < m->fp8_num_sites(); ++s) out.emplace_back(m->fp8_state_name(s), holder[k++]);
  return out;
}

void Trainer::fp8_after_backward() {
  // Tensor-parallel ranks hold shards of one tensor, DP x CP ranks replicas of it (or of its tokens): one
  // scale for all of them, from the max of their amaxes.
  for (GPTModel* m : models()) m->fp8_update_scaling({&ps_->tp(), &ps_->dp_cp()});
}

double Trainer::params_norm() const {
  // The master weights (sharded or not), replicas counted once; collective over the world.
  return dopt_->param_norm();
}

TrainResult Trainer::run() {
  const int world_size = world_->size();
  cfg_.validate(world_size);
  distributed_ = world_size > 1;
  ps_ = distributed_ ? ParallelState::create(cfg_.parallel, std::move(world_))
                     : ParallelState::create(cfg_.parallel, world_size, 0);
  dp_ = ps_->dp_size();
  gbs_ = cfg_.global_batch_size(dp_);
  nmb_ = cfg_.num_micro_batches(dp_);
  B_ = cfg_.batch.micro_batch_size;
  T_ = cfg_.batch.seq_length;
  dropout_seed_ = cfg_.seed;
  // Cheap checks of --load before any data or model is built.
  if (!cfg_.checkpoint.load.empty() && is_hf_model_dir(cfg_.checkpoint.load) && !cfg_.checkpoint.finetune)
    user_error("--load ", cfg_.checkpoint.load, " is a Hugging Face model directory (config.json), which holds "
               "weights only; add --finetune to start from them at iteration 0");

  // The device before any data or model work, so a wrong --device / --profile fails fast.
  ctx_ = make_device_context();
  if (cfg_.logging.profile && ctx_->device().is_cpu())
    user_error("--profile records NVTX ranges and CUDA profiler captures for Nsight Systems; this run computes on "
               "the CPU: drop --profile, or run on a GPU (--device cuda)");
  build_data();
  log_ << "using world size: " << ps_->world_size() << ", data-parallel size: " << dp_
       << ", context-parallel size: " << ps_->cp_size() << ", tensor-model-parallel size: " << ps_->tp_size()
       << ", pipeline-model-parallel size: " << ps_->pp_size() << "\n";
  log_ << "setting number of micro-batches to constant " << nmb_ << "\n";
  build_model();
  load_checkpoint();
  result_.start_iteration = iteration_;
  // TensorBoard and JSONL: written by the printing (last) rank only, like the log.
  const bool printer = ps_->rank() == ps_->world_size() - 1;
  if (printer && !cfg_.logging.tensorboard_dir.empty())
    tb_ = std::make_unique<TensorBoardWriter>(cfg_.logging.tensorboard_dir);
  if (printer && !cfg_.logging.metrics_jsonl.empty())
    jsonl_ = std::make_unique<MetricsJsonlWriter>(cfg_.logging.metrics_jsonl, /*append=*/iteration_ > 0);

  const LoaderConfig lcfg = loader_config(consumed_train_);
  if (iteration_ < cfg_.batch.train_iters) train_loader_ = std::make_unique<Loader>(train_ds_, lcfg);

  SignalGuard signals(cfg_.exit.exit_signal_handler);
  log_ << "training ...\n" << std::flush;
  reset_comm_stats();  // the communication lines count training steps, not the set-up
  result_.exit_reason = "train-iters";
  bool exiting = false;
  if (!ctx_->device().is_cpu()) timers_.set_hooks({[this] { ctx_->synchronize(); }, {}, {}});
  inputs_checked_through_ = iteration_;
  while (iteration_ < cfg_.batch.train_iters) {
    update_profiler();
    const auto t0 = std::chrono::steady_clock::now();
    const StepOutcome s = train_step();
    last_step_ms_ = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    ++iteration_;
    consumed_train_ += gbs_;
    result_.losses.push_back(s.loss);
    result_.grad_norms.push_back(s.grad_norm);
    result_.loss_scales.push_back(s.loss_scale);
    result_.learning_rates.push_back(s.lr);
    if (s.skipped) {
      ++result_.skipped_iterations;
      if (!std::isfinite(s.loss)) ++result_.nan_iterations;
    }
    if (iteration_ % cfg_.logging.log_interval == 0 || iteration_ == cfg_.batch.train_iters) check_device_inputs();
    training_log(s);

    if (iteration_ % cfg_.eval.eval_interval == 0)
      evaluate_and_print("iteration " + std::to_string(iteration_), false, true);

    // Megatron's order: signal, save interval, duration, exit interval.
    bool saved = false;
    if (cfg_.exit.exit_signal_handler && g_signal.load() != 0) {
      save_checkpoint();
      log_ << "[" << now_string() << "] exiting program after receiving "
           << (g_signal.load() == SIGINT ? "SIGINT" : "SIGTERM") << ".\n";
      result_.exit_reason = "signal";
      exiting = true;
      break;
    }
    if (!cfg_.checkpoint.save.empty() && cfg_.checkpoint.save_interval &&
        iteration_ % *cfg_.checkpoint.save_interval == 0) {
      save_checkpoint();
      saved = true;
    }
    if (cfg_.exit.exit_duration_in_mins && elapsed_minutes() > *cfg_.exit.exit_duration_in_mins) {
      if (!saved) save_checkpoint();
      log_ << "[" << now_string() << "] exiting program after " << elapsed_minutes() << " minutes\n";
      result_.exit_reason = "exit-duration";
      exiting = true;
      break;
    }
    if (cfg_.exit.exit_interval && iteration_ % *cfg_.exit.exit_interval == 0) {
      if (!saved) save_checkpoint();
      log_ << "[" << now_string() << "] exiting program at iteration " << iteration_ << "\n";
      result_.exit_reason = "exit-interval";
      exiting = true;
      break;
    }
  }
  if (profiling_) {  // the run ended inside the window
    timers_.set_hooks({[this] { ctx_->synchronize(); }, {}, {}});
    ctx_->profiler_stop();
    profiling_ = false;
  }
  result_.final_iteration = iteration_;
  result_.final_valid_loss = result_.final_test_loss = NAN;
  if (!exiting) {
    log_ << "[after training is done] " << now_string() << "\n";
    const bool just_saved = cfg_.checkpoint.save_interval && iteration_ % *cfg_.checkpoint.save_interval == 0;
    if (iteration_ > result_.start_iteration && !just_saved) save_checkpoint();
    evaluate_and_print("iteration " + std::to_string(iteration_) + " on validation set", false, false);
    evaluate_and_print("iteration " + std::to_string(iteration_) + " on test set", true, false);
  }
  const AllocStats mem = ctx_->memory_stats();
  result_.peak_bytes = mem.peak_bytes - base_bytes_;
  log_ << fmt("[after training is done] memory (MB) | allocated: %.1f | max allocated: %.1f | max resident: %.1f\n",
              double(mem.current_bytes - base_bytes_) / 1048576.0,
              double(mem.peak_bytes - base_bytes_) / 1048576.0, double(max_rss_bytes()) / 1048576.0)
       << std::flush;
  if (tb_) tb_->flush();
  return result_;
}

TrainResult run_training(const TrainConfig& cfg, std::ostream& log) {
  std::unique_ptr<Communicator> world =
      init_world(std::chrono::milliseconds(int64_t(cfg.dist.timeout_minutes * 60000.0)));
  // Megatron prints the iteration lines from the last rank (the last pipeline stage knows the loss); Loom
  // prints everything from there so that an mpirun log reads like a single process's.
  std::ostream null_stream(nullptr);
  const bool printer = world->rank() == world->size() - 1;
  Trainer t(cfg, printer ? log : null_stream, std::move(world));
  return t.run();
}

}  // namespace loom

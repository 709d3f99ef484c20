// ds_config.json onto TrainConfig (train/deepspeed_config.h). Precedence, as DeepSpeed's engine decides
// when Megatron-DeepSpeed hands it the model:
//   - the engine steps the optimizer with the file's batch keys, does the loss scaling of its fp16 section,
//     clips with gradient_clipping (DeepSpeed's default 0: none), builds the optimizer of an "optimizer"
//     section (absent params take that optimizer's defaults) and prefers a "scheduler" section to the
//     client's schedule: the file wins over the Megatron flags for all of these;
//   - the iteration log line is Megatron's: --log-interval wins over steps_per_print, and
//     --timing-log-level over wall_clock_breakdown;
//   - precision must agree: --fp16 / --bf16 with fp16.enabled / bf16.enabled (a section alone turns it on).
// Every value the file sets and every flag it overrides is recorded in cfg.deepspeed.notes.
#include "train/deepspeed_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "loom/core/check.h"
#include "loom/core/file_io.h"
#include "loom/optim/distributed_optimizer.h"
#include "loom/train/flags.h"

namespace loom {

namespace {

using nlohmann::json;

// Every key Loom reads, as a dotted path; the closest one is suggested for an unknown key.
const std::vector<std::string>& known_keys() {
  static const std::vector<std::string> keys = {
      "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
      "gradient_clipping", "prescale_gradients", "gradient_predivide_factor", "wall_clock_breakdown",
      "zero_allow_untested_optimizer", "zero_optimization", "fp16", "bf16", "optimizer", "scheduler",
      "activation_checkpointing", "wandb",
      // refused sections (their own error says why)
      "amp", "aio", "compression_training", "data_efficiency", "curriculum_learning", "flops_profiler", "tensorboard",
      "csv_monitor", "comms_logger", "elasticity", "autotuning", "sparse_attention", "pipeline", "checkpoint", "nebula",
      "moe",
      "zero_optimization.stage", "zero_optimization.reduce_bucket_size", "zero_optimization.allgather_bucket_size",
      "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients", "zero_optimization.reduce_scatter",
      "zero_optimization.allgather_partitions", "zero_optimization.round_robin_gradients",
      "zero_optimization.sub_group_size", "zero_optimization.stage3_max_live_parameters",
      "zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_prefetch_bucket_size",
      "zero_optimization.stage3_param_persistence_threshold",
      "zero_optimization.stage3_gather_16bit_weights_on_model_save", "zero_optimization.offload_optimizer",
      "zero_optimization.offload_param", "zero_optimization.cpu_offload", "zero_optimization.cpu_offload_params",
      "fp16.enabled", "fp16.loss_scale", "fp16.initial_scale_power", "fp16.loss_scale_window", "fp16.hysteresis",
      "fp16.min_loss_scale", "fp16.consecutive_hysteresis", "fp16.auto_cast", "fp16.fp16_master_weights_and_grads",
      "bf16.enabled", "optimizer.type", "optimizer.params", "optimizer.params.lr", "optimizer.params.betas",
      "optimizer.params.eps", "optimizer.params.weight_decay", "optimizer.params.max_grad_norm",
      "optimizer.params.adam_w_mode", "optimizer.params.torch_adam", "optimizer.params.bias_correction",
      "optimizer.params.amsgrad", "scheduler.type", "scheduler.params", "scheduler.params.warmup_min_lr",
      "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps", "scheduler.params.warmup_type",
      "scheduler.params.last_batch_iteration", "scheduler.params.total_num_steps", "scheduler.params.warmup_min_ratio",
      "scheduler.params.cos_min_ratio", "activation_checkpointing.partition_activations",
      "activation_checkpointing.contiguous_memory_optimization", "activation_checkpointing.cpu_checkpointing",
      "activation_checkpointing.number_checkpoints", "activation_checkpointing.synchronize_checkpoint_boundary",
      "activation_checkpointing.profile", "wandb.enabled", "wandb.project", "wandb.group", "wandb.team"};
  return keys;
}

std::string leaf(const std::string& path) {
  const size_t dot = path.rfind('.');
  return dot == std::string::npos ? path : path.substr(dot + 1);
}

std::string parent(const std::string& path) {
  const size_t dot = path.rfind('.');
  return dot == std::string::npos ? "" : path.substr(0, dot);
}

// The known key closest to `path`: same-level keys by their name, and any key whose last name matches
// (a key put in the wrong section).
std::string closest_key(const std::string& path) {
  std::string best;
  size_t best_d = SIZE_MAX;
  for (const std::string& k : known_keys()) {
    size_t d = SIZE_MAX;
    if (parent(k) == parent(path)) d = edit_distance(leaf(k), leaf(path));
    if (leaf(k) == leaf(path)) d = std::min<size_t>(d, 1);
    if (d < best_d) best_d = d, best = k;
  }
  return best;
}

class Reader {
 public:
  Reader(const std::string& file, TrainConfig& cfg, const std::set<std::string>& given)
      : file_(file), cfg_(cfg), given_(given) {}

  template <typename... Args>
  [[noreturn]] void fail(const std::string& key, const Args&... args) const {
    user_error("ds_config ", file_, ": \"", key, "\": ", args...);
  }

  // Every key of the object at `path` must be known; refused ones get their own error later.
  void check_keys(const json& obj, const std::string& path) const {
    if (!obj.is_object()) fail(path.empty() ? "(top level)" : path, "expected a JSON object, got ", obj.dump());
    for (const auto& [k, v] : obj.items()) {
      const std::string full = path.empty() ? k : path + "." + k;
      if (std::find(known_keys().begin(), known_keys().end(), full) == known_keys().end())
        fail(full, "unknown key (did you mean \"", closest_key(full), "\"?); docs/migrating.md lists every key "
             "Loom reads");
    }
  }

  bool get_bool(const json& v, const std::string& key) const {
    if (!v.is_boolean()) fail(key, "expected true or false, got ", v.dump());
    return v.get<bool>();
  }
  double get_number(const json& v, const std::string& key) const {
    if (!v.is_number()) fail(key, "expected a number, got ", v.dump());
    return v.get<double>();
  }
  // Integers may be written as 5e8 (DeepSpeed reads them through Python's int()).
  int64_t get_int(const json& v, const std::string& key) const {
    if (v.is_number_integer()) return v.get<int64_t>();
    if (v.is_number_float() && std::nearbyint(v.get<double>()) == v.get<double>() && std::fabs(v.get<double>()) < 9e18)
      return int64_t(v.get<double>());
    fail(key, "expected an integer, got ", v.dump());
  }
  std::string get_string(const json& v, const std::string& key) const {
    if (!v.is_string()) fail(key, "expected a string, got ", v.dump());
    return v.get<std::string>();
  }

  void note(const std::string& s) { cfg_.deepspeed.notes.push_back(" > ds_config " + file_ + ": " + s); }
  bool given(const char* flag) const { return given_.count(flag) > 0; }

  // The file's value wins over the flag (DeepSpeed's engine uses it); recorded either way.
  template <typename T>
  void take(T& field, const T& value, const std::string& key, const char* flag, const std::string& shown,
            const std::string& was) {
    if (given(flag) && !(field == value))
      note(key + " = " + shown + " wins over " + flag + " " + was + " (DeepSpeed's engine reads the file)");
    else
      note(key + " = " + shown + " (as " + flag + ")");
    field = value;
  }
  void take_number(double& field, double value, const std::string& key, const char* flag) {
    take(field, value, key, flag, num(value), num(field));
  }
  static std::string num(double v) {
    std::ostringstream o;
    o << v;
    return o.str();
  }

  const std::string& file() const { return file_; }
  TrainConfig& cfg() { return cfg_; }

 private:
  std::string file_;
  TrainConfig& cfg_;
  const std::set<std::string>& given_;
};

// A section Loom cannot honour: accepted only when it is switched off ({"enabled": false}).
void refuse_section(Reader& r, const json& root, const char* key, const char* why) {
  if (!root.contains(key)) return;
  const json& v = root.at(key);
  if (v.is_object() && v.contains("enabled") && v.at("enabled").is_boolean() && !v.at("enabled").get<bool>()) return;
  r.fail(key, "not supported: ", why, " (remove the section, or set \"enabled\": false)");
}

void apply_zero(Reader& r, const json& root) {
  TrainConfig& cfg = r.cfg();
  std::optional<int> stage = cfg.deepspeed.zero_stage;
  if (root.contains("zero_optimization")) {
    const json& z = root.at("zero_optimization");
    r.check_keys(z, "zero_optimization");
    for (const char* k : {"offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_params"})
      if (z.contains(k)) {
        const json& v = z.at(k);
        const bool off = v.is_boolean() ? !v.get<bool>()
                                        : v.is_object() && v.contains("device") && v.at("device") == "none";
        if (!off)
          r.fail(std::string("zero_optimization.") + k, "not supported: Loom keeps optimizer state and parameters in "
                 "the training device's memory (no CPU or NVMe offload); ZeRO-3 (\"stage\": 3) shards both over the "
                 "data-parallel ranks instead");
      }
    if (z.contains("stage")) {
      const int s = int(r.get_int(z.at("stage"), "zero_optimization.stage"));
      if (s < 0 || s > 3) r.fail("zero_optimization.stage", "must be 0, 1, 2 or 3, got ", s);
      if (cfg.deepspeed.zero_stage && *cfg.deepspeed.zero_stage != s)
        r.note("zero_optimization.stage = " + std::to_string(s) + " wins over --zero-stage " +
               std::to_string(*cfg.deepspeed.zero_stage) + " (DeepSpeed reads the stage from the file)");
      stage = s;
    }
    std::optional<int64_t> reduce, gather;
    if (z.contains("reduce_bucket_size")) reduce = r.get_int(z.at("reduce_bucket_size"), "zero_optimization.reduce_bucket_size");
    if (z.contains("allgather_bucket_size"))
      gather = r.get_int(z.at("allgather_bucket_size"), "zero_optimization.allgather_bucket_size");
    if (reduce && gather && *reduce != *gather)
      r.fail("zero_optimization.allgather_bucket_size", "Loom gathers the updated parameters in the buckets the "
             "gradients were reduced in: give the same size as reduce_bucket_size (", *reduce, ") or leave it out");
    if (reduce || gather) {
      const int64_t b = reduce ? *reduce : *gather;
      if (b <= 0) r.fail(reduce ? "zero_optimization.reduce_bucket_size" : "zero_optimization.allgather_bucket_size",
                         "must be > 0, got ", b);
      r.take(cfg.dist.ddp_bucket_size, b, reduce ? "zero_optimization.reduce_bucket_size"
                                                 : "zero_optimization.allgather_bucket_size",
             "--ddp-bucket-size", std::to_string(b) + " elements", std::to_string(cfg.dist.ddp_bucket_size));
    }
    if (z.contains("overlap_comm")) {
      const bool v = r.get_bool(z.at("overlap_comm"), "zero_optimization.overlap_comm");
      r.take(cfg.dist.overlap_grad_reduce, v, "zero_optimization.overlap_comm", "--overlap-grad-reduce",
             v ? "true" : "false", cfg.dist.overlap_grad_reduce ? "(on)" : "(off)");
    }
    // Layout and transport choices whose results Loom's ZeRO gives anyway: contiguous bucket buffers,
    // reduce-scatter into the owner's shard, all-gather of the updated partitions.
    std::vector<std::string> layout;
    for (const char* k : {"contiguous_gradients", "reduce_scatter", "allgather_partitions", "round_robin_gradients"})
      if (z.contains(k)) {
        r.get_bool(z.at(k), std::string("zero_optimization.") + k);
        layout.push_back(k);
      }
    for (const char* k : {"sub_group_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                          "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"})
      if (z.contains(k)) {
        r.get_int(z.at(k), std::string("zero_optimization.") + k);
        layout.push_back(k);
      }
    if (z.contains("stage3_gather_16bit_weights_on_model_save")) {
      r.get_bool(z.at("stage3_gather_16bit_weights_on_model_save"), "zero_optimization.stage3_gather_16bit_weights_on_model_save");
      layout.push_back("stage3_gather_16bit_weights_on_model_save");
    }
    if (!layout.empty()) {
      std::string s;
      for (const std::string& k : layout) s += (s.empty() ? "" : ", ") + k;
      r.note("zero_optimization " + s + ": DeepSpeed's buffer and transport tuning; Loom's ZeRO always reduces "
             "into contiguous buckets, reduce-scatters into the owner's shard and gathers whole buckets, and its "
             "checkpoints always hold full f32 weights: the results do not depend on these");
    }
  }
  if (!stage) {
    r.note("no zero_optimization.stage: ZeRO stage 0 (DeepSpeed's default; plain data parallelism)");
    stage = 0;
  }
  static const char* kStrategy[] = {"no_shard", "optim", "optim_grads", "optim_grads_params"};
  const ShardingStrategy want = parse_sharding_strategy(kStrategy[*stage]);
  if (r.given("--use-distributed-optimizer") || r.given("--data-parallel-sharding-strategy")) {
    const ShardingStrategy flags = resolve_sharding(cfg.dist.use_distributed_optimizer, cfg.dist.sharding_strategy);
    if (flags != want)
      r.fail("zero_optimization.stage", "ZeRO stage ", *stage, " (", zero_stage_name(want), ") disagrees with "
             "--use-distributed-optimizer / --data-parallel-sharding-strategy (", zero_stage_name(flags),
             "): give the stage in one place");
  }
  cfg.dist.use_distributed_optimizer = false;
  cfg.dist.sharding_strategy = kStrategy[*stage];
  r.note(std::string("ZeRO stage ") + std::to_string(*stage) + ": --data-parallel-sharding-strategy " +
         kStrategy[*stage] + " (" + zero_stage_name(want) + ")");
}

void apply_precision(Reader& r, const json& root) {
  TrainConfig& cfg = r.cfg();
  PrecisionConfig& p = cfg.precision;
  bool fp16 = false, bf16 = false;
  if (root.contains("fp16")) {
    const json& f = root.at("fp16");
    r.check_keys(f, "fp16");
    fp16 = f.contains("enabled") && r.get_bool(f.at("enabled"), "fp16.enabled");
    for (const char* k : {"consecutive_hysteresis", "auto_cast", "fp16_master_weights_and_grads"})
      if (f.contains(k) && r.get_bool(f.at(k), std::string("fp16.") + k))
        r.fail(std::string("fp16.") + k, "not supported: Loom's fp16 keeps f32 master weights and gradients, casts "
               "explicitly, and refills the hysteresis only when the scale grows (as Megatron); set it to false");
  }
  if (root.contains("bf16")) {
    r.check_keys(root.at("bf16"), "bf16");
    bf16 = root.at("bf16").contains("enabled") && r.get_bool(root.at("bf16").at("enabled"), "bf16.enabled");
  }
  if (fp16 && bf16) r.fail("bf16.enabled", "fp16 and bf16 cannot both be enabled");
  if (fp16 && p.bf16) r.fail("fp16.enabled", "fp16 is enabled here but the command line has --bf16");
  if (bf16 && p.fp16) r.fail("bf16.enabled", "bf16 is enabled here but the command line has --fp16");
  if (p.fp16 && !fp16)
    r.fail("fp16", "--fp16 needs \"fp16\": {\"enabled\": true} here (DeepSpeed's engine does the loss scaling); "
           "enable it, or drop --fp16");
  if (p.bf16 && !bf16)
    r.fail("bf16", "--bf16 needs \"bf16\": {\"enabled\": true} here; enable it, or drop --bf16");
  if (fp16 && !p.fp16) r.note("fp16.enabled turns on --fp16");
  if (bf16 && !p.bf16) r.note("bf16.enabled turns on --bf16");
  p.fp16 = p.fp16 || fp16;
  p.bf16 = p.bf16 || bf16;
  if (!fp16) return;
  // DeepSpeed's loss scaler: the file's values or DeepSpeed's defaults (initial 2^16, window 1000,
  // hysteresis 2, minimum 1). Its update rule is Megatron's (GradScaler).
  const json& f = root.at("fp16");
  auto number = [&](const char* k, double def) { return f.contains(k) ? r.get_number(f.at(k), std::string("fp16.") + k) : def; };
  const double loss_scale = number("loss_scale", 0.0);
  if (loss_scale < 0) r.fail("fp16.loss_scale", "must be >= 0 (0: dynamic), got ", loss_scale);
  if (loss_scale > 0) {
    if (r.given("--loss-scale") && p.loss_scale != loss_scale)
      r.note("fp16.loss_scale = " + Reader::num(loss_scale) + " wins over --loss-scale");
    p.loss_scale = loss_scale;
    r.note("fp16.loss_scale = " + Reader::num(loss_scale) + ": static loss scale (as --loss-scale)");
    return;
  }
  if (p.loss_scale) r.note("fp16.loss_scale = 0 (dynamic) wins over --loss-scale " + Reader::num(*p.loss_scale));
  p.loss_scale.reset();
  const int64_t power = f.contains("initial_scale_power") ? r.get_int(f.at("initial_scale_power"), "fp16.initial_scale_power") : 16;
  if (power < 0 || power > 127) r.fail("fp16.initial_scale_power", "must be in [0, 127], got ", power);
  r.take_number(p.initial_loss_scale, std::ldexp(1.0, int(power)), "fp16.initial_scale_power " + std::to_string(power),
                "--initial-loss-scale");
  const int64_t window = f.contains("loss_scale_window") ? r.get_int(f.at("loss_scale_window"), "fp16.loss_scale_window") : 1000;
  r.take(p.loss_scale_window, window, "fp16.loss_scale_window", "--loss-scale-window", std::to_string(window),
         std::to_string(p.loss_scale_window));
  const int64_t hyst = f.contains("hysteresis") ? r.get_int(f.at("hysteresis"), "fp16.hysteresis") : 2;
  r.take(p.hysteresis, hyst, "fp16.hysteresis", "--hysteresis", std::to_string(hyst), std::to_string(p.hysteresis));
  r.take_number(p.min_loss_scale, number("min_loss_scale", 1.0), "fp16.min_loss_scale", "--min-loss-scale");
}

void apply_optimizer(Reader& r, const json& root) {
  TrainConfig& cfg = r.cfg();
  OptimConfig& o = cfg.optim;
  const bool max_grad_norm = root.contains("optimizer") && root.at("optimizer").is_object() &&
                             root.at("optimizer").contains("params") && root.at("optimizer").at("params").is_object() &&
                             root.at("optimizer").at("params").contains("max_grad_norm");
  if (root.contains("gradient_clipping")) {
    r.take_number(o.clip_grad, r.get_number(root.at("gradient_clipping"), "gradient_clipping"), "gradient_clipping",
                  "--clip-grad");
  } else if (!max_grad_norm) {
    if (r.given("--clip-grad") && o.clip_grad != 0.0)
      r.note("no gradient_clipping: DeepSpeed does not clip (its default 0) and wins over --clip-grad " +
             Reader::num(o.clip_grad));
    else
      r.note("no gradient_clipping: no clipping (DeepSpeed's default 0)");
    o.clip_grad = 0.0;
  }
  if (!root.contains("optimizer")) return;
  const json& opt = root.at("optimizer");
  r.check_keys(opt, "optimizer");
  if (!opt.contains("type")) r.fail("optimizer.type", "missing (valid: Adam, AdamW)");
  std::string type = r.get_string(opt.at("type"), "optimizer.type");
  std::string lower = type;
  for (char& ch : lower) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  if (lower != "adam" && lower != "adamw")
    r.fail("optimizer.type", "'", type, "' is not supported (valid: Adam, AdamW — both AdamW with decoupled "
           "weight decay, DeepSpeed's adam_w_mode default; Loom's SGD is --optimizer sgd without an optimizer section)");
  if (r.given("--optimizer") && o.optimizer != OptimizerKind::kAdam)
    r.fail("optimizer.type", "'", type, "' disagrees with --optimizer ", optimizer_kind_name(o.optimizer));
  o.optimizer = OptimizerKind::kAdam;
  json params = opt.contains("params") ? opt.at("params") : json::object();
  r.check_keys(params, "optimizer.params");
  auto flag_bool = [&](const char* k, bool want, const char* why) {
    if (params.contains(k) && r.get_bool(params.at(k), std::string("optimizer.params.") + k) != want)
      r.fail(std::string("optimizer.params.") + k, "not supported: ", why);
  };
  flag_bool("adam_w_mode", true, "Loom's Adam decouples the weight decay (AdamW); L2-regularised Adam is not built");
  flag_bool("bias_correction", true, "Loom's Adam always corrects the moment bias");
  flag_bool("amsgrad", false, "Loom's Adam has no AMSGrad variant");
  // torch_adam: torch.optim.AdamW instead of DeepSpeed's fused Adam (the same update; its default weight
  // decay is 0.01 where FusedAdam's is 0).
  const bool torch_adam = params.contains("torch_adam") && r.get_bool(params.at("torch_adam"), "optimizer.params.torch_adam");
  // DeepSpeed builds this optimizer from the file: a missing param is the optimizer's default.
  auto number = [&](const char* k, double def) {
    return params.contains(k) ? r.get_number(params.at(k), std::string("optimizer.params.") + k) : def;
  };
  r.take_number(o.lr, number("lr", 1e-3), "optimizer.params.lr", "--lr");
  double b1 = 0.9, b2 = 0.999;
  if (params.contains("betas")) {
    const json& b = params.at("betas");
    if (!b.is_array() || b.size() != 2 || !b[0].is_number() || !b[1].is_number())
      r.fail("optimizer.params.betas", "expected [beta1, beta2], got ", b.dump());
    b1 = b[0].get<double>();
    b2 = b[1].get<double>();
  }
  r.take(o.adam.beta1, float(b1), "optimizer.params.betas[0]", "--adam-beta1", Reader::num(b1), Reader::num(o.adam.beta1));
  r.take(o.adam.beta2, float(b2), "optimizer.params.betas[1]", "--adam-beta2", Reader::num(b2), Reader::num(o.adam.beta2));
  const double eps = number("eps", 1e-8);
  r.take(o.adam.eps, float(eps), "optimizer.params.eps", "--adam-eps", Reader::num(eps), Reader::num(o.adam.eps));
  r.take_number(o.weight_decay, number("weight_decay", torch_adam ? 0.01 : 0.0), "optimizer.params.weight_decay",
                "--weight-decay");
  if (params.contains("max_grad_norm")) {
    const double m = r.get_number(params.at("max_grad_norm"), "optimizer.params.max_grad_norm");
    if (root.contains("gradient_clipping") && m != o.clip_grad)
      r.fail("optimizer.params.max_grad_norm", m, " disagrees with gradient_clipping ", o.clip_grad,
             ": both clip the global gradient norm; give one");
    o.clip_grad = m;
    r.note("optimizer.params.max_grad_norm = " + Reader::num(m) + " clips the global gradient norm (as --clip-grad)");
  }
}

void apply_scheduler(Reader& r, const json& root) {
  if (!root.contains("scheduler")) return;
  TrainConfig& cfg = r.cfg();
  const json& s = root.at("scheduler");
  r.check_keys(s, "scheduler");
  if (!s.contains("type")) r.fail("scheduler.type", "missing (valid: WarmupLR, WarmupDecayLR, WarmupCosineLR)");
  const std::string type = r.get_string(s.at("type"), "scheduler.type");
  DeepSpeedSchedule d;
  if (type == "WarmupLR") d.type = DeepSpeedScheduleType::kWarmupLR;
  else if (type == "WarmupDecayLR") d.type = DeepSpeedScheduleType::kWarmupDecayLR;
  else if (type == "WarmupCosineLR") d.type = DeepSpeedScheduleType::kWarmupCosineLR;
  else r.fail("scheduler.type", "'", type, "' is not supported (valid: WarmupLR, WarmupDecayLR, WarmupCosineLR)");
  json params = s.contains("params") ? s.at("params") : json::object();
  r.check_keys(params, "scheduler.params");
  const bool cosine = d.type == DeepSpeedScheduleType::kWarmupCosineLR;
  for (const auto& [k, v] : params.items()) {
    const bool cos_only = k == "warmup_min_ratio" || k == "cos_min_ratio";
    const bool lr_only = k == "warmup_min_lr" || k == "warmup_max_lr";
    if ((cos_only && !cosine) || (lr_only && cosine) || (k == "total_num_steps" && d.type == DeepSpeedScheduleType::kWarmupLR))
      r.fail("scheduler.params." + k, "not a parameter of ", type);
  }
  const std::string p = "scheduler.params.";
  if (params.contains("warmup_min_lr")) d.warmup_min_lr = r.get_number(params.at("warmup_min_lr"), p + "warmup_min_lr");
  if (params.contains("warmup_max_lr")) d.warmup_max_lr = r.get_number(params.at("warmup_max_lr"), p + "warmup_max_lr");
  if (params.contains("warmup_num_steps")) d.warmup_num_steps = r.get_int(params.at("warmup_num_steps"), p + "warmup_num_steps");
  if (params.contains("warmup_type")) {
    const std::string w = r.get_string(params.at("warmup_type"), p + "warmup_type");
    if (w != "log" && w != "linear") r.fail(p + "warmup_type", "'", w, "' (valid: log, linear)");
    d.log_warmup = w == "log";
  }
  if (params.contains("last_batch_iteration") && r.get_int(params.at("last_batch_iteration"), p + "last_batch_iteration") != -1)
    r.fail(p + "last_batch_iteration", "only -1 (a fresh schedule) is supported; a resumed run restores the "
           "schedule from its checkpoint");
  if (d.type != DeepSpeedScheduleType::kWarmupLR) {
    if (!params.contains("total_num_steps")) r.fail(p + "total_num_steps", "required by ", type);
    d.total_num_steps = r.get_int(params.at("total_num_steps"), p + "total_num_steps");
  }
  if (params.contains("warmup_min_ratio")) d.warmup_min_ratio = r.get_number(params.at("warmup_min_ratio"), p + "warmup_min_ratio");
  if (params.contains("cos_min_ratio")) d.cos_min_ratio = r.get_number(params.at("cos_min_ratio"), p + "cos_min_ratio");
  cfg.optim.deepspeed_schedule = d;
  std::string yielded;
  for (const char* f : {"--lr-decay-style", "--lr-warmup-iters", "--lr-warmup-fraction", "--lr-warmup-init", "--min-lr",
                        "--lr-decay-iters", "--lr-wsd-decay-iters", "--lr-wsd-decay-style"})
    if (r.given(f)) yielded += std::string(yielded.empty() ? "" : ", ") + f;
  r.note("scheduler " + type + " sets the learning rate, stepped once per applied optimizer step (DeepSpeed prefers "
         "a configured scheduler to the client's)" + (yielded.empty() ? "" : "; it wins over " + yielded));
}

void apply_logging(Reader& r, const json& root) {
  TrainConfig& cfg = r.cfg();
  if (root.contains("steps_per_print")) {
    const int64_t n = r.get_int(root.at("steps_per_print"), "steps_per_print");
    if (n <= 0) r.fail("steps_per_print", "must be > 0, got ", n);
    if (r.given("--log-interval")) {
      if (n != cfg.logging.log_interval)
        r.note("--log-interval " + std::to_string(cfg.logging.log_interval) + " wins over steps_per_print = " +
               std::to_string(n) + " (the iteration line is Megatron's)");
    } else {
      cfg.logging.log_interval = n;
      r.note("steps_per_print = " + std::to_string(n) + " (as --log-interval)");
    }
  }
  if (root.contains("wall_clock_breakdown") && r.get_bool(root.at("wall_clock_breakdown"), "wall_clock_breakdown")) {
    if (r.given("--timing-log-level")) {
      r.note("--timing-log-level " + std::to_string(cfg.logging.timing_log_level) + " wins over wall_clock_breakdown");
    } else {
      cfg.logging.timing_log_level = 2;
      r.note("wall_clock_breakdown = true: --timing-log-level 2 (forward, backward, optimizer and communication "
             "times per log line)");
    }
  }
  if (root.contains("wandb")) {
    const json& w = root.at("wandb");
    r.check_keys(w, "wandb");
    if (w.contains("enabled") && r.get_bool(w.at("enabled"), "wandb.enabled"))
      r.note("WARNING: wandb.enabled: Loom has no Weights & Biases client; the metrics go to --tensorboard-dir and "
             "--metrics-jsonl");
    for (const char* k : {"project", "group", "team"})
      if (w.contains(k)) r.get_string(w.at(k), std::string("wandb.") + k);
  }
  if (root.contains("zero_allow_untested_optimizer"))
    r.get_bool(root.at("zero_allow_untested_optimizer"), "zero_allow_untested_optimizer");  // both optimizers are ZeRO-native
  if (root.contains("prescale_gradients") && r.get_bool(root.at("prescale_gradients"), "prescale_gradients"))
    r.fail("prescale_gradients", "not supported: Loom averages the gradients after their reduction; set it to false");
  if (root.contains("gradient_predivide_factor") &&
      r.get_number(root.at("gradient_predivide_factor"), "gradient_predivide_factor") != 1.0)
    r.fail("gradient_predivide_factor", "not supported: Loom averages the gradients after their reduction; use 1.0");
  if (root.contains("activation_checkpointing")) {
    const json& a = root.at("activation_checkpointing");
    r.check_keys(a, "activation_checkpointing");
    if (a.contains("cpu_checkpointing") && r.get_bool(a.at("cpu_checkpointing"), "activation_checkpointing.cpu_checkpointing"))
      r.fail("activation_checkpointing.cpu_checkpointing", "not supported: Loom keeps checkpointed activations in "
             "device memory; set it to false");
    for (const char* k : {"partition_activations", "contiguous_memory_optimization", "synchronize_checkpoint_boundary", "profile"})
      if (a.contains(k)) r.get_bool(a.at(k), std::string("activation_checkpointing.") + k);
    if (a.contains("number_checkpoints") && !a.at("number_checkpoints").is_null() && !a.at("number_checkpoints").is_boolean())
      r.get_int(a.at("number_checkpoints"), "activation_checkpointing.number_checkpoints");
    r.note("activation_checkpointing: DeepSpeed's placement of checkpointed activations; Loom recomputes with "
           "--checkpoint-activations / --recompute-granularity and the results do not depend on these");
  }
}

}  // namespace

void apply_deepspeed_file(TrainConfig& cfg, const std::set<std::string>& given) {
  const std::string& path = cfg.deepspeed.config_path;
  const std::string text = read_file(path, "--deepspeed_config", int64_t(16) << 20);
  json root;
  try {
    root = json::parse(text);
  } catch (const json::parse_error& e) {
    user_error("ds_config ", path, ": not valid JSON (", e.what(), ")");
  }
  Reader r(path, cfg, given);
  r.check_keys(root, "");
  refuse_section(r, root, "amp", "apex AMP; use \"fp16\" or \"bf16\"");
  refuse_section(r, root, "aio", "NVMe offload (Loom keeps everything in device memory)");
  refuse_section(r, root, "compression_training", "DeepSpeed Compression (quantisation-aware training, pruning)");
  refuse_section(r, root, "data_efficiency", "DeepSpeed data efficiency (curriculum, random-LTD)");
  refuse_section(r, root, "curriculum_learning", "curriculum learning (Loom's data order is Megatron's)");
  refuse_section(r, root, "flops_profiler", "the DeepSpeed FLOPs profiler (Loom logs TFLOPs with --log-throughput)");
  refuse_section(r, root, "tensorboard", "DeepSpeed's monitor; use --tensorboard-dir");
  refuse_section(r, root, "csv_monitor", "DeepSpeed's CSV monitor; use --metrics-jsonl");
  refuse_section(r, root, "comms_logger", "DeepSpeed's communication logger; use --timing-log-level 2");
  refuse_section(r, root, "elasticity", "elastic training");
  refuse_section(r, root, "autotuning", "the DeepSpeed autotuner");
  refuse_section(r, root, "sparse_attention", "sparse attention");
  refuse_section(r, root, "pipeline", "DeepSpeed's pipeline engine; use --pipeline-model-parallel-size");
  refuse_section(r, root, "checkpoint", "DeepSpeed's checkpoint engine options; Loom writes its own format (--save)");
  refuse_section(r, root, "nebula", "Nebula checkpointing");
  refuse_section(r, root, "moe", "a DeepSpeed MoE section; Loom builds mixture-of-experts layers from Megatron's "
                                 "flags (--num-experts, --moe-router-topk, --expert-model-parallel-size; docs/models.md)");
  for (const char* k : {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"})
    if (root.contains(k)) {
      const int64_t v = r.get_int(root.at(k), k);
      if (v <= 0) r.fail(k, "has to be greater than 0, got ", v);
      std::optional<int64_t>& dst = std::string(k) == "train_batch_size" ? cfg.deepspeed.train_batch_size
                                    : std::string(k) == "train_micro_batch_size_per_gpu"
                                        ? cfg.deepspeed.micro_batch_size
                                        : cfg.deepspeed.gradient_accumulation_steps;
      dst = v;
    }
  apply_zero(r, root);
  apply_precision(r, root);
  apply_optimizer(r, root);
  apply_scheduler(r, root);
  apply_logging(r, root);
}

}  // namespace loom

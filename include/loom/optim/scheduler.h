// Megatron's OptimizerParamScheduler: the learning-rate schedule (linear warmup from --lr-warmup-init,
// then constant / linear / cosine / inverse-square-root / WSD decay to --min-lr) and the weight-decay
// increment schedule (--start-weight-decay to --end-weight-decay), with the checkpoint state and the
// resume rules of Megatron's load_state_dict.
//
// Everything is counted in SAMPLES, as Megatron does when --train-iters is given: the caller converts
// iterations with × global batch size, and after iteration i calls step(global_batch_size), so iteration
// i (1-based) trains with lr()/wd() at num_steps = (i - 1) · global_batch_size.
// Invariants (checked at construction and after load_state): 0 <= min_lr <= max_lr, init_lr <= max_lr,
// 0 <= lr_warmup_steps < lr_decay_steps, 0 <= start_wd <= end_wd.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "loom/optim/optimizer.h"

namespace loom {

// --lr-wsd-decay-style: the shape of the annealing phase at the end of a WSD schedule.
enum class WSDDecayStyle { kLinear, kCosine, kExponential, kMinusSqrt };
WSDDecayStyle parse_wsd_decay_style(const std::string& s);  // UserError naming --lr-wsd-decay-style
const char* wsd_decay_style_name(WSDDecayStyle s);          // Megatron's spelling ("minus_sqrt")

// --weight-decay-incr-style
enum class WDIncrStyle { kConstant, kLinear, kCosine };
WDIncrStyle parse_wd_incr_style(const std::string& s);  // UserError naming --weight-decay-incr-style
const char* wd_incr_style_name(WDIncrStyle s);

// DeepSpeed's learning-rate schedules (a ds_config.json "scheduler" section), which replace the Megatron
// schedule when set. DeepSpeed steps them once per applied optimizer step (not on a skipped fp16 step)
// and an optimizer step trains with the lr of last_batch_iteration = (steps applied so far) - 1:
//   WarmupLR       lr = min + (max - min) · γ, γ = log(k+1)/log(W) ("log") or k/W ("linear") for
//                  0 <= k < W, else 1; k = -1 (the first step) trains with min. W = max(2, warmup_num_steps).
//   WarmupDecayLR  as WarmupLR, then γ = max(0, (T - k) / max(1, T - W)) for k >= W.
//   WarmupCosineLR lr = base · r with r = wmin + γ · (1 - wmin) in the warmup, then
//                  r = max(0, cmin + (1 - cmin) · (1 + cos(π (k - W + 1) / (T - W))) / 2); k = -1 gives 0.
// (T = total_num_steps, base = the optimizer's lr.) The formulas keep DeepSpeed's operation order.
enum class DeepSpeedScheduleType { kNone, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR };
struct DeepSpeedSchedule {
  DeepSpeedScheduleType type = DeepSpeedScheduleType::kNone;
  double warmup_min_lr = 0.0;    // WarmupLR / WarmupDecayLR
  double warmup_max_lr = 0.001;
  int64_t warmup_num_steps = 1000;
  bool log_warmup = true;        // warmup_type "log" (DeepSpeed's default) or "linear"
  int64_t total_num_steps = 0;   // WarmupDecayLR / WarmupCosineLR
  double warmup_min_ratio = 0.0;  // WarmupCosineLR
  double cos_min_ratio = 0.0001;
  double base_lr = 0.0;          // WarmupCosineLR: the optimizer's lr
  int64_t samples_per_step = 0;  // the global batch: the scheduler's sample count / this = steps applied

  bool enabled() const { return type != DeepSpeedScheduleType::kNone; }
  const char* name() const;  // "WarmupLR", ...
  // The lr of the optimizer step after `applied` steps were applied.
  double lr(int64_t applied) const;
  std::string to_json() const;  // the checkpoint's record ("" when not enabled)
  static DeepSpeedSchedule from_json(const std::string& text, const std::string& what);
  bool operator==(const DeepSpeedSchedule&) const = default;
};

struct SchedulerConfig {
  double init_lr = 0.0;       // --lr-warmup-init: lr at num_steps 0 when warming up
  double max_lr = 0.0;        // --lr
  double min_lr = 0.0;        // --min-lr
  int64_t lr_warmup_steps = 0;  // samples: --lr-warmup-iters × gbs (or --lr-warmup-fraction × decay)
  int64_t lr_decay_steps = 0;   // samples: --lr-decay-iters (default --train-iters) × gbs; must be > 0
  LRDecayStyle lr_decay_style = LRDecayStyle::kLinear;  // --lr-decay-style
  int64_t wsd_decay_steps = 0;  // samples: --lr-wsd-decay-iters × gbs; WSD only, 0 < it <= lr_decay_steps
  WSDDecayStyle lr_wsd_decay_style = WSDDecayStyle::kExponential;  // --lr-wsd-decay-style
  double start_wd = 0.0;      // --start-weight-decay (= --weight-decay for the constant style)
  double end_wd = 0.0;        // --end-weight-decay (= --weight-decay for the constant style)
  int64_t wd_incr_steps = 0;  // samples: --train-iters × gbs; must be > 0 unless the style is constant
  WDIncrStyle wd_incr_style = WDIncrStyle::kConstant;  // --weight-decay-incr-style
  bool override_opt_param_scheduler = false;        // --override-opt_param-scheduler
  bool use_checkpoint_opt_param_scheduler = false;  // --use-checkpoint-opt_param-scheduler
  DeepSpeedSchedule deepspeed;  // ds_config "scheduler": when enabled, lr() follows it (wd is unchanged)
  // Megatron-DeepSpeed's token-based schedule (--lr-warmup-tokens / --lr-decay-tokens): tokens =
  // num_steps (samples) x tokens_per_sample. Warmup by tokens when set (else by samples), decay by tokens
  // when set (the warmup then ends at lr_warmup_steps x tokens_per_sample tokens unless given in tokens).
  int64_t tokens_per_sample = 0;
  std::optional<int64_t> lr_warmup_tokens, lr_decay_tokens;
};

// What a checkpoint records: the fields of Megatron's state_dict plus the WSD pair (which Megatron does
// not save; a state without them, e.g. converted from Megatron, skips their check on load).
struct SchedulerState {
  double max_lr = 0.0;
  double min_lr = 0.0;
  int64_t lr_warmup_steps = 0;
  int64_t lr_decay_steps = 0;
  LRDecayStyle lr_decay_style = LRDecayStyle::kLinear;
  int64_t num_steps = 0;
  bool has_wd = true;  // false for checkpoints older than weight-decay scheduling (no start_wd key)
  double start_wd = 0.0;
  double end_wd = 0.0;
  int64_t wd_incr_steps = 0;
  WDIncrStyle wd_incr_style = WDIncrStyle::kConstant;
  bool has_wsd = true;  // false when the state carries no wsd_decay_steps / lr_wsd_decay_style
  int64_t wsd_decay_steps = 0;
  WSDDecayStyle lr_wsd_decay_style = WSDDecayStyle::kExponential;
  DeepSpeedSchedule deepspeed;  // "deepspeed_scheduler" (absent: none)
  std::optional<int64_t> lr_warmup_tokens, lr_decay_tokens;  // Megatron-DeepSpeed's keys (null: not token-based)

  // JSON object with Megatron's key names (styles as Megatron's strings). from_json also accepts
  // Megatron's legacy keys (start_lr, warmup_iter/warmup_steps, end_iter/decay_steps, decay_style,
  // num_iters); a malformed document is a UserError naming `what` (e.g. the checkpoint file).
  std::string to_json() const;
  static SchedulerState from_json(const std::string& text, const std::string& what = "scheduler state");
  bool operator==(const SchedulerState&) const = default;
};

class OptimizerParamScheduler {
 public:
  // Validates cfg (UserError naming the Megatron flags) and sets num_steps = 0.
  explicit OptimizerParamScheduler(const SchedulerConfig& cfg);

  // num_steps += increment (samples), then lr and wd are recomputed.
  void step(int64_t increment);
  double lr() const { return lr_; }
  double wd() const { return wd_; }
  int64_t num_steps() const { return num_steps_; }
  // The schedule at any point, with the current settings (used for tests and look-ahead logging).
  double lr_at(int64_t num_steps) const;
  double wd_at(int64_t num_steps) const;
  const SchedulerConfig& config() const { return cfg_; }

  SchedulerState state() const;
  // Megatron's load_state_dict. For each recorded setting: with --override-opt_param-scheduler the
  // command-line value is kept; with --use-checkpoint-opt_param-scheduler the checkpoint's is taken;
  // with neither, a difference is a UserError naming the flag and both values. Then num_steps is set to
  // the checkpoint's and lr/wd recomputed (unlike Megatron, after all settings are applied, so the
  // first resumed iteration already uses the checkpoint's weight-decay settings).
  // Returns Megatron's log lines (" > using checkpoint value X for Y", " > overriding Y value to X").
  std::vector<std::string> load_state(const SchedulerState& s);

 private:
  void recompute();
  SchedulerConfig cfg_;
  int64_t num_steps_ = 0;
  double lr_ = 0.0;
  double wd_ = 0.0;
};

// A number the way Python prints it (repr of a float: shortest round-trip, "0.0003", "3.0", "1e-05"),
// so Loom's log lines match Megatron's.
std::string python_float_repr(double v);

}  // namespace loom

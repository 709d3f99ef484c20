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

// OptimizerParamScheduler: Megatron's lr / weight-decay schedules in samples, and its checkpoint rules.
// The formulas keep Megatron's operation order (and pow(x, 0.5) where Python writes x**0.5) so the
// values match a Python run of the same schedule to within an ULP or two (FMA contraction aside).
#include "loom/optim/scheduler.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>

namespace loom {

WSDDecayStyle parse_wsd_decay_style(const std::string& s) {
  if (s == "linear") return WSDDecayStyle::kLinear;
  if (s == "cosine") return WSDDecayStyle::kCosine;
  if (s == "exponential") return WSDDecayStyle::kExponential;
  if (s == "minus_sqrt") return WSDDecayStyle::kMinusSqrt;
  user_error("--lr-wsd-decay-style: unknown style '", s, "' (valid: linear, cosine, exponential, minus_sqrt)");
}

const char* wsd_decay_style_name(WSDDecayStyle s) {
  switch (s) {
    case WSDDecayStyle::kLinear: return "linear";
    case WSDDecayStyle::kCosine: return "cosine";
    case WSDDecayStyle::kExponential: return "exponential";
    case WSDDecayStyle::kMinusSqrt: return "minus_sqrt";
  }
  return "?";
}

WDIncrStyle parse_wd_incr_style(const std::string& s) {
  if (s == "constant") return WDIncrStyle::kConstant;
  if (s == "linear") return WDIncrStyle::kLinear;
  if (s == "cosine") return WDIncrStyle::kCosine;
  user_error("--weight-decay-incr-style: unknown style '", s, "' (valid: constant, linear, cosine)");
}

const char* wd_incr_style_name(WDIncrStyle s) {
  switch (s) {
    case WDIncrStyle::kConstant: return "constant";
    case WDIncrStyle::kLinear: return "linear";
    case WDIncrStyle::kCosine: return "cosine";
  }
  return "?";
}

std::string python_float_repr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (v == 0.0) return std::signbit(v) ? "-0.0" : "0.0";
  // Shortest round-trip digits, then Python's layout: positional for exponents in [-4, 16), else
  // d.ddde±XX; integral positional values keep a ".0".
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, std::fabs(v), std::chars_format::scientific);
  const std::string sci(buf, res.ptr);
  const size_t epos = sci.find('e');
  const int exp = std::atoi(sci.c_str() + epos + 1);
  std::string digits;
  for (size_t i = 0; i < epos; ++i)
    if (sci[i] != '.') digits += sci[i];
  std::string out;
  if (exp < -4 || exp >= 16) {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  } else if (exp < 0) {
    out = "0." + std::string(size_t(-exp - 1), '0') + digits;
  } else {
    const size_t int_len = size_t(exp) + 1;
    if (digits.size() <= int_len)
      out = digits + std::string(int_len - digits.size(), '0') + ".0";
    else
      out = digits.substr(0, int_len) + "." + digits.substr(int_len);
  }
  return v < 0 ? "-" + out : out;
}

namespace {

// Megatron's constructor assertions (and the flag-level rules of arguments.py that keep get_lr/get_wd
// well defined), as user errors naming the flags. `context` prefixes the message after a checkpoint load.
void validate(const SchedulerConfig& c, const std::string& context) {
  auto fail = [&](const auto&... args) { user_error(context, args...); };
  if (!std::isfinite(c.max_lr) || !std::isfinite(c.min_lr) || !std::isfinite(c.init_lr))
    fail("--lr, --min-lr, --lr-warmup-init must be finite, got ", c.max_lr, ", ", c.min_lr, ", ", c.init_lr);
  if (c.min_lr < 0.0) fail("--min-lr must be >= 0, got ", c.min_lr);
  if (c.max_lr < c.min_lr) fail("--lr (", c.max_lr, ") must be >= --min-lr (", c.min_lr, ")");
  if (c.init_lr < 0.0 || c.init_lr > c.max_lr)
    fail("--lr-warmup-init must be in [0, --lr = ", c.max_lr, "], got ", c.init_lr);
  if (c.lr_decay_steps <= 0)
    fail("--lr-decay-iters (default --train-iters) must give a decay of > 0 samples, got ", c.lr_decay_steps);
  if (c.lr_warmup_steps < 0)
    fail("--lr-warmup-iters/--lr-warmup-fraction must be >= 0, got ", c.lr_warmup_steps, " samples");
  if (c.lr_warmup_steps >= c.lr_decay_steps)
    fail("--lr-warmup-iters/--lr-warmup-fraction: the warmup (", c.lr_warmup_steps,
         " samples) must be shorter than the decay (--lr-decay-iters, ", c.lr_decay_steps, " samples)");
  if (c.lr_decay_style == LRDecayStyle::kWSD && (c.wsd_decay_steps <= 0 || c.wsd_decay_steps > c.lr_decay_steps))
    fail("--lr-wsd-decay-iters: --lr-decay-style WSD needs an annealing phase of 1 to --lr-decay-iters (",
         c.lr_decay_steps, " samples), got ", c.wsd_decay_steps, " samples");
  if (!std::isfinite(c.start_wd) || !std::isfinite(c.end_wd) || c.start_wd < 0.0)
    fail("--start-weight-decay must be finite and >= 0, got ", c.start_wd, " (end ", c.end_wd, ")");
  if (c.end_wd < c.start_wd)
    fail("--end-weight-decay (", c.end_wd, ") must be >= --start-weight-decay (", c.start_wd, ")");
  if (c.wd_incr_style == WDIncrStyle::kConstant && c.start_wd != c.end_wd)
    fail("--weight-decay-incr-style constant needs --start-weight-decay == --end-weight-decay (use "
         "--weight-decay), got ", c.start_wd, " and ", c.end_wd);
  if (c.wd_incr_style != WDIncrStyle::kConstant && c.wd_incr_steps <= 0)
    fail("--weight-decay-incr-style ", wd_incr_style_name(c.wd_incr_style),
         " increments over --train-iters, which must give > 0 samples, got ", c.wd_incr_steps);
  if (c.override_opt_param_scheduler && c.use_checkpoint_opt_param_scheduler)
    fail("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are mutually exclusive");
  if (c.lr_warmup_tokens || c.lr_decay_tokens) {
    if (c.tokens_per_sample <= 0) fail("--lr-warmup-tokens/--lr-decay-tokens need --seq-length > 0");
    if (c.lr_decay_style == LRDecayStyle::kWSD)
      fail("--lr-decay-style WSD counts samples; --lr-warmup-tokens/--lr-decay-tokens work with constant, linear, "
           "cosine and inverse-square-root");
    const int64_t w = c.lr_warmup_tokens.value_or(c.lr_warmup_steps * c.tokens_per_sample);
    if (c.lr_warmup_tokens && *c.lr_warmup_tokens < 0) fail("--lr-warmup-tokens must be >= 0, got ", *c.lr_warmup_tokens);
    if (c.lr_decay_tokens && *c.lr_decay_tokens <= w)
      fail("--lr-decay-tokens (", *c.lr_decay_tokens, ") must exceed the warmup (", w, " tokens)");
  }
  const DeepSpeedSchedule& d = c.deepspeed;
  if (d.enabled()) {
    const std::string key = std::string("ds_config scheduler ") + d.name() + ": ";
    if (d.samples_per_step <= 0) fail(key, "the global batch must be > 0 samples, got ", d.samples_per_step);
    if (d.warmup_num_steps < 0) fail(key, "warmup_num_steps must be >= 0, got ", d.warmup_num_steps);
    if (!std::isfinite(d.warmup_min_lr) || !std::isfinite(d.warmup_max_lr) || d.warmup_min_lr < 0 ||
        d.warmup_max_lr < 0)
      fail(key, "warmup_min_lr and warmup_max_lr must be finite and >= 0, got ", d.warmup_min_lr, " and ",
           d.warmup_max_lr);
    const int64_t W = std::max<int64_t>(2, d.warmup_num_steps);
    if (d.type != DeepSpeedScheduleType::kWarmupLR && d.total_num_steps <= 0)
      fail(key, "total_num_steps must be > 0, got ", d.total_num_steps);
    if (d.type == DeepSpeedScheduleType::kWarmupCosineLR) {
      if (d.total_num_steps <= W)
        fail(key, "total_num_steps (", d.total_num_steps, ") must exceed warmup_num_steps (", W,
             "): the cosine phase divides by their difference");
      if (!(d.base_lr >= 0) || !std::isfinite(d.base_lr)) fail(key, "the optimizer's lr must be >= 0, got ", d.base_lr);
      if (!(d.warmup_min_ratio >= 0 && d.warmup_min_ratio <= 1) || !(d.cos_min_ratio >= 0 && d.cos_min_ratio <= 1))
        fail(key, "warmup_min_ratio and cos_min_ratio must be in [0, 1], got ", d.warmup_min_ratio, " and ",
             d.cos_min_ratio);
    }
  }
}

std::string log_value(double v) { return python_float_repr(v); }
std::string log_value(int64_t v) { return std::to_string(v); }
std::string log_value(LRDecayStyle v) { return lr_decay_style_name(v); }
std::string log_value(WDIncrStyle v) { return wd_incr_style_name(v); }
std::string log_value(WSDDecayStyle v) { return wsd_decay_style_name(v); }
std::string log_value(const std::optional<int64_t>& v) { return v ? std::to_string(*v) : "None"; }
std::string log_value(const DeepSpeedSchedule& v) { return v.enabled() ? v.to_json() : "none (Megatron's)"; }

}  // namespace

OptimizerParamScheduler::OptimizerParamScheduler(const SchedulerConfig& cfg) : cfg_(cfg) {
  validate(cfg_, "");
  recompute();
}

void OptimizerParamScheduler::step(int64_t increment) {
  LOOM_CHECK(increment >= 0, "[OptimizerParamScheduler] step increment must be >= 0, got ", increment);
  num_steps_ += increment;
  recompute();
}

void OptimizerParamScheduler::recompute() {
  lr_ = lr_at(num_steps_);
  wd_ = wd_at(num_steps_);
}

// Megatron's get_lr. With --lr-warmup-tokens / --lr-decay-tokens (Megatron-DeepSpeed) a phase runs on the
// token clock (tokens = num_steps x tokens_per_sample) instead of the sample clock, with the same
// formulas: the warmup when it is given in tokens (inverse-square-root then counts tokens too), the decay
// when it is given in tokens (from the warmup's end in tokens: given, or lr_warmup_steps x
// tokens_per_sample, Megatron-DeepSpeed's "sample-wise warmup + token-wise decay").
double OptimizerParamScheduler::lr_at(int64_t n) const {
  LOOM_CHECK(n >= 0, "[OptimizerParamScheduler] num_steps must be >= 0, got ", n);
  const SchedulerConfig& c = cfg_;
  if (c.deepspeed.enabled()) return c.deepspeed.lr(n / c.deepspeed.samples_per_step);
  const int64_t tokens = n * c.tokens_per_sample;
  // Warmup: (position, length) on its clock.
  const bool warm_tokens = c.lr_warmup_tokens.has_value();
  const int64_t wx = warm_tokens ? tokens : n, wl = warm_tokens ? *c.lr_warmup_tokens : c.lr_warmup_steps;
  if (wl > 0 && wx <= wl) return c.init_lr + (c.max_lr - c.init_lr) * double(wx) / double(wl);
  if (c.lr_decay_style == LRDecayStyle::kConstant) return c.max_lr;
  // Decay: position, warmup end and decay end on its clock.
  const bool decay_tokens = c.lr_decay_tokens.has_value();
  const int64_t x = decay_tokens ? tokens : n;
  const int64_t w = decay_tokens ? c.lr_warmup_tokens.value_or(c.lr_warmup_steps * c.tokens_per_sample) : c.lr_warmup_steps;
  const int64_t d = decay_tokens ? *c.lr_decay_tokens : c.lr_decay_steps;
  if (x > d) return c.min_lr;
  if (c.lr_decay_style == LRDecayStyle::kInverseSquareRoot) {
    const double warmup = double(std::max<int64_t>(wl, 1));
    const double steps = double(std::max<int64_t>(wx, 1));
    return std::max(c.min_lr, c.max_lr * std::pow(warmup, 0.5) / std::pow(steps, 0.5));
  }
  const double ratio = double(x - w) / double(d - w);
  LOOM_CHECK(ratio >= 0.0 && ratio <= 1.0, "[OptimizerParamScheduler] decay ratio ", ratio);
  double coeff = 0.0;
  switch (c.lr_decay_style) {
    case LRDecayStyle::kLinear: coeff = 1.0 - ratio; break;
    case LRDecayStyle::kCosine: coeff = 0.5 * (std::cos(M_PI * ratio) + 1.0); break;
    case LRDecayStyle::kWSD: {  // samples only (validate refuses WSD with the token flags)
      const int64_t anneal_start = c.lr_decay_steps - c.wsd_decay_steps;
      if (n <= anneal_start) {
        coeff = 1.0;
        break;
      }
      const double r = double(n - anneal_start) / double(c.wsd_decay_steps);
      switch (c.lr_wsd_decay_style) {
        case WSDDecayStyle::kLinear: coeff = 1.0 - r; break;
        case WSDDecayStyle::kCosine: coeff = 0.5 * (std::cos(M_PI * r) + 1.0); break;
        case WSDDecayStyle::kExponential: coeff = 2.0 * std::pow(0.5, r) - 1.0; break;
        case WSDDecayStyle::kMinusSqrt: coeff = 1.0 - std::sqrt(r); break;
      }
      break;
    }
    case LRDecayStyle::kConstant:
    case LRDecayStyle::kInverseSquareRoot: LOOM_FAIL("handled above");
  }
  return c.min_lr + coeff * (c.max_lr - c.min_lr);
}

double OptimizerParamScheduler::wd_at(int64_t n) const {
  LOOM_CHECK(n >= 0, "[OptimizerParamScheduler] num_steps must be >= 0, got ", n);
  const SchedulerConfig& c = cfg_;
  if (n > c.wd_incr_steps) return c.end_wd;
  if (c.wd_incr_style == WDIncrStyle::kConstant) return c.end_wd;  // start == end, validated
  const double ratio = double(n) / double(c.wd_incr_steps);
  const double coeff =
      c.wd_incr_style == WDIncrStyle::kLinear ? ratio : 0.5 * (std::cos(M_PI * (1.0 - ratio)) + 1.0);
  return c.start_wd + coeff * (c.end_wd - c.start_wd);
}

SchedulerState OptimizerParamScheduler::state() const {
  SchedulerState s;
  s.max_lr = cfg_.max_lr;
  s.min_lr = cfg_.min_lr;
  s.lr_warmup_steps = cfg_.lr_warmup_steps;
  s.lr_decay_steps = cfg_.lr_decay_steps;
  s.lr_decay_style = cfg_.lr_decay_style;
  s.num_steps = num_steps_;
  s.has_wd = true;
  s.start_wd = cfg_.start_wd;
  s.end_wd = cfg_.end_wd;
  s.wd_incr_steps = cfg_.wd_incr_steps;
  s.wd_incr_style = cfg_.wd_incr_style;
  s.has_wsd = true;
  s.wsd_decay_steps = cfg_.wsd_decay_steps;
  s.lr_wsd_decay_style = cfg_.lr_wsd_decay_style;
  s.deepspeed = cfg_.deepspeed;
  s.lr_warmup_tokens = cfg_.lr_warmup_tokens;
  s.lr_decay_tokens = cfg_.lr_decay_tokens;
  return s;
}

std::vector<std::string> OptimizerParamScheduler::load_state(const SchedulerState& s) {
  std::vector<std::string> log;
  // Megatron's _check_and_set for one setting; `name` is Megatron's wording, `flag` the option to fix.
  auto check_and_set = [&](auto& cls, const auto& ckpt, const char* name, const char* flag) {
    if (cfg_.override_opt_param_scheduler) {
      log.push_back(std::string(" > overriding ") + name + " value to " + log_value(cls));
      return;
    }
    if (!cfg_.use_checkpoint_opt_param_scheduler && !(cls == ckpt))
      user_error(flag, ": command-line value ", log_value(cls), " and checkpoint value ", log_value(ckpt), " for ",
                 name, " do not match; pass --override-opt_param-scheduler to keep the command line's or "
                 "--use-checkpoint-opt_param-scheduler to take the checkpoint's scheduler settings");
    log.push_back(std::string(" > using checkpoint value ") + log_value(ckpt) + " for " + name);
    cls = ckpt;
  };
  SchedulerConfig& c = cfg_;
  check_and_set(c.max_lr, s.max_lr, "learning rate", "--lr");
  check_and_set(c.min_lr, s.min_lr, "minimum learning rate", "--min-lr");
  check_and_set(c.lr_warmup_steps, s.lr_warmup_steps, "warmup iterations",
                "--lr-warmup-iters/--lr-warmup-fraction (in samples)");
  check_and_set(c.lr_decay_steps, s.lr_decay_steps, "total number of iterations",
                "--lr-decay-iters/--train-iters (in samples)");
  check_and_set(c.lr_decay_style, s.lr_decay_style, "learning rate decay style", "--lr-decay-style");
  if (s.has_wd) {
    check_and_set(c.start_wd, s.start_wd, "start weight decay", "--start-weight-decay/--weight-decay");
    check_and_set(c.end_wd, s.end_wd, "end weight decay", "--end-weight-decay/--weight-decay");
    check_and_set(c.wd_incr_steps, s.wd_incr_steps, "total number of weight decay iterations",
                  "--train-iters (weight-decay increment, in samples)");
    check_and_set(c.wd_incr_style, s.wd_incr_style, "weight decay incr style", "--weight-decay-incr-style");
  }
  // The WSD pair matters only for a WSD schedule; other styles ignore whatever was saved.
  if (s.has_wsd && c.lr_decay_style == LRDecayStyle::kWSD) {
    check_and_set(c.wsd_decay_steps, s.wsd_decay_steps, "WSD decay iterations",
                  "--lr-wsd-decay-iters (in samples)");
    check_and_set(c.lr_wsd_decay_style, s.lr_wsd_decay_style, "WSD decay style", "--lr-wsd-decay-style");
  }
  if (c.lr_warmup_tokens || s.lr_warmup_tokens)
    check_and_set(c.lr_warmup_tokens, s.lr_warmup_tokens, "warmup tokens", "--lr-warmup-tokens");
  if (c.lr_decay_tokens || s.lr_decay_tokens)
    check_and_set(c.lr_decay_tokens, s.lr_decay_tokens, "decay tokens", "--lr-decay-tokens");
  // A DeepSpeed schedule on either side must match like any other setting (none vs one is a mismatch).
  if (c.deepspeed.enabled() || s.deepspeed.enabled())
    check_and_set(c.deepspeed, s.deepspeed, "DeepSpeed scheduler", "ds_config \"scheduler\"");
  validate(c, "after loading the checkpoint's optimizer-param scheduler: ");
  if (s.num_steps < 0) user_error("scheduler state: num_steps must be >= 0, got ", s.num_steps);
  num_steps_ = 0;
  step(s.num_steps);
  return log;
}

// ---- JSON ---------------------------------------------------------------------------------------

std::string SchedulerState::to_json() const {
  nlohmann::ordered_json j;
  j["max_lr"] = max_lr;
  j["lr_warmup_steps"] = lr_warmup_steps;
  j["num_steps"] = num_steps;
  j["lr_decay_style"] = lr_decay_style_name(lr_decay_style);
  j["lr_decay_steps"] = lr_decay_steps;
  j["min_lr"] = min_lr;
  if (has_wd) {
    j["start_wd"] = start_wd;
    j["end_wd"] = end_wd;
    j["wd_incr_style"] = wd_incr_style_name(wd_incr_style);
    j["wd_incr_steps"] = wd_incr_steps;
  }
  if (has_wsd) {
    j["wsd_decay_steps"] = wsd_decay_steps;
    j["lr_wsd_decay_style"] = wsd_decay_style_name(lr_wsd_decay_style);
  }
  if (lr_warmup_tokens || lr_decay_tokens) {
    j["lr_warmup_tokens"] = lr_warmup_tokens ? nlohmann::ordered_json(*lr_warmup_tokens) : nlohmann::ordered_json();
    j["lr_decay_tokens"] = lr_decay_tokens ? nlohmann::ordered_json(*lr_decay_tokens) : nlohmann::ordered_json();
  }
  if (deepspeed.enabled()) j["deepspeed_scheduler"] = nlohmann::ordered_json::parse(deepspeed.to_json());
  return j.dump(2);
}

namespace {

// The first of `keys` present in j (Megatron renamed several over time), or a UserError.
const nlohmann::json& field(const nlohmann::json& j, std::initializer_list<const char*> keys,
                            const std::string& what) {
  for (const char* k : keys)
    if (j.contains(k)) return j.at(k);
  user_error(what, ": missing key '", *keys.begin(), "'");
}

double get_double(const nlohmann::json& v, const char* key, const std::string& what) {
  if (!v.is_number()) user_error(what, ": '", key, "' must be a number, got ", v.dump());
  return v.get<double>();
}

int64_t get_int(const nlohmann::json& v, const char* key, const std::string& what) {
  if (!v.is_number_integer()) user_error(what, ": '", key, "' must be an integer, got ", v.dump());
  return v.get<int64_t>();
}

std::string get_string(const nlohmann::json& v, const char* key, const std::string& what) {
  if (!v.is_string()) user_error(what, ": '", key, "' must be a string, got ", v.dump());
  return v.get<std::string>();
}

// Style names from a file: a bad one names the file, not the command-line flag.
template <typename F>
auto parse_style(F parse, const std::string& name, const char* key, const std::string& what) {
  try {
    return parse(name);
  } catch (const UserError& e) {
    user_error(what, ": '", key, "': ", e.what());
  }
}

}  // namespace

SchedulerState SchedulerState::from_json(const std::string& text, const std::string& what) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    user_error(what, ": not valid JSON (", e.what(), ")");
  }
  if (!j.is_object()) user_error(what, ": expected a JSON object");
  SchedulerState s;
  s.max_lr = get_double(field(j, {"max_lr", "start_lr"}, what), "max_lr", what);
  s.min_lr = get_double(field(j, {"min_lr"}, what), "min_lr", what);
  s.lr_warmup_steps =
      get_int(field(j, {"lr_warmup_steps", "warmup_steps", "warmup_iter"}, what), "lr_warmup_steps", what);
  s.lr_decay_steps = get_int(field(j, {"lr_decay_steps", "decay_steps", "end_iter"}, what), "lr_decay_steps", what);
  s.lr_decay_style = parse_style(parse_lr_decay_style,
                                 get_string(field(j, {"lr_decay_style", "decay_style"}, what), "lr_decay_style", what),
                                 "lr_decay_style", what);
  s.num_steps = get_int(field(j, {"num_steps", "num_iters"}, what), "num_steps", what);
  if (s.num_steps < 0) user_error(what, ": 'num_steps' must be >= 0, got ", s.num_steps);
  s.has_wd = j.contains("start_wd") && !j.at("start_wd").is_null();
  if (s.has_wd) {
    s.start_wd = get_double(j.at("start_wd"), "start_wd", what);
    s.end_wd = get_double(field(j, {"end_wd"}, what), "end_wd", what);
    s.wd_incr_steps = get_int(field(j, {"wd_incr_steps"}, what), "wd_incr_steps", what);
    s.wd_incr_style = parse_style(parse_wd_incr_style,
                                  get_string(field(j, {"wd_incr_style"}, what), "wd_incr_style", what),
                                  "wd_incr_style", what);
  }
  s.has_wsd = j.contains("wsd_decay_steps") && !j.at("wsd_decay_steps").is_null();
  if (s.has_wsd) {
    s.wsd_decay_steps = get_int(j.at("wsd_decay_steps"), "wsd_decay_steps", what);
    s.lr_wsd_decay_style =
        parse_style(parse_wsd_decay_style,
                    get_string(field(j, {"lr_wsd_decay_style"}, what), "lr_wsd_decay_style", what),
                    "lr_wsd_decay_style", what);
  }
  for (const auto& [key, dst] : {std::pair{"lr_warmup_tokens", &s.lr_warmup_tokens}, {"lr_decay_tokens", &s.lr_decay_tokens}})
    if (j.contains(key) && !j.at(key).is_null()) *dst = get_int(j.at(key), key, what);
  if (j.contains("deepspeed_scheduler") && !j.at("deepspeed_scheduler").is_null())
    s.deepspeed = DeepSpeedSchedule::from_json(j.at("deepspeed_scheduler").dump(), what);
  return s;
}

// ---- DeepSpeed schedules ----------------------------------------------------------------------------

const char* DeepSpeedSchedule::name() const {
  switch (type) {
    case DeepSpeedScheduleType::kNone: return "none";
    case DeepSpeedScheduleType::kWarmupLR: return "WarmupLR";
    case DeepSpeedScheduleType::kWarmupDecayLR: return "WarmupDecayLR";
    case DeepSpeedScheduleType::kWarmupCosineLR: return "WarmupCosineLR";
  }
  return "?";
}

double DeepSpeedSchedule::lr(int64_t applied) const {
  const int64_t k = applied - 1;  // DeepSpeed's last_batch_iteration
  const int64_t W = std::max<int64_t>(2, warmup_num_steps);
  const double inverse_log_warm_up = 1.0 / std::log(double(W));
  auto warm = [&] { return log_warmup ? inverse_log_warm_up * std::log(double(k + 1)) : double(k) / double(W); };
  if (type == DeepSpeedScheduleType::kWarmupCosineLR) {
    if (k < 0) return 0.0;
    double ratio;
    if (k < W) {
      ratio = warmup_min_ratio + warm() * (1.0 - warmup_min_ratio);
    } else {
      const double real_last_step = double(k - W + 1), real_total_steps = double(total_num_steps - W);
      ratio = (1.0 + std::cos(M_PI * real_last_step / real_total_steps)) / 2.0;
      ratio = std::max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * ratio);
    }
    return base_lr * ratio;
  }
  if (k < 0) return warmup_min_lr;
  double gamma = 1.0;
  if (k < W)
    gamma = warm();
  else if (type == DeepSpeedScheduleType::kWarmupDecayLR)
    gamma = std::max(0.0, double(total_num_steps - k) / std::max(1.0, double(total_num_steps - W)));
  return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma;
}

std::string DeepSpeedSchedule::to_json() const {
  if (!enabled()) return "";
  nlohmann::ordered_json j;
  j["type"] = name();
  j["warmup_num_steps"] = warmup_num_steps;
  j["warmup_type"] = log_warmup ? "log" : "linear";
  if (type == DeepSpeedScheduleType::kWarmupCosineLR) {
    j["total_num_steps"] = total_num_steps;
    j["warmup_min_ratio"] = warmup_min_ratio;
    j["cos_min_ratio"] = cos_min_ratio;
    j["base_lr"] = base_lr;
  } else {
    j["warmup_min_lr"] = warmup_min_lr;
    j["warmup_max_lr"] = warmup_max_lr;
    if (type == DeepSpeedScheduleType::kWarmupDecayLR) j["total_num_steps"] = total_num_steps;
  }
  j["samples_per_step"] = samples_per_step;
  return j.dump();
}

DeepSpeedSchedule DeepSpeedSchedule::from_json(const std::string& text, const std::string& what) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    user_error(what, ": deepspeed_scheduler is not valid JSON (", e.what(), ")");
  }
  if (!j.is_object()) user_error(what, ": deepspeed_scheduler must be a JSON object");
  DeepSpeedSchedule d;
  const std::string type = get_string(field(j, {"type"}, what), "type", what);
  if (type == "WarmupLR") d.type = DeepSpeedScheduleType::kWarmupLR;
  else if (type == "WarmupDecayLR") d.type = DeepSpeedScheduleType::kWarmupDecayLR;
  else if (type == "WarmupCosineLR") d.type = DeepSpeedScheduleType::kWarmupCosineLR;
  else user_error(what, ": deepspeed_scheduler type '", type, "' (valid: WarmupLR, WarmupDecayLR, WarmupCosineLR)");
  d.warmup_num_steps = get_int(field(j, {"warmup_num_steps"}, what), "warmup_num_steps", what);
  d.log_warmup = get_string(field(j, {"warmup_type"}, what), "warmup_type", what) == "log";
  if (d.type == DeepSpeedScheduleType::kWarmupCosineLR) {
    d.total_num_steps = get_int(field(j, {"total_num_steps"}, what), "total_num_steps", what);
    d.warmup_min_ratio = get_double(field(j, {"warmup_min_ratio"}, what), "warmup_min_ratio", what);
    d.cos_min_ratio = get_double(field(j, {"cos_min_ratio"}, what), "cos_min_ratio", what);
    d.base_lr = get_double(field(j, {"base_lr"}, what), "base_lr", what);
  } else {
    d.warmup_min_lr = get_double(field(j, {"warmup_min_lr"}, what), "warmup_min_lr", what);
    d.warmup_max_lr = get_double(field(j, {"warmup_max_lr"}, what), "warmup_max_lr", what);
    if (d.type == DeepSpeedScheduleType::kWarmupDecayLR)
      d.total_num_steps = get_int(field(j, {"total_num_steps"}, what), "total_num_steps", what);
  }
  d.samples_per_step = get_int(field(j, {"samples_per_step"}, what), "samples_per_step", what);
  return d;
}

}  // namespace loom

// Megatron's constant and dynamic loss scalers. Scale arithmetic stays in float (Megatron's float32
// tensor), so a sequence of updates gives the same bits as Megatron's.
#include "loom/optim/grad_scaler.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <nlohmann/json.hpp>

#include "loom/core/check.h"

namespace loom {

namespace {

// A scale flag must be a positive number that FP32 can hold.
float positive_fp32(double v, const char* flag) {
  if (!(v > 0.0) || !std::isfinite(v) || v > double(FLT_MAX) || float(v) == 0.0f)
    user_error(flag, " must be a positive number within FP32 range, got ", v);
  return float(v);
}

}  // namespace

ConstantGradScaler::ConstantGradScaler(double loss_scale) : GradScaler(positive_fp32(loss_scale, "--loss-scale")) {}

DynamicGradScaler::DynamicGradScaler(const DynamicGradScalerConfig& cfg)
    : GradScaler(positive_fp32(cfg.initial_scale, "--initial-loss-scale")),
      cfg_(cfg),
      min_scale_(positive_fp32(cfg.min_scale, "--min-loss-scale")),
      growth_factor_(float(cfg.growth_factor)),
      backoff_factor_(float(cfg.backoff_factor)),
      hysteresis_tracker_(cfg.hysteresis) {
  if (min_scale_ > scale_)
    user_error("--min-loss-scale (", cfg.min_scale, ") must be <= --initial-loss-scale (", cfg.initial_scale, ")");
  if (cfg.growth_interval < 1) user_error("--loss-scale-window must be >= 1, got ", cfg.growth_interval);
  if (cfg.hysteresis < 1) user_error("--hysteresis must be >= 1, got ", cfg.hysteresis);
  // Not flags in Megatron (fixed 2 and 0.5): a bad value here is a caller bug.
  LOOM_CHECK(cfg.growth_factor > 1.0 && std::isfinite(cfg.growth_factor),
             "[DynamicGradScaler] growth_factor must be > 1, got ", cfg.growth_factor);
  LOOM_CHECK(cfg.backoff_factor > 0.0 && cfg.backoff_factor < 1.0,
             "[DynamicGradScaler] backoff_factor must be in (0, 1), got ", cfg.backoff_factor);
}

void DynamicGradScaler::update(bool found_inf) {
  if (found_inf) {
    growth_tracker_ = 0;
    --hysteresis_tracker_;
    if (hysteresis_tracker_ <= 0) scale_ = std::max(scale_ * backoff_factor_, min_scale_);
    return;
  }
  ++growth_tracker_;
  if (growth_tracker_ == cfg_.growth_interval) {
    growth_tracker_ = 0;
    hysteresis_tracker_ = cfg_.hysteresis;
    scale_ = scale_ * growth_factor_;
  }
}

void DynamicGradScaler::load_state(const GradScalerState& s) {
  LOOM_CHECK(s.scale > 0.0f && std::isfinite(s.scale), "[DynamicGradScaler] bad saved scale ", s.scale);
  LOOM_CHECK(s.growth_tracker >= 0, "[DynamicGradScaler] bad saved growth_tracker ", s.growth_tracker);
  scale_ = s.scale;
  growth_tracker_ = std::min(s.growth_tracker, cfg_.growth_interval - 1);
  hysteresis_tracker_ = s.hysteresis_tracker;
}

std::unique_ptr<GradScaler> make_grad_scaler(bool fp16, bool bf16, double loss_scale,
                                             const DynamicGradScalerConfig& dynamic_cfg) {
  if (loss_scale < 0.0) user_error("--loss-scale must be > 0, got ", loss_scale);
  if (loss_scale > 0.0 && (fp16 || bf16)) return std::make_unique<ConstantGradScaler>(loss_scale);
  if (fp16) return std::make_unique<DynamicGradScaler>(dynamic_cfg);
  return nullptr;
}

// ---- JSON ---------------------------------------------------------------------------------------

std::string GradScalerState::to_json() const {
  nlohmann::ordered_json j;
  j["scale"] = double(scale);  // every float is exact as a double, so the round trip is lossless
  j["growth_tracker"] = growth_tracker;
  j["hysteresis_tracker"] = hysteresis_tracker;
  return j.dump(2);
}

GradScalerState GradScalerState::from_json(const std::string& text, const std::string& what) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    user_error(what, ": not valid JSON (", e.what(), ")");
  }
  if (!j.is_object()) user_error(what, ": expected a JSON object");
  for (const char* k : {"scale", "growth_tracker", "hysteresis_tracker"})
    if (!j.contains(k)) user_error(what, ": missing key '", k, "'");
  if (!j["scale"].is_number()) user_error(what, ": 'scale' must be a number, got ", j["scale"].dump());
  for (const char* k : {"growth_tracker", "hysteresis_tracker"})
    if (!j[k].is_number_integer()) user_error(what, ": '", k, "' must be an integer, got ", j[k].dump());
  GradScalerState s;
  const double scale = j["scale"].get<double>();
  if (!(scale > 0.0) || !std::isfinite(scale) || scale > double(FLT_MAX))
    user_error(what, ": 'scale' must be a positive FP32 number, got ", j["scale"].dump());
  s.scale = float(scale);
  s.growth_tracker = j["growth_tracker"].get<int64_t>();
  s.hysteresis_tracker = j["hysteresis_tracker"].get<int64_t>();
  if (s.growth_tracker < 0) user_error(what, ": 'growth_tracker' must be >= 0, got ", s.growth_tracker);
  return s;
}

}  // namespace loom

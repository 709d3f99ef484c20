// Megatron's gradient (loss) scalers for FP16 training: the loss is multiplied by scale() before
// backward and the gradients by inv_scale() before clipping and the update; a step whose gradients
// hold inf/nan is skipped and reported through update(found_inf = true).
//   ConstantGradScaler  --loss-scale S: the scale never changes.
//   DynamicGradScaler   --initial-loss-scale, --min-loss-scale, --loss-scale-window, --hysteresis:
//     an overflow resets the growth count and spends one unit of hysteresis; once hysteresis is spent
//     each further overflow halves the scale (not below min). `window` clean steps in a row double the
//     scale and refill the hysteresis. A clean step does NOT refill the hysteresis by itself (Megatron).
// The scale is FP32 arithmetic, as Megatron keeps it in a float32 tensor, so values match bit for bit.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

namespace loom {

// What a checkpoint records (Megatron's grad_scaler state_dict: scale, growth_tracker,
// hysteresis_tracker). hysteresis_tracker may be negative after repeated overflows.
struct GradScalerState {
  float scale = 1.0f;
  int64_t growth_tracker = 0;
  int64_t hysteresis_tracker = 0;
  std::string to_json() const;
  // UserError naming `what` on malformed input, a non-finite or non-positive scale, or a negative
  // growth_tracker.
  static GradScalerState from_json(const std::string& text, const std::string& what = "grad scaler state");
  bool operator==(const GradScalerState&) const = default;
};

// The trainer holds either scaler through this interface.
class GradScaler {
 public:
  virtual ~GradScaler() = default;
  float scale() const { return scale_; }
  // 1/scale computed in double and rounded to float (Megatron: scale.double().reciprocal().float()).
  float inv_scale() const { return float(1.0 / double(scale_)); }
  // Called once per iteration after the inf/nan check of the (model-parallel reduced) gradients.
  virtual void update(bool found_inf) = 0;
  virtual bool is_dynamic() const = 0;
  // True when the scale cannot back off any further (a dynamic scaler at --min-loss-scale).
  virtual bool at_floor() const { return false; }
  virtual GradScalerState state() const = 0;
  // Restores a saved state. The constant scaler keeps its --loss-scale (Megatron's does nothing).
  virtual void load_state(const GradScalerState& s) = 0;

 protected:
  explicit GradScaler(float scale) : scale_(scale) {}
  float scale_;
};

class ConstantGradScaler final : public GradScaler {
 public:
  explicit ConstantGradScaler(double loss_scale);  // --loss-scale, > 0 and finite in FP32
  void update(bool) override {}
  bool is_dynamic() const override { return false; }
  GradScalerState state() const override { return {scale_, 0, 0}; }
  void load_state(const GradScalerState&) override {}
};

struct DynamicGradScalerConfig {
  double initial_scale = 4294967296.0;  // --initial-loss-scale (2^32)
  double min_scale = 1.0;               // --min-loss-scale; <= initial_scale
  double growth_factor = 2.0;           // Megatron fixes 2 (no flag); > 1
  double backoff_factor = 0.5;          // Megatron fixes 0.5 (no flag); in (0, 1)
  int64_t growth_interval = 1000;       // --loss-scale-window: clean steps before the scale grows
  int64_t hysteresis = 2;               // --hysteresis: overflows tolerated before the scale backs off
};

class DynamicGradScaler final : public GradScaler {
 public:
  explicit DynamicGradScaler(const DynamicGradScalerConfig& cfg);  // UserError naming the flag at fault
  void update(bool found_inf) override;
  bool is_dynamic() const override { return true; }
  bool at_floor() const override { return scale_ <= min_scale_; }
  GradScalerState state() const override { return {scale_, growth_tracker_, hysteresis_tracker_}; }
  // A saved growth_tracker at or past a (changed, smaller) --loss-scale-window is clamped to window - 1
  // so growth resumes on the next clean step (Megatron's == test would never fire again).
  void load_state(const GradScalerState& s) override;
  int64_t growth_tracker() const { return growth_tracker_; }
  int64_t hysteresis_tracker() const { return hysteresis_tracker_; }
  const DynamicGradScalerConfig& config() const { return cfg_; }

 private:
  DynamicGradScalerConfig cfg_;
  float min_scale_, growth_factor_, backoff_factor_;
  int64_t growth_tracker_ = 0;
  int64_t hysteresis_tracker_;
};

// Megatron's choice in get_megatron_optimizer: --loss-scale > 0 (with --fp16 or --bf16) gives a
// constant scaler; otherwise --fp16 gives a dynamic one; anything else (BF16/FP32 without
// --loss-scale) needs none and returns nullptr. loss_scale == 0 means "not given"; < 0 is a UserError.
std::unique_ptr<GradScaler> make_grad_scaler(bool fp16, bool bf16, double loss_scale,
                                             const DynamicGradScalerConfig& dynamic_cfg);

}  // namespace loom

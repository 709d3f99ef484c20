// Optimizer pieces that work on flat parameter/gradient buffers (no modules): AdamW over contiguous
// ranges with per-range weight decay, the global gradient norm, Megatron's clipping rule, and
// Megatron's OptimizerParamScheduler learning-rate schedule.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/backend/device_context.h"
#include "loom/dist/communicator.h"

namespace loom {

// A run of consecutive parameters in the flat buffers that share a weight-decay setting.
struct ParamRange {
  int64_t offset = 0;
  int64_t numel = 0;
  bool weight_decay = true;  // false for biases and norm parameters
};

struct AdamWConfig {
  float beta1 = 0.9f;    // --adam-beta1
  float beta2 = 0.999f;  // --adam-beta2
  float eps = 1e-8f;     // --adam-eps
};

// AdamW with FP32 state (exp_avg, exp_avg_sq) laid out like the parameter buffer.
class AdamW {
 public:
  AdamW(const DeviceContext& ctx, int64_t numel, std::vector<ParamRange> ranges, AdamWConfig cfg);
  // One update of `params` from `grads` (both flat, numel elements). Gradients are multiplied by
  // grad_scale first (the clipping coefficient); zero_grads clears them in the same pass.
  void step(TensorView params, TensorView grads, float lr, float weight_decay, float grad_scale, bool zero_grads);
  int64_t num_steps() const { return step_; }
  const Tensor& exp_avg() const { return m_; }
  const Tensor& exp_avg_sq() const { return v_; }

 private:
  const DeviceContext& ctx_;
  std::vector<ParamRange> ranges_;
  AdamWConfig cfg_;
  Tensor m_, v_;
  int64_t step_ = 0;
};

// L2 norm of the gradient buffer, summed over the ranks of `group` (identity for one process).
double global_grad_norm(const DeviceContext& ctx, TensorView grads, const Communicator& group);
// Megatron's clip_grad_norm: coefficient max_norm / (norm + 1e-6) when that is < 1, else 1. max_norm <= 0
// disables clipping.
float clip_coefficient(double total_norm, float max_norm);

enum class LRDecayStyle { kConstant, kLinear, kCosine };
LRDecayStyle parse_lr_decay_style(const std::string& s);  // UserError naming --lr-decay-style
const char* lr_decay_style_name(LRDecayStyle s);

// Megatron's OptimizerParamScheduler, counted in samples: iteration i (1-based) trains with
// lr(num_steps = (i - 1) · global_batch_size); warmup is linear from 0, then the decay style runs from
// max_lr to min_lr over [warmup, decay], and min_lr after.
struct LRSchedule {
  double max_lr = 0;
  double min_lr = 0;
  int64_t warmup_steps = 0;  // samples
  int64_t decay_steps = 0;   // samples
  LRDecayStyle style = LRDecayStyle::kLinear;
  double lr_at(int64_t num_steps) const;
};

}  // namespace loom

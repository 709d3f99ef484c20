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

// --optimizer (Megatron's names): adam is AdamW (decoupled weight decay, as Megatron's torch/apex
// AdamW); sgd is torch.optim.SGD with --sgd-momentum (L2 weight decay added to the gradient).
enum class OptimizerKind { kAdam, kSGD };
OptimizerKind parse_optimizer_kind(const std::string& s);  // UserError naming --optimizer
const char* optimizer_kind_name(OptimizerKind k);         // "adam" | "sgd"

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kAdam;
  AdamWConfig adam;           // kAdam
  float sgd_momentum = 0.9f;  // kSGD: --sgd-momentum (Megatron's default 0.9; 0: no momentum buffer)
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
  // Checkpoint restore: the state tensors are written in place (their shape and dtype must not change)
  // and the step count, which drives Adam's bias correction, is set to the saved one.
  Tensor& exp_avg_mut() { return m_; }
  Tensor& exp_avg_sq_mut() { return v_; }
  void set_num_steps(int64_t n);

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

// --lr-decay-style, Megatron's names: constant, linear, cosine, inverse-square-root, WSD.
enum class LRDecayStyle { kConstant, kLinear, kCosine, kInverseSquareRoot, kWSD };
LRDecayStyle parse_lr_decay_style(const std::string& s);  // UserError naming --lr-decay-style
const char* lr_decay_style_name(LRDecayStyle s);


}  // namespace loom

#include "loom/optim/optimizer.h"

#include <cmath>

namespace loom {

AdamW::AdamW(const DeviceContext& ctx, int64_t numel, std::vector<ParamRange> ranges, AdamWConfig cfg)
    : ctx_(ctx), ranges_(std::move(ranges)), cfg_(cfg) {
  int64_t covered = 0;
  for (const ParamRange& r : ranges_) {
    LOOM_CHECK(r.offset == covered, "[AdamW] ranges must tile the buffer in order: expected offset ", covered,
               ", got ", r.offset);
    covered += r.numel;
  }
  LOOM_CHECK(covered == numel, "[AdamW] ranges cover ", covered, " of ", numel, " elements");
  m_ = ctx.zeros({numel}, DType::kF32);
  v_ = ctx.zeros({numel}, DType::kF32);
}

void AdamW::step(TensorView params, TensorView grads, float lr, float weight_decay, float grad_scale,
                 bool zero_grads) {
  LOOM_CHECK(params.numel() == m_.numel() && grads.numel() == m_.numel(), "[AdamW] buffers ", params.desc(), ", ",
             grads.desc(), " vs state of ", m_.numel(), " elements");
  ++step_;
  AdamWParams p;
  p.lr = lr;
  p.beta1 = cfg_.beta1;
  p.beta2 = cfg_.beta2;
  p.eps = cfg_.eps;
  p.step = step_;
  p.grad_scale = grad_scale;
  p.zero_grad = zero_grads;
  for (const ParamRange& r : ranges_) {
    p.weight_decay = r.weight_decay ? weight_decay : 0.0f;
    const Shape s{r.numel};
    ctx_.ops().adamw_update(params.slice_flat(r.offset, s), grads.slice_flat(r.offset, s),
                            m_.view().slice_flat(r.offset, s), v_.view().slice_flat(r.offset, s), p);
  }
}

double global_grad_norm(const DeviceContext& ctx, TensorView grads, const Communicator& group) {
  const double local = ctx.ops().sum_squares(grads);
  return std::sqrt(group.all_reduce_scalar(local, ReduceOp::kSum));
}

float clip_coefficient(double total_norm, float max_norm) {
  if (max_norm <= 0.0f) return 1.0f;
  const double coeff = double(max_norm) / (total_norm + 1.0e-6);
  return coeff < 1.0 ? float(coeff) : 1.0f;
}

LRDecayStyle parse_lr_decay_style(const std::string& s) {
  if (s == "constant") return LRDecayStyle::kConstant;
  if (s == "linear") return LRDecayStyle::kLinear;
  if (s == "cosine") return LRDecayStyle::kCosine;
  user_error("--lr-decay-style: unknown style '", s, "' (valid: constant, linear, cosine)");
}

const char* lr_decay_style_name(LRDecayStyle s) {
  switch (s) {
    case LRDecayStyle::kConstant: return "constant";
    case LRDecayStyle::kLinear: return "linear";
    case LRDecayStyle::kCosine: return "cosine";
  }
  return "?";
}

double LRSchedule::lr_at(int64_t num_steps) const {
  if (warmup_steps > 0 && num_steps <= warmup_steps)
    return max_lr * double(num_steps) / double(warmup_steps);
  if (style == LRDecayStyle::kConstant) return max_lr;
  if (num_steps > decay_steps) return min_lr;
  const double ratio = double(num_steps - warmup_steps) / double(decay_steps - warmup_steps);
  const double coeff = style == LRDecayStyle::kLinear ? 1.0 - ratio : 0.5 * (std::cos(M_PI * ratio) + 1.0);
  return min_lr + coeff * (max_lr - min_lr);
}

}  // namespace loom

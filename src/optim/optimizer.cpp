#include "loom/optim/optimizer.h"

#include <algorithm>
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

void AdamW::set_num_steps(int64_t n) {
  LOOM_CHECK(n >= 0, "[AdamW] step count must be >= 0, got ", n);
  step_ = n;
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

OptimizerKind parse_optimizer_kind(const std::string& s) {
  if (s == "adam") return OptimizerKind::kAdam;
  if (s == "sgd") return OptimizerKind::kSGD;
  user_error("--optimizer: unknown optimizer '", s, "' (valid: adam, sgd)");
}

const char* optimizer_kind_name(OptimizerKind k) { return k == OptimizerKind::kSGD ? "sgd" : "adam"; }

LRDecayStyle parse_lr_decay_style(const std::string& s) {
  if (s == "constant") return LRDecayStyle::kConstant;
  if (s == "linear") return LRDecayStyle::kLinear;
  if (s == "cosine") return LRDecayStyle::kCosine;
  if (s == "inverse-square-root") return LRDecayStyle::kInverseSquareRoot;
  if (s == "WSD") return LRDecayStyle::kWSD;
  user_error("--lr-decay-style: unknown style '", s,
             "' (valid: constant, linear, cosine, inverse-square-root, WSD)");
}

const char* lr_decay_style_name(LRDecayStyle s) {
  switch (s) {
    case LRDecayStyle::kConstant: return "constant";
    case LRDecayStyle::kLinear: return "linear";
    case LRDecayStyle::kCosine: return "cosine";
    case LRDecayStyle::kInverseSquareRoot: return "inverse-square-root";
    case LRDecayStyle::kWSD: return "WSD";
  }
  return "?";
}


}  // namespace loom

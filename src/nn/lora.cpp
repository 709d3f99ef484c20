// LoraAdapter (loom/nn/lora.h): two GEMMs through the rank-r bottleneck, the scale applied to the (N, r)
// activation (the cheapest place), the input gradient added to the base layer's.
#include "loom/nn/lora.h"

#include <cmath>

#include "loom/core/check.h"

namespace loom {

LoraAdapter::LoraAdapter(ParameterSet& ps, const std::string& prefix, int64_t in_features, int64_t out_features,
                         const LoraConfig& cfg)
    : in_(in_features), out_(out_features), cfg_(cfg) {
  if (cfg.rank < 1 || cfg.rank > std::min(in_features, out_features))
    user_error("--lora-rank must be in [1, ", std::min(in_features, out_features), "] for ", prefix, " (", in_features,
               " -> ", out_features, "), got ", cfg.rank);
  if (!(cfg.dropout >= 0.0f && cfg.dropout < 1.0f)) user_error("--lora-dropout must be in [0, 1), got ", cfg.dropout);
  if (!std::isfinite(cfg.alpha) || cfg.alpha <= 0.0f) user_error("--lora-alpha must be > 0, got ", cfg.alpha);
  a_ = &ps.add(prefix + ".lora_A.weight", Shape{cfg.rank, in_features}, InitKind::kUniform,
               float(1.0 / std::sqrt(double(in_features))), false);
  b_ = &ps.add(prefix + ".lora_B.weight", Shape{out_features, cfg.rank}, InitKind::kZeros, 0.0f, false);
}

void LoraAdapter::forward(const DeviceContext& ctx, TensorView out, Saved& s, TensorView inp, uint64_t seed,
                          uint64_t stream) const {
  const OpTable& ops = ctx.ops();
  const int64_t N = inp.numel() / in_;
  TensorView x = inp;
  if (cfg_.dropout > 0.0f) {
    s.dropped = ctx.empty({N, in_}, inp.dtype());
    ops.dropout_forward(s.dropped, inp.reshape({N, in_}), cfg_.dropout, seed, stream);
    x = s.dropped;
  } else {
    s.dropped = Tensor();
  }
  s.h = ctx.empty({N, cfg_.rank}, inp.dtype());
  ops.matmul_forward(s.h, x.reshape({N, in_}), a_->compute, TensorView());
  ops.scale_(s.h, cfg_.scale());
  Tensor y = ctx.empty({N, out_}, out.dtype());
  ops.matmul_forward(y, s.h, b_->compute, TensorView());
  ops.residual_forward(out.reshape({N, out_}), out.reshape({N, out_}), y);
}

void LoraAdapter::backward(const DeviceContext& ctx, TensorView dinp, TensorView dout, TensorView inp,
                           const Saved& s, uint64_t seed, uint64_t stream) const {
  const OpTable& ops = ctx.ops();
  const int64_t N = inp.numel() / in_;
  const TensorView x = s.dropped.defined() ? TensorView(s.dropped) : inp.reshape({N, in_});
  // dB += dout^T h;  dh = dout B, then the scale.
  Tensor dh = ctx.empty({N, cfg_.rank}, dout.dtype());
  ops.matmul_backward(dh, b_->grad, TensorView(), dout.reshape({N, out_}), s.h, b_->compute);
  ops.scale_(dh, cfg_.scale());
  // dA += dh^T x;  dx = dh A.
  Tensor dx = dinp.defined() ? ctx.empty({N, in_}, dinp.dtype()) : Tensor();
  ops.matmul_backward(dx, a_->grad, TensorView(), dh, x, a_->compute);
  if (!dinp.defined()) return;
  if (cfg_.dropout > 0.0f) ops.dropout_backward(dx, dx, cfg_.dropout, seed, stream);
  ops.residual_forward(dinp.reshape({N, in_}), dinp.reshape({N, in_}), dx);
}

}  // namespace loom

// LoraAdapter (loom/nn/lora.h): two GEMMs through the rank-r bottleneck, the scale applied to the (N, r)
// activation (the cheapest place), the input gradient added to the base layer's. A slice adapter runs its
// up-projection over the layer's whole local output with B spread into a zeroed (layer_out, r) matrix:
// the extra rows cost r multiply-adds per output element, far less than a strided scatter would.
#include "loom/nn/lora.h"

#include <cmath>

#include "loom/core/check.h"

namespace loom {

namespace {

int64_t total(const std::vector<ShardRange>& rs) {
  int64_t n = 0;
  for (const ShardRange& r : rs) n += r.size;
  return n;
}

}  // namespace

LoraAdapter::LoraAdapter(ParameterSet& ps, const std::string& prefix, int64_t in_features, int64_t out_features,
                         const LoraConfig& cfg)
    : LoraAdapter(ps, prefix, LoraPlacement::whole(in_features, out_features), cfg) {}

LoraAdapter::LoraAdapter(ParameterSet& ps, const std::string& prefix, const LoraPlacement& place,
                         const LoraConfig& cfg)
    : in_(place.a_shard ? place.a_shard->size : place.in_global),
      out_(place.b_shard.empty() ? place.out_global : total(place.b_shard)),
      place_(place),
      cfg_(cfg) {
  const int64_t lim = std::min(place.in_global, place.out_global);
  if (cfg.rank < 1 || cfg.rank > lim)
    user_error("--lora-rank must be in [1, ", lim, "] for ", prefix, " (", place.in_global, " -> ", place.out_global,
               "), got ", cfg.rank);
  if (!(cfg.dropout >= 0.0f && cfg.dropout < 1.0f)) user_error("--lora-dropout must be in [0, 1), got ", cfg.dropout);
  if (!std::isfinite(cfg.alpha) || cfg.alpha <= 0.0f) user_error("--lora-alpha must be > 0, got ", cfg.alpha);
  LOOM_CHECK(place.columns.empty() ? place.layer_out == out_ : total(place.columns) == out_,
             "[LoraAdapter] ", prefix, ": the adapted columns must match B's ", out_, " local rows");
  const float bound = float(1.0 / std::sqrt(double(place.in_global)));
  const Shape a_shape{cfg.rank, place.in_global}, b_shape{place.out_global, cfg.rank};
  a_ = place.a_shard ? &ps.add_sharded(prefix + ".lora_A.weight", a_shape, 1, {*place.a_shard}, InitKind::kUniform,
                                       bound, false)
                     : &ps.add(prefix + ".lora_A.weight", a_shape, InitKind::kUniform, bound, false);
  b_ = place.b_shard.empty()
           ? &ps.add(prefix + ".lora_B.weight", b_shape, InitKind::kZeros, 0.0f, false)
           : &ps.add_sharded(prefix + ".lora_B.weight", b_shape, 0, place.b_shard, InitKind::kZeros, 0.0f, false);
}

TensorView LoraAdapter::input(const DeviceContext& ctx, TensorView x, Tensor& holder, const DropoutMask& mask) const {
  const int64_t N = x.numel() / in_;
  if (!mask.active()) return x.reshape({N, in_});
  holder = ctx.empty({N, in_}, x.dtype());
  ctx.ops().dropout_forward(holder, x.reshape({N, in_}), mask.p, mask.seed, mask.stream, mask.offset);
  return holder;
}

void LoraAdapter::down(const DeviceContext& ctx, TensorView h, TensorView x) const {
  ctx.ops().matmul_forward(h, x, a_->compute, TensorView());
  ctx.ops().scale_(h, cfg_.scale());
}

Tensor LoraAdapter::spread_b(const DeviceContext& ctx) const {
  const int64_t r = cfg_.rank;
  Tensor full = ctx.zeros({place_.layer_out, r}, b_->compute.dtype());
  int64_t row = 0;
  for (const ShardRange& c : place_.columns) {
    ctx.copy(full.view().slice_flat(c.start * r, {c.size, r}), b_->compute.view().slice_flat(row * r, {c.size, r}));
    row += c.size;
  }
  return full;
}

void LoraAdapter::up_accumulate(const DeviceContext& ctx, TensorView out, TensorView h) const {
  const int64_t N = h.numel() / cfg_.rank, W = place_.layer_out;
  const Tensor spread = place_.columns.empty() ? Tensor() : spread_b(ctx);
  const TensorView b = place_.columns.empty() ? b_->compute.view() : spread.view();
  Tensor y = ctx.empty({N, W}, out.dtype());
  ctx.ops().matmul_forward(y, h, b, TensorView());
  const TensorView o = out.reshape({N, W});
  ctx.ops().residual_forward(o, o, y);
}

void LoraAdapter::up_backward(const DeviceContext& ctx, TensorView dh, TensorView dout, TensorView h) const {
  const int64_t r = cfg_.rank, N = h.numel() / r, W = place_.layer_out;
  const TensorView d = dout.reshape({N, W});
  if (place_.columns.empty()) {
    ctx.ops().matmul_backward(dh, b_->grad, TensorView(), d, h, b_->compute);
  } else {
    // dB of the spread matrix, then its adapted rows added into dB.
    const Tensor spread = spread_b(ctx);
    Tensor dspread = b_->grad.defined() ? ctx.zeros({W, r}, b_->grad.dtype()) : Tensor();
    ctx.ops().matmul_backward(dh, dspread, TensorView(), d, h, spread);
    if (dspread.defined()) {
      int64_t row = 0;
      for (const ShardRange& c : place_.columns) {
        const TensorView g = b_->grad.view().slice_flat(row * r, {c.size, r});
        ctx.ops().residual_forward(g, g, dspread.view().slice_flat(c.start * r, {c.size, r}));
        row += c.size;
      }
    }
  }
  ctx.ops().scale_(dh, cfg_.scale());
}

void LoraAdapter::down_backward(const DeviceContext& ctx, TensorView dx, TensorView dh, TensorView x_dropped,
                                const DropoutMask& mask) const {
  const int64_t N = dh.numel() / cfg_.rank;
  Tensor dxa = dx.defined() ? ctx.empty({N, in_}, dx.dtype()) : Tensor();
  ctx.ops().matmul_backward(dxa, a_->grad, TensorView(), dh, x_dropped, a_->compute);
  if (!dx.defined()) return;
  if (mask.active()) ctx.ops().dropout_backward(dxa, dxa, mask.p, mask.seed, mask.stream, mask.offset);
  const TensorView d = dx.reshape({N, in_});
  ctx.ops().residual_forward(d, d, dxa);
}

void LoraAdapter::forward(const DeviceContext& ctx, TensorView out, Saved& s, TensorView inp, uint64_t seed,
                          uint64_t stream) const {
  const int64_t N = inp.numel() / in_;
  Tensor dropped;
  const TensorView x = input(ctx, inp, dropped, {cfg_.dropout, seed, stream, 0});
  s.h = ctx.empty({N, cfg_.rank}, inp.dtype());
  down(ctx, s.h, x);
  up_accumulate(ctx, out, s.h);
}

void LoraAdapter::backward(const DeviceContext& ctx, TensorView dinp, TensorView dout, TensorView inp,
                           const Saved& s, uint64_t seed, uint64_t stream) const {
  const int64_t N = inp.numel() / in_;
  const DropoutMask mask{cfg_.dropout, seed, stream, 0};
  Tensor dropped;
  const TensorView x = input(ctx, inp, dropped, mask);
  Tensor dh = ctx.empty({N, cfg_.rank}, dout.dtype());
  up_backward(ctx, dh, dout, s.h);
  down_backward(ctx, dinp, dh, x, mask);
}

}  // namespace loom

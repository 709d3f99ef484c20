// RotaryEmbedding: the cos/sin tables of RoPE (with Llama 3.1's frequency scaling) and the in-place rotation
// of a grouped qkv tensor's q and k heads through the op table. The tables are constants: computed once in
// f64 (so a long context's large angles p · inv_freq lose nothing before the final f32 rounding) and never
// written again, so forward, backward and a recomputed forward all read the same bits.
#include <cmath>
#include <numbers>

#include "loom/nn/modules.h"

namespace loom {

std::vector<double> RotaryEmbedding::inverse_frequencies(const RotaryOptions& o) {
  LOOM_CHECK(o.rotary_dim >= 2 && o.rotary_dim % 2 == 0, "[RotaryEmbedding] rotary_dim must be even and >= 2, got ",
             o.rotary_dim);
  LOOM_CHECK(o.base > 0, "[RotaryEmbedding] base must be > 0, got ", o.base);
  const int64_t half = o.rotary_dim / 2;
  std::vector<double> inv(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) inv[size_t(i)] = 1.0 / std::pow(o.base, double(2 * i) / double(o.rotary_dim));
  if (!o.scaling) return inv;
  const RopeScaling& s = *o.scaling;
  LOOM_CHECK(s.factor > 0 && s.high_freq_factor > s.low_freq_factor && s.original_max_positions > 0,
             "[RotaryEmbedding] invalid Llama-3 scaling: factor ", s.factor, ", low/high frequency factors ",
             s.low_freq_factor, "/", s.high_freq_factor, ", original positions ", s.original_max_positions);
  const double low_freq_wavelen = s.original_max_positions / s.low_freq_factor;
  const double high_freq_wavelen = s.original_max_positions / s.high_freq_factor;
  for (double& f : inv) {
    const double wavelen = 2.0 * std::numbers::pi / f;
    if (wavelen < high_freq_wavelen) continue;  // high frequencies: unchanged
    if (wavelen > low_freq_wavelen) {           // low frequencies: interpolated by the factor
      f /= s.factor;
      continue;
    }
    // The band in between blends the two, continuously at both ends.
    const double smooth = (s.original_max_positions / wavelen - s.low_freq_factor) /
                          (s.high_freq_factor - s.low_freq_factor);
    f = (1.0 - smooth) * f / s.factor + smooth * f;
  }
  return inv;
}

RotaryEmbedding::RotaryEmbedding(const DeviceContext& ctx, const RotaryOptions& o, int64_t max_positions) : o_(o) {
  LOOM_CHECK(max_positions >= 1, "[RotaryEmbedding] max_positions must be >= 1, got ", max_positions);
  const std::vector<double> inv = inverse_frequencies(o);
  const int64_t half = int64_t(inv.size());
  const Shape shape{max_positions, half};
  cos_ = ctx.empty(shape, DType::kF32);
  sin_ = ctx.empty(shape, DType::kF32);
  const bool host = ctx.device().is_cpu();
  Tensor hc = host ? cos_ : Tensor::empty(shape, DType::kF32);
  Tensor hs = host ? sin_ : Tensor::empty(shape, DType::kF32);
  float* c = hc.data<float>();
  float* s = hs.data<float>();
  for (int64_t p = 0; p < max_positions; ++p) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = double(p) * inv[size_t(i)];
      c[p * half + i] = float(std::cos(angle));
      s[p * half + i] = float(std::sin(angle));
    }
  }
  if (!host) {
    ctx.copy(cos_, hc);
    ctx.copy(sin_, hs);
  }
}

void RotaryEmbedding::forward(const DeviceContext& ctx, TensorView qkv, const AttentionParams& p,
                              TensorView position_ids) const {
  ctx.ops().rope_forward(qkv, cos_, sin_, p, RopeParams{o_.rotary_dim, o_.interleaved}, position_ids);
}

void RotaryEmbedding::backward(const DeviceContext& ctx, TensorView dqkv, const AttentionParams& p,
                               TensorView position_ids) const {
  ctx.ops().rope_backward(dqkv, cos_, sin_, p, RopeParams{o_.rotary_dim, o_.interleaved}, position_ids);
}

}  // namespace loom

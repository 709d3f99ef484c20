#include "loom/nn/modules.h"

namespace loom {

void ensure_tensor(const DeviceContext& ctx, Tensor& t, Shape s, DType dt) {
  if (!t.defined() || t.shape() != s || t.dtype() != dt) t = ctx.empty(s, dt);
}

Linear::Linear(ParameterSet& ps, const std::string& prefix, int64_t in_features, int64_t out_features, bool bias,
               float init_std)
    : in_(in_features), out_(out_features) {
  weight_ = &ps.add(prefix + ".weight", {out_features, in_features}, InitKind::kNormal, init_std, false, 0);
  if (bias) bias_ = &ps.add(prefix + ".bias", {out_features}, InitKind::kZeros, 0.0f, true, 0);
}

void Linear::forward(const DeviceContext& ctx, TensorView out, TensorView inp) const {
  ctx.ops().matmul_forward(out, inp, weight_->value, bias_ ? bias_->value.view() : TensorView());
}

void Linear::backward(const DeviceContext& ctx, TensorView dinp, TensorView dout, TensorView inp) const {
  ctx.ops().matmul_backward(dinp, weight_->grad, bias_ ? bias_->grad.view() : TensorView(), dout, inp,
                            weight_->value);
}

LayerNorm::LayerNorm(ParameterSet& ps, const std::string& prefix, int64_t C, float eps) : C_(C), eps_(eps) {
  weight_ = &ps.add(prefix + ".weight", {C}, InitKind::kOnes, 0.0f, true);
  bias_ = &ps.add(prefix + ".bias", {C}, InitKind::kZeros, 0.0f, true);
}

void LayerNorm::forward(const DeviceContext& ctx, TensorView out, Saved& s, TensorView inp) const {
  const int64_t N = inp.shape().rows();
  ensure_tensor(ctx, s.mean, {N});
  ensure_tensor(ctx, s.rstd, {N});
  ctx.ops().layernorm_forward(out, s.mean, s.rstd, inp, weight_->value, bias_->value, eps_);
}

void LayerNorm::forward_residual(const DeviceContext& ctx, TensorView residual, TensorView out, Saved& s,
                                 TensorView a, TensorView b) const {
  const int64_t N = a.shape().rows();
  ensure_tensor(ctx, s.mean, {N});
  ensure_tensor(ctx, s.rstd, {N});
  ctx.ops().residual_layernorm_forward(residual, out, s.mean, s.rstd, a, b, weight_->value, bias_->value, eps_);
}

void LayerNorm::backward(const DeviceContext& ctx, TensorView dinp, TensorView dout, TensorView inp,
                         const Saved& s) const {
  ctx.ops().layernorm_backward(dinp, weight_->grad, bias_->grad, dout, inp, weight_->value, s.mean, s.rstd);
}

Embedding::Embedding(ParameterSet& ps, int64_t padded_vocab, int64_t C, int64_t max_positions, float init_std) {
  word_ = &ps.add("embedding.word_embeddings.weight", {padded_vocab, C}, InitKind::kNormal, init_std, false, 0);
  if (max_positions > 0)
    position_ = &ps.add("embedding.position_embeddings.weight", {max_positions, C}, InitKind::kNormal, init_std,
                        false);
}

void Embedding::forward(const DeviceContext& ctx, TensorView out, TensorView tokens, TensorView position_ids) const {
  ctx.ops().embedding_forward(out, tokens, word_->value, position_ ? position_->value.view() : TensorView(),
                              position_ ? position_ids : TensorView());
}

void Embedding::backward(const DeviceContext& ctx, TensorView dout, TensorView tokens, TensorView position_ids) const {
  ctx.ops().embedding_backward(word_->grad, position_ ? position_->grad.view() : TensorView(), dout, tokens,
                               position_ ? position_ids : TensorView());
}

void AttentionCore::forward(const DeviceContext& ctx, TensorView out, Saved& s, TensorView qkv,
                            TensorView segment_ids) const {
  ensure_tensor(ctx, s.lse, {qkv.size(0), p_.num_heads, qkv.size(1)});
  ctx.ops().attention_forward(out, s.lse, qkv, p_, segment_ids);
}

void AttentionCore::backward(const DeviceContext& ctx, TensorView dqkv, TensorView dout, TensorView qkv,
                             TensorView out, const Saved& s, TensorView segment_ids) const {
  ctx.ops().attention_backward(dqkv, dout, qkv, out, s.lse, p_, segment_ids);
}

}  // namespace loom

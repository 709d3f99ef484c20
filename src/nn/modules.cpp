// nn modules: thin wrappers that bind parameters (compute copies and grads) to the op table.
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

Linear::Linear(ParameterSet& ps, const std::string& prefix, int64_t in_features, int64_t out_features, bool bias,
               float init_std, int partition_dim, std::vector<ShardRange> shard) {
  LOOM_CHECK(partition_dim == 0 || partition_dim == 1, "[Linear] ", prefix, ": partition dim must be 0 or 1, got ",
             partition_dim);
  int64_t local = 0;
  for (const ShardRange& r : shard) local += r.size;
  in_ = partition_dim == 1 ? local : in_features;
  out_ = partition_dim == 0 ? local : out_features;
  weight_ = &ps.add_sharded(prefix + ".weight", {out_features, in_features}, partition_dim, shard, InitKind::kNormal,
                            init_std, false);
  if (!bias) return;
  bias_ = partition_dim == 0
              ? &ps.add_sharded(prefix + ".bias", {out_features}, 0, std::move(shard), InitKind::kZeros, 0.0f, true)
              : &ps.add(prefix + ".bias", {out_features}, InitKind::kZeros, 0.0f, true);
}

void Linear::forward(const DeviceContext& ctx, TensorView out, TensorView inp) const {
  ctx.ops().matmul_forward(out, inp, weight_->compute, bias_ ? bias_->compute.view() : TensorView());
}

void Linear::backward(const DeviceContext& ctx, TensorView dinp, TensorView dout, TensorView inp) const {
  ctx.ops().matmul_backward(dinp, weight_->grad, bias_ ? bias_->grad.view() : TensorView(), dout, inp,
                            weight_->compute, take_grad_write(ctx, *weight_));
}

NormKind parse_norm_kind(const std::string& s) {
  if (s == "LayerNorm") return NormKind::kLayerNorm;
  if (s == "RMSNorm") return NormKind::kRMSNorm;
  user_error("--normalization must be LayerNorm or RMSNorm, got '", s, "'");
}

const char* norm_kind_name(NormKind k) { return k == NormKind::kLayerNorm ? "LayerNorm" : "RMSNorm"; }

Norm::Norm(ParameterSet& ps, const std::string& prefix, int64_t C, float eps, NormKind kind)
    : C_(C), eps_(eps), kind_(kind) {
  weight_ = &ps.add(prefix + ".weight", {C}, InitKind::kOnes, 0.0f, true);
  if (kind == NormKind::kLayerNorm) bias_ = &ps.add(prefix + ".bias", {C}, InitKind::kZeros, 0.0f, true);
}

void Norm::forward(const DeviceContext& ctx, TensorView out, Saved& s, TensorView inp) const {
  const int64_t N = inp.numel() / C_;
  ensure_tensor(ctx, s.rstd, {N});
  const TensorView x = inp.reshape({N, C_}), y = out.reshape({N, C_});
  if (kind_ == NormKind::kRMSNorm) {
    ctx.ops().rmsnorm_forward(y, s.rstd, x, weight_->compute, eps_);
    return;
  }
  ensure_tensor(ctx, s.mean, {N});
  ctx.ops().layernorm_forward(y, s.mean, s.rstd, x, weight_->compute, bias_->compute, eps_);
}

void Norm::forward_residual(const DeviceContext& ctx, TensorView residual, TensorView out, Saved& s, TensorView a,
                            TensorView b) const {
  const int64_t N = a.numel() / C_;
  ensure_tensor(ctx, s.rstd, {N});
  const Shape rows{N, C_};
  if (kind_ == NormKind::kRMSNorm) {
    ctx.ops().residual_rmsnorm_forward(residual.reshape(rows), out.reshape(rows), s.rstd, a.reshape(rows),
                                       b.reshape(rows), weight_->compute, eps_);
    return;
  }
  ensure_tensor(ctx, s.mean, {N});
  ctx.ops().residual_layernorm_forward(residual.reshape(rows), out.reshape(rows), s.mean, s.rstd, a.reshape(rows),
                                       b.reshape(rows), weight_->compute, bias_->compute, eps_);
}

void Norm::backward(const DeviceContext& ctx, TensorView dinp, TensorView dout, TensorView inp,
                    const Saved& s) const {
  const int64_t N = inp.numel() / C_;
  const Shape rows{N, C_};
  if (kind_ == NormKind::kRMSNorm) {
    ctx.ops().rmsnorm_backward(dinp.reshape(rows), weight_->grad, dout.reshape(rows), inp.reshape(rows),
                               weight_->compute, s.rstd);
    return;
  }
  ctx.ops().layernorm_backward(dinp.reshape(rows), weight_->grad, bias_->grad, dout.reshape(rows), inp.reshape(rows),
                               weight_->compute, s.mean, s.rstd);
}

Embedding::Embedding(ParameterSet& ps, int64_t padded_vocab, int64_t C, int64_t max_positions, float init_std) {
  word_ = &ps.add("embedding.word_embeddings.weight", {padded_vocab, C}, InitKind::kNormal, init_std, false, 0);
  if (max_positions > 0)
    position_ = &ps.add("embedding.position_embeddings.weight", {max_positions, C}, InitKind::kNormal, init_std,
                        false);
}

Embedding::Embedding(ParameterSet& ps, int64_t padded_vocab, int64_t C, int64_t max_positions, float init_std,
                     ShardRange vocab_shard) {
  word_ = &ps.add_sharded("embedding.word_embeddings.weight", {padded_vocab, C}, 0, {vocab_shard}, InitKind::kNormal,
                          init_std, false);
  if (max_positions > 0)
    position_ = &ps.add("embedding.position_embeddings.weight", {max_positions, C}, InitKind::kNormal, init_std,
                        false);
}

void Embedding::forward(const DeviceContext& ctx, TensorView out, TensorView tokens, TensorView position_ids) const {
  ctx.ops().embedding_forward(out, tokens, word_->compute, position_ ? position_->compute.view() : TensorView(),
                              position_ ? position_ids : TensorView());
}

void Embedding::backward(const DeviceContext& ctx, TensorView dout, TensorView tokens, TensorView position_ids) const {
  // A scatter-add: a tied output layer's matmul that writes this gradient later in the step must add to it.
  clear_grad_zero(*word_);
  if (position_) clear_grad_zero(*position_);
  ctx.ops().embedding_backward(word_->grad, position_ ? position_->grad.view() : TensorView(), dout, tokens,
                               position_ ? position_ids : TensorView());
}

AttentionParams AttentionCore::with_dropout(const DropoutMask& d) const {
  AttentionParams p = p_;
  p.dropout_p = d.active() ? d.p : 0.0f;
  p.dropout_seed = d.seed;
  p.dropout_stream = d.stream;
  return p;
}

void AttentionCore::forward(const DeviceContext& ctx, TensorView out, Saved& s, TensorView qkv,
                            TensorView segment_ids, const DropoutMask& dropout) const {
  ensure_tensor(ctx, s.lse, {qkv.size(0), p_.num_heads, qkv.size(1)});
  s.dropout = dropout;
  ctx.ops().attention_forward(out, s.lse, qkv, with_dropout(dropout), segment_ids);
}

void AttentionCore::backward(const DeviceContext& ctx, TensorView dqkv, TensorView dout, TensorView qkv,
                             TensorView out, const Saved& s, TensorView segment_ids) const {
  ctx.ops().attention_backward(dqkv, dout, qkv, out, s.lse, with_dropout(s.dropout), segment_ids);
}

void dropout_forward(const DeviceContext& ctx, TensorView out, TensorView inp, const DropoutMask& d) {
  if (d.active()) ctx.ops().dropout_forward(out, inp, d.p, d.seed, d.stream, d.offset);
  else if (out.raw() != inp.raw()) ctx.ops().cast(out, inp);
}

void dropout_backward(const DeviceContext& ctx, TensorView dinp, TensorView dout, const DropoutMask& d) {
  if (d.active()) ctx.ops().dropout_backward(dinp, dout, d.p, d.seed, d.stream, d.offset);
  else if (dinp.raw() != dout.raw()) ctx.ops().cast(dinp, dout);
}

}  // namespace loom

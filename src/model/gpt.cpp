#include "loom/model/gpt.h"

#include <cmath>

namespace loom {

struct GPTModel::Layer {
  LayerNorm ln1, ln2;
  Linear qkv, proj, fc1, fc2;
  AttentionCore attn;
  Layer(ParameterSet& ps, const GPTConfig& c, int64_t i)
      : ln1(ps, prefix(i) + "input_layernorm", c.hidden_size, c.layernorm_epsilon),
        ln2(ps, prefix(i) + "pre_mlp_layernorm", c.hidden_size, c.layernorm_epsilon),
        qkv(ps, prefix(i) + "self_attention.linear_qkv", c.hidden_size, 3 * c.hidden_size, true, c.init_method_std),
        proj(ps, prefix(i) + "self_attention.linear_proj", c.hidden_size, c.hidden_size, true, scaled_std(c)),
        fc1(ps, prefix(i) + "mlp.linear_fc1", c.hidden_size, c.ffn_hidden_size(), true, c.init_method_std),
        fc2(ps, prefix(i) + "mlp.linear_fc2", c.ffn_hidden_size(), c.hidden_size, true, scaled_std(c)),
        attn(AttentionParams{c.num_attention_heads, c.num_attention_heads, c.head_dim(),
                             float(1.0 / std::sqrt(double(c.head_dim()))), true, -1}) {}
  static std::string prefix(int64_t i) { return "decoder.layers." + std::to_string(i) + "."; }
  // Megatron's output_layer_init_method: std / sqrt(2 · num_layers) for projections into the residual.
  static float scaled_std(const GPTConfig& c) {
    return float(c.init_method_std / std::sqrt(2.0 * double(c.num_layers)));
  }
};

struct GPTModel::LayerActs {
  Tensor ln1;        // (B, T, C)
  LayerNorm::Saved ln1_saved;
  Tensor qkv;        // (B, T, 3C)
  Tensor att;        // (B, T, C)
  AttentionCore::Saved attn_saved;
  Tensor residual2;  // (B, T, C) x + attention branch
  Tensor ln2;        // (B, T, C)
  LayerNorm::Saved ln2_saved;
  Tensor fc;         // (B, T, 4C) pre-GeLU
  Tensor out;        // (B, T, C) layer output = next layer's input
};

int64_t GPTConfig::num_parameters() const {
  const int64_t C = hidden_size, F = ffn_hidden_size();
  const int64_t per_layer = 2 * C + (3 * C * C + 3 * C) + (C * C + C) + 2 * C + (F * C + F) + (C * F + C);
  return padded_vocab_size * C + max_position_embeddings * C + num_layers * per_layer + 2 * C;
}

double GPTConfig::flops_per_step(int64_t B, int64_t T) const {
  const double b = double(B), t = double(T), l = double(num_layers), c = double(hidden_size);
  return 3.0 * (24.0 * b * t * l * c * c + 4.0 * b * t * t * l * c + 2.0 * b * t * c * double(padded_vocab_size));
}

void GPTConfig::validate() const {
  if (num_layers < 1) user_error("--num-layers must be >= 1, got ", num_layers);
  if (hidden_size < 1) user_error("--hidden-size must be >= 1, got ", hidden_size);
  if (num_attention_heads < 1) user_error("--num-attention-heads must be >= 1, got ", num_attention_heads);
  if (hidden_size % num_attention_heads != 0)
    user_error("--hidden-size (", hidden_size, ") must be divisible by --num-attention-heads (",
               num_attention_heads, ")");
  if (vocab_size < 1) user_error("vocabulary size must be >= 1, got ", vocab_size);
  if (padded_vocab_size < vocab_size)
    user_error("padded vocabulary ", padded_vocab_size, " is smaller than the vocabulary ", vocab_size);
  if (max_position_embeddings < 1)
    user_error("--max-position-embeddings must be >= 1, got ", max_position_embeddings);
}

GPTModel::GPTModel(const GPTConfig& cfg, const DeviceContext& ctx) : cfg_(cfg), ctx_(ctx) {
  cfg_.validate();
  embedding_ = std::make_unique<Embedding>(params_, cfg.padded_vocab_size, cfg.hidden_size,
                                           cfg.max_position_embeddings, cfg.init_method_std);
  for (int64_t i = 0; i < cfg.num_layers; ++i) layers_.push_back(std::make_unique<Layer>(params_, cfg, i));
  final_ln_ = std::make_unique<LayerNorm>(params_, "decoder.final_layernorm", cfg.hidden_size, cfg.layernorm_epsilon);
  params_.allocate(ctx);
  acts_.resize(size_t(cfg.num_layers));
}

GPTModel::~GPTModel() = default;

void GPTModel::ensure_buffers(int64_t B, int64_t T) {
  if (B == B_ && T == T_) return;
  const int64_t C = cfg_.hidden_size, F = cfg_.ffn_hidden_size();
  for (LayerActs& a : acts_) {
    ensure_tensor(ctx_, a.ln1, {B, T, C});
    ensure_tensor(ctx_, a.qkv, {B, T, 3 * C});
    ensure_tensor(ctx_, a.att, {B, T, C});
    ensure_tensor(ctx_, a.residual2, {B, T, C});
    ensure_tensor(ctx_, a.ln2, {B, T, C});
    ensure_tensor(ctx_, a.fc, {B, T, F});
    ensure_tensor(ctx_, a.out, {B, T, C});
  }
  ensure_tensor(ctx_, x0_, {B, T, C});
  ensure_tensor(ctx_, lnf_, {B, T, C});
  ensure_tensor(ctx_, logits_, {B, T, cfg_.padded_vocab_size});
  ensure_tensor(ctx_, losses_, {B, T});
  ensure_tensor(ctx_, gelu_, {B, T, F});
  ensure_tensor(ctx_, proj_, {B, T, C});
  ensure_tensor(ctx_, dres_, {B, T, C});
  ensure_tensor(ctx_, dln_, {B, T, C});
  ensure_tensor(ctx_, datt_, {B, T, C});
  ensure_tensor(ctx_, dqkv_, {B, T, 3 * C});
  ensure_tensor(ctx_, dfc_, {B, T, F});
  B_ = B;
  T_ = T;
}

float GPTModel::forward(const GPTBatch& batch, float dloss_scale) {
  const TensorView tokens = batch.tokens, targets = batch.targets;
  for (const TensorView* t : {&batch.loss_mask, &batch.position_ids, &batch.segment_ids})
    LOOM_CHECK(!t->defined() || t->shape() == tokens.shape(), "[GPTModel] batch extras must be (B, T) like tokens ",
               tokens.desc(), ", got ", t->desc());
  LOOM_CHECK(tokens.ndim() == 2 && tokens.dtype() == DType::kI32, "[GPTModel] tokens must be i32 (B, T), got ",
             tokens.desc());
  LOOM_CHECK(targets.shape() == tokens.shape() && targets.dtype() == DType::kI32,
             "[GPTModel] targets must match tokens ", tokens.desc(), ", got ", targets.desc());
  const int64_t B = tokens.size(0), T = tokens.size(1);
  LOOM_CHECK(T <= cfg_.max_position_embeddings, "[GPTModel] sequence length ", T,
             " exceeds --max-position-embeddings ", cfg_.max_position_embeddings);
  ensure_buffers(B, T);
  const OpTable& ops = ctx_.ops();

  embedding_->forward(ctx_, x0_, tokens, batch.position_ids);
  TensorView x = x0_;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = *layers_[l];
    LayerActs& a = acts_[l];
    L.ln1.forward(ctx_, a.ln1, a.ln1_saved, x);
    L.qkv.forward(ctx_, a.qkv, a.ln1);
    L.attn.forward(ctx_, a.att, a.attn_saved, a.qkv, batch.segment_ids);
    L.proj.forward(ctx_, proj_, a.att);
    L.ln2.forward_residual(ctx_, a.residual2, a.ln2, a.ln2_saved, x, proj_);
    L.fc1.forward(ctx_, a.fc, a.ln2);
    ops.gelu_forward(gelu_, a.fc);
    L.fc2.forward(ctx_, a.out, gelu_);
    ops.residual_forward(a.out, a.out, a.residual2);
    x = a.out;
  }
  final_ln_->forward(ctx_, lnf_, lnf_saved_, x);
  ops.matmul_forward(logits_, lnf_, embedding_->word_embeddings().value, TensorView());
  const int64_t N = B * T;
  const TensorView mask = batch.loss_mask.defined() ? batch.loss_mask.reshape({N}) : TensorView();
  ops.cross_entropy_forward_backward(losses_.reshape({N}), logits_.reshape({N, cfg_.padded_vocab_size}),
                                     targets.reshape({N}), cfg_.vocab_size, mask, dloss_scale);
  backward_ready_ = dloss_scale != 0.0f;
  double sum = 0, count = 0;
  const float* lp = losses_.data<float>();
  const float* mp = mask.defined() ? mask.data<float>() : nullptr;
  for (int64_t i = 0; i < N; ++i) {
    const double w = mp ? double(mp[i]) : 1.0;
    if (w != 0.0) sum += w * double(lp[i]);
    count += w;
  }
  return count > 0 ? float(sum / count) : 0.0f;
}

void GPTModel::backward(const GPTBatch& batch) {
  LOOM_CHECK(backward_ready_, "[GPTModel] backward() needs a preceding forward() with dloss_scale != 0");
  backward_ready_ = false;
  const OpTable& ops = ctx_.ops();
  const int64_t N = B_ * T_;
  // Output layer (tied): dlnf = dlogits · Wte; dWte += dlogits^T · lnf.
  Parameter& wte = embedding_->word_embeddings();
  ops.matmul_backward(dln_, wte.grad, TensorView(), logits_.reshape({N, cfg_.padded_vocab_size}), lnf_, wte.value);
  ops.fill_(dres_, 0.0f);
  const TensorView last = layers_.empty() ? TensorView(x0_) : TensorView(acts_.back().out);
  final_ln_->backward(ctx_, dres_, dln_, last, lnf_saved_);
  for (size_t li = layers_.size(); li-- > 0;) {
    const Layer& L = *layers_[li];
    LayerActs& a = acts_[li];
    const TensorView x = li == 0 ? TensorView(x0_) : TensorView(acts_[li - 1].out);
    // MLP branch: dres is d(out) = d(residual2) through the skip connection.
    ops.gelu_forward(gelu_, a.fc);  // recompute instead of saving 4·B·T·C per layer
    L.fc2.backward(ctx_, dfc_, dres_, gelu_);
    ops.gelu_backward(dfc_, a.fc, dfc_);
    L.fc1.backward(ctx_, dln_, dfc_, a.ln2);
    L.ln2.backward(ctx_, dres_, dln_, a.residual2, a.ln2_saved);
    // Attention branch: dres is now d(residual2) = d(x) through the skip connection.
    L.proj.backward(ctx_, datt_, dres_, a.att);
    L.attn.backward(ctx_, dqkv_, datt_, a.qkv, a.att, a.attn_saved, batch.segment_ids);
    L.qkv.backward(ctx_, dln_, dqkv_, a.ln1);
    L.ln1.backward(ctx_, dres_, dln_, x, a.ln1_saved);
  }
  embedding_->backward(ctx_, dres_, batch.tokens, batch.position_ids);
}

}  // namespace loom

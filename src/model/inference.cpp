// InferenceSession: the model's own TransformerLayers run on only the new positions, with a key/value
// cache and a single-pass attention of the new queries over it in place of the training attention core,
// so a step reproduces the full forward's values for those rows up to the attention core's rounding. Buffers for a step are reused until the number of new tokens per row changes (prefill, then
// one token per decode step).
#include "loom/model/inference.h"

#include "model/transformer_layer.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace loom {


const Parameter& InferenceSession::param(const std::string& name) const {
  const Parameter* p = model_.params().find(name);
  LOOM_CHECK(p != nullptr, "[InferenceSession] the model has no parameter ", name);
  return *p;
}

InferenceSession::InferenceSession(const GPTModel& model, const DeviceContext& ctx, int64_t batch, int64_t capacity)
    : model_(model), cfg_(model.config()), ctx_(ctx), B_(batch), capacity_(capacity), attn_(cfg_.attention_params()) {
  LOOM_CHECK(ctx.device().is_cpu(), "[InferenceSession] the KV-cached forward runs on the CPU backend, got ",
             ctx.device().str());
  LOOM_CHECK(batch >= 1 && capacity >= 1, "[InferenceSession] batch and capacity must be >= 1, got ", batch, ", ",
             capacity);
  LOOM_CHECK(cfg_.position_embedding_type == PositionEmbeddingType::kNone || capacity <= cfg_.max_position_embeddings,
             "[InferenceSession] capacity ", capacity, " exceeds --max-position-embeddings ",
             cfg_.max_position_embeddings);
  const bool layernorm = cfg_.normalization == NormKind::kLayerNorm;
  auto bias = [&](const std::string& name, bool present) { return present ? &param(name) : nullptr; };
  wte_ = &param("embedding.word_embeddings.weight");
  if (cfg_.position_embedding_type == PositionEmbeddingType::kLearnedAbsolute)
    wpe_ = &param("embedding.position_embeddings.weight");
  LOOM_CHECK(model.num_local_layers() == cfg_.num_layers && model.options().parallel.tp_size() == 1,
             "[InferenceSession] generation needs the whole model in one process (", model.num_local_layers(), " of ",
             cfg_.num_layers, " layers here)");
  lnf_w_ = &param("decoder.final_layernorm.weight");
  lnf_b_ = bias("decoder.final_layernorm.bias", layernorm);
  out_w_ = cfg_.untie_embeddings_and_output_weights ? &param("output_layer.weight") : wte_;
  rope_ = model.rotary();

  const int64_t NKV = cfg_.num_kv_heads(), HS = cfg_.head_dim();
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    k_cache_.push_back(ctx.empty({B_, NKV, capacity_, HS}, DType::kF32));
    v_cache_.push_back(ctx.empty({B_, NKV, capacity_, HS}, DType::kF32));
  }
  last_ = ctx.empty({B_, cfg_.hidden_size}, model.params().compute_dtype());
  lnf_ = ctx.empty({B_, cfg_.hidden_size}, model.params().compute_dtype());
  logits_c_ = ctx.empty({B_, cfg_.padded_vocab_size}, model.params().compute_dtype());
  logits_ = ctx.empty({B_, cfg_.padded_vocab_size}, DType::kF32);
}

InferenceSession::~InferenceSession() = default;

int64_t InferenceSession::cache_bytes() const {
  int64_t n = 0;
  for (const Tensor& t : k_cache_) n += t.nbytes();
  for (const Tensor& t : v_cache_) n += t.nbytes();
  return n;
}

void InferenceSession::ensure_step_buffers(int64_t Tn) {
  if (Tn == step_tn_) return;
  const int64_t N = B_ * Tn, C = cfg_.hidden_size, NH = cfg_.num_attention_heads, HS = cfg_.head_dim();
  const int64_t F = cfg_.ffn_hidden_size(), F1 = (cfg_.gated_mlp() ? 2 : 1) * F;
  const DType cd = model_.params().compute_dtype();
  positions_ = ctx_.empty({B_, Tn}, DType::kI32);
  tokens_ = ctx_.empty({B_, Tn}, DType::kI32);
  x_ = ctx_.empty({N, C}, cd);
  h_ = ctx_.empty({N, C}, cd);
  qkv_ = ctx_.empty({B_, Tn, cfg_.qkv_size()}, cd);
  att_ = ctx_.empty({N, NH * HS}, cd);
  branch_ = ctx_.empty({N, C}, cd);
  res2_ = ctx_.empty({N, C}, cd);
  fc_ = ctx_.empty({N, F1}, cd);
  act_ = ctx_.empty({N, F}, cd);
  if (cfg_.qk_layernorm) qk_scratch_ = ctx_.empty({N * NH * HS}, cd);
  mean_ = ctx_.empty({B_}, DType::kF32);
  rstd_ = ctx_.empty({B_}, DType::kF32);
  step_tn_ = Tn;
}

void InferenceSession::norm(TensorView out, TensorView inp, const Parameter& w, const Parameter* b) const {
  const int64_t C = inp.size(inp.ndim() - 1), N = inp.numel() / C;
  const TensorView x = inp.reshape({N, C}), y = out.reshape({N, C});
  if (cfg_.normalization == NormKind::kRMSNorm) {
    ctx_.ops().rmsnorm_forward(y, rstd_.view().slice_flat(0, {N}), x, w.compute, cfg_.layernorm_epsilon);
  } else {
    ctx_.ops().layernorm_forward(y, mean_.view().slice_flat(0, {N}), rstd_.view().slice_flat(0, {N}), x, w.compute,
                                 b->compute, cfg_.layernorm_epsilon);
  }
}

// Appends the new rows' key and value heads (after qk-norm and RoPE) at positions [length_, length_ + Tn).
void InferenceSession::append_kv(int64_t layer, TensorView qkv, int64_t Tn) const {
  const int64_t NKV = attn_.num_kv_heads, G = attn_.num_heads / NKV, HS = attn_.head_dim, row = NKV * (G + 2) * HS;
  float* kc = k_cache_[size_t(layer)].data<float>();
  float* vc = v_cache_[size_t(layer)].data<float>();
  const void* src = qkv.raw();
  const DType dt = qkv.dtype();
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t t = 0; t < Tn; ++t)
      for (int64_t g = 0; g < NKV; ++g) {
        const int64_t s = (b * Tn + t) * row + g * (G + 2) * HS + G * HS;
        const int64_t d = ((b * NKV + g) * capacity_ + length_ + t) * HS;
        for (int64_t c = 0; c < HS; ++c) {
          kc[d + c] = load_as_f32(src, dt, s + c);
          vc[d + c] = load_as_f32(src, dt, s + HS + c);
        }
      }
}

// out (B·Tn, NH·HS): new query t of row b sits at position p = length_ + t and attends to the cached keys
// j with max(0, p - window + 1) <= j <= p (all of [0, p] without a window); query head h reads key/value
// head h / G. Softmax in f32 with the maximum subtracted; each (b, t, h) is independent, so the result does
// not depend on the thread count.
void InferenceSession::cached_attention(int64_t layer, TensorView out, TensorView qkv, int64_t Tn) const {
  const int64_t NH = attn_.num_heads, NKV = attn_.num_kv_heads, G = NH / NKV, HS = attn_.head_dim;
  const int64_t row = NKV * (G + 2) * HS, cap = capacity_, len = length_;
  const float* kc = k_cache_[size_t(layer)].data<float>();
  const float* vc = v_cache_[size_t(layer)].data<float>();
  const void* src = qkv.raw();
  void* dst = out.raw();
  const DType dt = qkv.dtype(), odt = out.dtype();
  const float scale = attn_.softmax_scale;
  const int64_t window = attn_.window;
  const int64_t total = B_ * Tn * NH;
#pragma omp parallel
  {
    std::vector<float> q(static_cast<size_t>(HS)), acc(static_cast<size_t>(HS)), scores(static_cast<size_t>(len + Tn));
#pragma omp for schedule(static)
    for (int64_t idx = 0; idx < total; ++idx) {
      const int64_t h = idx % NH, t = (idx / NH) % Tn, b = idx / (NH * Tn);
      const int64_t g = h / G, pos = len + t;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const int64_t qoff = (b * Tn + t) * row + g * (G + 2) * HS + (h % G) * HS;
      for (int64_t c = 0; c < HS; ++c) q[size_t(c)] = load_as_f32(src, dt, qoff + c);
      const float* kb = kc + (b * NKV + g) * cap * HS;
      const float* vb = vc + (b * NKV + g) * cap * HS;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = lo; j <= pos; ++j) {
        float s = 0.0f;
        const float* k = kb + j * HS;
        for (int64_t c = 0; c < HS; ++c) s += q[size_t(c)] * k[c];
        s *= scale;
        scores[size_t(j)] = s;
        mx = std::max(mx, s);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      float sum = 0.0f;
      for (int64_t j = lo; j <= pos; ++j) {
        const float e = std::exp(scores[size_t(j)] - mx);
        sum += e;
        const float* v = vb + j * HS;
        for (int64_t c = 0; c < HS; ++c) acc[size_t(c)] += e * v[c];
      }
      const float inv = 1.0f / sum;
      const int64_t ooff = (b * Tn + t) * NH * HS + h * HS;
      for (int64_t c = 0; c < HS; ++c) store_from_f32(dst, odt, ooff + c, acc[size_t(c)] * inv);
    }
  }
}

TensorView InferenceSession::forward(TensorView tokens) {
  LOOM_CHECK(tokens.ndim() == 2 && tokens.size(0) == B_ && tokens.dtype() == DType::kI32 && tokens.device().is_cpu(),
             "[InferenceSession] tokens must be host i32 (", B_, ", Tn), got ", tokens.desc());
  const int64_t Tn = tokens.size(1), N = B_ * Tn;
  LOOM_CHECK(Tn >= 1 && length_ + Tn <= capacity_, "[InferenceSession] ", Tn, " new tokens do not fit: ", length_,
             " of ", capacity_, " positions are used");
  const int32_t* tp = tokens.data<int32_t>();
  for (int64_t i = 0; i < N; ++i)
    LOOM_CHECK(tp[i] >= 0 && tp[i] < cfg_.padded_vocab_size, "[InferenceSession] token id ", tp[i],
               " is outside the vocabulary [0, ", cfg_.padded_vocab_size, ")");
  ensure_step_buffers(Tn);
  ctx_.copy(tokens_, tokens);
  int32_t* pp = positions_.data<int32_t>();
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t t = 0; t < Tn; ++t) pp[b * Tn + t] = int32_t(length_ + t);

  const OpTable& ops = ctx_.ops();
  const int64_t C = cfg_.hidden_size;
  ops.embedding_forward(x_.reshape({B_, Tn, C}), tokens_, wte_->compute,
                        wpe_ ? TensorView(wpe_->compute) : TensorView(), positions_);
  // The model's own layers, with a KV-cache attention and no dropout. The layer's saved activations are
  // this session's step buffers (ln1 and ln2 share h_: each is consumed before the next is written).
  TransformerLayerContext c{ctx_};
  c.act = act_;
  c.branch = branch_;
  c.qk_a = qk_scratch_;
  c.rope = rope_;
  c.positions = positions_;
  int64_t layer = 0;
  c.attend = [&](const TransformerLayer&, TransformerLayerSaved& s, bool) {
    append_kv(layer, s.qkv, Tn);
    cached_attention(layer, s.att, s.qkv, Tn);
  };
  TransformerLayerSaved saved;
  saved.ln1 = h_;
  saved.qkv = qkv_;
  saved.att = att_;
  saved.residual2 = res2_;
  saved.ln2 = h_;
  saved.fc = fc_;
  for (layer = 0; layer < cfg_.num_layers; ++layer) model_.layer(layer).forward(c, x_, saved, x_);
  length_ += Tn;
  for (int64_t b = 0; b < B_; ++b)
    ctx_.copy(last_.view().slice_flat(b * C, {C}), x_.view().slice_flat((b * Tn + Tn - 1) * C, {C}));
  norm(lnf_, last_, *lnf_w_, lnf_b_);
  ops.matmul_forward(logits_c_, lnf_, out_w_->compute, TensorView());
  if (logits_c_.dtype() == DType::kF32) return logits_c_;
  ops.cast(logits_, logits_c_);
  return logits_;
}

}  // namespace loom

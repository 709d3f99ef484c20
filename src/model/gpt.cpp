// GPTModel: buffers (one layout shared by the static memory plan and the allocation), forward, backward
// and activation recomputation. Invariant: a recomputed forward runs the very same ops on the very same
// inputs with the same dropout masks as the original forward, so it reproduces every bit.
#include "loom/model/gpt.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "loom/core/rng.h"

namespace loom {

namespace {

uint64_t mix64(uint64_t x) {  // splitmix64 finaliser: a bijection that spreads every input bit
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Philox stream of one dropout site for one micro-batch. The site hash names the tensor (layer index
// included); a tensor-parallel rank will mix its TP rank into the site hash for dropout inside TP regions
// (attention probabilities of its heads), as Megatron's model-parallel RNG tracker does, and leave it out
// for the replicated hidden dropout so all TP ranks drop the same elements.
uint64_t dropout_stream(uint64_t site, uint64_t micro_batch_index) { return mix64(site ^ mix64(micro_batch_index)); }

const char* granularity_flag(RecomputeGranularity g) {
  switch (g) {
    case RecomputeGranularity::kNone: return "(unset)";
    case RecomputeGranularity::kSelective: return "selective";
    case RecomputeGranularity::kFull: return "full";
  }
  return "?";
}

}  // namespace

struct GPTModel::Layer {
  // Declaration order is parameter order in the flat buffers: norms, attention, MLP (GPT-2's order, with
  // the qk-norms after the attention projections).
  Norm ln1, ln2;
  Linear qkv, proj;
  std::optional<QKNorm> qk_norm;
  Linear fc1, fc2;
  AttentionCore attn;
  uint64_t attn_dropout_site, proj_dropout_site, mlp_dropout_site;
  Layer(ParameterSet& ps, const GPTConfig& c, int64_t i)
      : ln1(ps, prefix(i) + "input_layernorm", c.hidden_size, c.layernorm_epsilon, c.normalization),
        ln2(ps, prefix(i) + "pre_mlp_layernorm", c.hidden_size, c.layernorm_epsilon, c.normalization),
        qkv(ps, prefix(i) + "self_attention.linear_qkv", c.hidden_size, c.qkv_size(), c.qkv_bias(),
            c.init_method_std),
        proj(ps, prefix(i) + "self_attention.linear_proj", c.num_attention_heads * c.head_dim(), c.hidden_size,
             c.add_bias_linear, scaled_std(c)),
        qk_norm(c.qk_layernorm ? std::optional<QKNorm>(std::in_place, ps, prefix(i) + "self_attention",
                                                       c.attention_params(), c.layernorm_epsilon, c.normalization)
                               : std::nullopt),
        fc1(ps, prefix(i) + "mlp.linear_fc1", c.hidden_size, (c.gated_mlp() ? 2 : 1) * c.ffn_hidden_size(),
            c.add_bias_linear, c.init_method_std),
        fc2(ps, prefix(i) + "mlp.linear_fc2", c.ffn_hidden_size(), c.hidden_size, c.add_bias_linear, scaled_std(c)),
        attn(c.attention_params()),
        attn_dropout_site(hash_stream(prefix(i) + "self_attention.core_attention.attention_dropout")),
        proj_dropout_site(hash_stream(prefix(i) + "self_attention.hidden_dropout")),
        mlp_dropout_site(hash_stream(prefix(i) + "mlp.hidden_dropout")) {}
  static std::string prefix(int64_t i) { return "decoder.layers." + std::to_string(i) + "."; }
  // Megatron's output_layer_init_method: std / sqrt(2 · num_layers) for projections into the residual.
  static float scaled_std(const GPTConfig& c) {
    return float(c.init_method_std / std::sqrt(2.0 * double(c.num_layers)));
  }
};

struct GPTModel::LayerActs {
  Tensor ln1;        // (B, T, C)
  Norm::Saved ln1_saved;
  Tensor qkv;        // (B, T, (NH + 2·NKV)·HS) after the qk-norm and RoPE: what the attention core reads
  QKNorm::Saved qk_saved;  // --qk-layernorm: the q/k heads before the norm and its statistics
  Tensor att;        // (B, T, NH·HS) attention core output
  AttentionCore::Saved attn_saved;
  Tensor residual2;  // (B, T, C) x + attention branch
  Tensor ln2;        // (B, T, C)
  Norm::Saved ln2_saved;
  Tensor fc;         // (B, T, F), or (B, T, 2F) = [gate | up] for a gated MLP: fc1's output
  Tensor out;        // (B, T, C) layer output = next layer's input
};

// Full recomputation: a recomputed layer belongs to the group [group_begin, group_end), re-run together
// in backward; its activations live in scratch_[l - group_begin].
struct GPTModel::LayerRole {
  bool recomputed = false;
  int64_t group_begin = 0, group_end = 0;
};

struct GPTModel::BufferSlot {
  PlannedBuffer buffer;
  Tensor* target;  // where the model keeps it; null for the static plan
};

namespace {
uint64_t embedding_dropout_site() {
  static const uint64_t site = hash_stream("embedding.embedding_dropout");
  return site;
}
}  // namespace

PositionEmbeddingType parse_position_embedding_type(std::string_view s) {
  if (s == "learned_absolute") return PositionEmbeddingType::kLearnedAbsolute;
  if (s == "rope") return PositionEmbeddingType::kRope;
  if (s == "none") return PositionEmbeddingType::kNone;
  if (s == "mrope" || s == "relative")
    user_error("--position-embedding-type ", s, " is not supported by Loom; valid: learned_absolute, rope, none");
  user_error("--position-embedding-type must be learned_absolute, rope or none, got '", s, "'");
}

const char* position_embedding_type_name(PositionEmbeddingType t) {
  switch (t) {
    case PositionEmbeddingType::kLearnedAbsolute: return "learned_absolute";
    case PositionEmbeddingType::kRope: return "rope";
    case PositionEmbeddingType::kNone: return "none";
  }
  return "?";
}

const char* mlp_activation_name(MlpActivation a) {
  switch (a) {
    case MlpActivation::kGeLU: return "gelu";
    case MlpActivation::kSwiGLU: return "swiglu";
    case MlpActivation::kGeGLU: return "geglu";
    case MlpActivation::kReGLU: return "reglu";
  }
  return "?";
}

int64_t GPTConfig::ffn_hidden_size() const {
  if (ffn_hidden > 0) return ffn_hidden;
  // Megatron: int((4 * h * 2 / 3) / 64) * 64. 8h/3 is never within rounding of a multiple of 64 unless it
  // is one, so the float expression equals this integer one.
  return gated_mlp() ? hidden_size / 24 * 64 : 4 * hidden_size;
}

int64_t GPTConfig::rotary_dim() const {
  if (position_embedding_type != PositionEmbeddingType::kRope) return 0;
  return int64_t(double(head_dim()) * double(rotary_percent));  // Megatron: int(kv_channels * rotary_percent)
}

AttentionParams GPTConfig::attention_params() const {
  AttentionParams p;
  p.num_heads = num_attention_heads;
  p.num_kv_heads = num_kv_heads();
  p.head_dim = head_dim();
  p.softmax_scale = float(1.0 / std::sqrt(double(head_dim())));
  p.causal = true;
  p.window = window_size_left >= 0 ? window_size_left + 1 : -1;  // keys [i - L, i]: L + 1 of them
  return p;
}

RotaryOptions GPTConfig::rotary_options() const {
  RotaryOptions o;
  o.rotary_dim = rotary_dim();
  o.base = rotary_base;
  o.interleaved = rotary_interleaved;
  if (use_rope_scaling) {
    RopeScaling s;
    s.factor = double(rope_scaling_factor);
    o.scaling = s;
  }
  return o;
}

int64_t GPTConfig::num_parameters() const {
  const int64_t C = hidden_size, F = ffn_hidden_size(), HS = head_dim(), NH = num_attention_heads;
  const int64_t QKV = qkv_size(), F1 = (gated_mlp() ? 2 : 1) * F, norm = Norm::num_parameters(normalization, C);
  const int64_t attention = C * QKV + (qkv_bias() ? QKV : 0) + NH * HS * C + (add_bias_linear ? C : 0) +
                            (qk_layernorm ? 2 * Norm::num_parameters(normalization, HS) : 0);
  const int64_t mlp = C * F1 + F * C + (add_bias_linear ? F1 + C : 0);
  const int64_t per_layer = 2 * norm + attention + mlp;
  const int64_t embeddings =
      padded_vocab_size * C +
      (position_embedding_type == PositionEmbeddingType::kLearnedAbsolute ? max_position_embeddings * C : 0);
  const int64_t output_layer = untie_embeddings_and_output_weights ? padded_vocab_size * C : 0;
  return embeddings + num_layers * per_layer + norm + output_layer;
}

double GPTConfig::attention_core_forward_flops(int64_t B, int64_t T) const {
  // Q·K^T and P·V: 2·T·HS multiply-adds per query and head each.
  return 4.0 * double(B) * double(T) * double(T) * double(num_attention_heads) * double(head_dim());
}

double GPTConfig::layer_forward_flops(int64_t B, int64_t T) const {
  const double c = double(hidden_size), f = double(ffn_hidden_size()), q = double(num_attention_heads * head_dim());
  const double weights = c * double(qkv_size()) + q * c + c * f * (gated_mlp() ? 2.0 : 1.0) + f * c;
  return 2.0 * double(B) * double(T) * weights + attention_core_forward_flops(B, T);
}

double GPTConfig::logits_forward_flops(int64_t B, int64_t T) const {
  return 2.0 * double(B) * double(T) * double(hidden_size) * double(padded_vocab_size);
}

double GPTConfig::flops_per_step(int64_t B, int64_t T) const {
  return 3.0 * (double(num_layers) * layer_forward_flops(B, T) + logits_forward_flops(B, T));
}

void GPTConfig::validate_architecture() const {
  if (num_layers < 1) user_error("--num-layers must be >= 1, got ", num_layers);
  if (hidden_size < 1) user_error("--hidden-size must be >= 1, got ", hidden_size);
  if (num_attention_heads < 1) user_error("--num-attention-heads must be >= 1, got ", num_attention_heads);
  if (kv_channels < 0) user_error("--kv-channels must be >= 1, got ", kv_channels);
  if (kv_channels == 0 && hidden_size % num_attention_heads != 0)
    user_error("--hidden-size (", hidden_size, ") must be divisible by --num-attention-heads (", num_attention_heads,
               "), or give the head size with --kv-channels");
  if (group_query_attention) {
    if (num_query_groups < 1) user_error("--num-query-groups must be >= 1, got ", num_query_groups);
    if (num_attention_heads % num_query_groups != 0)
      user_error("--num-attention-heads (", num_attention_heads, ") must be divisible by --num-query-groups (",
                 num_query_groups, ")");
  }
  if (ffn_hidden < 0) user_error("--ffn-hidden-size must be >= 1, got ", ffn_hidden);
  if (ffn_hidden_size() < 1)
    user_error("the default --ffn-hidden-size of a gated MLP, int(4 * ", hidden_size,
               " * 2 / 3 / 64) * 64, is 0 for a hidden size below 24: give --ffn-hidden-size");
  if (position_embedding_type == PositionEmbeddingType::kRope) {
    if (!(rotary_base > 0)) user_error("--rotary-base must be > 0, got ", rotary_base);
    if (!(rotary_percent > 0.0f && rotary_percent <= 1.0f))
      user_error("--rotary-percent must be in (0, 1], got ", rotary_percent);
    const int64_t rd = rotary_dim();
    if (rd < 2 || rd % 2 != 0)
      user_error("--rotary-percent ", rotary_percent, " of the head size ", head_dim(), " gives ", rd,
                 " rotary channels; RoPE needs an even number >= 2");
    if (use_rope_scaling && !(rope_scaling_factor > 0))
      user_error("--rope-scaling-factor must be > 0, got ", rope_scaling_factor);
  } else {
    const char* t = position_embedding_type_name(position_embedding_type);
    if (use_rope_scaling) user_error("--use-rope-scaling needs --position-embedding-type rope (got ", t, ")");
    if (rotary_interleaved) user_error("--rotary-interleaved needs --position-embedding-type rope (got ", t, ")");
  }
  if (window_size_left < -1)
    user_error("--window-size: the left window must be >= 0 (or -1: none), got ", window_size_left);
  if (max_position_embeddings < 1)
    user_error("--max-position-embeddings must be >= 1, got ", max_position_embeddings);
  if (!(hidden_dropout >= 0.0f && hidden_dropout < 1.0f))
    user_error("--hidden-dropout must be in [0, 1), got ", hidden_dropout);
  if (!(attention_dropout >= 0.0f && attention_dropout < 1.0f))
    user_error("--attention-dropout must be in [0, 1), got ", attention_dropout);
}

void GPTConfig::validate() const {
  validate_architecture();
  if (vocab_size < 1) user_error("vocabulary size must be >= 1, got ", vocab_size);
  if (padded_vocab_size < vocab_size)
    user_error("padded vocabulary ", padded_vocab_size, " is smaller than the vocabulary ", vocab_size);
}

RecomputeGranularity parse_recompute_granularity(std::string_view s) {
  if (s == "full") return RecomputeGranularity::kFull;
  if (s == "selective") return RecomputeGranularity::kSelective;
  user_error("--recompute-granularity must be 'full' or 'selective', got '", s, "'");
}

RecomputeMethod parse_recompute_method(std::string_view s) {
  if (s == "uniform") return RecomputeMethod::kUniform;
  if (s == "block") return RecomputeMethod::kBlock;
  user_error("--recompute-method must be 'uniform' or 'block', got '", s, "'");
}

void ModelOptions::validate(const GPTConfig& cfg) const {
  if (compute_dtype != DType::kF32 && compute_dtype != DType::kBF16 && compute_dtype != DType::kF16)
    user_error("the compute dtype must be f32, bf16 (--bf16) or f16 (--fp16), got ", dtype_name(compute_dtype));
  if (grad_dtype != DType::kF32 && grad_dtype != compute_dtype)
    user_error("gradients must be f32 (--accumulate-allreduce-grads-in-fp32) or in the compute dtype ",
               dtype_name(compute_dtype), ", got ", dtype_name(grad_dtype));
  switch (recompute_granularity) {
    case RecomputeGranularity::kNone: break;  // Megatron ignores --recompute-method/-num-layers then
    case RecomputeGranularity::kSelective:
      if (recompute_method != RecomputeMethod::kNone)
        user_error("--recompute-method is not supported with --recompute-granularity selective; drop it");
      if (recompute_num_layers != 0)
        user_error("--recompute-num-layers must not be given with --recompute-granularity selective, got ",
                   recompute_num_layers);
      break;
    case RecomputeGranularity::kFull:
      if (recompute_method == RecomputeMethod::kNone)
        user_error("--recompute-granularity full needs --recompute-method uniform or block");
      if (recompute_num_layers < 1 || recompute_num_layers > cfg.num_layers)
        user_error("--recompute-num-layers must be in [1, ", cfg.num_layers, "] (--num-layers) with --recompute-granularity ",
                   granularity_flag(recompute_granularity), ", got ", recompute_num_layers);
      break;
  }
}

int64_t GPTMemoryPlan::parameter_bytes() const {
  int64_t n = 0;
  for (const PlannedBuffer& b : parameters) n += b.bytes();
  return n;
}

int64_t GPTMemoryPlan::activation_bytes() const {
  int64_t n = 0;
  for (const PlannedBuffer& b : activations) n += b.bytes();
  return n;
}

std::vector<GPTModel::LayerRole> GPTModel::layer_roles(const GPTConfig& cfg, const ModelOptions& opts) {
  const int64_t L = cfg.num_layers, N = opts.recompute_num_layers;
  std::vector<LayerRole> roles(static_cast<size_t>(L));
  if (opts.recompute_granularity != RecomputeGranularity::kFull) return roles;
  for (int64_t l = 0; l < L; ++l) {
    LayerRole& r = roles[size_t(l)];
    if (opts.recompute_method == RecomputeMethod::kUniform) {
      r = {true, l / N * N, std::min(l / N * N + N, L)};
    } else if (l < N) {  // block: the first N layers, each on its own
      r = {true, l, l + 1};
    }
  }
  return roles;
}

// The one list of activation buffers: memory_plan() reports it, ensure_buffers() allocates it. Recomputed
// layers own no buffers except a group's output; their LayerActs are bound to scratch_ afterwards.
std::vector<GPTModel::BufferSlot> GPTModel::activation_layout(const GPTConfig& cfg, const ModelOptions& opts,
                                                              int64_t B, int64_t T, GPTModel* m) {
  const DType cd = opts.compute_dtype, f32 = DType::kF32;
  const int64_t C = cfg.hidden_size, F = cfg.ffn_hidden_size(), NH = cfg.num_attention_heads,
                NKV = cfg.num_kv_heads(), HS = cfg.head_dim(), N = B * T;
  const int64_t QKV = cfg.qkv_size(), A = NH * HS, F1 = (cfg.gated_mlp() ? 2 : 1) * F;
  const bool selective = opts.recompute_granularity == RecomputeGranularity::kSelective;
  const bool layernorm = cfg.normalization == NormKind::kLayerNorm;  // RMSNorm keeps no mean
  const std::vector<LayerRole> roles = layer_roles(cfg, opts);
  std::vector<BufferSlot> out;
  auto emit = [&](std::string name, Shape s, DType dt, Tensor* target) {
    out.push_back({PlannedBuffer{std::move(name), s, dt}, m ? target : nullptr});
  };
  auto emit_stats = [&](const std::string& name, int64_t rows, Norm::Saved* sv) {
    if (layernorm) emit(name + ".mean", {rows}, f32, sv ? &sv->mean : nullptr);
    emit(name + ".rstd", {rows}, f32, sv ? &sv->rstd : nullptr);
  };
  // All fields of one layer's activations; the attention core output and lse unless selective, the
  // output only when `with_out`.
  auto emit_acts = [&](const std::string& p, LayerActs* a, bool with_att, bool with_out) {
    emit(p + "ln1", {B, T, C}, cd, a ? &a->ln1 : nullptr);
    emit_stats(p + "ln1", N, a ? &a->ln1_saved : nullptr);
    emit(p + "qkv", {B, T, QKV}, cd, a ? &a->qkv : nullptr);
    if (cfg.qk_layernorm) {
      QKNorm::Saved* q = a ? &a->qk_saved : nullptr;
      emit(p + "q_layernorm.input", {B, T, A}, cd, q ? &q->q_inp : nullptr);
      emit(p + "k_layernorm.input", {B, T, NKV * HS}, cd, q ? &q->k_inp : nullptr);
      emit_stats(p + "q_layernorm", N * NH, q ? &q->q : nullptr);
      emit_stats(p + "k_layernorm", N * NKV, q ? &q->k : nullptr);
    }
    if (with_att) {
      emit(p + "attention", {B, T, A}, cd, a ? &a->att : nullptr);
      emit(p + "attention.lse", {B, NH, T}, f32, a ? &a->attn_saved.lse : nullptr);
    }
    emit(p + "residual2", {B, T, C}, cd, a ? &a->residual2 : nullptr);
    emit(p + "ln2", {B, T, C}, cd, a ? &a->ln2 : nullptr);
    emit_stats(p + "ln2", N, a ? &a->ln2_saved : nullptr);
    emit(p + "fc1", {B, T, F1}, cd, a ? &a->fc : nullptr);
    if (with_out) emit(p + "output", {B, T, C}, cd, a ? &a->out : nullptr);
  };

  emit("embedding.output", {B, T, C}, cd, m ? &m->x0_ : nullptr);
  int64_t slots = 0;
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    const LayerRole& r = roles[size_t(l)];
    LayerActs* a = m ? &m->acts_[size_t(l)] : nullptr;
    const std::string p = "decoder.layers." + std::to_string(l) + ".";
    if (!r.recomputed) {
      emit_acts(p, a, !selective, true);
    } else {
      slots = std::max(slots, r.group_end - r.group_begin);
      if (l == r.group_end - 1) emit(p + "output", {B, T, C}, cd, a ? &a->out : nullptr);  // next group's input
    }
  }
  for (int64_t s = 0; s < slots; ++s) {
    // The last slot's output is never needed: a group's last layer writes the kept group output.
    emit_acts("recompute.slot" + std::to_string(s) + ".", m ? &m->scratch_[size_t(s)] : nullptr, true,
              s + 1 < slots);
  }
  if (selective) {
    emit("selective.attention", {B, T, A}, cd, m ? &m->att_scratch_ : nullptr);
    emit("selective.attention.lse", {B, NH, T}, f32, m ? &m->lse_scratch_ : nullptr);
  }
  emit("decoder.final_layernorm.output", {B, T, C}, cd, m ? &m->lnf_ : nullptr);
  emit_stats("decoder.final_layernorm", N, m ? &m->lnf_saved_ : nullptr);
  emit("output_layer.logits", {B, T, cfg.padded_vocab_size}, cd, m ? &m->logits_ : nullptr);
  emit("losses", {B, T}, f32, m ? &m->losses_ : nullptr);
  emit("scratch.mlp_activation", {B, T, F}, cd, m ? &m->act_ : nullptr);
  emit("scratch.branch", {B, T, C}, cd, m ? &m->branch_ : nullptr);
  emit("grad.residual", {B, T, C}, cd, m ? &m->dres_ : nullptr);
  emit("grad.ln", {B, T, C}, cd, m ? &m->dln_ : nullptr);
  emit("grad.attention", {B, T, A}, cd, m ? &m->datt_ : nullptr);
  emit("grad.qkv", {B, T, QKV}, cd, m ? &m->dqkv_ : nullptr);
  emit("grad.fc1", {B, T, F}, cd, m ? &m->dfc_ : nullptr);  // d(MLP activation output), and GeLU's d(fc1)
  if (cfg.qk_layernorm) {
    emit("scratch.qk_layernorm", {B, T, A}, cd, m ? &m->qk_a_ : nullptr);
    emit("grad.qk_layernorm", {B, T, A}, cd, m ? &m->qk_b_ : nullptr);
  }
  return out;
}

GPTMemoryPlan GPTModel::memory_plan(const GPTConfig& cfg, const ModelOptions& opts, int64_t B, int64_t T) {
  cfg.validate();
  opts.validate(cfg);
  LOOM_CHECK(B >= 1 && T >= 1, "[GPTModel] memory_plan needs a positive micro-batch shape, got B=", B, " T=", T);
  GPTMemoryPlan plan;
  const int64_t n = cfg.num_parameters();
  plan.parameters.push_back({"params.values", {n}, DType::kF32});
  if (opts.compute_dtype != DType::kF32) plan.parameters.push_back({"params.compute", {n}, opts.compute_dtype});
  if (opts.with_grads) plan.parameters.push_back({"params.grads", {n}, opts.grad_dtype});
  if (cfg.position_embedding_type == PositionEmbeddingType::kRope) {
    const Shape table{cfg.max_position_embeddings, cfg.rotary_dim() / 2};
    plan.parameters.push_back({"rope.cos", table, DType::kF32});
    plan.parameters.push_back({"rope.sin", table, DType::kF32});
  }
  for (BufferSlot& s : activation_layout(cfg, opts, B, T, nullptr)) plan.activations.push_back(std::move(s.buffer));
  return plan;
}

GPTModel::GPTModel(const GPTConfig& cfg, const DeviceContext& ctx, const ModelOptions& opts)
    : cfg_(cfg), opts_(opts), ctx_(ctx) {
  cfg_.validate();
  opts_.validate(cfg_);
  const bool learned = cfg.position_embedding_type == PositionEmbeddingType::kLearnedAbsolute;
  embedding_ = std::make_unique<Embedding>(params_, cfg.padded_vocab_size, cfg.hidden_size,
                                           learned ? cfg.max_position_embeddings : 0, cfg.init_method_std);
  for (int64_t i = 0; i < cfg.num_layers; ++i) layers_.push_back(std::make_unique<Layer>(params_, cfg, i));
  final_ln_ = std::make_unique<Norm>(params_, "decoder.final_layernorm", cfg.hidden_size, cfg.layernorm_epsilon,
                                     cfg.normalization);
  // Megatron initialises the untied output layer with init_method (not the scaled one).
  if (cfg.untie_embeddings_and_output_weights)
    output_layer_ = std::make_unique<Linear>(params_, "output_layer", cfg.hidden_size, cfg.padded_vocab_size, false,
                                             cfg.init_method_std);
  params_.allocate(ctx, opts_.compute_dtype, opts_.grad_dtype, opts_.with_grads);
  if (cfg.position_embedding_type == PositionEmbeddingType::kRope)
    rope_ = std::make_unique<RotaryEmbedding>(ctx, cfg.rotary_options(), cfg.max_position_embeddings);
  roles_ = layer_roles(cfg_, opts_);
  acts_.resize(size_t(cfg.num_layers));
  int64_t slots = 0;
  for (const LayerRole& r : roles_)
    if (r.recomputed) slots = std::max(slots, r.group_end - r.group_begin);
  scratch_.resize(size_t(slots));
}

GPTModel::~GPTModel() = default;

void GPTModel::ensure_buffers(int64_t B, int64_t T) {
  if (B == B_ && T == T_) return;
  // Free the old set before allocating the new one so the two never coexist.
  if (B_ > 0)
    for (BufferSlot& s : activation_layout(cfg_, opts_, B_, T_, this)) *s.target = Tensor();
  acts_.assign(acts_.size(), LayerActs{});
  scratch_.assign(scratch_.size(), LayerActs{});
  activation_bytes_ = 0;

  for (BufferSlot& s : activation_layout(cfg_, opts_, B, T, this)) {
    *s.target = ctx_.empty(s.buffer.shape, s.buffer.dtype);
    activation_bytes_ += s.target->nbytes();
  }
  // Bind recomputed layers to their scratch slot (sharing storage), keeping a group's own output.
  for (size_t l = 0; l < acts_.size(); ++l) {
    const LayerRole& r = roles_[l];
    if (!r.recomputed) continue;
    const bool last = int64_t(l) == r.group_end - 1;
    Tensor kept_out = acts_[l].out;
    acts_[l] = scratch_[size_t(int64_t(l) - r.group_begin)];
    if (last) acts_[l].out = kept_out;
  }
  if (opts_.recompute_granularity == RecomputeGranularity::kSelective) {
    for (LayerActs& a : acts_) {
      a.att = att_scratch_;
      a.attn_saved.lse = lse_scratch_;
    }
  }
  B_ = B;
  T_ = T;
}

DropoutMask GPTModel::hidden_mask(uint64_t site) const {
  if (!fwd_.training || cfg_.hidden_dropout <= 0.0f) return {};
  return {cfg_.hidden_dropout, fwd_.dropout_seed, dropout_stream(site, fwd_.micro_batch_index)};
}

DropoutMask GPTModel::attention_mask(uint64_t site) const {
  if (!fwd_.training || cfg_.attention_dropout <= 0.0f) return {};
  return {cfg_.attention_dropout, fwd_.dropout_seed, dropout_stream(site, fwd_.micro_batch_index)};
}

Parameter& GPTModel::output_weight() const {
  return output_layer_ ? output_layer_->weight() : embedding_->word_embeddings();
}

TensorView GPTModel::layer_input(int64_t l) const {
  return l == 0 ? TensorView(x0_) : TensorView(acts_[size_t(l - 1)].out);
}

void GPTModel::forward_layer(int64_t l, TensorView segment_ids) {
  const Layer& L = *layers_[size_t(l)];
  LayerActs& a = acts_[size_t(l)];
  const TensorView x = layer_input(l);
  L.ln1.forward(ctx_, a.ln1, a.ln1_saved, x);
  L.qkv.forward(ctx_, a.qkv, a.ln1);
  if (L.qk_norm) L.qk_norm->forward(ctx_, a.qkv, a.qk_saved, qk_a_);
  if (rope_) rope_->forward(ctx_, a.qkv, L.attn.params());  // in place: attention reads rotated q, k
  L.attn.forward(ctx_, a.att, a.attn_saved, a.qkv, segment_ids, attention_mask(L.attn_dropout_site));
  // Bias-dropout-add: the bias is part of the linear output, dropout follows, then the residual add.
  L.proj.forward(ctx_, branch_, a.att);
  dropout_forward(ctx_, branch_, branch_, hidden_mask(L.proj_dropout_site));
  L.ln2.forward_residual(ctx_, a.residual2, a.ln2, a.ln2_saved, x, branch_);
  L.fc1.forward(ctx_, a.fc, a.ln2);
  mlp_activation_forward(a.fc);
  L.fc2.forward(ctx_, a.out, act_);
  dropout_forward(ctx_, a.out, a.out, hidden_mask(L.mlp_dropout_site));
  ctx_.ops().residual_forward(a.out, a.out, a.residual2);
}

void GPTModel::mlp_activation_forward(TensorView fc) const {
  const int64_t N = B_ * T_, F = cfg_.ffn_hidden_size();
  switch (cfg_.activation) {
    case MlpActivation::kGeLU: ctx_.ops().gelu_forward(act_, fc); return;
    case MlpActivation::kSwiGLU:
    case MlpActivation::kGeGLU:
    case MlpActivation::kReGLU: ctx_.ops().glu_forward(act_.reshape({N, F}), fc.reshape({N, 2 * F}), glu_kind()); return;
  }
}

GluKind GPTModel::glu_kind() const {
  switch (cfg_.activation) {
    case MlpActivation::kGeGLU: return GluKind::kGeGLU;
    case MlpActivation::kReGLU: return GluKind::kReGLU;
    default: return GluKind::kSwiGLU;
  }
}

// Enters with dres_ = d(layer output), leaves with dres_ = d(layer input).
void GPTModel::backward_layer(int64_t l, TensorView segment_ids) {
  const Layer& L = *layers_[size_t(l)];
  LayerActs& a = acts_[size_t(l)];
  const OpTable& ops = ctx_.ops();
  // MLP branch: dres is d(out) = d(residual2) through the skip connection.
  mlp_activation_forward(a.fc);  // recompute instead of saving B·T·F per layer
  const DropoutMask mlp_drop = hidden_mask(L.mlp_dropout_site);
  TensorView dmlp = dres_;
  if (mlp_drop.active()) {
    dropout_backward(ctx_, branch_, dres_, mlp_drop);
    dmlp = branch_;
  }
  L.fc2.backward(ctx_, dfc_, dmlp, act_);  // dfc_ = d(activation output)
  TensorView dfc1 = dfc_;
  if (cfg_.gated_mlp()) {
    // d[gate | up] is twice as wide as dfc_; it overwrites fc1's output in place (the op allows dinp to
    // alias inp), which nothing reads after this point.
    const int64_t N = B_ * T_, F = cfg_.ffn_hidden_size();
    ops.glu_backward(a.fc.reshape({N, 2 * F}), a.fc.reshape({N, 2 * F}), dfc_.reshape({N, F}), glu_kind());
    dfc1 = a.fc;
  } else {
    ops.gelu_backward(dfc_, a.fc, dfc_);
  }
  L.fc1.backward(ctx_, dln_, dfc1, a.ln2);
  L.ln2.backward(ctx_, dres_, dln_, a.residual2, a.ln2_saved);
  // Attention branch: dres is now d(residual2) = d(x) through the skip connection.
  if (opts_.recompute_granularity == RecomputeGranularity::kSelective)
    L.attn.forward(ctx_, a.att, a.attn_saved, a.qkv, segment_ids, a.attn_saved.dropout);
  const DropoutMask proj_drop = hidden_mask(L.proj_dropout_site);
  TensorView dproj = dres_;
  if (proj_drop.active()) {
    dropout_backward(ctx_, branch_, dres_, proj_drop);
    dproj = branch_;
  }
  L.proj.backward(ctx_, datt_, dproj, a.att);
  L.attn.backward(ctx_, dqkv_, datt_, a.qkv, a.att, a.attn_saved, segment_ids);
  if (rope_) rope_->backward(ctx_, dqkv_, L.attn.params());
  if (L.qk_norm) L.qk_norm->backward(ctx_, dqkv_, a.qk_saved, qk_a_, qk_b_);
  L.qkv.backward(ctx_, dln_, dqkv_, a.ln1);
  L.ln1.backward(ctx_, dres_, dln_, layer_input(l), a.ln1_saved);
}

float GPTModel::forward(const GPTBatch& batch, float dloss_scale, const ForwardOptions& opts) {
  const TensorView tokens = batch.tokens, targets = batch.targets;
  for (const TensorView* t : {&batch.loss_mask, &batch.position_ids, &batch.segment_ids})
    LOOM_CHECK(!t->defined() || t->shape() == tokens.shape(), "[GPTModel] batch extras must be (B, T) like tokens ",
               tokens.desc(), ", got ", t->desc());
  LOOM_CHECK(tokens.ndim() == 2 && tokens.dtype() == DType::kI32, "[GPTModel] tokens must be i32 (B, T), got ",
             tokens.desc());
  LOOM_CHECK(targets.shape() == tokens.shape() && targets.dtype() == DType::kI32,
             "[GPTModel] targets must match tokens ", tokens.desc(), ", got ", targets.desc());
  LOOM_CHECK(opts.training || dloss_scale == 0.0f,
             "[GPTModel] an evaluation forward (training = false) cannot prepare backward; dloss_scale must be 0, got ",
             dloss_scale);
  const int64_t B = tokens.size(0), T = tokens.size(1);
  LOOM_CHECK(T <= cfg_.max_position_embeddings || cfg_.position_embedding_type == PositionEmbeddingType::kNone,
             "[GPTModel] sequence length ", T, " exceeds --max-position-embeddings ", cfg_.max_position_embeddings);
  backward_ready_ = false;
  ensure_buffers(B, T);
  fwd_ = opts;
  const OpTable& ops = ctx_.ops();

  embedding_->forward(ctx_, x0_, tokens, batch.position_ids);
  dropout_forward(ctx_, x0_, x0_, hidden_mask(embedding_dropout_site()));
  for (int64_t l = 0; l < cfg_.num_layers; ++l) forward_layer(l, batch.segment_ids);
  final_ln_->forward(ctx_, lnf_, lnf_saved_, layer_input(cfg_.num_layers));
  ops.matmul_forward(logits_, lnf_, output_weight().compute, TensorView());
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
  LOOM_CHECK(opts_.with_grads, "[GPTModel] backward() on a model built without gradients (ModelOptions::with_grads)");
  LOOM_CHECK(backward_ready_, "[GPTModel] backward() needs a preceding forward() with dloss_scale != 0");
  LOOM_CHECK(batch.tokens.ndim() == 2 && batch.tokens.size(0) == B_ && batch.tokens.size(1) == T_,
             "[GPTModel] backward() batch must be the forward's (", B_, ", ", T_, "), got ", batch.tokens.desc());
  backward_ready_ = false;
  const OpTable& ops = ctx_.ops();
  const int64_t N = B_ * T_;
  // Output layer: dlnf = dlogits · W; dW += dlogits^T · lnf (W: output_layer.weight, or the tied Wte).
  Parameter& w = output_weight();
  ops.matmul_backward(dln_, w.grad, TensorView(), logits_.reshape({N, cfg_.padded_vocab_size}), lnf_, w.compute);
  ops.fill_(dres_, 0.0f);
  final_ln_->backward(ctx_, dres_, dln_, layer_input(cfg_.num_layers), lnf_saved_);
  for (int64_t l = cfg_.num_layers; l-- > 0;) {
    const LayerRole& r = roles_[size_t(l)];
    // Entering a recomputed group from its top: re-run it from its kept input into the scratch slots.
    if (r.recomputed && l == r.group_end - 1)
      for (int64_t g = r.group_begin; g < r.group_end; ++g) forward_layer(g, batch.segment_ids);
    backward_layer(l, batch.segment_ids);
  }
  dropout_backward(ctx_, dres_, dres_, hidden_mask(embedding_dropout_site()));
  embedding_->backward(ctx_, dres_, batch.tokens, batch.position_ids);
}

}  // namespace loom

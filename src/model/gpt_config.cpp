// GPTConfig (sizes, parameter and FLOP counts, architecture validation), the recompute flag parsers and
// ModelOptions::validate: everything about a model's shape that needs no buffers.
#include <algorithm>
#include <cmath>

#include "loom/model/gpt.h"

namespace loom {

namespace {

const char* granularity_flag(RecomputeGranularity g) {
  switch (g) {
    case RecomputeGranularity::kNone: return "(unset)";
    case RecomputeGranularity::kSelective: return "selective";
    case RecomputeGranularity::kFull: return "full";
  }
  return "?";
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

int64_t GPTConfig::num_moe_layers() const {
  if (!is_moe()) return 0;
  int64_t n = 0;
  for (int64_t l = 0; l < num_layers; ++l) n += is_moe_layer(l) ? 1 : 0;
  return n;
}

namespace {

// One layer's parameters: norms and attention, and the dense MLP or, in a MoE layer, the router, the
// routed experts (`experts` of them: all for the total, top-k for the active count) and the shared experts.
int64_t layer_parameters(const GPTConfig& c, bool moe, int64_t experts) {
  const int64_t C = c.hidden_size, HS = c.head_dim(), NH = c.num_attention_heads, QKV = c.qkv_size();
  const int64_t norm = Norm::num_parameters(c.normalization, C);
  const int64_t attention = C * QKV + (c.qkv_bias() ? QKV : 0) + NH * HS * C + (c.add_bias_linear ? C : 0) +
                            (c.qk_layernorm ? 2 * Norm::num_parameters(c.normalization, HS) : 0);
  const int64_t gate = c.gated_mlp() ? 2 : 1;
  int64_t mlp = 0;
  if (!moe) {
    const int64_t F = c.ffn_hidden_size();
    mlp = C * gate * F + F * C + (c.add_bias_linear ? gate * F + C : 0);
  } else {
    const int64_t F = c.moe_ffn_hidden_size(), S = c.moe.shared_expert_intermediate_size;
    mlp = c.moe.num_experts * C + experts * (C * gate * F + F * C) + (C * gate * S + S * C) +
          (S > 0 && c.moe.shared_expert_gate ? C : 0);
  }
  return 2 * norm + attention + mlp;
}

}  // namespace

int64_t GPTConfig::num_parameters() const {
  const int64_t C = hidden_size, norm = Norm::num_parameters(normalization, C);
  const int64_t embeddings =
      padded_vocab_size * C +
      (position_embedding_type == PositionEmbeddingType::kLearnedAbsolute ? max_position_embeddings * C : 0);
  const int64_t output_layer = untie_embeddings_and_output_weights ? padded_vocab_size * C : 0;
  const int64_t moe_layers = num_moe_layers();
  return embeddings + (num_layers - moe_layers) * layer_parameters(*this, false, 0) +
         moe_layers * layer_parameters(*this, true, moe.num_experts) + norm + output_layer;
}

int64_t GPTConfig::num_active_parameters() const {
  const int64_t moe_layers = num_moe_layers();
  return num_parameters() - moe_layers * (layer_parameters(*this, true, moe.num_experts) -
                                          layer_parameters(*this, true, moe.router.topk));
}

double GPTConfig::attention_core_forward_flops(int64_t B, int64_t T) const {
  // Q·K^T and P·V: 2·T·HS multiply-adds per query and head each.
  return 4.0 * double(B) * double(T) * double(T) * double(num_attention_heads) * double(head_dim());
}

double GPTConfig::layer_forward_flops(int64_t B, int64_t T, int64_t layer) const {
  const double c = double(hidden_size), q = double(num_attention_heads * head_dim());
  const double gate = gated_mlp() ? 2.0 : 1.0;
  double mlp = 0;
  if (is_moe_layer(layer)) {
    // Megatron's num_floating_point_operations: the top-k routed experts and the shared experts per token
    // (the router's E·C GEMM is not counted).
    const double f = double(moe_ffn_hidden_size()), s = double(moe.shared_expert_intermediate_size);
    mlp = double(moe.router.topk) * (c * f * gate + f * c) + (c * s * gate + s * c);
  } else {
    const double f = double(ffn_hidden_size());
    mlp = c * f * gate + f * c;
  }
  const double weights = c * double(qkv_size()) + q * c + mlp;
  return 2.0 * double(B) * double(T) * weights + attention_core_forward_flops(B, T);
}

double GPTConfig::logits_forward_flops(int64_t B, int64_t T) const {
  return 2.0 * double(B) * double(T) * double(hidden_size) * double(padded_vocab_size);
}

double GPTConfig::flops_per_step(int64_t B, int64_t T) const {
  double layers = 0;
  for (int64_t l = 0; l < num_layers; ++l) layers += layer_forward_flops(B, T, l);
  return 3.0 * (layers + logits_forward_flops(B, T));
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
  validate_moe();
}

void GPTConfig::validate_moe() const {
  const MoeConfig& m = moe;
  if (m.num_experts < 0) user_error("--num-experts must be >= 1, got ", m.num_experts);
  if (m.num_experts == 0) {
    if (m.ffn_hidden_size != 0 || m.shared_expert_intermediate_size != 0 || m.shared_expert_gate ||
        !m.layer_pattern.empty())
      user_error("--moe-ffn-hidden-size, --moe-shared-expert-intermediate-size, --moe-shared-expert-gate and "
                 "--moe-layer-freq need --num-experts (a mixture-of-experts model)");
    return;
  }
  if (m.router.num_experts != m.num_experts)
    user_error("the router's expert count ", m.router.num_experts, " differs from --num-experts ", m.num_experts);
  m.router.validate();
  if (m.ffn_hidden_size < 0) user_error("--moe-ffn-hidden-size must be >= 1, got ", m.ffn_hidden_size);
  if (m.shared_expert_intermediate_size < 0)
    user_error("--moe-shared-expert-intermediate-size must be >= 1, got ", m.shared_expert_intermediate_size);
  if (m.shared_expert_gate && m.shared_expert_intermediate_size == 0)
    user_error("--moe-shared-expert-gate needs shared experts (--moe-shared-expert-intermediate-size)");
  if (!m.layer_pattern.empty()) {
    if (int64_t(m.layer_pattern.size()) != num_layers)
      user_error("--moe-layer-freq describes ", m.layer_pattern.size(), " layers but --num-layers is ", num_layers);
    if (num_moe_layers() == 0) user_error("--moe-layer-freq marks no layer as a MoE layer (1); drop --num-experts for a dense model");
  }
  if (activation != MlpActivation::kGeLU && activation != MlpActivation::kSwiGLU)
    user_error("--num-experts: experts run GeLU or SwiGLU (--swiglu), not ", mlp_activation_name(activation));
  if (add_bias_linear)
    user_error("--num-experts: Loom's experts run as grouped GEMMs without biases (as Megatron's grouped MLP); add "
               "--disable-bias-linear (and --add-qkv-bias for a qkv bias, as Qwen-MoE)");
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
  if (lora && lora->targets.empty())
    user_error("--lora-rank is set but --lora-target-modules names no linear layer to adapt");
  if (compute_dtype != DType::kF32 && compute_dtype != DType::kBF16 && compute_dtype != DType::kF16)
    user_error("the compute dtype must be f32, bf16 (--bf16) or f16 (--fp16), got ", dtype_name(compute_dtype));
  if (fp8) {
    if (compute_dtype == DType::kF32)
      user_error("--fp8-format needs 16-bit compute (--bf16 or --fp16): FP8 GEMMs read 16-bit activations and "
                 "weights, as in Transformer Engine");
    fp8->validate();
  }
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
    case RecomputeGranularity::kFull: {
      if (recompute_method == RecomputeMethod::kNone)
        user_error("--recompute-granularity full needs --recompute-method uniform or block");
      // Megatron counts recomputed layers per pipeline stage.
      const int64_t nl = std::max<int64_t>(parallel.layer_count(cfg.num_layers), 1);
      if (recompute_num_layers < 1 || recompute_num_layers > nl)
        user_error("--recompute-num-layers must be in [1, ", nl, "] (--num-layers",
                   nl == cfg.num_layers ? "" : " per pipeline stage", ") with --recompute-granularity ",
                   granularity_flag(recompute_granularity), ", got ", recompute_num_layers);
      break;
    }
  }
  if (activation_slots < 1) user_error("activation slots (pipeline micro-batches in flight) must be >= 1, got ",
                                       activation_slots);
  const ModelParallel& mp = parallel;
  const int64_t nl = mp.layer_count(cfg.num_layers);
  if (mp.first_layer < 0 || mp.first_layer > cfg.num_layers || nl < 0 || mp.first_layer + nl > cfg.num_layers)
    user_error("pipeline stage layers [", mp.first_layer, ", ", mp.first_layer + nl, ") are not within --num-layers ",
               cfg.num_layers, " (check --pipeline-model-parallel-size / --decoder-first-pipeline-num-layers)");
  const int tp = mp.tp_size();
  validate_tensor_parallel(cfg, tp, mp.sequence_parallel);
  if (cfg.padded_vocab_size % tp != 0)
    user_error("the padded vocabulary (", cfg.padded_vocab_size, ") must be divisible by --tensor-model-parallel-size (",
               tp, "); pad it to a multiple of --make-vocab-size-divisible-by x TP");
}

void validate_tensor_parallel(const GPTConfig& cfg, int tp, bool sequence_parallel) {
  if (sequence_parallel && tp == 1) user_error("--sequence-parallel needs --tensor-model-parallel-size > 1");
  if (tp == 1) return;
  const int64_t nkv = cfg.num_kv_heads(), f = cfg.ffn_hidden_size();
  if (cfg.num_attention_heads % tp != 0)
    user_error("--num-attention-heads (", cfg.num_attention_heads, ") must be divisible by --tensor-model-parallel-size (",
               tp, ")");
  if (nkv % tp != 0)
    user_error("--num-query-groups (", nkv, ") must be divisible by --tensor-model-parallel-size (", tp,
               "): each rank holds whole query groups");
  if (f % tp != 0) user_error("--ffn-hidden-size (", f, ") must be divisible by --tensor-model-parallel-size (", tp, ")");
}

}  // namespace loom

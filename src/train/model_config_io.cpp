// Model configurations in and out (see model_io.h): a Loom checkpoint's committed dir, metadata.json and
// model_config, and Hugging Face config.json to GPTConfig and back. The weights themselves are model_io.cpp's.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "loom/ckpt/checkpoint.h"
#include "loom/core/file_io.h"
#include "loom/train/model_io.h"
#include "train/checkpoint_format.h"
#include "train/model_io_impl.h"

namespace fs = std::filesystem;

namespace loom {

using nlohmann::json;

namespace {

double tidy(float x) { return model_io_detail::tidy_float(x); }

template <typename T>
T field(const json& j, const char* key, const std::string& file) {
  if (!j.contains(key)) user_error(file, ": model_config has no \"", key, "\"");
  try {
    return j.at(key).get<T>();
  } catch (const json::exception&) {
    user_error(file, ": model_config \"", key, "\" has the wrong type: ", j.at(key).dump());
  }
}

template <typename T>
T field_or(const json& j, const char* key, T dflt, const std::string& file) {
  return j.contains(key) ? field<T>(j, key, file) : dflt;
}

MlpActivation parse_activation(const std::string& s, const std::string& file) {
  for (MlpActivation a : {MlpActivation::kGeLU, MlpActivation::kSwiGLU, MlpActivation::kGeGLU, MlpActivation::kReGLU})
    if (s == mlp_activation_name(a)) return a;
  user_error(file, ": model_config activation '", s, "' is not one of gelu, swiglu, geglu, reglu");
}

int64_t round_up(int64_t v, int64_t multiple) {
  if (multiple < 1) user_error("--make-vocab-size-divisible-by must be >= 1, got ", multiple);
  return (v + multiple - 1) / multiple * multiple;
}

// Fixed by Megatron's --use-rope-scaling (and docs/models.md).
constexpr double kRopeLowFreqFactor = 1.0, kRopeHighFreqFactor = 4.0;
constexpr int64_t kRopeOriginalContext = 8192;

// The mixture-of-experts fields of model_config (checkpoint_format.h); absent: a dense model (checkpoints
// written before Loom had MoE).
void read_moe_fields(const json& j, const std::string& file, GPTConfig& c) {
  const int64_t E = field_or<int64_t>(j, "num_experts", 0, file);
  if (E == 0) return;
  MoeConfig& m = c.moe;
  m.num_experts = m.router.num_experts = E;
  m.ffn_hidden_size = field_or<int64_t>(j, "moe_ffn_hidden_size", 0, file);
  m.router.topk = field_or<int64_t>(j, "moe_router_topk", m.router.topk, file);
  m.shared_expert_intermediate_size = field_or<int64_t>(j, "moe_shared_expert_intermediate_size", 0, file);
  m.shared_expert_gate = field_or<bool>(j, "moe_shared_expert_gate", false, file);
  if (j.contains("moe_layer_pattern") && !j.at("moe_layer_pattern").is_null())
    m.layer_pattern = field<std::vector<int>>(j, "moe_layer_pattern", file);
  for (int v : m.layer_pattern)
    if (v != 0 && v != 1) user_error(file, ": model_config moe_layer_pattern must hold 0 (dense) or 1 (MoE), got ", v);
  const std::string score = field_or<std::string>(j, "moe_router_score_function", "softmax", file);
  if (score != "softmax" && score != "sigmoid")
    user_error(file, ": model_config moe_router_score_function '", score, "' is not softmax or sigmoid");
  m.router.score_function = parse_moe_score_function(score);
  m.router.pre_softmax = field_or<bool>(j, "moe_router_pre_softmax", false, file);
  m.router.topk_scaling_factor = field_or<double>(j, "moe_router_topk_scaling_factor", 0.0, file);
  m.router.enable_expert_bias = field_or<bool>(j, "moe_router_enable_expert_bias", false, file);
  // Sinkhorn routes differently at inference too (top-k of its activation); the other types do not matter
  // there. Checkpoints before this field: Megatron's default.
  m.router.load_balancing =
      parse_moe_load_balancing(field_or<std::string>(j, "moe_router_load_balancing_type", "aux_loss", file));
  m.router.aux_loss_coeff = field_or<double>(j, "moe_aux_loss_coeff", 0.0, file);
}

// The sparse MoE block of mixtral / qwen2_moe / qwen3_moe: loom/model/hf_mapping.h has the routing each
// setting reproduces (norm_topk_prob true: softmax over the top-k logits; false: --moe-router-pre-softmax).
void moe_config_from_hf(const HfConfig& hf, const std::string& where, GPTConfig& c) {
  if (hf.num_experts_per_tok == 1 && hf.norm_topk_prob)
    user_error(where, ": num_experts_per_tok 1 with renormalised top-k probabilities (norm_topk_prob true, or "
               "mixtral) gives every token probability 1; Loom's softmax router, as Megatron's, builds top-1 only "
               "with --moe-router-pre-softmax (norm_topk_prob false)");
  MoeConfig& m = c.moe;
  m.num_experts = m.router.num_experts = hf.num_experts;
  m.ffn_hidden_size = hf.moe_intermediate_size;
  m.router.topk = hf.num_experts_per_tok;
  m.router.pre_softmax = !hf.norm_topk_prob;
  m.router.aux_loss_coeff = hf.router_aux_loss_coef;
  m.shared_expert_intermediate_size = hf.shared_expert_intermediate_size;
  m.shared_expert_gate = hf.shared_expert_intermediate_size > 0;  // Qwen2-MoE's shared expert is always gated
  m.layer_pattern = hf.moe_layers;
}

// config.json's MoE keys (hf_model_type() mixtral, qwen2_moe or qwen3_moe), HF's defaults written out.
void moe_config_json(const GPTConfig& cfg, HfFamily family, json& j) {
  const MoeConfig& m = cfg.moe;
  j["num_experts_per_tok"] = m.router.topk;
  j["router_aux_loss_coef"] = tidy(float(m.router.aux_loss_coeff));
  j["output_router_logits"] = false;
  if (family == HfFamily::kMixtral) {
    j["num_local_experts"] = m.num_experts;
    j["intermediate_size"] = cfg.moe_ffn_hidden_size();  // every layer is a MoE layer
    j["router_jitter_noise"] = 0.0;
    j["sliding_window"] = cfg.window_size_left >= 0 ? json(cfg.window_size_left + 1) : json(nullptr);
    return;
  }
  j["num_experts"] = m.num_experts;
  j["moe_intermediate_size"] = cfg.moe_ffn_hidden_size();
  j["norm_topk_prob"] = !m.router.pre_softmax;
  j["decoder_sparse_step"] = 1;
  j["mlp_only_layers"] = json::array();
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    if (!cfg.is_moe_layer(l)) j["mlp_only_layers"].push_back(l);
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  j["max_window_layers"] = cfg.num_layers;
  if (family == HfFamily::kQwen2Moe) {
    j["shared_expert_intermediate_size"] = m.shared_expert_intermediate_size;
    j["qkv_bias"] = true;  // hf_family_for: shared experts come with --add-qkv-bias
  } else {
    j["attention_bias"] = cfg.qkv_bias();
  }
}

}  // namespace

namespace model_io_detail {

GPTConfig model_config_from_json(const json& j, const std::string& file) {
  if (!j.is_object()) user_error(file, ": model_config is not an object");
  GPTConfig c;
  c.num_layers = field<int64_t>(j, "num_layers", file);
  c.hidden_size = field<int64_t>(j, "hidden_size", file);
  c.num_attention_heads = field<int64_t>(j, "num_attention_heads", file);
  c.max_position_embeddings = field<int64_t>(j, "max_position_embeddings", file);
  c.vocab_size = field<int64_t>(j, "vocab_size", file);
  c.padded_vocab_size = field<int64_t>(j, "padded_vocab_size", file);
  c.ffn_hidden = field<int64_t>(j, "ffn_hidden_size", file);
  c.layernorm_epsilon = field_or<float>(j, "layernorm_epsilon", c.layernorm_epsilon, file);
  c.init_method_std = field_or<float>(j, "init_method_std", c.init_method_std, file);
  c.hidden_dropout = field_or<float>(j, "hidden_dropout", 0.0f, file);
  c.attention_dropout = field_or<float>(j, "attention_dropout", 0.0f, file);
  if (j.contains("normalization")) c.normalization = parse_norm_kind(field<std::string>(j, "normalization", file));
  if (j.contains("activation")) c.activation = parse_activation(field<std::string>(j, "activation", file), file);
  c.kv_channels = field_or<int64_t>(j, "kv_channels", 0, file);
  const int64_t groups = field_or<int64_t>(j, "num_query_groups", c.num_attention_heads, file);
  c.group_query_attention = groups != c.num_attention_heads;
  c.num_query_groups = c.group_query_attention ? groups : 1;
  c.add_bias_linear = field_or<bool>(j, "add_bias_linear", c.add_bias_linear, file);
  c.add_qkv_bias = field_or<bool>(j, "add_qkv_bias", c.add_qkv_bias, file);
  c.untie_embeddings_and_output_weights =
      field_or<bool>(j, "untie_embeddings_and_output_weights", c.untie_embeddings_and_output_weights, file);
  if (j.contains("position_embedding_type"))
    c.position_embedding_type = parse_position_embedding_type(field<std::string>(j, "position_embedding_type", file));
  c.rotary_base = field_or<double>(j, "rotary_base", c.rotary_base, file);
  c.rotary_percent = field_or<float>(j, "rotary_percent", c.rotary_percent, file);
  c.rotary_interleaved = field_or<bool>(j, "rotary_interleaved", c.rotary_interleaved, file);
  c.use_rope_scaling = field_or<bool>(j, "use_rope_scaling", c.use_rope_scaling, file);
  c.rope_scaling_factor = field_or<float>(j, "rope_scaling_factor", c.rope_scaling_factor, file);
  if (j.contains("window_size") && !j.at("window_size").is_null()) {
    const auto w = field<std::vector<int64_t>>(j, "window_size", file);
    if (w.size() != 2 || w[1] != 0) user_error(file, ": model_config window_size must be null or [L, 0], got ", j.at("window_size").dump());
    c.window_size_left = w[0];
  }
  c.qk_layernorm = field_or<bool>(j, "qk_layernorm", c.qk_layernorm, file);
  read_moe_fields(j, file, c);
  c.validate();
  return c;
}

// The committed dir of a Loom checkpoint: `dir` itself when it holds metadata.json (an iter_* dir), else
// the one its tracker names.
double tidy_float(float x) {
  char buf[32];
  for (int digits = 6; digits <= 9; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, double(x));
    if (std::strtof(buf, nullptr) == x) break;
  }
  return std::strtod(buf, nullptr);
}

std::string loom_checkpoint_dir(const std::string& dir) {
  if (fs::is_regular_file(fs::path(dir) / "metadata.json")) return dir;
  const std::optional<LatestCheckpoint> latest = read_latest_checkpoint(dir);
  if (!latest)
    user_error("'", dir, "' is neither a Hugging Face model directory (config.json + model.safetensors) nor a Loom "
               "checkpoint (", checkpoint_tracker_path(dir), " or metadata.json)");
  return latest->dir;
}

json read_loom_metadata(const std::string& ckpt_dir) {
  const std::string path = ckpt_dir + "/metadata.json";
  const json meta = read_json_file(path, "checkpoint metadata");
  if (!meta.is_object() || !meta.contains("format") || meta["format"] != kLoomFormat)
    user_error(path, " is not a Loom checkpoint (format ", meta.is_object() && meta.contains("format") ? meta["format"].dump() : "missing", ")");
  // The trainer refuses a newer format on resume; generate and convert must not misread one either.
  if (meta.contains("format_version") &&
      (!meta["format_version"].is_number_integer() || meta["format_version"].get<int64_t>() > kLoomFormatVersion))
    user_error(path, " has format_version ", meta["format_version"].dump(), "; this Loom reads up to ",
               kLoomFormatVersion);
  if (!meta.contains("model_config")) user_error(path, " has no \"model_config\"");
  return meta;
}

const char* torch_dtype_name(DType dt) {
  switch (dt) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    default: user_error("HF export dtype must be f32, bf16 or f16, got ", dtype_name(dt));
  }
}

}  // namespace model_io_detail

using model_io_detail::loom_checkpoint_dir;
using model_io_detail::model_config_from_json;
using model_io_detail::read_loom_metadata;
using model_io_detail::torch_dtype_name;

bool is_hf_model_dir(const std::string& dir) {
  const fs::path d(dir);
  std::error_code ec;
  return fs::is_regular_file(d / "config.json", ec) &&
         (fs::is_regular_file(d / "model.safetensors", ec) || fs::is_regular_file(d / "model.safetensors.index.json", ec));
}

GPTConfig gpt_config_from_hf(const HfConfig& hf, int64_t divisible_by) {
  const std::string where = "config.json (model_type " + hf.model_type + ")";
  GPTConfig c;
  c.num_layers = hf.num_hidden_layers;
  c.hidden_size = hf.hidden_size;
  c.num_attention_heads = hf.num_attention_heads;
  c.max_position_embeddings = hf.max_position_embeddings;
  c.vocab_size = hf.vocab_size;
  c.padded_vocab_size = round_up(hf.vocab_size, divisible_by);
  c.ffn_hidden = hf.intermediate_size;
  c.layernorm_epsilon = float(hf.norm_eps);
  c.hidden_dropout = c.attention_dropout = 0.0f;
  c.untie_embeddings_and_output_weights = !hf.tie_word_embeddings;
  if (hf.is_gpt2()) {
    if (hf.activation != "gelu_new" && hf.activation != "gelu_pytorch_tanh")
      user_error(where, ": activation_function '", hf.activation,
                 "' is not supported; Loom's GeLU is the tanh approximation (gelu_new, gelu_pytorch_tanh)");
    c.normalization = NormKind::kLayerNorm;
    c.activation = MlpActivation::kGeLU;
    c.position_embedding_type = PositionEmbeddingType::kLearnedAbsolute;
    c.add_bias_linear = true;
  } else {
    c.normalization = NormKind::kRMSNorm;
    if (hf.activation == "silu" || hf.activation == "swish") c.activation = MlpActivation::kSwiGLU;
    else if (hf.activation == "gelu_pytorch_tanh" || hf.activation == "gelu_new") c.activation = MlpActivation::kGeGLU;
    else if (hf.activation == "relu") c.activation = MlpActivation::kReGLU;
    else
      user_error(where, ": hidden_act '", hf.activation,
                 "' is not supported (supported: silu -> SwiGLU, gelu_pytorch_tanh / gelu_new -> GeGLU, relu -> ReGLU)");
    c.kv_channels = hf.head_dim;
    c.group_query_attention = hf.num_key_value_heads != hf.num_attention_heads;
    c.num_query_groups = c.group_query_attention ? hf.num_key_value_heads : 1;
    if (hf.attention_bias && hf.mlp_bias) {
      c.add_bias_linear = true;
    } else if (hf.attention_bias) {
      c.add_bias_linear = false;
      c.add_qkv_bias = true;
    } else if (hf.mlp_bias) {
      user_error(where, ": mlp_bias = true with attention_bias = false has no Loom equivalent (linear biases are all "
                 "on, all off, or on q/k/v only)");
    } else {
      c.add_bias_linear = false;
    }
    c.position_embedding_type = PositionEmbeddingType::kRope;
    c.rotary_base = hf.rope_theta;
    if (hf.rope_scaling) {
      const HfRopeScaling& r = *hf.rope_scaling;
      if (r.low_freq_factor != kRopeLowFreqFactor || r.high_freq_factor != kRopeHighFreqFactor ||
          r.original_max_position_embeddings != kRopeOriginalContext)
        user_error(where, ": rope_scaling (llama3) with low_freq_factor ", r.low_freq_factor, ", high_freq_factor ",
                   r.high_freq_factor, ", original_max_position_embeddings ", r.original_max_position_embeddings,
                   " is not supported; --use-rope-scaling fixes them at ", kRopeLowFreqFactor, ", ", kRopeHighFreqFactor,
                   ", ", kRopeOriginalContext, " (Megatron's values)");
      c.use_rope_scaling = true;
      c.rope_scaling_factor = float(r.factor);
    }
    if (hf.sliding_window) c.window_size_left = *hf.sliding_window - 1;  // HF: keys j > i - W
    if (hf.qkv_bias) c.add_qkv_bias = true;  // qwen2_moe: q/k/v biases, none on o_proj
    c.qk_layernorm = hf.qk_norm;            // qwen3_moe: RMSNorm per head (the model's norm and epsilon)
    if (hf.is_moe()) moe_config_from_hf(hf, where, c);
  }
  try {
    c.validate();
  } catch (const UserError& e) {
    user_error(where, " describes a model Loom cannot build: ", e.what());
  }
  return c;
}

GPTConfig read_model_config(const std::string& dir, int64_t divisible_by) {
  if (is_hf_model_dir(dir)) {
    const std::string path = (fs::path(dir) / "config.json").string();
    return gpt_config_from_hf(parse_hf_config(read_file(path, "HF config"), path), divisible_by);
  }
  const std::string ck = loom_checkpoint_dir(dir);
  const json meta = read_loom_metadata(ck);
  return model_config_from_json(meta["model_config"], ck + "/metadata.json");
}

std::string hf_config_json(const GPTConfig& cfg, const HfExportOptions& opts) {
  const HfFamily family = hf_family_for(cfg);
  json j;
  j["vocab_size"] = cfg.vocab_size;
  j["initializer_range"] = tidy(cfg.init_method_std);
  j["tie_word_embeddings"] = !cfg.untie_embeddings_and_output_weights;
  j["torch_dtype"] = torch_dtype_name(opts.dtype);
  j["use_cache"] = true;
  if (opts.bos_token_id) j["bos_token_id"] = *opts.bos_token_id;
  if (opts.eos_token_ids.size() == 1) j["eos_token_id"] = opts.eos_token_ids.front();
  if (opts.eos_token_ids.size() > 1) j["eos_token_id"] = opts.eos_token_ids;
  if (family == HfFamily::kGPT2) {
    j["architectures"] = json::array({"GPT2LMHeadModel"});
    j["model_type"] = "gpt2";
    j["n_positions"] = cfg.max_position_embeddings;
    j["n_ctx"] = cfg.max_position_embeddings;
    j["n_embd"] = cfg.hidden_size;
    j["n_layer"] = cfg.num_layers;
    j["n_head"] = cfg.num_attention_heads;
    j["n_inner"] = cfg.ffn_hidden_size() == 4 * cfg.hidden_size ? json(nullptr) : json(cfg.ffn_hidden_size());
    j["activation_function"] = "gelu_new";
    j["layer_norm_epsilon"] = tidy(cfg.layernorm_epsilon);
    j["resid_pdrop"] = j["embd_pdrop"] = tidy(cfg.hidden_dropout);
    j["attn_pdrop"] = tidy(cfg.attention_dropout);
    j["scale_attn_weights"] = true;
  } else {
    const std::string type = hf_model_type(cfg);
    const bool mistral = type == "mistral";
    if (mistral && cfg.qkv_bias())
      user_error("a model with --window-size converts to Hugging Face Mistral, which has no linear biases; drop "
                 "the window or the biases");
    const char* arch = mistral ? "MistralForCausalLM"
                       : type == "llama" ? "LlamaForCausalLM"
                       : type == "mixtral" ? "MixtralForCausalLM"
                       : type == "qwen2_moe" ? "Qwen2MoeForCausalLM"
                                             : "Qwen3MoeForCausalLM";
    j["architectures"] = json::array({arch});
    j["model_type"] = type;
    j["hidden_size"] = cfg.hidden_size;
    j["intermediate_size"] = cfg.ffn_hidden_size();
    j["num_hidden_layers"] = cfg.num_layers;
    j["num_attention_heads"] = cfg.num_attention_heads;
    j["num_key_value_heads"] = cfg.num_kv_heads();
    j["head_dim"] = cfg.head_dim();
    j["max_position_embeddings"] = cfg.max_position_embeddings;
    j["rms_norm_eps"] = tidy(cfg.layernorm_epsilon);
    j["hidden_act"] = cfg.activation == MlpActivation::kSwiGLU   ? "silu"
                      : cfg.activation == MlpActivation::kGeGLU ? "gelu_pytorch_tanh"
                                                                : "relu";
    j["rope_theta"] = cfg.rotary_base;
    j["rope_scaling"] = nullptr;
    if (cfg.use_rope_scaling)
      j["rope_scaling"] = {{"rope_type", "llama3"},
                           {"factor", tidy(cfg.rope_scaling_factor)},
                           {"low_freq_factor", kRopeLowFreqFactor},
                           {"high_freq_factor", kRopeHighFreqFactor},
                           {"original_max_position_embeddings", kRopeOriginalContext}};
    j["attention_dropout"] = tidy(cfg.attention_dropout);
    if (family != HfFamily::kLlama) {
      moe_config_json(cfg, family, j);
    } else if (mistral) {
      j["sliding_window"] = cfg.window_size_left + 1;
    } else {
      j["attention_bias"] = cfg.qkv_bias();
      j["mlp_bias"] = cfg.add_bias_linear;
    }
  }
  return j.dump(2) + "\n";
}

std::string hf_model_type(const GPTConfig& cfg) {
  const HfFamily family = hf_family_for(cfg);
  if (family == HfFamily::kLlama) return cfg.window_size_left >= 0 ? "mistral" : "llama";
  return hf_family_name(family);
}

}  // namespace loom

// Model weights in and out: Loom checkpoints and Hugging Face directories (see model_io.h). Import checks
// everything (names, shapes, tied copies, implied-zero biases) before it writes a single parameter; all
// layout work is model/hf_mapping.h's exact row gathers.
#include "loom/train/model_io.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "loom/ckpt/checkpoint.h"
#include "loom/ckpt/sharded.h"
#include "loom/core/file_io.h"
#include "train/checkpoint_format.h"
#include "train/training_run.h"

namespace fs = std::filesystem;

namespace loom {

namespace {

using nlohmann::json;

// The trainer's metadata.json format (trainer_checkpoint.cpp writes and reads the same keys).
constexpr const char* kLoomFormat = kCheckpointFormat;
constexpr int kLoomFormatVersion = kCheckpointFormatVersion;
constexpr const char* kWordEmbedding = "embedding.word_embeddings.weight";

// A float printed with the fewest digits that read back as the same float (1e-06, not 9.99999997e-07).
double tidy(float x) {
  char buf[32];
  for (int digits = 6; digits <= 9; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, double(x));
    if (std::strtof(buf, nullptr) == x) break;
  }
  return std::strtod(buf, nullptr);
}



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


// Checkpoints written before the architecture fields existed are GPT-2: a missing field keeps the default.
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
  c.validate();
  return c;
}

// The committed dir of a Loom checkpoint: `dir` itself when it holds metadata.json (an iter_* dir), else
// the one its tracker names.
std::string loom_checkpoint_dir(const std::string& dir) {
  if (fs::is_regular_file(fs::path(dir) / "metadata.json")) return dir;
  const std::optional<LatestCheckpoint> latest = read_latest_checkpoint(dir);
  if (!latest)
    user_error("'", dir, "' is neither a Hugging Face model directory (config.json + model.safetensors) nor a Loom "
               "checkpoint (", checkpoint_tracker_path(dir), " or metadata.json)");
  return latest->dir;
}

using LoomTensors = std::vector<std::pair<std::string, Tensor>>;

// The model weights of a Loom checkpoint (any layout, either format) as whole f32 tensors: every tensor
// but the optimizer state and the FP8 scaling state.
LoomTensors read_checkpoint_weights(const ShardedCheckpoint& ck) {
  LoomTensors out;
  const auto ends_with = [](const std::string& s, const std::string& x) {
    return s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  for (const std::string& name : ck.tensor_names())
    if (name.rfind("optimizer.", 0) != 0 && !ends_with(name, ".fp8_state"))
      out.emplace_back(name, ck.read_full(name, DType::kF32));
  return out;
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

int64_t round_up(int64_t v, int64_t multiple) {
  if (multiple < 1) user_error("--make-vocab-size-divisible-by must be >= 1, got ", multiple);
  return (v + multiple - 1) / multiple * multiple;
}

// The HF name prefix this directory uses: transformers' default, or none (the Hub's gpt2 files).
std::string detect_prefix(const HfCheckpoint& hf, HfFamily family) {
  const std::string emb = family == HfFamily::kGPT2 ? "wte.weight" : "embed_tokens.weight";
  const std::string dflt = hf_default_prefix(family);
  if (!hf.contains(dflt + emb) && hf.contains(emb)) return "";
  return dflt;
}

void check_hf_shape(const HfCheckpoint& hf, const std::string& name, const Shape& want, const std::string& purpose) {
  const SafetensorsInfo& info = hf.info(name);
  if (info.shape != want)
    user_error("HF tensor '", name, "' in ", hf.dir(), " has shape ", info.shape.str(), " but ", purpose, " needs ",
               want.str(), " (from config.json)");
  const bool is_float = info.dtype ? dtype_is_float(*info.dtype) : info.dtype_str == "F64";
  if (!is_float)
    user_error("HF tensor '", name, "' in ", hf.dir(), " has dtype ", info.dtype_str, "; weights must be F32, BF16, F16 or F64");
}


// Every check first, then the reads: the Loom parameters of `cfg` (f32, host) in GPTModel's order.
LoomTensors import_hf(const HfCheckpoint& hf, const GPTConfig& cfg, std::ostream* log) {
  const HfFamily family = hf_family_for(cfg);
  const std::string prefix = detect_prefix(hf, family);
  const HfLayout layout = hf_layout(cfg, prefix);
  std::set<std::string> known;
  for (const HfParamMap& m : layout.params)
    for (const HfPart& p : m.parts) known.insert(p.name);
  for (const HfAlias& a : layout.aliases) known.insert(a.name);
  for (const HfPart& z : layout.zero_tensors) known.insert(z.name);
  std::vector<std::string> skipped;
  for (const std::string& name : hf.names()) {
    if (known.count(name)) continue;
    if (hf_is_buffer(name)) {
      skipped.push_back(name);
      continue;
    }
    user_error("HF tensor '", name, "' in ", hf.dir(), " maps to no Loom parameter of this ", hf.config().model_type,
               " model (config.json: ", cfg.num_layers, " layers", cfg.untie_embeddings_and_output_weights ? "" : ", tied lm_head",
               cfg.qkv_bias() ? "" : ", no attention bias", cfg.add_bias_linear ? "" : ", no MLP bias",
               "; names are expected under '", prefix, "')");
  }
  for (const HfParamMap& m : layout.params)
    for (const HfPart& p : m.parts) {
      if (!hf.contains(p.name))
        user_error("HF directory ", hf.dir(), " has no tensor '", p.name, "', needed for Loom parameter '", m.loom_name,
                   "'");
      check_hf_shape(hf, p.name, p.shape, "Loom parameter '" + m.loom_name + "'");
    }
  for (const HfAlias& a : layout.aliases)
    if (hf.contains(a.name)) check_hf_shape(hf, a.name, hf.info(a.same_as).shape, "a tied copy of '" + a.same_as + "'");
  for (const HfPart& z : layout.zero_tensors)
    if (hf.contains(z.name)) check_hf_shape(hf, z.name, z.shape, "an all-zero bias");

  for (const HfAlias& a : layout.aliases) {
    if (!hf.contains(a.name)) continue;
    const Tensor x = hf.read(a.name, DType::kF32), y = hf.read(a.same_as, DType::kF32);
    if (std::memcmp(x.raw(), y.raw(), size_t(x.nbytes())) != 0)
      user_error("HF tensor '", a.name, "' in ", hf.dir(), " differs from '", a.same_as,
                 "' but config.json has tie_word_embeddings = true; set it to false to load a separate output layer");
  }
  for (const HfPart& z : layout.zero_tensors) {
    if (!hf.contains(z.name)) continue;
    const Tensor t = hf.read(z.name, DType::kF32);
    const float* v = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i)
      if (v[i] != 0.0f)
        user_error("HF tensor '", z.name, "' in ", hf.dir(), " is not zero, but a Loom model with q/k/v biases only "
                   "(--add-qkv-bias --disable-bias-linear) has no output projection bias; with mlp_bias = true as well "
                   "the model converts with every linear bias");
  }

  LoomTensors out;
  for (const HfParamMap& m : layout.params) {
    std::vector<Tensor> parts;
    std::vector<TensorView> views;
    for (const HfPart& p : m.parts) {
      parts.push_back(hf.read(p.name, DType::kF32));
      views.push_back(parts.back());
    }
    Tensor t = Tensor::empty(m.loom_shape, DType::kF32);
    hf_to_loom(m, views, t);
    out.emplace_back(m.loom_name, std::move(t));
  }
  if (log) {
    *log << "mapping " << hf.config().model_type << " tensors of " << hf.dir() << " to Loom parameters:\n";
    for (const std::string& line : hf_mapping_summary(layout)) *log << "  " << line << "\n";
    if (!skipped.empty())
      *log << "  skipped " << skipped.size() << " non-parameter buffers (" << skipped.front()
           << (skipped.size() > 1 ? ", ..." : "") << ")\n";
  }
  return out;
}

Tensor cast_from_f32(TensorView x, DType dt) {
  if (dt == DType::kF32) {
    Tensor t = Tensor::empty(x.shape(), dt);
    std::memcpy(t.raw(), x.raw(), size_t(x.nbytes()));
    return t;
  }
  LOOM_CHECK(dt == DType::kBF16 || dt == DType::kF16, "[export_hf] unsupported dtype ", dtype_name(dt));
  Tensor t = Tensor::empty(x.shape(), dt);
  const float* s = x.data<float>();
  uint16_t* d = t.data<uint16_t>();
  for (int64_t i = 0; i < x.numel(); ++i) d[i] = dt == DType::kBF16 ? f32_to_bf16(s[i]) : f32_to_f16(s[i]);
  return t;
}

// Writes the HF directory from Loom parameters given by name (f32, host).
void export_tensors(const std::map<std::string, TensorView>& loom, const GPTConfig& cfg, const std::string& out_dir,
                    const HfExportOptions& opts, const std::string& source) {
  const HfLayout layout = hf_layout(cfg);
  std::set<std::string> mapped;
  for (const HfParamMap& m : layout.params) {
    const auto it = loom.find(m.loom_name);
    if (it == loom.end()) user_error(source, " has no parameter '", m.loom_name, "' that its model_config implies");
    if (it->second.shape() != m.loom_shape)
      user_error(source, ": parameter '", m.loom_name, "' has shape ", it->second.shape().str(), " but its model_config implies ",
                 m.loom_shape.str());
    mapped.insert(m.loom_name);
  }
  for (const auto& [name, view] : loom)
    if (!mapped.count(name)) user_error(source, " holds '", name, "', which no ", hf_family_name(layout.family), " tensor takes");
  const std::string config = hf_config_json(cfg, opts);
  std::vector<Tensor> keep;
  NamedTensors out;
  for (const HfParamMap& m : layout.params) {
    const std::vector<Tensor> parts = loom_to_hf(m, loom.at(m.loom_name));
    for (size_t p = 0; p < parts.size(); ++p) {
      keep.push_back(cast_from_f32(parts[p], opts.dtype));
      out.emplace_back(m.parts[p].name, keep.back());
    }
  }
  for (const HfPart& z : layout.zero_tensors) {
    keep.push_back(Tensor::zeros(z.shape, opts.dtype));
    out.emplace_back(z.name, keep.back());
  }
  if (opts.log) {
    *opts.log << "mapping Loom parameters to " << hf_family_name(layout.family) << " tensors:\n";
    for (const std::string& line : hf_mapping_summary(layout, /*to_hf=*/true)) *opts.log << "  " << line << "\n";
  }
  write_hf_dir(out_dir, config, out, opts.max_shard_bytes);
}

const char* torch_dtype_name(DType dt) {
  switch (dt) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    default: user_error("HF export dtype must be f32, bf16 or f16, got ", dtype_name(dt));
  }
}

// Fixed by Megatron's --use-rope-scaling (and docs/models.md).
constexpr double kRopeLowFreqFactor = 1.0, kRopeHighFreqFactor = 4.0;
constexpr int64_t kRopeOriginalContext = 8192;

}  // namespace

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
    const bool mistral = cfg.window_size_left >= 0;
    if (mistral && cfg.qkv_bias())
      user_error("a model with --window-size converts to Hugging Face Mistral, which has no linear biases; drop "
                 "the window or the biases");
    j["architectures"] = json::array({mistral ? "MistralForCausalLM" : "LlamaForCausalLM"});
    j["model_type"] = mistral ? "mistral" : "llama";
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
    if (mistral) {
      j["sliding_window"] = cfg.window_size_left + 1;
    } else {
      j["attention_bias"] = cfg.qkv_bias();
      j["mlp_bias"] = cfg.add_bias_linear;
    }
  }
  return j.dump(2) + "\n";
}

void load_model_weights(const std::string& dir, ParameterSet& params, const HfImportOptions& opts) {
  LoomTensors values;
  std::string source;
  if (is_hf_model_dir(dir)) {
    const HfCheckpoint hf = HfCheckpoint::open(dir);
    GPTConfig cfg = gpt_config_from_hf(hf.config(), 1);
    const Parameter* wte = params.find(kWordEmbedding);
    if (!wte) user_error("the model has no ", kWordEmbedding, "; cannot load HF directory ", dir);
    if (wte->shape[0] < cfg.vocab_size)
      user_error("HF directory ", dir, " has a vocabulary of ", cfg.vocab_size, " tokens but the model's embedding has ",
                 wte->shape[0], " rows");
    cfg.padded_vocab_size = wte->shape[0];
    if (opts.rotary_interleaved) {
      if (cfg.position_embedding_type != PositionEmbeddingType::kRope)
        user_error("--rotary-interleaved needs a RoPE model; HF directory ", dir, " holds ", hf.config().model_type);
      cfg.rotary_interleaved = true;
    }
    values = import_hf(hf, cfg, opts.log);
    source = "HF directory " + dir;
  } else {
    const std::string ck = loom_checkpoint_dir(dir);
    values = read_checkpoint_weights(ShardedCheckpoint::open(ck));
    source = "checkpoint " + ck;
  }
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : values) by_name[name] = &t;
  for (const Parameter& p : params.all()) {
    const auto it = by_name.find(p.name);
    if (it == by_name.end())
      user_error(source, " has no weights for the model's parameter '", p.name,
                 "': the model's architecture differs from the one it holds");
    if (it->second->shape() != p.shape)
      user_error(source, ": parameter '", p.name, "' is ", it->second->shape().str(), " there but ", p.shape.str(),
                 " in the model");
  }
  if (by_name.size() != params.all().size())
    for (const auto& [name, t] : values)
      if (!params.find(name))
        user_error(source, " holds '", name, "', which the model does not have: the architectures differ");
  for (Parameter& p : params.all()) {
    const Tensor& src = *by_name.at(p.name);
    if (p.value.device().is_cpu()) {
      std::memcpy(p.value.raw(), src.raw(), size_t(src.nbytes()));
    } else {
      LOOM_CHECK(opts.ctx, "[load_model_weights] parameters on ", p.value.device().str(), " need HfImportOptions::ctx");
      opts.ctx->copy(p.value, src);
    }
  }
}

void export_hf(const ParameterSet& params, const GPTConfig& cfg, const std::string& out_dir, const HfExportOptions& opts) {
  std::vector<Tensor> host;
  std::map<std::string, TensorView> loom;
  for (const Parameter& p : params.all()) {
    if (p.value.device().is_cpu()) {
      loom[p.name] = p.value;
    } else {
      LOOM_CHECK(opts.ctx, "[export_hf] parameters on ", p.value.device().str(), " need HfExportOptions::ctx");
      host.push_back(Tensor::empty(p.shape, DType::kF32));
      opts.ctx->copy(host.back(), p.value);
      loom[p.name] = host.back();
    }
  }
  if (opts.ctx) opts.ctx->synchronize();
  export_tensors(loom, cfg, out_dir, opts, "the model");
}

void convert_hf_to_loom(const std::string& hf_dir, const std::string& loom_root, const HfToLoomOptions& opts,
                        std::ostream& log) {
  std::error_code ec;
  if (fs::exists(loom_root, ec) && !(fs::is_directory(loom_root, ec) && fs::is_empty(loom_root, ec)))
    user_error("--to loom:", loom_root, " already exists and is not an empty directory; choose a new one");
  const HfCheckpoint hf = HfCheckpoint::open(hf_dir);
  GPTConfig cfg = gpt_config_from_hf(hf.config(), opts.make_vocab_size_divisible_by);
  if (opts.rotary_interleaved) {
    if (cfg.position_embedding_type != PositionEmbeddingType::kRope)
      user_error("--rotary-interleaved needs a RoPE model; ", hf_dir, " holds ", hf.config().model_type);
    cfg.rotary_interleaved = true;
  }
  log << "converting Hugging Face " << hf.config().model_type << " model " << hf_dir << " ("
      << hf.names().size() << " tensors, " << hf.total_bytes() << " bytes" << (hf.sharded() ? ", sharded" : "")
      << ") to a Loom checkpoint in " << loom_root << "\n";
  const LoomTensors values = import_hf(hf, cfg, &log);
  int64_t numel = 0;
  std::vector<TensorPiece> pieces;  // the sharded format of a world of one: each tensor one whole piece
  for (const auto& [name, t] : values) {
    TensorPiece piece;
    piece.name = name;
    piece.global_shape = t.shape();
    piece.data = t;
    pieces.push_back(std::move(piece));
    numel += t.numel();
  }
  LOOM_CHECK(numel == cfg.num_parameters(), "[convert] ", numel, " converted values, config implies ",
             cfg.num_parameters());
  json meta;
  meta["format"] = kLoomFormat;
  meta["format_version"] = kLoomFormatVersion;
  meta["loom_version"] = kLoomVersion;
  meta["iteration"] = 0;
  meta["consumed_train_samples"] = 0;
  meta["consumed_valid_samples"] = 0;
  meta["consumed_tokens"] = 0;
  meta["model_config"] = model_config_json(cfg);
  meta["precision"] = "fp32";
  json src = {{"format", "huggingface"}, {"model_type", hf.config().model_type}, {"dir", hf_dir}};
  if (hf.config().bos_token_id) src["bos_token_id"] = *hf.config().bos_token_id;
  if (!hf.config().eos_token_ids.empty()) src["eos_token_ids"] = hf.config().eos_token_ids;
  meta["converted_from"] = src;
  save_sharded_checkpoint(loom_root, 0, pieces, R"({"tp":1,"pp":1,"cp":1,"dp":1,"sharding":"no_shard"})",
                          meta.dump(), /*rank=*/0, /*world_size=*/1, [] {});
  log << "wrote " << checkpoint_dir(loom_root, 0) << ": " << values.size() << " parameters, " << numel
      << " values (vocabulary " << cfg.vocab_size << " padded to " << cfg.padded_vocab_size
      << "); train from it with `loom train --load " << loom_root << " --finetune ...`\n";
}

void convert_loom_to_hf(const std::string& loom_dir, const std::string& hf_dir, const HfExportOptions& opts_in,
                        std::ostream& log) {
  const std::string ck = loom_checkpoint_dir(loom_dir);
  const json meta = read_loom_metadata(ck);
  const GPTConfig cfg = model_config_from_json(meta["model_config"], ck + "/metadata.json");
  HfExportOptions opts = opts_in;
  opts.log = &log;
  // Token ids of a model that came from HF go back into its config.json.
  if (meta.contains("converted_from") && meta["converted_from"].is_object()) {
    const json& src = meta["converted_from"];
    if (!opts.bos_token_id && src.contains("bos_token_id") && src["bos_token_id"].is_number_integer())
      opts.bos_token_id = src["bos_token_id"].get<int64_t>();
    if (opts.eos_token_ids.empty() && src.contains("eos_token_ids") && src["eos_token_ids"].is_array())
      for (const json& id : src["eos_token_ids"])
        if (id.is_number_integer()) opts.eos_token_ids.push_back(id.get<int64_t>());
  }
  const std::string file = ck + "/metadata.json";
  const LoomTensors tensors = read_checkpoint_weights(ShardedCheckpoint::open(ck));
  std::map<std::string, TensorView> loom;
  for (const auto& [name, t] : tensors) loom[name] = t;
  log << "converting Loom checkpoint " << ck << " (" << loom.size() << " parameters) to a Hugging Face "
      << (hf_family_for(cfg) == HfFamily::kGPT2 ? "gpt2" : cfg.window_size_left >= 0 ? "mistral" : "llama")
      << " model in " << hf_dir << " (" << torch_dtype_name(opts.dtype) << ")\n";
  export_tensors(loom, cfg, hf_dir, opts, file);
  log << "wrote " << hf_dir << "\n";
}

}  // namespace loom

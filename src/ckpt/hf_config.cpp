// Hugging Face config.json -> HfConfig (include/loom/ckpt/hf_dir.h): the families Loom converts (gpt2; the
// Llama layer: llama, mistral; with sparse MoE blocks: mixtral, qwen2_moe, qwen3_moe). Every value is
// type- and range-checked before use and dimensions are capped at 2^31 - 1, so later arithmetic on them
// (4 * n_embd, hidden / heads, E * F) cannot overflow. A field whose setting Loom cannot reproduce (a
// per-layer sliding window, router jitter) is refused here, naming it, before any weight is read.
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "json_no_duplicates.h"
#include "loom/ckpt/hf_dir.h"

namespace loom {

namespace {

using Json = nlohmann::json;
using ckpt_io::parse_json_strict;
using ckpt_io::shown;

constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();

// Typed access to config.json's fields with errors naming the file and the field.
class Fields {
 public:
  Fields(const Json& j, std::string path) : j_(j), path_(std::move(path)) {}

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    user_error(path_, ": field '", field, "': ", what);
  }

  // Present and not null.
  bool has(const std::string& key) const { return j_.contains(key) && !j_.at(key).is_null(); }

  const Json& required(const std::string& key) const {
    if (!j_.contains(key)) user_error(path_, ": missing field '", key, "'");
    if (j_.at(key).is_null()) fail(key, "must not be null");
    return j_.at(key);
  }

  int64_t integer(const std::string& key, const Json& v, int64_t min, int64_t max) const {
    const bool is_int = v.is_number_integer();
    const bool in_range =
        is_int && (v.is_number_unsigned() ? v.get<uint64_t>() <= uint64_t(max) && int64_t(v.get<uint64_t>()) >= min
                                          : v.get<int64_t>() >= min && v.get<int64_t>() <= max);
    if (!in_range)
      fail(key, detail::concat("expected an integer in [", min, ", ", max, "], got ", shown(v)));
    return v.is_number_unsigned() ? int64_t(v.get<uint64_t>()) : v.get<int64_t>();
  }

  int64_t dim(const std::string& key) const { return integer(key, required(key), 1, kMaxDim); }
  std::optional<int64_t> optional_dim(const std::string& key) const {
    if (!has(key)) return std::nullopt;
    return integer(key, j_.at(key), 1, kMaxDim);
  }
  std::optional<int64_t> optional_token(const std::string& key) const {
    if (!has(key)) return std::nullopt;
    return integer(key, j_.at(key), 0, kMaxDim);
  }

  double positive_number(const std::string& key, const Json& v) const {
    if (!v.is_number() || !(v.get<double>() > 0.0) || !std::isfinite(v.get<double>()))
      fail(key, "expected a positive number, got " + shown(v));
    return v.get<double>();
  }
  double positive_number(const std::string& key) const { return positive_number(key, required(key)); }
  double positive_number_or(const std::string& key, double dflt) const {
    return has(key) ? positive_number(key, j_.at(key)) : dflt;
  }

  double non_negative_number_or(const std::string& key, double dflt) const {
    if (!has(key)) return dflt;
    const Json& v = j_.at(key);
    if (!v.is_number() || !(v.get<double>() >= 0.0) || !std::isfinite(v.get<double>()))
      fail(key, "expected a number >= 0, got " + shown(v));
    return v.get<double>();
  }

  bool boolean_or(const std::string& key, bool dflt) const {
    if (!has(key)) return dflt;
    const Json& v = j_.at(key);
    if (!v.is_boolean()) fail(key, "expected true or false, got " + shown(v));
    return v.get<bool>();
  }

  std::string string_or(const std::string& key, const std::string& dflt) const {
    if (!has(key)) return dflt;
    const Json& v = j_.at(key);
    if (!v.is_string()) fail(key, "expected a string, got " + shown(v));
    return v.get<std::string>();
  }

  const Json& json() const { return j_; }
  const std::string& path() const { return path_; }

 private:
  const Json& j_;
  std::string path_;
};

void parse_gpt2(const Fields& f, HfConfig& c) {
  c.vocab_size = f.dim("vocab_size");
  c.max_position_embeddings = f.dim("n_positions");
  c.hidden_size = f.dim("n_embd");
  c.num_hidden_layers = f.dim("n_layer");
  c.num_attention_heads = f.dim("n_head");
  c.num_key_value_heads = c.num_attention_heads;
  if (c.hidden_size % c.num_attention_heads != 0)
    f.fail("n_head", detail::concat("n_embd ", c.hidden_size, " is not divisible by n_head ", c.num_attention_heads));
  c.head_dim = c.hidden_size / c.num_attention_heads;
  c.intermediate_size = f.optional_dim("n_inner").value_or(4 * c.hidden_size);
  c.norm_eps = f.positive_number_or("layer_norm_epsilon", 1e-5);
  c.activation = f.string_or("activation_function", "gelu_new");
  c.tie_word_embeddings = f.boolean_or("tie_word_embeddings", true);
  c.attention_bias = c.mlp_bias = true;  // every GPT-2 linear has a bias
}

std::optional<HfRopeScaling> parse_rope_scaling(const Fields& f) {
  if (!f.has("rope_scaling")) return std::nullopt;
  const Json& v = f.json().at("rope_scaling");
  if (!v.is_object()) f.fail("rope_scaling", "expected null or an object, got " + shown(v));
  // transformers accepts the older key "type" for "rope_type".
  const char* type_key = v.contains("rope_type") ? "rope_type" : "type";
  if (!v.contains(type_key)) f.fail("rope_scaling", "has neither 'rope_type' nor 'type'");
  const Json& t = v.at(type_key);
  if (!t.is_string()) f.fail(std::string("rope_scaling.") + type_key, "expected a string, got " + shown(t));
  const std::string type = t.get<std::string>();
  if (type == "default") return std::nullopt;
  if (type != "llama3")
    f.fail(std::string("rope_scaling.") + type_key,
           "'" + type + "' is not supported (supported: llama3, default)");
  const Fields sub(v, f.path());
  HfRopeScaling r;
  r.rope_type = type;
  auto num = [&](const char* key) {
    if (!v.contains(key)) user_error(f.path(), ": missing field 'rope_scaling.", key, "'");
    return sub.positive_number(std::string("rope_scaling.") + key, v.at(key));
  };
  r.factor = num("factor");
  r.low_freq_factor = num("low_freq_factor");
  r.high_freq_factor = num("high_freq_factor");
  if (!(r.high_freq_factor > r.low_freq_factor))
    f.fail("rope_scaling.high_freq_factor",
           detail::concat("must be greater than low_freq_factor (", r.high_freq_factor, " <= ", r.low_freq_factor, ")"));
  if (!v.contains("original_max_position_embeddings"))
    user_error(f.path(), ": missing field 'rope_scaling.original_max_position_embeddings'");
  r.original_max_position_embeddings = sub.integer("rope_scaling.original_max_position_embeddings",
                                                   v.at("original_max_position_embeddings"), 1, kMaxDim);
  return r;
}

// The Llama skeleton every family but gpt2 shares: shapes, norms, RoPE, attention biases and windows.
void parse_llama_like(const Fields& f, HfConfig& c) {
  const std::string& t = c.model_type;
  const bool mistral = t == "mistral", qwen = t == "qwen2_moe" || t == "qwen3_moe";
  c.vocab_size = f.dim("vocab_size");
  c.hidden_size = f.dim("hidden_size");
  c.intermediate_size = f.dim("intermediate_size");
  c.num_hidden_layers = f.dim("num_hidden_layers");
  c.num_attention_heads = f.dim("num_attention_heads");
  // transformers' MistralConfig assumes 8 KV heads when the key is missing, LlamaConfig assumes one per
  // query head; real Mistral configs always say, so a missing key there is an error instead of a guess.
  if ((mistral || t == "mixtral") && !f.json().contains("num_key_value_heads")) f.required("num_key_value_heads");
  c.num_key_value_heads = f.optional_dim("num_key_value_heads").value_or(c.num_attention_heads);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    f.fail("num_key_value_heads", detail::concat(c.num_key_value_heads, " does not divide num_attention_heads ",
                                                 c.num_attention_heads));
  if (const auto hd = f.optional_dim("head_dim")) {
    c.head_dim = *hd;
  } else {
    if (c.hidden_size % c.num_attention_heads != 0)
      f.fail("num_attention_heads", detail::concat("hidden_size ", c.hidden_size, " is not divisible by ",
                                                   c.num_attention_heads, " heads and there is no head_dim"));
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.head_dim % 2 != 0) f.fail("head_dim", detail::concat("RoPE needs an even head dimension, got ", c.head_dim));
  c.max_position_embeddings = f.dim("max_position_embeddings");
  c.norm_eps = f.positive_number("rms_norm_eps");
  c.activation = f.string_or("hidden_act", "silu");
  c.tie_word_embeddings = f.boolean_or("tie_word_embeddings", false);
  c.rope_theta = f.positive_number_or("rope_theta", 10000.0);
  c.rope_scaling = parse_rope_scaling(f);
  if (mistral) {
    // MistralConfig's default when the key is absent is 4096; an explicit null means full attention.
    if (!f.json().contains("sliding_window")) c.sliding_window = 4096;
    else c.sliding_window = f.optional_dim("sliding_window");
  } else if (t == "mixtral") {
    c.sliding_window = f.optional_dim("sliding_window");  // MixtralConfig's default: none
  } else if (qwen) {
    // Qwen's window covers only some layers (max_window_layers, layer_types); Loom's --window-size all.
    if (f.boolean_or("use_sliding_window", false))
      f.fail("use_sliding_window", "true is not supported: Qwen's sliding window applies to some layers only "
                                   "(max_window_layers), Loom's --window-size to every layer; set it to false");
    if (f.has("layer_types")) {
      const Json& lt = f.json().at("layer_types");
      if (!lt.is_array()) f.fail("layer_types", "expected a list, got " + shown(lt));
      for (const Json& x : lt)
        if (x != "full_attention")
          f.fail("layer_types", "only \"full_attention\" layers are supported, got " + shown(x));
    }
  }
  if (t == "llama" || t == "qwen3_moe") {
    c.attention_bias = f.boolean_or("attention_bias", false);  // qwen3_moe: q, k, v and o_proj as Llama
    if (t == "llama") c.mlp_bias = f.boolean_or("mlp_bias", false);
  }
  if (t == "qwen2_moe") c.qkv_bias = f.boolean_or("qkv_bias", true);  // transformers 4.x: always
  c.qk_norm = t == "qwen3_moe";
}

// The sparse MoE block of mixtral, qwen2_moe and qwen3_moe (after parse_llama_like).
void parse_moe(const Fields& f, HfConfig& c) {
  const bool mixtral = c.model_type == "mixtral";
  const char* experts_key = mixtral ? "num_local_experts" : "num_experts";
  c.num_experts = f.dim(experts_key);
  c.num_experts_per_tok = f.dim("num_experts_per_tok");
  if (c.num_experts_per_tok > c.num_experts)
    f.fail("num_experts_per_tok", detail::concat(c.num_experts_per_tok, " exceeds ", experts_key, " ", c.num_experts));
  c.moe_intermediate_size = mixtral ? c.intermediate_size : f.dim("moe_intermediate_size");
  c.norm_topk_prob = mixtral || f.boolean_or("norm_topk_prob", false);
  c.router_aux_loss_coef = f.non_negative_number_or("router_aux_loss_coef", 0.001);
  if (mixtral && f.non_negative_number_or("router_jitter_noise", 0.0) != 0.0)
    f.fail("router_jitter_noise", "Loom's router has no input jitter; only 0 is supported");
  if (c.model_type == "qwen2_moe") c.shared_expert_intermediate_size = f.dim("shared_expert_intermediate_size");
  const int64_t L = c.num_hidden_layers;
  c.moe_layers.assign(size_t(L), 1);
  if (mixtral) return;
  const int64_t step = f.optional_dim("decoder_sparse_step").value_or(1);
  std::set<int64_t> dense;
  if (f.has("mlp_only_layers")) {
    const Json& v = f.json().at("mlp_only_layers");
    if (!v.is_array()) f.fail("mlp_only_layers", "expected a list of layer indices, got " + shown(v));
    for (const Json& x : v) dense.insert(f.integer("mlp_only_layers", x, 0, L - 1));
  }
  int64_t sparse = 0;
  for (int64_t i = 0; i < L; ++i) {
    c.moe_layers[size_t(i)] = !dense.count(i) && (i + 1) % step == 0 ? 1 : 0;
    sparse += c.moe_layers[size_t(i)];
  }
  if (sparse == 0)
    f.fail("decoder_sparse_step", "with mlp_only_layers it leaves no sparse MoE layer; Loom converts such a model "
                                  "only as what it is, a dense one (model_type llama)");
}

}  // namespace

HfConfig parse_hf_config(const std::string& json_text, const std::string& path) {
  const Json j = parse_json_strict(json_text, path);
  const Fields f(j, path);
  HfConfig c;
  const Json& mt = f.required("model_type");
  if (!mt.is_string()) f.fail("model_type", "expected a string, got " + shown(mt));
  c.model_type = mt.get<std::string>();
  const std::string& t = c.model_type;
  if (t == "gpt2") {
    parse_gpt2(f, c);
  } else if (t == "llama" || t == "mistral" || t == "mixtral" || t == "qwen2_moe" || t == "qwen3_moe") {
    parse_llama_like(f, c);
    if (t == "mixtral" || t == "qwen2_moe" || t == "qwen3_moe") parse_moe(f, c);
  } else if (t == "olmoe") {
    f.fail("model_type", "'olmoe' is not supported: its q_norm and k_norm normalise the whole query and key "
                         "projections, Loom's --qk-layernorm each head (configs/olmoe-1b-7b.yaml trains the shape)");
  } else {
    f.fail("model_type",
           "'" + t + "' is not supported (supported: gpt2, llama, mistral, mixtral, qwen2_moe, qwen3_moe)");
  }

  // Newer transformers write "dtype" where older ones wrote "torch_dtype".
  c.torch_dtype = f.has("torch_dtype") ? f.string_or("torch_dtype", "") : f.string_or("dtype", "");
  c.bos_token_id = f.optional_token("bos_token_id");
  if (f.has("eos_token_id")) {
    const Json& e = j.at("eos_token_id");
    if (e.is_array()) {
      for (const Json& x : e) c.eos_token_ids.push_back(f.integer("eos_token_id", x, 0, kMaxDim));
    } else {
      c.eos_token_ids.push_back(*f.optional_token("eos_token_id"));
    }
  }
  c.raw_json = json_text;
  return c;
}

}  // namespace loom

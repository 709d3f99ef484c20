// Hugging Face <-> Loom layouts (see hf_mapping.h). Everything is a row gather: a Loom parameter's row r
// is one row of the stacked HF parts (or zero), so both directions are exact copies and a round trip
// reproduces every byte. The sparse MoE blocks (Mixtral, Qwen-MoE) are hf_mapping_moe.cpp's.
#include "loom/model/hf_mapping.h"

#include <cctype>
#include <cstring>
#include <map>

#include "model/hf_mapping_impl.h"

namespace loom {

namespace hf_detail {

std::vector<int64_t> identity_rows(int64_t stacked, int64_t loom_rows) {
  std::vector<int64_t> rows(static_cast<size_t>(loom_rows), -1);
  for (int64_t r = 0; r < stacked && r < loom_rows; ++r) rows[size_t(r)] = r;
  return rows;
}

int64_t part_rows(const HfPart& p) { return p.transposed ? p.shape[1] : p.shape[0]; }

HfParamMap one_to_one(std::string loom_name, Shape loom_shape, std::string hf_name, Shape hf_shape, bool transposed) {
  HfParamMap m;
  m.loom_name = std::move(loom_name);
  m.loom_shape = loom_shape;
  m.parts.push_back({std::move(hf_name), hf_shape, transposed});
  m.row_source = identity_rows(part_rows(m.parts[0]), loom_shape[0]);
  m.note = transposed ? "transposed" : "";
  return m;
}

HfParamMap gated_fc1(std::string loom_name, int64_t F, int64_t C, const std::string& gate, const std::string& up) {
  HfParamMap m;
  m.loom_name = std::move(loom_name);
  m.loom_shape = {2 * F, C};
  for (const std::string& proj : {gate, up}) m.parts.push_back({proj, {F, C}});
  m.row_source = identity_rows(2 * F, 2 * F);
  m.note = "concatenated [gate | up]";
  return m;
}

}  // namespace hf_detail

namespace {

using hf_detail::gated_fc1;
using hf_detail::identity_rows;
using hf_detail::layer_name;
using hf_detail::one_to_one;
using hf_detail::part_rows;

// Replaces each ".<digits>." by ".*." and a trailing "weight<digits>" (a Loom expert) by "weight*", so
// that all layers and experts of one kind print as one line.
std::string fold_layers(const std::string& s) {
  std::string out;
  size_t end = s.size();
  while (end > 0 && std::isdigit(static_cast<unsigned char>(s[end - 1]))) --end;
  if (end < s.size() && end >= 6 && s.compare(end - 6, 6, "weight") == 0) return fold_layers(s.substr(0, end)) + "*";
  for (size_t i = 0; i < s.size();) {
    if (s[i] == '.' && i + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[i + 1]))) {
      size_t j = i + 1;
      while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
      if (j == s.size() || s[j] == '.') {
        out += ".*";
        i = j;
        continue;
      }
    }
    out += s[i++];
  }
  return out;
}

// Columns of a part after the optional transpose (a 1-D tensor is n rows of one element).
int64_t part_cols(const HfPart& p) {
  if (p.shape.ndim() == 1) return 1;
  return p.transposed ? p.shape[0] : p.shape[1];
}

struct RowRef {
  size_t part;
  int64_t row;
};

// stacked row -> (part, row within the part)
std::vector<RowRef> stacked_rows(const HfParamMap& m) {
  std::vector<RowRef> rows;
  for (size_t p = 0; p < m.parts.size(); ++p)
    for (int64_t r = 0; r < part_rows(m.parts[p]); ++r) rows.push_back({p, r});
  return rows;
}

int64_t loom_cols(const HfParamMap& m) { return m.loom_shape.ndim() == 1 ? 1 : m.loom_shape[1]; }

// Word embedding or untied output layer: HF has V rows, Loom Vp >= V (the rest is zero padding).
HfParamMap vocab_table(std::string loom_name, const GPTConfig& c, std::string hf_name) {
  HfParamMap m = one_to_one(std::move(loom_name), {c.padded_vocab_size, c.hidden_size}, std::move(hf_name),
                            {c.vocab_size, c.hidden_size});
  if (c.padded_vocab_size > c.vocab_size)
    m.note = "padded " + std::to_string(c.vocab_size) + " -> " + std::to_string(c.padded_vocab_size) + " rows";
  return m;
}

void add_norm(HfLayout& l, const GPTConfig& c, const std::string& loom, const std::string& hf) {
  l.params.push_back(one_to_one(loom + ".weight", {c.hidden_size}, hf + ".weight", {c.hidden_size}));
  if (c.normalization == NormKind::kLayerNorm)
    l.params.push_back(one_to_one(loom + ".bias", {c.hidden_size}, hf + ".bias", {c.hidden_size}));
}

HfLayout gpt2_layout(const GPTConfig& c, const std::string& pre) {
  HfLayout l;
  l.family = HfFamily::kGPT2;
  const int64_t C = c.hidden_size, F = c.ffn_hidden_size(), QKV = c.qkv_size();
  const std::vector<int64_t> qkv_rows =
      hf_qkv_row_source(c.num_attention_heads, c.num_kv_heads(), c.head_dim());
  l.params.push_back(vocab_table("embedding.word_embeddings.weight", c, pre + "wte.weight"));
  l.params.push_back(one_to_one("embedding.position_embeddings.weight", {c.max_position_embeddings, C},
                                pre + "wpe.weight", {c.max_position_embeddings, C}));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string L = layer_name(i), H = pre + "h." + std::to_string(i) + ".";
    add_norm(l, c, L + "input_layernorm", H + "ln_1");
    add_norm(l, c, L + "pre_mlp_layernorm", H + "ln_2");
    HfParamMap qkv = one_to_one(L + "self_attention.linear_qkv.weight", {QKV, C}, H + "attn.c_attn.weight", {C, QKV}, true);
    qkv.row_source = qkv_rows;
    qkv.note = "transposed, regrouped";
    l.params.push_back(qkv);
    HfParamMap qkv_b = one_to_one(L + "self_attention.linear_qkv.bias", {QKV}, H + "attn.c_attn.bias", {QKV});
    qkv_b.row_source = qkv_rows;
    qkv_b.note = "regrouped";
    l.params.push_back(qkv_b);
    l.params.push_back(one_to_one(L + "self_attention.linear_proj.weight", {C, C}, H + "attn.c_proj.weight", {C, C}, true));
    l.params.push_back(one_to_one(L + "self_attention.linear_proj.bias", {C}, H + "attn.c_proj.bias", {C}));
    l.params.push_back(one_to_one(L + "mlp.linear_fc1.weight", {F, C}, H + "mlp.c_fc.weight", {C, F}, true));
    l.params.push_back(one_to_one(L + "mlp.linear_fc1.bias", {F}, H + "mlp.c_fc.bias", {F}));
    l.params.push_back(one_to_one(L + "mlp.linear_fc2.weight", {C, F}, H + "mlp.c_proj.weight", {F, C}, true));
    l.params.push_back(one_to_one(L + "mlp.linear_fc2.bias", {C}, H + "mlp.c_proj.bias", {C}));
  }
  add_norm(l, c, "decoder.final_layernorm", pre + "ln_f");
  if (c.untie_embeddings_and_output_weights)
    l.params.push_back(vocab_table("output_layer.weight", c, "lm_head.weight"));
  else
    l.aliases.push_back({"lm_head.weight", pre + "wte.weight"});
  return l;
}

// Llama, Mistral and the MoE families (the same attention; Qwen3-MoE's q/k norms; MoE layers' blocks).
HfLayout llama_layout(const GPTConfig& c, const std::string& pre, HfFamily family) {
  HfLayout l;
  l.family = family;
  const int64_t C = c.hidden_size, F = c.ffn_hidden_size(), HS = c.head_dim(), NH = c.num_attention_heads,
                NKV = c.num_kv_heads(), QKV = c.qkv_size();
  const std::vector<int64_t> qkv_rows = hf_qkv_row_source(NH, NKV, HS, c.rotary_interleaved, c.rotary_dim());
  const std::string regroup = c.rotary_interleaved ? "regrouped, RoPE rows interleaved" : "regrouped";
  l.params.push_back(vocab_table("embedding.word_embeddings.weight", c, pre + "embed_tokens.weight"));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string L = layer_name(i), H = pre + "layers." + std::to_string(i) + ".";
    add_norm(l, c, L + "input_layernorm", H + "input_layernorm");
    add_norm(l, c, L + "pre_mlp_layernorm", H + "post_attention_layernorm");
    for (const char* kind : {"weight", "bias"}) {
      const bool weight = std::string(kind) == "weight";
      if (!weight && !c.qkv_bias()) continue;
      HfParamMap m;
      m.loom_name = L + "self_attention.linear_qkv." + kind;
      m.loom_shape = weight ? Shape{QKV, C} : Shape{QKV};
      const std::pair<const char*, int64_t> projs[] = {{"q_proj", NH * HS}, {"k_proj", NKV * HS}, {"v_proj", NKV * HS}};
      for (const auto& [proj, rows] : projs)
        m.parts.push_back({H + "self_attn." + proj + "." + kind, weight ? Shape{rows, C} : Shape{rows}});
      m.row_source = qkv_rows;
      m.note = regroup;
      l.params.push_back(m);
    }
    l.params.push_back(
        one_to_one(L + "self_attention.linear_proj.weight", {C, NH * HS}, H + "self_attn.o_proj.weight", {C, NH * HS}));
    if (c.add_bias_linear)
      l.params.push_back(one_to_one(L + "self_attention.linear_proj.bias", {C}, H + "self_attn.o_proj.bias", {C}));
    else if (c.add_qkv_bias && family != HfFamily::kQwen2Moe)  // Qwen2-MoE's o_proj never has a bias
      l.zero_tensors.push_back({H + "self_attn.o_proj.bias", {C}});
    if (c.qk_layernorm)  // Qwen3-MoE (RMSNorm, no bias)
      for (const char* qk : {"q", "k"})
        l.params.push_back(one_to_one(L + "self_attention." + qk + "_layernorm.weight", {HS},
                                      H + "self_attn." + qk + "_norm.weight", {HS}));
    if (c.is_moe_layer(i)) {
      hf_detail::add_moe_mlp(l, c, family, L, H);
      continue;
    }
    for (const char* kind : {"weight", "bias"}) {
      const bool weight = std::string(kind) == "weight";
      if (!weight && !c.add_bias_linear) continue;
      HfParamMap m;
      m.loom_name = L + "mlp.linear_fc1." + kind;
      m.loom_shape = weight ? Shape{2 * F, C} : Shape{2 * F};
      for (const char* proj : {"gate_proj", "up_proj"})
        m.parts.push_back({H + "mlp." + proj + "." + kind, weight ? Shape{F, C} : Shape{F}});
      m.row_source = identity_rows(2 * F, 2 * F);
      m.note = "concatenated [gate | up]";
      l.params.push_back(m);
    }
    l.params.push_back(one_to_one(L + "mlp.linear_fc2.weight", {C, F}, H + "mlp.down_proj.weight", {C, F}));
    if (c.add_bias_linear)
      l.params.push_back(one_to_one(L + "mlp.linear_fc2.bias", {C}, H + "mlp.down_proj.bias", {C}));
  }
  add_norm(l, c, "decoder.final_layernorm", pre + "norm");
  if (c.untie_embeddings_and_output_weights)
    l.params.push_back(vocab_table("output_layer.weight", c, "lm_head.weight"));
  else
    l.aliases.push_back({"lm_head.weight", pre + "embed_tokens.weight"});
  return l;
}

}  // namespace

const char* hf_family_name(HfFamily f) {
  switch (f) {
    case HfFamily::kGPT2: return "gpt2";
    case HfFamily::kLlama: return "llama";
    case HfFamily::kMixtral: return "mixtral";
    case HfFamily::kQwen2Moe: return "qwen2_moe";
    case HfFamily::kQwen3Moe: return "qwen3_moe";
  }
  return "?";
}

const char* hf_default_prefix(HfFamily f) { return f == HfFamily::kGPT2 ? "transformer." : "model."; }

HfFamily hf_family_for(const GPTConfig& c) {
  if (c.qk_layernorm && !c.is_moe())
    user_error("--qk-layernorm has no Hugging Face GPT-2 or Llama counterpart (only the mixture-of-experts "
               "Qwen3-MoE has per-head q/k norms); cannot convert");
  if (c.is_moe() && c.position_embedding_type != PositionEmbeddingType::kRope)
    user_error("--position-embedding-type ", position_embedding_type_name(c.position_embedding_type),
               " with --num-experts: Hugging Face Mixtral and Qwen-MoE use RoPE; cannot convert");
  switch (c.position_embedding_type) {
    case PositionEmbeddingType::kNone:
      user_error("--position-embedding-type none has no Hugging Face GPT-2 or Llama counterpart; cannot convert "
                 "(GPT-2 uses learned_absolute, Llama rope)");
    case PositionEmbeddingType::kLearnedAbsolute: {
      const char* why = nullptr;
      if (c.normalization != NormKind::kLayerNorm) why = "--normalization RMSNorm (GPT-2 uses LayerNorm)";
      else if (c.activation != MlpActivation::kGeLU) why = "a gated MLP (GPT-2 uses GeLU)";
      else if (!c.add_bias_linear) why = "--disable-bias-linear (every GPT-2 linear layer has a bias)";
      else if (c.num_kv_heads() != c.num_attention_heads) why = "--group-query-attention (GPT-2 has one key/value head per query head)";
      else if (c.head_dim() * c.num_attention_heads != c.hidden_size) why = "--kv-channels other than hidden/heads";
      else if (c.window_size_left >= 0) why = "--window-size (GPT-2 attends to the whole context)";
      if (why)
        user_error("a model with learned absolute position embeddings converts to Hugging Face GPT-2, which has no ",
                   why, "; cannot convert");
      return HfFamily::kGPT2;
    }
    case PositionEmbeddingType::kRope: {
      const char* why = nullptr;
      if (c.normalization != NormKind::kRMSNorm) why = "--normalization LayerNorm (Llama uses RMSNorm)";
      else if (!c.gated_mlp()) why = "a GeLU MLP (Llama's MLP is gated: --swiglu)";
      else if (c.rotary_dim() != c.head_dim()) why = "--rotary-percent below 1 (Llama rotates whole heads)";
      if (why)
        user_error("a model with RoPE converts to Hugging Face ", c.is_moe() ? "Mixtral or Qwen-MoE" : "Llama",
                   ", which has no ", why, "; cannot convert");
      return c.is_moe() ? hf_detail::moe_family_for(c) : HfFamily::kLlama;
    }
  }
  LOOM_CHECK(false, "[hf_family_for] unknown position embedding type");
  return HfFamily::kGPT2;
}

HfLayout hf_layout(const GPTConfig& cfg, const std::string& prefix) {
  const HfFamily f = hf_family_for(cfg);
  LOOM_CHECK(cfg.padded_vocab_size >= cfg.vocab_size, "[hf_layout] padded vocabulary ", cfg.padded_vocab_size,
             " < vocabulary ", cfg.vocab_size);
  return f == HfFamily::kGPT2 ? gpt2_layout(cfg, prefix) : llama_layout(cfg, prefix, f);
}

HfLayout hf_layout(const GPTConfig& cfg) { return hf_layout(cfg, hf_default_prefix(hf_family_for(cfg))); }

bool hf_is_buffer(const std::string& name) {
  const auto ends = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  // ".attn.bias" alone (not ".c_attn.bias"): GPT-2's causal mask.
  return ends(".attn.bias") || ends(".attn.masked_bias") || ends(".rotary_emb.inv_freq");
}

std::vector<int64_t> hf_qkv_row_source(int64_t NH, int64_t NKV, int64_t HS, bool interleaved, int64_t rotary_dim) {
  LOOM_CHECK(NKV >= 1 && NH % NKV == 0 && HS >= 1, "[hf_qkv_row_source] heads ", NH, " / kv heads ", NKV);
  LOOM_CHECK(!interleaved || (rotary_dim >= 2 && rotary_dim % 2 == 0 && rotary_dim <= HS),
             "[hf_qkv_row_source] rotary_dim ", rotary_dim, " for head size ", HS);
  const int64_t G = NH / NKV;
  // Within a rotated head, Loom channel i holds HF channel head_row(i).
  const auto head_row = [&](int64_t i) {
    if (!interleaved || i >= rotary_dim) return i;
    return i % 2 == 0 ? i / 2 : i / 2 + rotary_dim / 2;
  };
  std::vector<int64_t> rows;
  rows.reserve(size_t((NH + 2 * NKV) * HS));
  for (int64_t g = 0; g < NKV; ++g) {
    for (int64_t j = 0; j < G; ++j)
      for (int64_t i = 0; i < HS; ++i) rows.push_back((g * G + j) * HS + head_row(i));
    for (int64_t i = 0; i < HS; ++i) rows.push_back(NH * HS + g * HS + head_row(i));
    for (int64_t i = 0; i < HS; ++i) rows.push_back((NH + NKV) * HS + g * HS + i);  // values are not rotated
  }
  return rows;
}

void hf_to_loom(const HfParamMap& m, const std::vector<TensorView>& parts, TensorView out) {
  LOOM_CHECK(parts.size() == m.parts.size(), "[hf_to_loom] ", m.loom_name, ": ", m.parts.size(), " parts expected, got ",
             parts.size());
  LOOM_CHECK(out.dtype() == DType::kF32 && out.device().is_cpu() && out.shape() == m.loom_shape, "[hf_to_loom] ",
             m.loom_name, ": expected f32 host ", m.loom_shape.str(), ", got ", out.desc());
  for (size_t p = 0; p < parts.size(); ++p)
    LOOM_CHECK(parts[p].dtype() == DType::kF32 && parts[p].device().is_cpu() && parts[p].shape() == m.parts[p].shape,
               "[hf_to_loom] ", m.parts[p].name, ": expected f32 host ", m.parts[p].shape.str(), ", got ",
               parts[p].desc());
  const std::vector<RowRef> rows = stacked_rows(m);
  const int64_t cols = loom_cols(m);
  float* dst = out.data<float>();
  for (int64_t r = 0; r < m.loom_shape[0]; ++r) {
    float* d = dst + r * cols;
    const int64_t s = m.row_source[size_t(r)];
    if (s < 0) {
      std::memset(d, 0, size_t(cols) * sizeof(float));
      continue;
    }
    const RowRef ref = rows[size_t(s)];
    const HfPart& part = m.parts[ref.part];
    LOOM_CHECK(part_cols(part) == cols, "[hf_to_loom] ", part.name, " has ", part_cols(part), " columns, ",
               m.loom_name, " ", cols);
    const float* src = parts[ref.part].data<float>();
    if (part.transposed) {
      const int64_t stride = part.shape[1];  // (in, out): column ref.row of the stored matrix
      for (int64_t c = 0; c < cols; ++c) d[c] = src[c * stride + ref.row];
    } else {
      std::memcpy(d, src + ref.row * cols, size_t(cols) * sizeof(float));
    }
  }
}

std::vector<Tensor> loom_to_hf(const HfParamMap& m, TensorView loom) {
  LOOM_CHECK(loom.dtype() == DType::kF32 && loom.device().is_cpu() && loom.shape() == m.loom_shape, "[loom_to_hf] ",
             m.loom_name, ": expected f32 host ", m.loom_shape.str(), ", got ", loom.desc());
  std::vector<Tensor> out;
  for (const HfPart& p : m.parts) out.push_back(Tensor::empty(p.shape, DType::kF32));
  const std::vector<RowRef> rows = stacked_rows(m);
  std::vector<char> covered(rows.size(), 0);
  const int64_t cols = loom_cols(m);
  const float* src = loom.data<float>();
  for (int64_t r = 0; r < m.loom_shape[0]; ++r) {
    const int64_t s = m.row_source[size_t(r)];
    if (s < 0) continue;  // padding
    LOOM_CHECK(!covered[size_t(s)], "[loom_to_hf] ", m.loom_name, ": HF row ", s, " used twice");
    covered[size_t(s)] = 1;
    const RowRef ref = rows[size_t(s)];
    const HfPart& part = m.parts[ref.part];
    float* dst = out[ref.part].data<float>();
    const float* row = src + r * cols;
    if (part.transposed) {
      const int64_t stride = part.shape[1];
      for (int64_t c = 0; c < cols; ++c) dst[c * stride + ref.row] = row[c];
    } else {
      std::memcpy(dst + ref.row * cols, row, size_t(cols) * sizeof(float));
    }
  }
  for (size_t s = 0; s < covered.size(); ++s)
    LOOM_CHECK(covered[s], "[loom_to_hf] ", m.loom_name, ": HF row ", s, " of ", m.parts[rows[s].part].name,
               " has no Loom row");
  return out;
}

std::vector<HfLoraMap> hf_lora_layout(const GPTConfig& cfg, const std::vector<LoraTarget>& targets, int64_t rank) {
  LOOM_CHECK(rank >= 1, "[hf_lora_layout] rank ", rank);
  if (cfg.is_moe())
    user_error("Hugging Face PEFT adapters are mapped for dense Llama-family models only; this is a mixture-of-experts "
               "model. Merge the adapters instead: loom convert --from loom:DIR --merge-lora --to hf:OUT");
  if (hf_family_for(cfg) != HfFamily::kLlama)
    user_error("Hugging Face PEFT adapters map to Llama-family models only (q_proj, k_proj, v_proj, o_proj, "
               "gate_proj, up_proj, down_proj); this is a GPT-2 model, whose attention is one Conv1D c_attn that "
               "PEFT adapts whole (fan_in_fan_out), which Loom does not export or import. Merge the adapters "
               "instead: loom convert --from loom:DIR --merge-lora --to hf:OUT");
  const std::string hf_prefix = std::string(kPeftPrefix) + hf_default_prefix(HfFamily::kLlama);
  const HfLayout layout = hf_layout(cfg, hf_prefix);
  std::map<std::string, const HfParamMap*> by_name;
  for (const HfParamMap& m : layout.params) by_name[m.loom_name] = &m;
  const auto strip = [](const std::string& name, const std::string& suffix) {
    LOOM_CHECK(name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0,
               "[hf_lora_layout] ", name, " does not end in ", suffix);
    return name.substr(0, name.size() - suffix.size());
  };
  std::vector<HfLoraMap> out;
  for (int64_t i = 0; i < cfg.num_layers; ++i)
    for (LoraTarget t : targets) {
      const LoraSite site = lora_site(cfg, t);
      const std::string L = layer_name(i);
      const HfParamMap& w = *by_name.at(L + site.layer + ".weight");
      LOOM_CHECK(w.loom_shape[1] == site.in, "[hf_lora_layout] ", w.loom_name, " has ", w.loom_shape[1], " columns");
      // The fused weight's rows that B's rows update, and the HF part (and its row) each comes from.
      std::vector<int64_t> fused;
      if (site.rows.empty())
        for (int64_t r = 0; r < site.out; ++r) fused.push_back(r);
      for (const ShardRange& rg : site.rows)
        for (int64_t r = 0; r < rg.size; ++r) fused.push_back(rg.start + r);
      LOOM_CHECK(int64_t(fused.size()) == site.out, "[hf_lora_layout] ", site.module, ": ", fused.size(), " rows");
      const std::vector<RowRef> stacked = stacked_rows(w);
      std::vector<int64_t> used(w.parts.size(), 0), first(w.parts.size(), 0);
      for (int64_t f : fused) {
        const int64_t s = w.row_source[size_t(f)];
        LOOM_CHECK(s >= 0, "[hf_lora_layout] ", w.loom_name, " row ", f, " is padding");
        ++used[stacked[size_t(s)].part];
      }
      HfLoraMap m;
      m.target = t;
      m.layer = i;
      m.loom_a = L + site.module + ".lora_A.weight";
      m.a_shape = {rank, site.in};
      m.b.loom_name = L + site.module + ".lora_B.weight";
      m.b.loom_shape = {site.out, rank};
      int64_t offset = 0;
      for (size_t p = 0; p < w.parts.size(); ++p) {
        if (used[p] == 0) continue;
        // An adapter covers whole HF modules: PEFT cannot adapt part of one.
        LOOM_CHECK(used[p] == part_rows(w.parts[p]) && !w.parts[p].transposed, "[hf_lora_layout] ", site.module,
                   " covers ", used[p], " of the ", part_rows(w.parts[p]), " rows of ", w.parts[p].name);
        const std::string module = strip(w.parts[p].name, ".weight");
        m.hf_modules.push_back(module.substr(module.rfind('.') + 1));
        m.hf_a.push_back(module + ".lora_A.weight");
        m.b.parts.push_back({module + ".lora_B.weight", {used[p], rank}});
        first[p] = offset;
        offset += used[p];
      }
      // B's row k: the HF row (part, row) of fused row fused[k], among the used parts' stacked B rows.
      for (int64_t f : fused) {
        const RowRef ref = stacked[size_t(w.row_source[size_t(f)])];
        m.b.row_source.push_back(first[ref.part] + ref.row);
      }
      m.b.note = m.hf_a.size() > 1 ? "lora_A repeated, lora_B split" : "";
      if (w.note.find("interleaved") != std::string::npos && (t == LoraTarget::kQkv || t == LoraTarget::kQ || t == LoraTarget::kK))
        m.b.note += std::string(m.b.note.empty() ? "" : ", ") + "RoPE rows interleaved";
      out.push_back(std::move(m));
    }
  return out;
}

std::vector<std::string> hf_mapping_summary(const HfLayout& layout, bool to_hf) {
  std::vector<std::string> order;
  std::map<std::string, int64_t> count;
  const auto add = [&](const std::string& line) {
    if (count[line]++ == 0) order.push_back(line);
  };
  for (const HfParamMap& m : layout.params) {
    std::string hf;
    for (const HfPart& p : m.parts) hf += (hf.empty() ? "" : " + ") + fold_layers(p.name);
    const std::string loom = fold_layers(m.loom_name), note = m.note.empty() ? "" : " (" + m.note + ")";
    add(to_hf ? loom + " -> " + hf + note : hf + " -> " + loom + note);
  }
  for (const HfAlias& a : layout.aliases)
    add(fold_layers(a.name) + (to_hf ? " not written: tied to " : " -> tied to ") + fold_layers(a.same_as) +
        (to_hf ? "" : " (not stored separately)"));
  for (const HfPart& z : layout.zero_tensors)
    add(to_hf ? "zeros -> " + fold_layers(z.name) + " (Loom has no such bias)"
              : fold_layers(z.name) + " -> none (must be zero: Loom has no such bias)");
  std::vector<std::string> out;
  for (const std::string& line : order) out.push_back(line + " x" + std::to_string(count[line]));
  return out;
}

}  // namespace loom

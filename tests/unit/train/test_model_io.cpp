// Hugging Face <-> Loom model I/O (train/model_io.h, model/hf_mapping.h) against the tiny HF directories of
// tests/golden/gen_hf_models.py: Loom loads each (config and weights) and its logits match the PyTorch
// reference written out from the HF modeling code within 1e-5 relative; Llama's interleaved-RoPE variant too;
// HF -> Loom -> HF reproduces model.safetensors byte for byte (but for the checksum entry Loom adds to the
// metadata) (directly and through the converter, sharded and
// with interleaved RoPE); every mapping error names the tensor (unmapped, missing, wrong shape, an untied copy
// of a tied head, a nonzero implied bias); the mapping's parameter list is exactly GPTModel's for every
// architecture the converter takes; config.json <-> GPTConfig both ways, with the errors for what Loom lacks.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "loom/ckpt/checkpoint.h"
#include "loom/ckpt/sharded.h"
#include "loom/ckpt/hf_dir.h"
#include "loom/model/hf_mapping.h"
#include "loom/train/args.h"
#include "loom/train/model_io.h"
#include "loom/train/trainer.h"
#include "model_io_test_util.h"
#include "model_test_util.h"
#include "unit/ckpt/ckpt_test_util.h"

using namespace loom;
namespace fs = std::filesystem;

namespace {

const std::string kFixtures = LOOM_FIXTURE_DIR;
const std::string kGpt2 = kFixtures + "/hf_gpt2";
const std::string kLlama = kFixtures + "/hf_llama";

// A scratch directory of this test file.
class TempDir : public test::ModelIoTempDir {
 public:
  TempDir() : test::ModelIoTempDir("model_io") {}
};
using test::slurp;

const SafetensorsFile& reference() {
  static const SafetensorsFile f = SafetensorsFile::open(kFixtures + "/hf_reference.safetensors");
  return f;
}

// max |got - ref| / max |ref| over the first V columns of (B, T, Vp) logits.
double logits_rel_err(TensorView logits, const Tensor& ref) {
  const int64_t V = ref.size(2), Vp = logits.size(2), rows = ref.size(0) * ref.size(1);
  const float* g = logits.data<float>();
  const float* r = ref.data<float>();
  double maxref = 0, maxdiff = 0;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t v = 0; v < V; ++v) {
      maxref = std::max(maxref, std::fabs(double(r[i * V + v])));
      maxdiff = std::max(maxdiff, std::fabs(double(g[i * Vp + v]) - double(r[i * V + v])));
    }
  return maxdiff / std::max(maxref, 1e-30);
}

// Loads `dir` into a fresh model of `cfg` and returns the error of its logits on the reference tokens.
double fixture_error(const std::string& dir, const GPTConfig& cfg, const std::string& which,
                     const HfImportOptions& opts = {}) {
  auto ctx = make_cpu_context();
  GPTModel model(cfg, *ctx);
  load_model_weights(dir, model.params(), opts);
  model.sync_compute();
  const Tensor tokens = reference().read(which + ".tokens");
  model.forward(tokens, tokens, 0.0f);
  return logits_rel_err(model.logits(), reference().read(which + ".logits"));
}

std::string load_error(const std::string& dir, const GPTConfig& cfg) {
  auto ctx = make_cpu_context();
  GPTModel model(cfg, *ctx);
  try {
    load_model_weights(dir, model.params());
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

// A copy of an HF fixture with `edit` applied to its tensors (name -> tensor).
void write_variant(const std::string& src, const std::string& dst, const std::function<void(std::map<std::string, Tensor>&)>& edit,
                   const std::string& config_edit_from = "", const std::string& config_edit_to = "") {
  const HfCheckpoint hf = HfCheckpoint::open(src);
  std::map<std::string, Tensor> tensors;
  for (const std::string& n : hf.names()) tensors[n] = hf.read(n, DType::kF32);
  edit(tensors);
  NamedTensors named;
  for (const auto& [n, t] : tensors) named.emplace_back(n, t);
  std::string config = hf.config().raw_json;
  if (!config_edit_from.empty()) {
    const size_t at = config.find(config_edit_from);
    ASSERT_NE(at, std::string::npos) << config_edit_from;
    config.replace(at, config_edit_from.size(), config_edit_to);
  }
  write_hf_dir(dst, config, named);
}

std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

// Every parameter of `a` equals `b`'s, the vocabulary tables on their first `vocab` rows (the padding is not
// exported).
void expect_same_weights(const ParameterSet& a, ParameterSet& b, int64_t vocab) {
  for (const Parameter& p : a.all()) {
    const Parameter* q = b.find(p.name);
    ASSERT_NE(q, nullptr) << p.name;
    ASSERT_EQ(p.shape, q->shape) << p.name;
    const bool table = p.name == "embedding.word_embeddings.weight" || p.name == "output_layer.weight";
    const int64_t n = table ? vocab * p.shape[1] : p.value.numel();
    EXPECT_EQ(std::memcmp(p.value.raw(), q->value.raw(), size_t(n) * sizeof(float)), 0) << p.name;
  }
}

GPTConfig gpt2_like() { return test::tiny_gpt2_config(16, 101, 128); }

GPTConfig llama_like() { return test::llama_variant(gpt2_like()); }

}  // namespace

// ---- configs ------------------------------------------------------------------------------------

TEST(ModelIo, ReadsTheFixtureConfigs) {
  EXPECT_TRUE(is_hf_model_dir(kGpt2));
  EXPECT_TRUE(is_hf_model_dir(kLlama));
  EXPECT_FALSE(is_hf_model_dir(kFixtures));
  const GPTConfig g = read_model_config(kGpt2);
  EXPECT_EQ(g.num_layers, 2);
  EXPECT_EQ(g.hidden_size, 32);
  EXPECT_EQ(g.num_attention_heads, 4);
  EXPECT_EQ(g.max_position_embeddings, 16);
  EXPECT_EQ(g.vocab_size, 101);
  EXPECT_EQ(g.padded_vocab_size, 128);
  EXPECT_EQ(g.ffn_hidden_size(), 128);
  EXPECT_EQ(g.normalization, NormKind::kLayerNorm);
  EXPECT_EQ(g.activation, MlpActivation::kGeLU);
  EXPECT_EQ(g.position_embedding_type, PositionEmbeddingType::kLearnedAbsolute);
  EXPECT_TRUE(g.add_bias_linear);
  EXPECT_FALSE(g.untie_embeddings_and_output_weights);
  EXPECT_EQ(read_model_config(kGpt2, 64).padded_vocab_size, 128);
  EXPECT_EQ(read_model_config(kGpt2, 1).padded_vocab_size, 101);

  const GPTConfig l = read_model_config(kLlama);
  EXPECT_EQ(l.normalization, NormKind::kRMSNorm);
  EXPECT_EQ(l.activation, MlpActivation::kSwiGLU);
  EXPECT_EQ(l.ffn_hidden_size(), 64);
  EXPECT_EQ(l.head_dim(), 8);
  EXPECT_EQ(l.num_kv_heads(), 2);
  EXPECT_FALSE(l.add_bias_linear);
  EXPECT_FALSE(l.qkv_bias());
  EXPECT_TRUE(l.untie_embeddings_and_output_weights);
  EXPECT_EQ(l.position_embedding_type, PositionEmbeddingType::kRope);
  EXPECT_EQ(l.rotary_base, 10000.0);
  EXPECT_FLOAT_EQ(l.layernorm_epsilon, 1e-6f);
  EXPECT_FALSE(l.use_rope_scaling);
  EXPECT_EQ(l.window_size_left, -1);
}

TEST(ModelIo, HfConfigOptionsMapToLoomFlags) {
  const std::string llama = slurp(kLlama + "/config.json");
  const auto with = [&](const std::string& from, const std::string& to) {
    std::string s = llama;
    const size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return s.replace(at, from.size(), to);
  };
  const auto cfg = [](const std::string& json) { return gpt_config_from_hf(parse_hf_config(json)); };
  const std::string scaling = R"("rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})";
  const GPTConfig scaled = cfg(with("\"rope_scaling\": null", scaling));
  EXPECT_TRUE(scaled.use_rope_scaling);
  EXPECT_FLOAT_EQ(scaled.rope_scaling_factor, 32.0f);
  std::string bad = scaling;
  bad.replace(bad.find("\"high_freq_factor\": 4.0"), 23, "\"high_freq_factor\": 2.0");
  EXPECT_NE(what_of([&] { cfg(with("\"rope_scaling\": null", bad)); }).find("high_freq_factor 2"), std::string::npos);

  const GPTConfig mistral = cfg(with("\"model_type\": \"llama\"", "\"model_type\": \"mistral\", \"sliding_window\": 4096"));
  EXPECT_EQ(mistral.window_size_left, 4095);  // HF: keys j > i - 4096, i.e. --window-size 4095,0
  EXPECT_EQ(mistral.attention_params().window, 4096);

  const GPTConfig qkv_only = cfg(with("\"attention_bias\": false", "\"attention_bias\": true"));
  EXPECT_FALSE(qkv_only.add_bias_linear);
  EXPECT_TRUE(qkv_only.add_qkv_bias);
  std::string both = with("\"attention_bias\": false", "\"attention_bias\": true");
  both.replace(both.find("\"mlp_bias\": false"), 17, "\"mlp_bias\": true ");
  const GPTConfig all_bias = cfg(both);
  EXPECT_TRUE(all_bias.add_bias_linear);
  EXPECT_NE(what_of([&] { cfg(with("\"mlp_bias\": false", "\"mlp_bias\": true")); }).find("mlp_bias"), std::string::npos);
  EXPECT_NE(what_of([&] { cfg(with("\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"")); }).find("hidden_act 'gelu'"),
            std::string::npos);
  const GPTConfig geglu = cfg(with("\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu_pytorch_tanh\""));
  EXPECT_EQ(geglu.activation, MlpActivation::kGeGLU);

  std::string gpt2 = slurp(kGpt2 + "/config.json");
  gpt2.replace(gpt2.find("\"gelu_new\""), 10, "\"gelu\"    ");
  EXPECT_NE(what_of([&] { cfg(gpt2); }).find("activation_function 'gelu'"), std::string::npos);
}

TEST(ModelIo, ConfigJsonRoundTripsEveryConvertibleArchitecture) {
  std::vector<GPTConfig> configs = {gpt2_like(), llama_like()};
  GPTConfig c = gpt2_like();
  c.untie_embeddings_and_output_weights = true;
  c.ffn_hidden = 80;
  configs.push_back(c);
  c = llama_like();
  c.add_qkv_bias = true;
  c.use_rope_scaling = true;
  c.rope_scaling_factor = 16.0f;
  c.rotary_base = 500000.0;
  c.kv_channels = 6;
  configs.push_back(c);
  c = llama_like();
  c.window_size_left = 7;
  c.untie_embeddings_and_output_weights = false;
  c.activation = MlpActivation::kReGLU;
  configs.push_back(c);
  c = llama_like();
  c.add_bias_linear = true;
  c.group_query_attention = false;
  c.layernorm_epsilon = 1e-6f;
  configs.push_back(c);
  for (const GPTConfig& want : configs) {
    const std::string json = hf_config_json(want);
    const GPTConfig got = gpt_config_from_hf(parse_hf_config(json), 128);
    EXPECT_EQ(nlohmann::json::parse(hf_config_json(got)), nlohmann::json::parse(json)) << json;
    EXPECT_EQ(got.num_parameters(), want.num_parameters()) << json;
    EXPECT_EQ(got.head_dim(), want.head_dim());
    EXPECT_EQ(got.num_kv_heads(), want.num_kv_heads());
    EXPECT_EQ(got.window_size_left, want.window_size_left);
    EXPECT_EQ(got.activation, want.activation);
    EXPECT_EQ(got.rotary_base, want.rotary_base);
    EXPECT_EQ(got.use_rope_scaling, want.use_rope_scaling);
    EXPECT_EQ(got.rope_scaling_factor, want.rope_scaling_factor);
    EXPECT_EQ(got.layernorm_epsilon, want.layernorm_epsilon);
    EXPECT_EQ(got.qkv_bias(), want.qkv_bias());
    EXPECT_EQ(got.add_bias_linear, want.add_bias_linear);
  }
  EXPECT_NE(hf_config_json(gpt2_like()).find("\"model_type\": \"gpt2\""), std::string::npos);
  EXPECT_NE(hf_config_json(configs[4]).find("\"model_type\": \"mistral\""), std::string::npos);
  EXPECT_NE(hf_config_json(configs[4]).find("\"sliding_window\": 8"), std::string::npos);
  EXPECT_NE(hf_config_json(llama_like()).find("\"rms_norm_eps\": 1e-05"), std::string::npos);
}

TEST(ModelIo, ArchitecturesWithoutAnHfCounterpartAreRejected) {
  GPTConfig c = llama_like();
  c.qk_layernorm = true;
  EXPECT_NE(what_of([&] { hf_family_for(c); }).find("--qk-layernorm"), std::string::npos);
  c = llama_like();
  c.rotary_percent = 0.5f;
  EXPECT_NE(what_of([&] { hf_family_for(c); }).find("--rotary-percent"), std::string::npos);
  c = llama_like();
  c.normalization = NormKind::kLayerNorm;
  EXPECT_NE(what_of([&] { hf_family_for(c); }).find("--normalization LayerNorm"), std::string::npos);
  c = gpt2_like();
  c.group_query_attention = true;
  c.num_query_groups = 2;
  EXPECT_NE(what_of([&] { hf_family_for(c); }).find("--group-query-attention"), std::string::npos);
  c = gpt2_like();
  c.position_embedding_type = PositionEmbeddingType::kNone;
  EXPECT_NE(what_of([&] { hf_family_for(c); }).find("none"), std::string::npos);
  c = llama_like();
  c.window_size_left = 3;
  c.add_qkv_bias = true;
  EXPECT_NE(what_of([&] { hf_config_json(c); }).find("Mistral"), std::string::npos);
}

// ---- layout -------------------------------------------------------------------------------------

TEST(HfMapping, QkvRowSourceIsMegatronsGroupedOrder) {
  // NH 4, NKV 2, HS 2: [Q0 Q1 Q2 Q3 | K0 K1 | V0 V1] -> [Q0 Q1 K0 V0 | Q2 Q3 K1 V1].
  EXPECT_EQ(hf_qkv_row_source(4, 2, 2),
            (std::vector<int64_t>{0, 1, 2, 3, 8, 9, 12, 13, 4, 5, 6, 7, 10, 11, 14, 15}));
  // MHA (GPT-2's c_attn) NH 2, HS 1: [q0 q1 | k0 k1 | v0 v1] -> [q0 k0 v0 q1 k1 v1].
  EXPECT_EQ(hf_qkv_row_source(2, 2, 1), (std::vector<int64_t>{0, 2, 4, 1, 3, 5}));
  // Interleaved RoPE, NH 2, NKV 1, HS 4: q/k heads' rows (0, 2, 1, 3); values untouched.
  EXPECT_EQ(hf_qkv_row_source(2, 1, 4, true, 4),
            (std::vector<int64_t>{0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 13, 14, 15}));
}

TEST(HfMapping, CoversExactlyTheModelsParameters) {
  std::vector<GPTConfig> configs = {gpt2_like(), llama_like()};
  GPTConfig c = gpt2_like();
  c.untie_embeddings_and_output_weights = true;
  configs.push_back(c);
  c = llama_like();
  c.add_qkv_bias = true;
  configs.push_back(c);
  c = llama_like();
  c.add_bias_linear = true;
  c.untie_embeddings_and_output_weights = false;
  c.kv_channels = 6;
  configs.push_back(c);
  auto ctx = make_cpu_context();
  for (const GPTConfig& cfg : configs) {
    GPTModel model(cfg, *ctx);
    const HfLayout layout = hf_layout(cfg);
    ASSERT_EQ(layout.params.size(), model.params().all().size());
    size_t i = 0;
    for (const Parameter& p : model.params().all()) {
      EXPECT_EQ(layout.params[i].loom_name, p.name);
      EXPECT_EQ(layout.params[i].loom_shape, p.shape) << p.name;
      ++i;
    }
    EXPECT_EQ(layout.zero_tensors.size(), cfg.qkv_bias() && !cfg.add_bias_linear ? size_t(cfg.num_layers) : 0u);
    EXPECT_EQ(layout.aliases.size(), cfg.untie_embeddings_and_output_weights ? 0u : 1u);
  }
}

TEST(HfMapping, ToLoomAndBackIsExact) {
  // A Conv1D part (in 3, out 4) transposed into (4, 3) with rows reversed, plus a padding row.
  HfParamMap m;
  m.loom_name = "w";
  m.loom_shape = {5, 3};
  m.parts.push_back({"conv", {3, 4}, true});
  m.row_source = {3, 2, 1, 0, -1};
  Tensor conv = Tensor::empty({3, 4}, DType::kF32);
  for (int64_t i = 0; i < 12; ++i) conv.data<float>()[i] = float(i + 1);
  Tensor loom = Tensor::empty({5, 3}, DType::kF32);
  hf_to_loom(m, {conv}, loom);
  // Loom row 0 = column 3 of conv = (4, 8, 12); row 4 is zero.
  const float* l = loom.data<float>();
  EXPECT_EQ(std::vector<float>(l, l + 3), (std::vector<float>{4, 8, 12}));
  EXPECT_EQ(std::vector<float>(l + 9, l + 12), (std::vector<float>{1, 5, 9}));
  EXPECT_EQ(std::vector<float>(l + 12, l + 15), (std::vector<float>{0, 0, 0}));
  const std::vector<Tensor> back = loom_to_hf(m, loom);
  ASSERT_EQ(back.size(), 1u);
  EXPECT_EQ(std::memcmp(back[0].raw(), conv.raw(), size_t(conv.nbytes())), 0);
}

// ---- weights against the PyTorch reference ---------------------------------------------------------

TEST(ModelIo, Gpt2FixtureLogitsMatchTheReference) {
  const double err = fixture_error(kGpt2, read_model_config(kGpt2), "gpt2");
  std::printf("gpt2 logits rel err %.3g\n", err);
  EXPECT_LT(err, 1e-5);
}

TEST(ModelIo, LlamaFixtureLogitsMatchTheReference) {
  const double err = fixture_error(kLlama, read_model_config(kLlama), "llama");
  std::printf("llama logits rel err %.3g\n", err);
  EXPECT_LT(err, 1e-5);
}

TEST(ModelIo, LlamaWithInterleavedRopeMatchesTheReference) {
  GPTConfig cfg = read_model_config(kLlama);
  cfg.rotary_interleaved = true;
  HfImportOptions opts;
  opts.rotary_interleaved = true;
  const double err = fixture_error(kLlama, cfg, "llama", opts);
  std::printf("llama (interleaved RoPE) logits rel err %.3g\n", err);
  EXPECT_LT(err, 1e-5);
  // Without the permutation the interleaved model computes something else.
  EXPECT_GT(fixture_error(kLlama, cfg, "llama"), 1e-3);
}

TEST(ModelIo, PaddedVocabularyRowsAreZero) {
  auto ctx = make_cpu_context();
  const GPTConfig cfg = read_model_config(kLlama);
  GPTModel model(cfg, *ctx);
  model.initialize(1);
  load_model_weights(kLlama, model.params());
  for (const char* name : {"embedding.word_embeddings.weight", "output_layer.weight"}) {
    const Parameter* p = model.params().find(name);
    ASSERT_NE(p, nullptr);
    const float* v = p->value.data<float>();
    for (int64_t i = cfg.vocab_size * cfg.hidden_size; i < p->value.numel(); ++i) ASSERT_EQ(v[i], 0.0f) << name;
    EXPECT_NE(v[0], 0.0f);
  }
}

TEST(ModelIo, HubStyleGpt2WithoutPrefixAndWithMaskBuffersLoads) {
  TempDir tmp;
  write_variant(kGpt2, tmp / "hub", [](std::map<std::string, Tensor>& t) {
    std::map<std::string, Tensor> out;
    for (auto& [n, v] : t) out[n.substr(std::string("transformer.").size())] = v;
    for (int i = 0; i < 2; ++i) {
      out["h." + std::to_string(i) + ".attn.bias"] = Tensor::zeros({1, 1, 16, 16}, DType::kF32);
      out["h." + std::to_string(i) + ".attn.masked_bias"] = Tensor::zeros({}, DType::kF32);
    }
    out["lm_head.weight"] = t.at("transformer.wte.weight");  // a tied copy stored anyway
    t = out;
  });
  EXPECT_LT(fixture_error(tmp / "hub", read_model_config(kGpt2), "gpt2"), 1e-5);
}

// ---- errors -----------------------------------------------------------------------------------------

TEST(ModelIo, UnmappedMissingAndMisshapenTensorsAreNamed) {
  TempDir tmp;
  const GPTConfig cfg = read_model_config(kGpt2);
  write_variant(kGpt2, tmp / "extra", [](std::map<std::string, Tensor>& t) {
    t["transformer.h.0.attn.q_norm.weight"] = Tensor::zeros({8}, DType::kF32);
  });
  std::string e = load_error(tmp / "extra", cfg);
  EXPECT_NE(e.find("HF tensor 'transformer.h.0.attn.q_norm.weight'"), std::string::npos) << e;
  EXPECT_NE(e.find("maps to no Loom parameter"), std::string::npos) << e;

  write_variant(kGpt2, tmp / "missing", [](std::map<std::string, Tensor>& t) { t.erase("transformer.h.1.mlp.c_fc.bias"); });
  e = load_error(tmp / "missing", cfg);
  EXPECT_NE(e.find("has no tensor 'transformer.h.1.mlp.c_fc.bias'"), std::string::npos) << e;
  EXPECT_NE(e.find("decoder.layers.1.mlp.linear_fc1.bias"), std::string::npos) << e;

  write_variant(kGpt2, tmp / "shape", [](std::map<std::string, Tensor>& t) {
    t["transformer.h.0.mlp.c_fc.weight"] = Tensor::zeros({128, 32}, DType::kF32);  // (out, in): not Conv1D's
  });
  e = load_error(tmp / "shape", cfg);
  EXPECT_NE(e.find("'transformer.h.0.mlp.c_fc.weight'"), std::string::npos) << e;
  EXPECT_NE(e.find("(128, 32)"), std::string::npos) << e;
  EXPECT_NE(e.find("(32, 128)"), std::string::npos) << e;

  write_variant(kGpt2, tmp / "untied_copy", [](std::map<std::string, Tensor>& t) {
    Tensor head = Tensor::zeros({101, 32}, DType::kF32);
    t["lm_head.weight"] = head;
  });
  e = load_error(tmp / "untied_copy", cfg);
  EXPECT_NE(e.find("'lm_head.weight'"), std::string::npos) << e;
  EXPECT_NE(e.find("tie_word_embeddings"), std::string::npos) << e;

  // A model of another architecture than the directory holds.
  GPTConfig other = cfg;
  other.ffn_hidden = 64;
  e = load_error(kGpt2, other);
  EXPECT_NE(e.find("linear_fc1"), std::string::npos) << e;
  EXPECT_NE(e.find("(64, 32)"), std::string::npos) << e;

  // Nothing is written into the parameters when a check fails.
  auto ctx = make_cpu_context();
  GPTModel model(cfg, *ctx);
  model.initialize(3);
  const std::vector<float> before(model.params().values().data<float>(),
                                  model.params().values().data<float>() + model.params().numel());
  EXPECT_THROW(load_model_weights(tmp / "missing", model.params()), UserError);
  EXPECT_EQ(std::memcmp(before.data(), model.params().values().raw(), before.size() * sizeof(float)), 0);
}

TEST(ModelIo, QkvOnlyBiasesWriteAndCheckAZeroOutputBias) {
  TempDir tmp;
  GPTConfig cfg = llama_like();
  cfg.add_qkv_bias = true;
  auto ctx = make_cpu_context();
  GPTModel model(cfg, *ctx);
  model.initialize(7);
  for (Parameter& p : model.params().all())  // give the (zero-initialised) biases values
    if (p.name.find("linear_qkv.bias") != std::string::npos)
      for (int64_t i = 0; i < p.value.numel(); ++i) p.value.data<float>()[i] = 0.01f * float(i + 1);
  export_hf(model.params(), cfg, tmp / "hf");
  const HfCheckpoint hf = HfCheckpoint::open(tmp / "hf");
  EXPECT_TRUE(hf.config().attention_bias);
  EXPECT_FALSE(hf.config().mlp_bias);
  ASSERT_TRUE(hf.contains("model.layers.1.self_attn.o_proj.bias"));
  ASSERT_TRUE(hf.contains("model.layers.1.self_attn.k_proj.bias"));
  GPTModel back(read_model_config(tmp / "hf"), *ctx);
  load_model_weights(tmp / "hf", back.params());
  expect_same_weights(model.params(), back.params(), cfg.vocab_size);
  write_variant(tmp / "hf", tmp / "bad", [](std::map<std::string, Tensor>& t) {
    t.at("model.layers.1.self_attn.o_proj.bias").data<float>()[3] = 0.5f;
  });
  const std::string e = load_error(tmp / "bad", cfg);
  EXPECT_NE(e.find("'model.layers.1.self_attn.o_proj.bias'"), std::string::npos) << e;
  EXPECT_NE(e.find("not zero"), std::string::npos) << e;
}

// ---- round trips ------------------------------------------------------------------------------------

TEST(ModelIo, ExportReproducesTheFixtureBytes) {
  for (const std::string& dir : {kGpt2, kLlama}) {
    TempDir tmp;
    auto ctx = make_cpu_context();
    const GPTConfig cfg = read_model_config(dir);
    GPTModel model(cfg, *ctx);
    load_model_weights(dir, model.params());
    std::ostringstream log;
    HfExportOptions opts;
    opts.log = &log;
    export_hf(model.params(), cfg, tmp / "out", opts);
    // Byte for byte what transformers wrote, plus the checksum entry in the metadata.
    EXPECT_TRUE(SafetensorsFile::open(tmp / "out/model.safetensors").has_checksums());
    EXPECT_EQ(ckpt_test::without_checksums(slurp(tmp / "out/model.safetensors")), slurp(dir + "/model.safetensors")) << dir;
    EXPECT_EQ(nlohmann::json::parse(hf_config_json(read_model_config(tmp / "out"))),
              nlohmann::json::parse(hf_config_json(cfg)));
    EXPECT_NE(log.str().find("x2"), std::string::npos) << log.str();
  }
}

TEST(ModelIo, ConvertRoundTripIsByteIdentical) {
  for (const std::string& dir : {kGpt2, kLlama}) {
    TempDir tmp;
    std::ostringstream log;
    convert_hf_to_loom(dir, tmp / "loom", {}, log);
    const std::string out = log.str();
    if (dir == kGpt2) {
      EXPECT_NE(out.find("transformer.h.*.attn.c_attn.weight -> decoder.layers.*.self_attention.linear_qkv.weight "
                         "(transposed, regrouped) x2"),
                std::string::npos)
          << out;
      EXPECT_NE(out.find("lm_head.weight -> tied to transformer.wte.weight"), std::string::npos) << out;
    } else {
      EXPECT_NE(out.find("model.layers.*.self_attn.q_proj.weight + model.layers.*.self_attn.k_proj.weight + "
                         "model.layers.*.self_attn.v_proj.weight -> decoder.layers.*.self_attention.linear_qkv.weight "
                         "(regrouped) x2"),
                std::string::npos)
          << out;
      EXPECT_NE(out.find("(padded 101 -> 128 rows) x1"), std::string::npos) << out;
    }
    // The Loom checkpoint: committed at iteration 0, config and weights as load_model_weights gives them.
    const std::optional<LatestCheckpoint> latest = read_latest_checkpoint(tmp / "loom");
    ASSERT_TRUE(latest);
    EXPECT_EQ(latest->iteration, 0);
    const GPTConfig cfg = read_model_config(tmp / "loom");
    EXPECT_EQ(nlohmann::json::parse(hf_config_json(cfg)), nlohmann::json::parse(hf_config_json(read_model_config(dir))));
    EXPECT_EQ(read_model_config(latest->dir).num_parameters(), cfg.num_parameters());
    auto ctx = make_cpu_context();
    GPTModel a(cfg, *ctx), b(cfg, *ctx);
    load_model_weights(tmp / "loom", a.params());
    load_model_weights(dir, b.params());
    EXPECT_EQ(std::memcmp(a.params().values().raw(), b.params().values().raw(), size_t(a.params().values().nbytes())), 0);

    convert_loom_to_hf(tmp / "loom", tmp / "hf", {}, log);
    EXPECT_EQ(ckpt_test::without_checksums(slurp(tmp / "hf/model.safetensors")), slurp(dir + "/model.safetensors")) << dir;
    const HfConfig back = HfCheckpoint::open(tmp / "hf").config();
    const HfConfig orig = HfCheckpoint::open(dir).config();
    EXPECT_EQ(back.bos_token_id.value_or(-1), orig.bos_token_id.value_or(-2));  // kept in the Loom metadata
    EXPECT_EQ(back.eos_token_ids, orig.eos_token_ids);
  }
}

TEST(ModelIo, InterleavedAndShardedRoundTripsAreByteIdentical) {
  TempDir tmp;
  std::ostringstream log;
  HfToLoomOptions to_loom;
  to_loom.rotary_interleaved = true;
  convert_hf_to_loom(kLlama, tmp / "loom", to_loom, log);
  EXPECT_TRUE(read_model_config(tmp / "loom").rotary_interleaved);
  HfExportOptions to_hf;
  to_hf.max_shard_bytes = 30000;
  convert_loom_to_hf(tmp / "loom", tmp / "hf", to_hf, log);
  const HfCheckpoint sharded = HfCheckpoint::open(tmp / "hf");
  EXPECT_TRUE(sharded.sharded());
  const HfCheckpoint orig = HfCheckpoint::open(kLlama);
  ASSERT_EQ(sharded.names(), orig.names());
  for (const std::string& n : orig.names()) {
    const Tensor x = sharded.read(n, DType::kF32), y = orig.read(n, DType::kF32);
    EXPECT_EQ(std::memcmp(x.raw(), y.raw(), size_t(x.nbytes())), 0) << n;
  }
  // The interleaved checkpoint's qkv rows really are permuted.
  const ShardedCheckpoint ck = ShardedCheckpoint::open(read_latest_checkpoint(tmp / "loom")->dir);
  const Tensor qkv = ck.read_full("decoder.layers.0.self_attention.linear_qkv.weight", DType::kF32);
  const Tensor q = orig.read("model.layers.0.self_attn.q_proj.weight", DType::kF32);
  const int64_t C = 32;
  EXPECT_EQ(std::memcmp(qkv.data<float>(), q.data<float>(), C * sizeof(float)), 0);              // row 0 = HF row 0
  EXPECT_EQ(std::memcmp(qkv.data<float>() + C, q.data<float>() + 4 * C, C * sizeof(float)), 0);  // row 1 = HF row 4
}

TEST(ModelIo, Bf16ExportRoundsAndReloads) {
  TempDir tmp;
  std::ostringstream log;
  convert_hf_to_loom(kGpt2, tmp / "loom", {}, log);
  HfExportOptions opts;
  opts.dtype = DType::kBF16;
  convert_loom_to_hf(tmp / "loom", tmp / "hf", opts, log);
  const HfCheckpoint hf = HfCheckpoint::open(tmp / "hf");
  EXPECT_EQ(hf.config().torch_dtype, "bfloat16");
  EXPECT_EQ(hf.info("transformer.h.0.attn.c_attn.weight").dtype_str, "BF16");
  const Tensor got = hf.read("transformer.wte.weight", DType::kF32);
  const Tensor want = HfCheckpoint::open(kGpt2).read("transformer.wte.weight", DType::kF32);
  for (int64_t i = 0; i < want.numel(); ++i)
    ASSERT_EQ(got.data<float>()[i], bf16_to_f32(f32_to_bf16(want.data<float>()[i]))) << i;
  // bf16 weights still give the reference logits to bf16 accuracy.
  EXPECT_LT(fixture_error(tmp / "hf", read_model_config(tmp / "hf"), "gpt2"), 3e-2);
}

// A checkpoint the trainer saved reads back with the same architecture (the two metadata writers agree),
// and its weights load by name.
TEST(ModelIo, ReadsTrainerCheckpoints) {
  TempDir tmp;
  const std::vector<std::string> args = {
      "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
      "--max-position-embeddings", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
      "--mock-data", "--vocab-size", "101", "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "48",
      "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear", "--add-qkv-bias",
      "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--rotary-interleaved",
      "--save", tmp / "ck", "--log-interval", "1"};
  TrainConfig tc = parse_train_args(args);
  std::ostringstream log;
  run_training(tc, log);
  const GPTConfig cfg = read_model_config(tmp / "ck");
  GPTConfig want = llama_like();
  want.add_qkv_bias = true;
  EXPECT_EQ(cfg.num_parameters(), want.num_parameters());
  EXPECT_TRUE(cfg.rotary_interleaved);
  EXPECT_TRUE(cfg.add_qkv_bias);
  EXPECT_EQ(cfg.num_kv_heads(), 2);
  EXPECT_EQ(cfg.padded_vocab_size, 128);
  auto ctx = make_cpu_context();
  GPTModel model(cfg, *ctx);
  load_model_weights(tmp / "ck", model.params());
  const ShardedCheckpoint ck = ShardedCheckpoint::open(read_latest_checkpoint(tmp / "ck")->dir);
  const Tensor w = ck.read_full("decoder.layers.1.mlp.linear_fc2.weight", DType::kF32);
  EXPECT_EQ(std::memcmp(model.params().find("decoder.layers.1.mlp.linear_fc2.weight")->value.raw(), w.raw(),
                        size_t(w.nbytes())),
            0);
  // And it exports: interleaved RoPE rows go back to HF's order, a zero o_proj bias is added.
  std::ostringstream out;
  convert_loom_to_hf(tmp / "ck", tmp / "hf", {}, out);
  const HfCheckpoint hf = HfCheckpoint::open(tmp / "hf");
  EXPECT_TRUE(hf.contains("model.layers.0.self_attn.o_proj.bias"));
  GPTConfig plain = cfg;
  plain.rotary_interleaved = false;
  GPTModel reloaded(plain, *ctx);
  load_model_weights(tmp / "hf", reloaded.params());
  HfImportOptions inter;
  inter.rotary_interleaved = true;
  GPTModel reloaded_inter(cfg, *ctx);
  load_model_weights(tmp / "hf", reloaded_inter.params(), inter);
  expect_same_weights(model.params(), reloaded_inter.params(), cfg.vocab_size);
  // Read as non-interleaved, the q/k rows differ (the permutation is real), the rest is the same.
  const Parameter* qkv = reloaded.params().find("decoder.layers.0.self_attention.linear_qkv.weight");
  EXPECT_NE(std::memcmp(qkv->value.raw(), model.params().find(qkv->name)->value.raw(), size_t(qkv->value.nbytes())), 0);
}

// A checkpoint of a newer format is refused by generate and convert too, as the trainer refuses it on resume.
TEST(ModelIo, NewerCheckpointFormatVersionIsRefused) {
  TempDir tmp;
  const std::string dir = tmp / "iter_0000001";
  fs::create_directories(dir);
  std::ofstream(dir + "/metadata.json")
      << R"({"format": "loom-checkpoint", "format_version": 99, "model_config": {"num_layers": 1}})";
  const std::string err = what_of([&] { read_model_config(dir); });
  EXPECT_NE(err.find("format_version 99"), std::string::npos) << err;
  EXPECT_NE(err.find("metadata.json"), std::string::npos) << err;
}

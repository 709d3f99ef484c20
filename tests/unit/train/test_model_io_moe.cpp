// Hugging Face <-> Loom conversion of mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against the
// tiny directories of tests/golden/gen_hf_moe_models.py: config.json maps to the MoE flags (routing,
// shared expert and gate, dense layers, q/k norms, head_dim); Loom's logits match the PyTorch reference
// within 1e-5 relative; HF -> Loom -> HF reproduces model.safetensors byte for byte (but for the checksum entry Loom adds to the
// metadata) (export and convert);
// greedy generation from the converted checkpoint (KV-cached prefill of the prompt, then one-token steps,
// and the no-cache path) gives the reference tokens and logits; the mapping's parameter list is exactly
// GPTModel's for MoE architectures; config.json round trips; unsupported routing and fields are refused
// naming them.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "loom/ckpt/checkpoint.h"
#include "loom/ckpt/hf_dir.h"
#include "loom/model/hf_mapping.h"
#include "loom/model/inference.h"
#include "loom/train/generate.h"
#include "loom/train/model_io.h"
#include "model_io_test_util.h"
#include "model_test_util.h"
#include "unit/ckpt/ckpt_test_util.h"

using namespace loom;
namespace fs = std::filesystem;

namespace {

const std::string kFixtures = LOOM_FIXTURE_DIR;
const std::vector<std::string> kCases = {"mixtral", "qwen2_moe", "qwen3_moe"};
std::string dir_of(const std::string& c) { return kFixtures + "/hf_" + c; }

// A scratch directory of this test file.
class TempDir : public test::ModelIoTempDir {
 public:
  TempDir() : test::ModelIoTempDir("model_io_moe") {}
};
using test::slurp;

const SafetensorsFile& reference() {
  static const SafetensorsFile f = SafetensorsFile::open(kFixtures + "/hf_moe_reference.safetensors");
  return f;
}

std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

// max |got - ref| / max |ref| of rows (n, V) of ref against rows of got with stride Vp.
double rel_err(const float* got, int64_t Vp, const float* ref, int64_t n, int64_t V) {
  double maxref = 0, maxdiff = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t v = 0; v < V; ++v) {
      maxref = std::max(maxref, std::fabs(double(ref[i * V + v])));
      maxdiff = std::max(maxdiff, std::fabs(double(got[i * Vp + v]) - double(ref[i * V + v])));
    }
  return maxdiff / std::max(maxref, 1e-30);
}

// config.json of `c` with `from` replaced by `to`.
std::string edited_config(const std::string& c, const std::string& from, const std::string& to) {
  std::string s = slurp(dir_of(c) + "/config.json");
  const size_t at = s.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) s.replace(at, from.size(), to);
  return s;
}

std::string hf_config_error(const std::string& json) {
  return what_of([&] { gpt_config_from_hf(parse_hf_config(json)); });
}

// A Mixtral-like Loom config (every layer MoE, softmax top-k routing); the Qwen variants edit it.
GPTConfig mixtral_like() {
  return test::moe_variant(test::llama_variant(test::tiny_gpt2_config(16, 101, 128)), 4, 2, 24);
}

GPTConfig qwen2_like() {
  GPTConfig c = mixtral_like();
  c.num_layers = 3;
  c.moe.layer_pattern = {1, 0, 1};
  c.moe.router.pre_softmax = true;
  c.moe.shared_expert_intermediate_size = 40;
  c.moe.shared_expert_gate = true;
  c.add_qkv_bias = true;
  c.untie_embeddings_and_output_weights = false;
  return c;
}

GPTConfig qwen3_like() {
  GPTConfig c = mixtral_like();
  c.qk_layernorm = true;
  c.kv_channels = 16;
  c.moe.layer_pattern = {0, 1};
  c.add_qkv_bias = true;  // Qwen3's attention_bias: o_proj gets an all-zero bias in the HF file
  return c;
}

}  // namespace

TEST(ModelIoMoe, ReadsTheFixtureConfigs) {
  const GPTConfig m = read_model_config(dir_of("mixtral"));
  EXPECT_EQ(m.moe.num_experts, 4);
  EXPECT_EQ(m.moe.router.num_experts, 4);
  EXPECT_EQ(m.moe.router.topk, 2);
  EXPECT_EQ(m.moe_ffn_hidden_size(), 48);
  EXPECT_FALSE(m.moe.router.pre_softmax);  // Mixtral renormalises the top-k: Loom's softmax over the k logits
  EXPECT_EQ(m.num_moe_layers(), 2);
  EXPECT_EQ(m.moe.shared_expert_intermediate_size, 0);
  EXPECT_FALSE(m.qk_layernorm);
  EXPECT_EQ(m.num_kv_heads(), 2);
  EXPECT_DOUBLE_EQ(m.moe.router.aux_loss_coeff, 0.02);
  EXPECT_EQ(m.window_size_left, -1);
  EXPECT_EQ(m.rotary_base, 1e6);

  const GPTConfig q2 = read_model_config(dir_of("qwen2_moe"));
  EXPECT_EQ(q2.moe.num_experts, 6);
  EXPECT_EQ(q2.moe.router.topk, 3);
  EXPECT_TRUE(q2.moe.router.pre_softmax);  // norm_topk_prob false
  EXPECT_EQ(q2.moe_ffn_hidden_size(), 24);
  EXPECT_EQ(q2.ffn_hidden_size(), 64);  // the dense layer's intermediate_size
  EXPECT_EQ(q2.moe.layer_pattern, (std::vector<int>{1, 0, 1}));
  EXPECT_EQ(q2.moe.shared_expert_intermediate_size, 40);
  EXPECT_TRUE(q2.moe.shared_expert_gate);
  EXPECT_TRUE(q2.add_qkv_bias);
  EXPECT_FALSE(q2.add_bias_linear);
  EXPECT_FALSE(q2.untie_embeddings_and_output_weights);

  const GPTConfig q3 = read_model_config(dir_of("qwen3_moe"));
  EXPECT_TRUE(q3.qk_layernorm);
  EXPECT_EQ(q3.head_dim(), 16);  // head_dim, not hidden / heads = 8
  EXPECT_EQ(q3.moe.layer_pattern, (std::vector<int>{0, 1}));  // decoder_sparse_step 2
  EXPECT_FALSE(q3.moe.router.pre_softmax);
  EXPECT_EQ(q3.moe.num_experts, 8);
  EXPECT_EQ(q3.ffn_hidden_size(), 48);
  EXPECT_EQ(q3.moe_ffn_hidden_size(), 16);
  EXPECT_FALSE(q3.qkv_bias());
}

TEST(ModelIoMoe, FixtureLogitsMatchTheReference) {
  for (const std::string& c : kCases) {
    const GPTConfig cfg = read_model_config(dir_of(c));
    auto ctx = make_cpu_context();
    GPTModel model(cfg, *ctx);
    load_model_weights(dir_of(c), model.params());
    model.sync_compute();
    const Tensor tokens = reference().read(c + ".tokens");
    model.forward(tokens, tokens, 0.0f);
    const Tensor ref = reference().read(c + ".logits");
    const double err = rel_err(model.logits().data<float>(), cfg.padded_vocab_size, ref.data<float>(),
                               ref.size(0) * ref.size(1), ref.size(2));
    EXPECT_LE(err, 1e-5) << c;
    std::printf("  %s logits rel err %.2e\n", c.c_str(), err);
  }
}

TEST(ModelIoMoe, ExportAndConvertRoundTripsAreByteIdentical) {
  for (const std::string& c : kCases) {
    TempDir tmp;
    const std::string dir = dir_of(c);
    std::ostringstream log;
    convert_hf_to_loom(dir, tmp / "loom", {}, log);
    if (c == "mixtral") {
      EXPECT_NE(log.str().find("model.layers.*.block_sparse_moe.experts.*.w1.weight + "
                               "model.layers.*.block_sparse_moe.experts.*.w3.weight -> "
                               "decoder.layers.*.mlp.experts.linear_fc1.weight* (concatenated [gate | up]) x8"),
                std::string::npos)
          << log.str();
    }
    if (c == "qwen2_moe") {
      EXPECT_NE(log.str().find("model.layers.*.mlp.shared_expert_gate.weight -> "
                               "decoder.layers.*.mlp.shared_experts.gate_weight x2"),
                std::string::npos)
          << log.str();
    }
    const GPTConfig cfg = read_model_config(tmp / "loom");
    EXPECT_EQ(nlohmann::json::parse(hf_config_json(cfg)),
              nlohmann::json::parse(hf_config_json(read_model_config(dir))));
    EXPECT_EQ(cfg.moe.layer_pattern, read_model_config(dir).moe.layer_pattern);

    // Directly from the model, and through the converter.
    auto ctx = make_cpu_context();
    GPTModel model(cfg, *ctx);
    load_model_weights(tmp / "loom", model.params());
    export_hf(model.params(), cfg, tmp / "exported");
    EXPECT_EQ(ckpt_test::without_checksums(slurp(tmp / "exported/model.safetensors")), slurp(dir + "/model.safetensors")) << c;
    convert_loom_to_hf(tmp / "loom", tmp / "hf", {}, log);
    EXPECT_EQ(ckpt_test::without_checksums(slurp(tmp / "hf/model.safetensors")), slurp(dir + "/model.safetensors")) << c;
    // config.json keeps every field Loom reads (the routing, pattern, shared expert, aux-loss coefficient).
    const HfConfig a = HfCheckpoint::open(tmp / "hf").config(), b = HfCheckpoint::open(dir).config();
    EXPECT_EQ(a.model_type, b.model_type);
    EXPECT_EQ(a.num_experts, b.num_experts);
    EXPECT_EQ(a.num_experts_per_tok, b.num_experts_per_tok);
    EXPECT_EQ(a.moe_intermediate_size, b.moe_intermediate_size);
    EXPECT_EQ(a.intermediate_size, b.intermediate_size);
    EXPECT_EQ(a.norm_topk_prob, b.norm_topk_prob);
    EXPECT_EQ(a.moe_layers, b.moe_layers);
    EXPECT_EQ(a.shared_expert_intermediate_size, b.shared_expert_intermediate_size);
    EXPECT_EQ(a.router_aux_loss_coef, b.router_aux_loss_coef);
    EXPECT_EQ(a.qk_norm, b.qk_norm);
    EXPECT_EQ(a.qkv_bias, b.qkv_bias);
    EXPECT_EQ(a.head_dim, b.head_dim);
    EXPECT_EQ(a.bos_token_id, b.bos_token_id);
  }
}

TEST(ModelIoMoe, GreedyGenerationFromTheConvertedModelMatchesPyTorch) {
  for (const std::string& c : kCases) {
    TempDir tmp;
    std::ostringstream log;
    convert_hf_to_loom(dir_of(c), tmp / "loom", {}, log);
    const auto ctx = make_cpu_context();
    const std::unique_ptr<GPTModel> model = load_model_for_inference(tmp / "loom", *ctx, DType::kF32);
    const GPTConfig& cfg = model->config();
    ASSERT_TRUE(cfg.is_moe()) << c;
    const Tensor prompt = reference().read(c + ".prompt"), want = reference().read(c + ".gen.tokens");
    const Tensor want_logits = reference().read(c + ".gen.logits");
    const int64_t Tp = prompt.numel(), steps = want.numel(), V = cfg.vocab_size, Vp = cfg.padded_vocab_size;
    // The KV-cached path by hand: the prompt in one prefill, then one token per step; every step's logits.
    InferenceSession s(*model, *ctx, 1, Tp + steps);
    TensorView logits = s.forward(prompt.reshape({1, Tp}));
    std::vector<int32_t> got;
    for (int64_t k = 0; k < steps; ++k) {
      const float* row = logits.data<float>();
      EXPECT_LE(rel_err(row, Vp, want_logits.data<float>() + k * V, 1, V), 1e-5) << c << " step " << k;
      got.push_back(int32_t(std::max_element(row, row + V) - row));
      if (k + 1 < steps) {
        Tensor t = Tensor::empty({1, 1}, DType::kI32);
        t.data<int32_t>()[0] = got.back();
        logits = s.forward(t);
      }
    }
    const std::vector<int32_t> ref(want.data<int32_t>(), want.data<int32_t>() + steps);
    EXPECT_EQ(got, ref) << c;
    // `loom generate`'s loop, with and without the cache.
    const std::vector<int32_t> p(prompt.data<int32_t>(), prompt.data<int32_t>() + Tp);
    GenerateOptions o;
    o.max_new_tokens = steps;
    o.sampling.temperature = 0.0f;
    EXPECT_EQ(generate(*model, *ctx, {p}, o).tokens[0], ref) << c;
    o.use_kv_cache = false;
    EXPECT_EQ(generate(*model, *ctx, {p}, o).tokens[0], ref) << c;
  }
}

TEST(ModelIoMoe, MappingCoversExactlyTheModelsParameters) {
  auto ctx = make_cpu_context();
  for (const GPTConfig& cfg : {mixtral_like(), qwen2_like(), qwen3_like()}) {
    GPTModel model(cfg, *ctx);
    const HfLayout layout = hf_layout(cfg);
    ASSERT_EQ(layout.params.size(), model.params().all().size());
    size_t i = 0;
    for (const Parameter& p : model.params().all()) {
      EXPECT_EQ(layout.params[i].loom_name, p.name);
      EXPECT_EQ(layout.params[i].loom_shape, p.shape) << p.name;
      ++i;
    }
    // Qwen3-MoE's attention_bias covers o_proj, which Loom does not have: an all-zero tensor per layer.
    EXPECT_EQ(layout.zero_tensors.size(), cfg.qk_layernorm ? size_t(cfg.num_layers) : 0u);
  }
  EXPECT_EQ(hf_family_for(mixtral_like()), HfFamily::kMixtral);
  EXPECT_EQ(hf_family_for(qwen2_like()), HfFamily::kQwen2Moe);
  EXPECT_EQ(hf_family_for(qwen3_like()), HfFamily::kQwen3Moe);
}

TEST(ModelIoMoe, ConfigJsonRoundTripsMoeArchitectures) {
  GPTConfig windowed = mixtral_like();
  windowed.window_size_left = 7;
  GPTConfig qwen3_pre = qwen3_like();
  qwen3_pre.moe.router.pre_softmax = true;
  qwen3_pre.moe.router.aux_loss_coeff = 0.01;
  for (const GPTConfig& want : {mixtral_like(), qwen2_like(), qwen3_like(), windowed, qwen3_pre}) {
    const std::string json = hf_config_json(want);
    const GPTConfig got = gpt_config_from_hf(parse_hf_config(json), 128);
    EXPECT_EQ(nlohmann::json::parse(hf_config_json(got)), nlohmann::json::parse(json)) << json;
    EXPECT_EQ(got.num_parameters(), want.num_parameters()) << json;
    EXPECT_EQ(got.num_active_parameters(), want.num_active_parameters()) << json;
    for (int64_t l = 0; l < want.num_layers; ++l) EXPECT_EQ(got.is_moe_layer(l), want.is_moe_layer(l));
    EXPECT_EQ(got.moe.router.pre_softmax, want.moe.router.pre_softmax);
    EXPECT_EQ(got.moe.router.topk, want.moe.router.topk);
    EXPECT_EQ(got.moe.shared_expert_gate, want.moe.shared_expert_gate);
    EXPECT_EQ(got.window_size_left, want.window_size_left);
    EXPECT_FLOAT_EQ(float(got.moe.router.aux_loss_coeff), float(want.moe.router.aux_loss_coeff));
  }
  const nlohmann::json m = nlohmann::json::parse(hf_config_json(mixtral_like()));
  EXPECT_EQ(m["architectures"][0], "MixtralForCausalLM");
  EXPECT_EQ(m["num_local_experts"], 4);
  EXPECT_EQ(m["intermediate_size"], 24);
  EXPECT_TRUE(m["sliding_window"].is_null());
  EXPECT_EQ(nlohmann::json::parse(hf_config_json(windowed))["sliding_window"], 8);
  const nlohmann::json q = nlohmann::json::parse(hf_config_json(qwen2_like()));
  EXPECT_EQ(q["model_type"], "qwen2_moe");
  EXPECT_EQ(q["mlp_only_layers"], nlohmann::json::array({1}));
  EXPECT_EQ(q["norm_topk_prob"], false);
  EXPECT_EQ(q["shared_expert_intermediate_size"], 40);
  EXPECT_EQ(nlohmann::json::parse(hf_config_json(qwen3_like()))["head_dim"], 16);
}

TEST(ModelIoMoe, ArchitecturesWithoutAnHfCounterpartAreRefused) {
  const auto family_error = [](const std::function<void(GPTConfig&)>& edit, GPTConfig c = mixtral_like()) {
    edit(c);
    return what_of([&] { hf_family_for(c); });
  };
  const auto has = [](const std::string& msg, const std::string& needle) {
    EXPECT_NE(msg.find(needle), std::string::npos) << "message: '" << msg << "'";
  };
  has(family_error([](GPTConfig& c) { c.moe.router.score_function = MoeScoreFunction::kSigmoid; }),
      "--moe-router-score-function sigmoid");
  has(family_error([](GPTConfig& c) { c.moe.router.topk_scaling_factor = 2.5; }), "--moe-router-topk-scaling-factor");
  has(family_error([](GPTConfig& c) { c.moe.router.enable_expert_bias = true; }), "--moe-router-enable-expert-bias");
  has(family_error([](GPTConfig& c) { c.moe.router.pre_softmax = true; }), "--moe-router-pre-softmax");
  has(family_error([](GPTConfig& c) { c.moe.layer_pattern = {1, 0}; }), "--moe-layer-freq");
  has(family_error([](GPTConfig& c) { c.add_qkv_bias = true; }), "--add-qkv-bias");
  has(family_error([](GPTConfig& c) { c.moe.shared_expert_gate = false; }, qwen2_like()), "--moe-shared-expert-gate");
  has(family_error([](GPTConfig& c) { c.add_qkv_bias = false; }, qwen2_like()), "--add-qkv-bias");
  has(family_error([](GPTConfig& c) { c.qk_layernorm = true; }, qwen2_like()), "--qk-layernorm");
  has(family_error([](GPTConfig& c) { c.window_size_left = 5; }, qwen3_like()), "--window-size");
  has(family_error([](GPTConfig& c) { c.position_embedding_type = PositionEmbeddingType::kLearnedAbsolute; }),
      "learned_absolute");
  // A dense model with q/k norms still has no counterpart.
  GPTConfig dense = test::llama_variant(test::tiny_gpt2_config(16, 101, 128));
  dense.qk_layernorm = true;
  has(what_of([&] { hf_family_for(dense); }), "--qk-layernorm");
  // PEFT adapters are not mapped for MoE models.
  has(what_of([&] { hf_lora_layout(mixtral_like(), {LoraTarget::kQkv}, 4); }), "mixture-of-experts");
}

TEST(ModelIoMoe, UnsupportedHfConfigsAreRefusedNamingTheField) {
  const auto has = [](const std::string& msg, const std::string& needle) {
    EXPECT_NE(msg.find(needle), std::string::npos) << "message: '" << msg << "'";
  };
  has(hf_config_error(edited_config("qwen2_moe", "\"use_sliding_window\": false", "\"use_sliding_window\": true")),
      "use_sliding_window");
  has(hf_config_error(edited_config("qwen3_moe", "\"use_sliding_window\": false",
                                    "\"use_sliding_window\": false, \"layer_types\": [\"sliding_attention\", "
                                    "\"full_attention\"]")),
      "layer_types");
  has(hf_config_error(edited_config("mixtral", "\"router_jitter_noise\": 0.0", "\"router_jitter_noise\": 0.1")),
      "router_jitter_noise");
  has(hf_config_error(edited_config("mixtral", "\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 5")),
      "num_experts_per_tok");
  has(hf_config_error(edited_config("mixtral", "\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 1")),
      "--moe-router-pre-softmax");
  const std::string only_layer_1 = "\"mlp_only_layers\": [\n    1\n  ]";
  has(hf_config_error(edited_config("qwen2_moe", only_layer_1, "\"mlp_only_layers\": [0, 1, 2]")),
      "no sparse MoE layer");
  has(hf_config_error(edited_config("qwen2_moe", only_layer_1, "\"mlp_only_layers\": [3]")),
      "mlp_only_layers");
  has(hf_config_error(edited_config("qwen3_moe", "\"model_type\": \"qwen3_moe\"", "\"model_type\": \"olmoe\"")),
      "'olmoe' is not supported");
  has(hf_config_error(edited_config("mixtral", "\"num_local_experts\": 4,", "")), "num_local_experts");
  // Mixtral's sliding window is Mistral's: W keys -> --window-size W-1,0.
  const GPTConfig w = gpt_config_from_hf(
      parse_hf_config(edited_config("mixtral", "\"sliding_window\": null", "\"sliding_window\": 4096")));
  EXPECT_EQ(w.window_size_left, 4095);
  // norm_topk_prob true on Qwen: softmax routing without pre-softmax.
  EXPECT_FALSE(gpt_config_from_hf(parse_hf_config(edited_config("qwen2_moe", "\"norm_topk_prob\": false",
                                                                "\"norm_topk_prob\": true")))
                   .moe.router.pre_softmax);
  // A bad tensor name in a MoE directory is named (the importer's strict checks apply).
  TempDir tmp;
  const HfCheckpoint hf = HfCheckpoint::open(dir_of("mixtral"));
  NamedTensors named;
  std::vector<Tensor> keep;
  for (const std::string& n : hf.names()) {
    keep.push_back(hf.read(n, DType::kF32));
    const std::string name = n == "model.layers.1.block_sparse_moe.experts.3.w3.weight"
                                 ? "model.layers.1.block_sparse_moe.experts.4.w3.weight"
                                 : n;
    named.emplace_back(name, keep.back());
  }
  write_hf_dir(tmp / "bad", hf.config().raw_json, named);
  const GPTConfig cfg = read_model_config(tmp / "bad");
  auto ctx = make_cpu_context();
  GPTModel model(cfg, *ctx);
  has(what_of([&] { load_model_weights(tmp / "bad", model.params()); }), "experts.4.w3.weight");
}

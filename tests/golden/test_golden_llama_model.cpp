// Whole-model checks of GPTModel's Llama-family options against the PyTorch float64 reference in
// fixtures/llama_tiny.safetensors (tests/golden/gen_llama_model.py, a Hugging Face LlamaModel written out):
// RMSNorm, SwiGLU, RoPE, untied output, no biases with multi-head, grouped-query and multi-query attention,
// each with and without a sliding window; a Qwen-style case (q/k norms, qkv bias only, --kv-channels, Llama
// 3.1 RoPE scaling) and a mixed one (LayerNorm, GeGLU, q/k LayerNorms, biases, tied output, partial
// interleaved RoPE, window). Logits, loss and every parameter gradient must match within 1e-5 relative to
// the reference tensor's largest magnitude (the GPT-2 golden test's tolerance).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "golden_util.h"
#include "loom/ckpt/safetensors.h"
#include "loom/model/gpt.h"

using namespace loom;

namespace {

const SafetensorsFile& fixture() {
  static const SafetensorsFile f = SafetensorsFile::open(std::string(LOOM_FIXTURE_DIR) + "/llama_tiny.safetensors");
  return f;
}

std::string meta(const std::string& key) {
  const auto& m = fixture().metadata();
  const auto it = m.find(key);
  LOOM_CHECK(it != m.end(), "llama_tiny.safetensors has no metadata ", key);
  return it->second;
}
int64_t meta_int(const std::string& key) { return std::stoll(meta(key)); }

std::vector<std::string> cases() {
  std::vector<std::string> out;
  const std::string all = meta("cases");
  for (size_t b = 0; b <= all.size();) {
    const size_t e = std::min(all.find(',', b), all.size());
    out.push_back(all.substr(b, e - b));
    b = e + 1;
  }
  return out;
}

// The GPTConfig the generator describes for `c` (the flags it names are in gen_llama_model.py).
GPTConfig case_config(const std::string& c) {
  GPTConfig cfg;
  cfg.num_layers = meta_int("num_layers");
  cfg.hidden_size = meta_int("hidden_size");
  cfg.num_attention_heads = meta_int("num_attention_heads");
  cfg.max_position_embeddings = meta_int("seq_length");
  cfg.vocab_size = meta_int("vocab_size");
  cfg.padded_vocab_size = meta_int("padded_vocab_size");
  cfg.ffn_hidden = meta_int("ffn_hidden_size");
  cfg.layernorm_epsilon = std::stof(meta("norm_epsilon"));
  const std::string p = c + ".";
  cfg.normalization = parse_norm_kind(meta(p + "normalization"));
  const std::string act = meta(p + "activation");
  cfg.activation = act == "swiglu" ? MlpActivation::kSwiGLU : act == "geglu" ? MlpActivation::kGeGLU
                                                                             : MlpActivation::kReGLU;
  cfg.kv_channels = meta_int(p + "kv_channels");
  cfg.group_query_attention = true;
  cfg.num_query_groups = meta_int(p + "num_query_groups");
  cfg.add_bias_linear = meta_int(p + "add_bias_linear") != 0;
  cfg.add_qkv_bias = meta_int(p + "add_qkv_bias") != 0;
  cfg.untie_embeddings_and_output_weights = meta_int(p + "untie") != 0;
  cfg.qk_layernorm = meta_int(p + "qk_layernorm") != 0;
  cfg.position_embedding_type = PositionEmbeddingType::kRope;
  cfg.rotary_base = std::stod(meta(p + "rotary_base"));
  cfg.rotary_percent = std::stof(meta(p + "rotary_percent"));
  cfg.rotary_interleaved = meta_int(p + "rotary_interleaved") != 0;
  cfg.use_rope_scaling = meta_int(p + "use_rope_scaling") != 0;
  cfg.window_size_left = meta_int(p + "window_left");
  return cfg;
}

class GoldenLlama : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST(GoldenLlamaFixture, CoversTheAttentionKindsAndOptions) {
  const std::vector<std::string> all = cases();
  for (const char* c : {"mha", "gqa", "mqa", "mha_window", "gqa_window", "mqa_window", "qwen", "mixed"})
    EXPECT_NE(std::find(all.begin(), all.end(), c), all.end()) << c;
  EXPECT_EQ(case_config("mha").num_kv_heads(), 4);
  EXPECT_EQ(case_config("gqa").num_kv_heads(), 2);
  EXPECT_EQ(case_config("mqa").num_kv_heads(), 1);
  EXPECT_EQ(case_config("gqa_window").attention_params().window, 4);  // --window-size 3,0: keys i-3 .. i
}

TEST_P(GoldenLlama, LogitsLossAndGradients) {
  const std::string c = GetParam();
  const SafetensorsFile& f = fixture();
  const GPTConfig cfg = case_config(c);
  auto ctx = make_cpu_context();
  GPTModel model(cfg, *ctx);
  // Every fixture parameter exists in the model and vice versa, with the count the config predicts.
  int64_t n_fixture = 0;
  const std::string param_prefix = c + ".param.";
  for (const std::string& name : f.names())
    if (name.rfind(param_prefix, 0) == 0) {
      ++n_fixture;
      EXPECT_NE(model.params().find(name.substr(param_prefix.size())), nullptr) << "model lacks " << name;
    }
  ASSERT_EQ(n_fixture, int64_t(model.params().all().size()));
  EXPECT_EQ(cfg.num_parameters(), model.params().numel());
  for (Parameter& p : model.params().all()) f.read_into(param_prefix + p.name, p.value);

  const Tensor tokens = f.read(c + ".tokens"), targets = f.read(c + ".targets");
  const float loss = model.forward(tokens, targets, 0.0f);
  const Tensor ref_logits = f.read(c + ".ref.logits");
  golden::expect_close(c + ": logits", model.logits(), ref_logits, 1e-5);
  const float ref_loss = f.read(c + ".ref.loss").data<float>()[0];
  EXPECT_NEAR(loss, ref_loss, 1e-5 * ref_loss);

  const float loss2 = model.forward(tokens, targets, 1.0f / float(tokens.numel()));
  EXPECT_EQ(loss, loss2);
  model.backward(tokens);
  for (const Parameter& p : model.params().all()) {
    const Tensor ref = f.read(c + ".ref.grad." + p.name);
    golden::expect_close(c + ": grad " + p.name, p.grad, ref, 1e-5);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, GoldenLlama,
                         ::testing::Values("mha", "gqa", "mqa", "mha_window", "gqa_window", "mqa_window", "qwen",
                                           "mixed"),
                         [](const auto& info) { return info.param; });

// LoRA on a whole Llama model (GPTModel with ModelOptions::lora) against the independently written
// PyTorch reference in fixtures/lora_tiny.safetensors (tests/golden/gen_lora_model.py: Hugging Face's
// separate q/k/v/o/gate/up/down modules with PEFT's LoRA, float64): PEFT-named adapters on the slices of
// Loom's fused layers, and whole-layer adapters (Megatron names) on the fused layers. Logits, loss and every
// adapter gradient within 1e-5 relative to the reference's largest magnitude; the base is frozen (no
// gradient buffer at all), and the trainable set, its units and the target parsing are what the flags say.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "golden_util.h"
#include "loom/ckpt/safetensors.h"
#include "loom/core/check.h"
#include "loom/model/gpt.h"

using namespace loom;

namespace {

const SafetensorsFile& fixture() {
  static const SafetensorsFile f = SafetensorsFile::open(std::string(LOOM_FIXTURE_DIR) + "/lora_tiny.safetensors");
  return f;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  for (size_t b = 0; b <= s.size();) {
    const size_t e = std::min(s.find(',', b), s.size());
    out.push_back(s.substr(b, e - b));
    b = e + 1;
  }
  return out;
}

// gen_llama_model.py's Llama shapes with two query groups.
GPTConfig llama() {
  GPTConfig cfg;
  cfg.num_layers = 2;
  cfg.hidden_size = 16;
  cfg.num_attention_heads = 4;
  cfg.max_position_embeddings = 12;
  cfg.vocab_size = 53;
  cfg.padded_vocab_size = 64;
  cfg.ffn_hidden = 24;
  cfg.normalization = NormKind::kRMSNorm;
  cfg.activation = MlpActivation::kSwiGLU;
  cfg.group_query_attention = true;
  cfg.num_query_groups = 2;
  cfg.add_bias_linear = false;
  cfg.untie_embeddings_and_output_weights = true;
  cfg.position_embedding_type = PositionEmbeddingType::kRope;
  return cfg;
}

ModelOptions lora_options(const std::string& c, const GPTConfig& cfg) {
  const auto& m = fixture().metadata();
  ModelOptions o;
  LoraOptions lo;
  lo.config.rank = std::stoll(m.at("lora_rank"));
  lo.config.alpha = std::stof(m.at("lora_alpha"));
  lo.targets = parse_lora_targets(split(m.at(c + ".targets")), cfg);
  o.lora = lo;
  return o;
}

class GoldenLora : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(GoldenLora, LogitsLossAndAdapterGradients) {
  const std::string c = GetParam();
  const SafetensorsFile& f = fixture();
  const GPTConfig cfg = llama();
  auto ctx = make_cpu_context();
  GPTModel model(cfg, *ctx, lora_options(c, cfg));
  ASSERT_TRUE(model.lora());
  // The base holds every model parameter and no gradient; the adapters are the trainable set.
  EXPECT_EQ(model.params().numel(), cfg.num_parameters());
  EXPECT_FALSE(model.params().grads().defined());
  for (const Parameter& p : model.params().all()) EXPECT_FALSE(p.grad.defined()) << p.name;
  int64_t n_adapters = 0;
  for (const std::string& name : f.names())
    if (name.rfind(c + ".lora.", 0) == 0) ++n_adapters;
  ASSERT_EQ(n_adapters, int64_t(model.trainable().all().size()));
  for (Parameter& p : model.params().all()) f.read_into(c + ".param." + p.name, p.value);
  for (Parameter& p : model.trainable().all()) f.read_into(c + ".lora." + p.name, p.value);
  model.sync_compute();
  // Units: one per layer holding that layer's adapters (the embedding and head units hold none).
  const std::vector<ParamUnit>& units = model.units();
  ASSERT_EQ(units.size(), 4u);
  EXPECT_EQ(units[0].numel, 0);
  EXPECT_EQ(units[1].numel + units[2].numel, model.trainable().numel());
  EXPECT_EQ(units[3].numel, 0);

  const Tensor tokens = f.read(c + ".tokens"), targets = f.read(c + ".targets");
  const float loss = model.forward(tokens, targets, 0.0f);
  golden::expect_close(c + ": logits", model.logits(), f.read(c + ".ref.logits"), 1e-5);
  const float ref_loss = f.read(c + ".ref.loss").data<float>()[0];
  EXPECT_NEAR(loss, ref_loss, 1e-5 * ref_loss);
  EXPECT_EQ(loss, model.forward(tokens, targets, 1.0f / float(tokens.numel())));
  model.backward(tokens);
  for (const Parameter& p : model.trainable().all())
    golden::expect_close(c + ": grad " + p.name, p.grad, f.read(c + ".ref.grad." + p.name), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Cases, GoldenLora, ::testing::Values("peft", "fused"),
                         [](const auto& info) { return info.param; });

TEST(GoldenLora, FreshAdaptersLeaveTheBaseModelUnchanged) {
  // PEFT's init (B = 0): the adapted model's logits equal the base model's, bit for bit.
  const SafetensorsFile& f = fixture();
  const GPTConfig cfg = llama();
  auto ctx = make_cpu_context();
  GPTModel base(cfg, *ctx), adapted(cfg, *ctx, lora_options("peft", cfg));
  adapted.initialize(7);
  for (Parameter& p : base.params().all()) f.read_into("peft.param." + p.name, p.value);
  for (Parameter& p : adapted.params().all()) f.read_into("peft.param." + p.name, p.value);
  const Tensor tokens = f.read("peft.tokens"), targets = f.read("peft.targets");
  EXPECT_EQ(base.forward(tokens, targets, 0.0f), adapted.forward(tokens, targets, 0.0f));
  const Parameter* a = adapted.trainable().find("decoder.layers.0.self_attention.q_proj.lora_A.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, (Shape{2, 16}));
  EXPECT_GT(golden::max_abs(a->value), 0.0);
  EXPECT_LE(golden::max_abs(a->value), 0.25);  // U(-1/sqrt(16), 1/sqrt(16))
}

TEST(GoldenLora, TargetNames) {
  GPTConfig cfg = llama();
  using T = LoraTarget;
  EXPECT_EQ(parse_lora_targets({"attention"}, cfg), (std::vector<T>{T::kQkv, T::kProj}));
  EXPECT_EQ(parse_lora_targets({"all"}, cfg), (std::vector<T>{T::kQkv, T::kProj, T::kFc1, T::kFc2}));
  EXPECT_EQ(parse_lora_targets({"o_proj", "down_proj", "q_proj", "v_proj"}, cfg),
            (std::vector<T>{T::kProj, T::kFc2, T::kQ, T::kV}));
  EXPECT_THROW(parse_lora_targets({"linear_qkv", "q_proj"}, cfg), UserError);
  EXPECT_THROW(parse_lora_targets({"linear_fc1", "gate_proj"}, cfg), UserError);
  EXPECT_THROW(parse_lora_targets({"lm_head"}, cfg), UserError);
  EXPECT_THROW(parse_lora_targets({}, cfg), UserError);
  cfg.activation = MlpActivation::kGeLU;  // an ungated MLP: up_proj is all of linear_fc1, there is no gate
  EXPECT_EQ(parse_lora_targets({"up_proj"}, cfg), (std::vector<T>{T::kFc1}));
  EXPECT_THROW(parse_lora_targets({"gate_proj"}, cfg), UserError);
  // A rank the layer cannot hold is refused with the flag's name.
  ModelOptions o;
  o.lora = LoraOptions{{17, 32.0f, 0.0f}, {T::kQkv}};
  auto ctx = make_cpu_context();
  try {
    GPTModel m(llama(), *ctx, o);
    ADD_FAILURE() << "rank 17 > hidden 16 accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("--lora-rank"), std::string::npos) << e.what();
  }
}

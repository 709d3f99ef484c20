// Whole-model checks of a mixture-of-experts GPTModel (a tiny Llama-style MoE: RMSNorm, RoPE, GQA, SwiGLU,
// untied output, --moe-layer-freq with one dense layer) against the PyTorch float64 reference in
// fixtures/moe_tiny.safetensors (tests/golden/gen_moe_model.py: Hugging Face's sparse MoE blocks written
// out, with Megatron-Core's routing, capacity and router losses). Cases: Mixtral routing with aux_loss and
// z-loss, the same with seq_aux_loss, Qwen-MoE style (pre-softmax, top-k scaling factor, gated shared
// experts), a capacity factor with the probs drop policy, and sigmoid scores with an expert bias.
//
// What must match, with dloss_scale = 1 / (B·T) (the gradient of the mean loss, one micro-batch, FP32):
// logits, the returned loss (the mean cross-entropy alone), every parameter gradient (of the mean loss
// plus every MoE layer's aux and z losses: MoEAuxLossAutoScaler's scale is 1 here), each MoE layer's
// aux / z loss and its tokens per expert after capacity (the same tokens dropped). Tolerance 1e-5 relative
// to the reference tensor's largest magnitude, as the other whole-model goldens; token counts exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "golden_util.h"
#include "loom/ckpt/safetensors.h"
#include "loom/model/gpt.h"

using namespace loom;

namespace {

const SafetensorsFile& fixture() {
  static const SafetensorsFile f = SafetensorsFile::open(std::string(LOOM_FIXTURE_DIR) + "/moe_tiny.safetensors");
  return f;
}

std::string meta(const std::string& key) {
  const auto& m = fixture().metadata();
  const auto it = m.find(key);
  LOOM_CHECK(it != m.end(), "moe_tiny.safetensors has no metadata ", key);
  return it->second;
}
int64_t meta_int(const std::string& key) { return std::stoll(meta(key)); }
double meta_double(const std::string& key) { return std::stod(meta(key)); }

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) out.push_back(x);
  return out;
}

// The GPTConfig gen_moe_model.py describes for case `c` (flags in its docstring).
GPTConfig case_config(const std::string& c) {
  GPTConfig cfg;
  cfg.num_layers = meta_int("num_layers");
  cfg.hidden_size = meta_int("hidden_size");
  cfg.num_attention_heads = meta_int("num_attention_heads");
  cfg.group_query_attention = true;
  cfg.num_query_groups = meta_int("num_query_groups");
  cfg.kv_channels = meta_int("kv_channels");
  cfg.max_position_embeddings = meta_int("seq_length");
  cfg.vocab_size = meta_int("vocab_size");
  cfg.padded_vocab_size = meta_int("padded_vocab_size");
  cfg.ffn_hidden = meta_int("ffn_hidden_size");
  cfg.layernorm_epsilon = std::stof(meta("norm_epsilon"));
  cfg.normalization = NormKind::kRMSNorm;
  cfg.activation = MlpActivation::kSwiGLU;
  cfg.add_bias_linear = false;
  cfg.untie_embeddings_and_output_weights = true;
  cfg.position_embedding_type = PositionEmbeddingType::kRope;
  cfg.rotary_base = meta_double("rotary_base");

  const std::string p = c + ".", set = meta(p + "weights") + ".";
  MoeConfig& m = cfg.moe;
  m.num_experts = meta_int("num_experts");
  m.ffn_hidden_size = meta_int("moe_ffn_hidden_size");
  m.shared_expert_intermediate_size = meta_int(set + "shared");
  m.shared_expert_gate = m.shared_expert_intermediate_size > 0 && meta_int(p + "shared_gate") != 0;
  for (const std::string& v : split(meta(set + "layer_freq"))) m.layer_pattern.push_back(std::stoi(v));
  RouterConfig& r = m.router;
  r.num_experts = m.num_experts;
  r.topk = meta_int("moe_router_topk");
  r.score_function = parse_moe_score_function(meta(p + "score"));
  r.pre_softmax = meta_int(p + "pre_softmax") != 0;
  r.topk_scaling_factor = meta_double(p + "topk_scaling");
  r.enable_expert_bias = meta_int(p + "expert_bias") != 0;
  r.load_balancing = parse_moe_load_balancing(meta(p + "lb"));
  r.aux_loss_coeff = meta_double(p + "aux");
  r.z_loss_coeff = meta_double(p + "z");
  if (meta_double(p + "capacity") > 0) r.capacity_factor = meta_double(p + "capacity");
  r.drop_policy = parse_moe_drop_policy(meta(p + "drop"));
  return cfg;
}

// A model of case `c` holding the fixture's parameters (and expert biases).
std::unique_ptr<GPTModel> case_model(const std::string& c, const DeviceContext& ctx) {
  const SafetensorsFile& f = fixture();
  const GPTConfig cfg = case_config(c);
  auto model = std::make_unique<GPTModel>(cfg, ctx);
  // Every fixture parameter exists in the model and vice versa.
  int64_t n_fixture = 0;
  const std::string param_prefix = meta(c + ".weights") + ".param.";
  for (const std::string& name : f.names())
    if (name.rfind(param_prefix, 0) == 0) {
      ++n_fixture;
      EXPECT_NE(model->params().find(name.substr(param_prefix.size())), nullptr) << "model lacks " << name;
    }
  EXPECT_EQ(n_fixture, int64_t(model->params().all().size()));
  EXPECT_EQ(cfg.num_parameters(), model->params().numel());
  for (Parameter& p : model->params().all()) f.read_into(param_prefix + p.name, p.value);
  model->sync_compute();
  for (auto& [name, bias] : model->expert_biases()) {
    // name: decoder.layers.N.mlp.router.expert_bias
    const std::string layer = name.substr(std::string("decoder.layers.").size(),
                                          name.find(".mlp") - std::string("decoder.layers.").size());
    const Tensor b = f.read(c + ".expert_bias." + layer);
    EXPECT_EQ(b.numel(), int64_t(bias->size()));
    std::copy_n(b.data<float>(), b.numel(), bias->data());
  }
  return model;
}

class GoldenMoeModel : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST(GoldenMoeModelFixture, CoversTheRoutingVariants) {
  const std::vector<std::string> all = split(meta("cases"));
  for (const char* c : {"mixtral", "mixtral_seqaux", "qwen", "capacity", "sigmoid_bias"})
    EXPECT_NE(std::find(all.begin(), all.end(), c), all.end()) << c;
  // One dense layer in each pattern, shared experts with their gate, a capacity, an expert bias.
  for (const std::string& c : all) {
    const GPTConfig cfg = case_config(c);
    EXPECT_EQ(cfg.num_moe_layers(), cfg.num_layers - 1) << c;
    EXPECT_LT(cfg.num_kv_heads(), cfg.num_attention_heads) << c;
  }
  EXPECT_TRUE(case_config("qwen").moe.shared_expert_gate);
  EXPECT_TRUE(case_config("qwen").moe.router.pre_softmax);
  EXPECT_TRUE(case_config("capacity").moe.router.capacity_factor.has_value());
  EXPECT_TRUE(case_config("sigmoid_bias").moe.router.enable_expert_bias);
  EXPECT_EQ(case_config("mixtral_seqaux").moe.router.load_balancing, MoeLoadBalancing::kSeqAuxLoss);
}

TEST_P(GoldenMoeModel, LogitsLossGradientsAndRouterFigures) {
  const std::string c = GetParam();
  const SafetensorsFile& f = fixture();
  auto ctx = make_cpu_context();
  std::unique_ptr<GPTModel> model = case_model(c, *ctx);
  const std::string set = meta(c + ".weights");
  const Tensor tokens = f.read(set + ".tokens"), targets = f.read(set + ".targets");

  const float loss = model->forward(tokens, targets, 0.0f);
  golden::expect_close(c + ": logits", model->logits(), f.read(c + ".ref.logits"), 1e-5);
  const float ref_loss = f.read(c + ".ref.loss").data<float>()[0];
  EXPECT_NEAR(loss, ref_loss, 1e-5 * ref_loss);

  // The gradient of the mean loss; the router losses add their own gradients, not to the returned loss.
  model->reset_moe_stats();
  const float loss2 = model->forward(tokens, targets, 1.0f / float(tokens.numel()));
  EXPECT_EQ(loss, loss2);
  model->backward(tokens);
  for (const Parameter& p : model->params().all())
    golden::expect_close(c + ": grad " + p.name, p.grad, f.read(c + ".ref.grad." + p.name), 1e-5);

  // The router's figures of this micro-batch (MoeLayerStats: the losses without their coefficients).
  const GPTConfig cfg = case_config(c);
  const std::vector<MoeLayerStats> stats = model->moe_stats();
  ASSERT_EQ(int64_t(stats.size()), cfg.num_moe_layers());
  for (const MoeLayerStats& s : stats) {
    const std::string l = std::to_string(s.layer);
    SCOPED_TRACE("layer " + l);
    EXPECT_EQ(s.micro_batches, 1);
    const double aux = f.read(c + ".ref.aux." + l).data<float>()[0], z = f.read(c + ".ref.z." + l).data<float>()[0];
    EXPECT_NEAR(s.load_balancing_loss, aux, 1e-5 * std::max(aux, 1e-3));
    EXPECT_NEAR(s.z_loss, z, 1e-5 * std::max(z, 1e-3));
    const Tensor counts = f.read(c + ".ref.tokens_per_expert." + l);
    ASSERT_EQ(int64_t(s.tokens_per_expert.size()), counts.numel());
    for (int64_t e = 0; e < counts.numel(); ++e)
      EXPECT_EQ(s.tokens_per_expert[size_t(e)], double(counts.data<float>()[e])) << "expert " << e;
    std::printf("  [golden] %-24s layer %s aux %.6f (ref %.6f) z %.6f (ref %.6f)\n", c.c_str(), l.c_str(),
                s.load_balancing_loss, aux, s.z_loss, z);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, GoldenMoeModel,
                         ::testing::Values("mixtral", "mixtral_seqaux", "qwen", "capacity", "sigmoid_bias"),
                         [](const auto& info) { return info.param; });

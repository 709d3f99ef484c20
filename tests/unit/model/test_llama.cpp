// GPTConfig's Llama-family options: parameter counts (by hand for a tiny config, the published Llama 2 7B
// and Llama 3 8B counts, and the allocated ParameterSet for every option), Megatron's FLOP formula and
// --ffn-hidden-size default, parameter names and init, validation naming the flags, half precision and a
// model without position embeddings. Numerics against PyTorch: tests/golden/test_golden_llama_model.cpp;
// recomputation and the memory plan: test_gpt.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "loom/model/gpt.h"

using namespace loom;

namespace {

GPTConfig llama(int64_t L, int64_t C, int64_t NH, int64_t NKV, int64_t F, int64_t V) {
  GPTConfig c;
  c.num_layers = L;
  c.hidden_size = C;
  c.num_attention_heads = NH;
  c.group_query_attention = NKV != NH;
  c.num_query_groups = NKV;
  c.ffn_hidden = F;
  c.vocab_size = c.padded_vocab_size = V;
  c.max_position_embeddings = 4096;
  c.normalization = NormKind::kRMSNorm;
  c.activation = MlpActivation::kSwiGLU;
  c.add_bias_linear = false;
  c.untie_embeddings_and_output_weights = true;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  return c;
}

std::string config_error(const GPTConfig& c) {
  try {
    c.validate();
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

// Megatron's num_floating_point_operations (training.py) for a dense model, written as Megatron does.
double megatron_flops(const GPTConfig& m, int64_t B, int64_t s) {
  const double h = double(m.hidden_size), q_ratio = double(m.head_dim() * m.num_attention_heads) / h;
  const double gated = m.gated_mlp() ? 1.5 : 1.0;
  return 12.0 * double(B) * double(s) * double(m.num_layers) * h * h *
         ((1.0 + double(m.num_kv_heads()) / double(m.num_attention_heads) + double(s) / h) * q_ratio +
          double(m.ffn_hidden_size()) / h * gated + double(m.padded_vocab_size) / (2.0 * double(m.num_layers) * h));
}

}  // namespace

TEST(LlamaConfig, ParameterCountsByHand) {
  // L=2, C=8, NH=4 (HS=2), NKV=2, F=12, V=10, RMSNorm, SwiGLU, no biases, untied.
  const GPTConfig c = llama(2, 8, 4, 2, 12, 10);
  const int64_t per_layer = 8 + 8 * (4 + 2 * 2) * 2  // input norm, qkv (8 x 16)
                            + 8 * 8                  // proj
                            + 8 + 8 * 24 + 12 * 8;   // pre-MLP norm, fc1 [gate | up], fc2
  EXPECT_EQ(per_layer, 8 + 128 + 64 + 8 + 192 + 96);
  EXPECT_EQ(c.num_parameters(), 10 * 8 + 2 * per_layer + 8 + 10 * 8);
  // Biases: --add-qkv-bias adds the qkv width; all biases add qkv, proj, fc1 and fc2 widths.
  GPTConfig qkv_bias = c;
  qkv_bias.add_qkv_bias = true;
  EXPECT_EQ(qkv_bias.num_parameters() - c.num_parameters(), 2 * 16);
  GPTConfig biases = c;
  biases.add_bias_linear = true;
  EXPECT_EQ(biases.num_parameters() - c.num_parameters(), 2 * (16 + 8 + 24 + 8));
  // LayerNorm doubles every norm (5 of them), qk-layernorm adds two per layer over HS.
  GPTConfig ln = c;
  ln.normalization = NormKind::kLayerNorm;
  EXPECT_EQ(ln.num_parameters() - c.num_parameters(), 5 * 8);
  GPTConfig qk = c;
  qk.qk_layernorm = true;
  EXPECT_EQ(qk.num_parameters() - c.num_parameters(), 2 * 2 * 2);
  // Tied output layer: no output_layer.weight; learned positions add P x C.
  GPTConfig tied = c;
  tied.untie_embeddings_and_output_weights = false;
  EXPECT_EQ(c.num_parameters() - tied.num_parameters(), 10 * 8);
  GPTConfig learned = c;
  learned.position_embedding_type = PositionEmbeddingType::kLearnedAbsolute;
  EXPECT_EQ(learned.num_parameters() - c.num_parameters(), 4096 * 8);
  // --kv-channels 3: qkv (4 + 4) x 3 rows, proj reads 4 x 3.
  GPTConfig kv = c;
  kv.kv_channels = 3;
  EXPECT_EQ(kv.num_parameters() - c.num_parameters(), 2 * (8 * 8 * 3 - 8 * 16 + 8 * 12 - 64));
}

TEST(LlamaConfig, PublishedParameterCounts) {
  // Llama 2 7B: 32 layers, 4096 hidden, 32 heads (MHA), 11008 FFN, 32000 vocabulary.
  EXPECT_EQ(llama(32, 4096, 32, 32, 11008, 32000).num_parameters(), 6738415616);
  // Llama 3 8B: 32 layers, 4096 hidden, 32 heads sharing 8 KV heads, 14336 FFN, 128256 vocabulary.
  EXPECT_EQ(llama(32, 4096, 32, 8, 14336, 128256).num_parameters(), 8030261248);
  // Llama 2 70B: 80 layers, 8192 hidden, 64 heads, 8 KV heads, 28672 FFN.
  EXPECT_EQ(llama(80, 8192, 64, 8, 28672, 32000).num_parameters(), 68976648192);
}

TEST(LlamaConfig, FlopsEqualMegatronsFormula) {
  for (const GPTConfig& m : {llama(32, 4096, 32, 32, 11008, 32000), llama(32, 4096, 32, 8, 14336, 128256),
                             llama(2, 64, 4, 1, 176, 512)}) {
    const double ours = m.flops_per_step(8, 4096), theirs = megatron_flops(m, 8, 4096);
    EXPECT_NEAR(ours, theirs, 1e-12 * theirs);
  }
  GPTConfig kv = llama(2, 64, 4, 2, 100, 512);
  kv.kv_channels = 24;  // NH · HS = 96 != C
  EXPECT_NEAR(kv.flops_per_step(3, 37), megatron_flops(kv, 3, 37), 1e-12 * megatron_flops(kv, 3, 37));
  // GPT-2: the paper's 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)).
  GPTConfig gpt2;
  const double B = 8, s = 1024, l = 12, h = 768, V = 50304;
  EXPECT_NEAR(gpt2.flops_per_step(8, 1024), 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)), 1e3);
  EXPECT_NEAR(gpt2.layer_forward_flops(8, 1024), 24 * B * s * h * h + 4 * B * s * s * h, 1);
  EXPECT_NEAR(gpt2.attention_core_forward_flops(8, 1024), 4 * B * s * s * h, 1);
}

TEST(LlamaConfig, FfnHiddenSizeDefaultIsMegatrons) {
  GPTConfig c;
  c.hidden_size = 4096;
  EXPECT_EQ(c.ffn_hidden_size(), 16384);
  c.activation = MlpActivation::kSwiGLU;
  // int((4 * 4096 * 2 / 3) / 64) * 64
  EXPECT_EQ(c.ffn_hidden_size(), 10880);
  for (int64_t h : {24, 64, 100, 768, 1000, 5120, 8192}) {
    c.hidden_size = h;
    EXPECT_EQ(c.ffn_hidden_size(), int64_t((4.0 * double(h) * 2.0 / 3.0) / 64.0) * 64) << h;
  }
  c.ffn_hidden = 123;
  EXPECT_EQ(c.ffn_hidden_size(), 123);
}

TEST(LlamaConfig, ValidationNamesTheFlags) {
  GPTConfig c = llama(2, 64, 4, 3, 100, 50);
  EXPECT_NE(config_error(c).find("--num-query-groups"), std::string::npos);
  c.num_query_groups = 2;
  EXPECT_EQ(config_error(c), "");
  GPTConfig odd = c;
  odd.hidden_size = 66;  // not divisible by 4 heads
  EXPECT_NE(config_error(odd).find("--kv-channels"), std::string::npos);
  odd.kv_channels = 16;  // now the head size is explicit
  EXPECT_EQ(config_error(odd), "");
  GPTConfig rot = c;
  rot.rotary_percent = 0.1f;  // int(16 · 0.1) = 1 channel: not a pair
  EXPECT_NE(config_error(rot).find("--rotary-percent"), std::string::npos);
  rot.rotary_percent = 0.0f;
  EXPECT_NE(config_error(rot).find("--rotary-percent"), std::string::npos);
  GPTConfig scaling = c;
  scaling.position_embedding_type = PositionEmbeddingType::kLearnedAbsolute;
  scaling.use_rope_scaling = true;
  EXPECT_NE(config_error(scaling).find("--use-rope-scaling"), std::string::npos);
  GPTConfig tiny = c;
  tiny.hidden_size = 16;
  tiny.ffn_hidden = 0;  // the SwiGLU default int(8 · 16 / 3 / 64) · 64 is 0
  EXPECT_NE(config_error(tiny).find("--ffn-hidden-size"), std::string::npos);
  GPTConfig window = c;
  window.window_size_left = -2;
  EXPECT_NE(config_error(window).find("--window-size"), std::string::npos);
  EXPECT_EQ(parse_position_embedding_type("rope"), PositionEmbeddingType::kRope);
  EXPECT_EQ(parse_position_embedding_type("none"), PositionEmbeddingType::kNone);
  EXPECT_EQ(parse_position_embedding_type("learned_absolute"), PositionEmbeddingType::kLearnedAbsolute);
  EXPECT_THROW(parse_position_embedding_type("mrope"), UserError);
  EXPECT_THROW(parse_position_embedding_type("alibi"), UserError);
  EXPECT_EQ(parse_norm_kind("RMSNorm"), NormKind::kRMSNorm);
  EXPECT_THROW(parse_norm_kind("rmsnorm"), UserError);
}

TEST(LlamaModel, ParameterNamesShapesAndInit) {
  auto ctx = make_cpu_context();
  GPTConfig c = llama(2, 32, 4, 2, 40, 60);
  c.max_position_embeddings = 16;
  c.qk_layernorm = true;
  c.add_qkv_bias = true;
  GPTModel m(c, *ctx);
  m.initialize(7);
  ParameterSet& ps = m.params();
  EXPECT_EQ(ps.numel(), c.num_parameters());
  const std::vector<std::pair<std::string, Shape>> expect = {
      {"embedding.word_embeddings.weight", {60, 32}},
      {"decoder.layers.1.input_layernorm.weight", {32}},
      {"decoder.layers.1.self_attention.linear_qkv.weight", {(4 + 2 * 2) * 8, 32}},
      {"decoder.layers.1.self_attention.linear_qkv.bias", {(4 + 2 * 2) * 8}},
      {"decoder.layers.1.self_attention.linear_proj.weight", {32, 32}},
      {"decoder.layers.1.self_attention.q_layernorm.weight", {8}},
      {"decoder.layers.1.self_attention.k_layernorm.weight", {8}},
      {"decoder.layers.1.pre_mlp_layernorm.weight", {32}},
      {"decoder.layers.1.mlp.linear_fc1.weight", {80, 32}},
      {"decoder.layers.1.mlp.linear_fc2.weight", {32, 40}},
      {"decoder.final_layernorm.weight", {32}},
      {"output_layer.weight", {60, 32}},
  };
  for (const auto& [name, shape] : expect) {
    const Parameter* p = ps.find(name);
    ASSERT_NE(p, nullptr) << name;
    EXPECT_EQ(p->shape, shape) << name;
  }
  for (const char* absent : {"embedding.position_embeddings.weight", "decoder.layers.0.input_layernorm.bias",
                             "decoder.layers.0.self_attention.linear_proj.bias", "decoder.layers.0.mlp.linear_fc1.bias",
                             "decoder.layers.0.mlp.linear_fc2.bias", "decoder.final_layernorm.bias",
                             "decoder.layers.0.self_attention.q_layernorm.bias"})
    EXPECT_EQ(ps.find(absent), nullptr) << absent;
  // RMSNorm weights start at one and have no weight decay; the untied output layer is N(0, std).
  for (const Parameter& p : ps.all()) {
    if (p.name.find("layernorm") != std::string::npos) {
      EXPECT_TRUE(p.no_weight_decay) << p.name;
      for (int64_t i = 0; i < p.shape.numel(); ++i) ASSERT_EQ(p.value.data<float>()[i], 1.0f) << p.name;
    }
  }
  const Parameter& out = *ps.find("output_layer.weight");
  EXPECT_FALSE(out.no_weight_decay);
  double sum = 0, sq = 0;
  const int64_t n = out.shape.numel();
  for (int64_t i = 0; i < n; ++i) {
    sum += out.value.data<float>()[i];
    sq += double(out.value.data<float>()[i]) * out.value.data<float>()[i];
  }
  EXPECT_NEAR(std::sqrt(sq / double(n) - (sum / double(n)) * (sum / double(n))), 0.02, 0.002);
  // Its values are not the word embedding's (a different name, so a different init stream).
  EXPECT_NE(out.value.data<float>()[0], ps.find("embedding.word_embeddings.weight")->value.data<float>()[0]);
}

namespace {
struct Batch {
  Tensor tokens = Tensor::empty({2, 16}, DType::kI32), targets = Tensor::empty({2, 16}, DType::kI32);
  explicit Batch(int64_t V) {
    for (int64_t i = 0; i < 32; ++i) {
      tokens.data<int32_t>()[i] = int32_t((i * 7 + 3) % V);
      targets.data<int32_t>()[i] = int32_t((i * 11 + 5) % V);
    }
  }
};
}  // namespace

// The untied output layer and the word embedding get their own gradients; with --position-embedding-type
// none the model has no position parameters and no position information: a row of one repeated token
// gives the same logits at every position.
TEST(LlamaModel, UntiedGradientsAndNoPositionEmbedding) {
  auto ctx = make_cpu_context();
  GPTConfig c = llama(2, 32, 4, 2, 40, 60);
  c.max_position_embeddings = 16;
  c.position_embedding_type = PositionEmbeddingType::kNone;
  GPTModel m(c, *ctx);
  m.initialize(3);
  EXPECT_EQ(m.params().numel(), c.num_parameters());
  const Batch b(60);
  m.forward(b.tokens, b.targets, 1.0f / 32.0f);
  m.backward(b.tokens);
  const Parameter& out = *m.params().find("output_layer.weight");
  const Parameter& wte = *m.params().find("embedding.word_embeddings.weight");
  double gout = 0, gwte = 0;
  for (int64_t i = 0; i < out.shape.numel(); ++i) gout += std::fabs(out.grad.data<float>()[i]);
  for (int64_t i = 0; i < wte.shape.numel(); ++i) gwte += std::fabs(wte.grad.data<float>()[i]);
  EXPECT_GT(gout, 0.0);
  EXPECT_GT(gwte, 0.0);
  // A row of one repeated token: without positions (and causal attention over identical keys) every
  // position sees the same thing, so all its logits are equal.
  Tensor same = Tensor::empty({1, 16}, DType::kI32), tgt = Tensor::empty({1, 16}, DType::kI32);
  for (int64_t i = 0; i < 16; ++i) same.data<int32_t>()[i] = tgt.data<int32_t>()[i] = 9;
  m.forward(same, tgt, 0.0f);
  const float* lg = m.logits().data<float>();
  for (int64_t t = 1; t < 16; ++t)
    for (int64_t v = 0; v < 60; ++v) ASSERT_NEAR(lg[t * 60 + v], lg[v], 1e-5f) << t << " " << v;
  // Learned absolute positions make the same row's logits depend on the position.
  GPTConfig learned = c;
  learned.position_embedding_type = PositionEmbeddingType::kLearnedAbsolute;
  GPTModel ml(learned, *ctx);
  ml.initialize(3);
  ml.forward(same, tgt, 0.0f);
  EXPECT_GT(std::fabs(ml.logits().data<float>()[15 * 60] - ml.logits().data<float>()[0]), 1e-4f);
}

// bf16 compute tracks f32 for the full Llama option set (RoPE, qk-norm, SwiGLU, GQA in bf16).
TEST(LlamaModel, Bf16TracksF32) {
  auto ctx = make_cpu_context();
  GPTConfig c = llama(2, 32, 4, 2, 40, 60);
  c.max_position_embeddings = 16;
  c.qk_layernorm = true;
  c.window_size_left = 5;
  c.init_method_std = 0.1f;
  const Batch b(60);
  GPTModel ref(c, *ctx);
  ref.initialize(5);
  const float ref_loss = ref.forward(b.tokens, b.targets, 1.0f / 32.0f);
  ref.backward(b.tokens);
  ModelOptions o;
  o.compute_dtype = DType::kBF16;
  GPTModel m(c, *ctx, o);
  m.initialize(5);
  const float loss = m.forward(b.tokens, b.targets, 1.0f / 32.0f);
  m.backward(b.tokens);
  EXPECT_NEAR(loss, ref_loss, 1e-2);
  EXPECT_NE(loss, ref_loss);
  double maxg = 0, maxd = 0;
  for (int64_t i = 0; i < ref.params().numel(); ++i) {
    const double g = ref.params().grads().data<float>()[i];
    maxg = std::max(maxg, std::fabs(g));
    maxd = std::max(maxd, std::fabs(double(m.params().grads().data<float>()[i]) - g));
  }
  EXPECT_LT(maxd, 5e-2 * maxg);
}

// Sampling (temperature, top-k, top-p, greedy, Philox determinism) and the decoding loop of generate():
// KV-cached and no-cache decoding give the same tokens (greedy and sampled) for GPT-2 and Llama configs, a
// batch of prompts of different lengths gives each row what it gets alone, EOD and the position limit stop
// generation; loading a saved Loom checkpoint for inference restores the model.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <vector>

#include "loom/ckpt/checkpoint.h"
#include "loom/train/generate.h"
#include "model_test_util.h"
#include "train/checkpoint_format.h"

using namespace loom;

namespace {

std::vector<float> logits_for(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(float(std::log(p)));
  return l;
}

int64_t nonzero(const std::vector<double>& p) {
  return std::count_if(p.begin(), p.end(), [](double x) { return x > 0; });
}

}  // namespace

TEST(Sampling, GreedyAndTopK1PickTheArgmax) {
  const std::vector<float> l = {0.1f, 2.0f, -1.0f, 2.0f, 1.9f};
  SamplingOptions greedy;
  greedy.temperature = 0.0f;
  SamplingOptions top1;
  top1.top_k = 1;
  top1.temperature = 5.0f;
  for (const SamplingOptions& o : {greedy, top1}) {
    EXPECT_TRUE(o.greedy());
    const std::vector<double> p = sampling_probabilities(l, o);
    EXPECT_EQ(p, (std::vector<double>{0, 1, 0, 0, 0}));  // the lowest id wins a tie
    for (uint64_t step = 0; step < 20; ++step) EXPECT_EQ(sample_token(l, o, 0, step), 1);
  }
}

TEST(Sampling, TemperatureScalesTheSoftmax) {
  const std::vector<float> l = {1.0f, 2.0f, 0.5f, -1.0f};
  for (float t : {0.5f, 1.0f, 2.0f}) {
    SamplingOptions o;
    o.temperature = t;
    const std::vector<double> p = sampling_probabilities(l, o);
    double z = 0;
    for (float x : l) z += std::exp(double(x) / t);
    for (size_t i = 0; i < l.size(); ++i) EXPECT_NEAR(p[i], std::exp(double(l[i]) / t) / z, 1e-12) << t;
  }
}

TEST(Sampling, TopKKeepsTheKMostLikely) {
  const std::vector<float> l = {0.3f, 1.2f, -0.4f, 2.5f, 0.9f, 1.1f};
  SamplingOptions o;
  o.top_k = 3;
  const std::vector<double> p = sampling_probabilities(l, o);
  EXPECT_EQ(nonzero(p), 3);
  const double z = std::exp(2.5) + std::exp(1.2) + std::exp(1.1);
  EXPECT_NEAR(p[3], std::exp(2.5) / z, 1e-6);
  EXPECT_NEAR(p[1], std::exp(1.2) / z, 1e-6);
  EXPECT_NEAR(p[5], std::exp(1.1) / z, 1e-6);
  o.top_k = 100;  // more than the vocabulary: everything
  EXPECT_EQ(nonzero(sampling_probabilities(l, o)), 6);
}

TEST(Sampling, TopPKeepsTheSmallestSetReachingP) {
  // Probabilities 0.5, 0.3, 0.15, 0.05 in a shuffled order.
  const std::vector<float> l = logits_for({0.15, 0.5, 0.05, 0.3});
  auto kept = [&](float p, int64_t k = 0) {
    SamplingOptions o;
    o.top_p = p;
    o.top_k = k;
    return sampling_probabilities(l, o);
  };
  EXPECT_EQ(nonzero(kept(0.45f)), 1);
  EXPECT_EQ(nonzero(kept(0.75f)), 2);
  EXPECT_EQ(nonzero(kept(0.85f)), 3);
  EXPECT_EQ(nonzero(kept(0.99f)), 4);
  EXPECT_EQ(nonzero(kept(1.0f)), 4);  // off
  EXPECT_EQ(nonzero(kept(0.0f)), 4);  // off (Megatron's 0)
  const std::vector<double> p = kept(0.75f);
  EXPECT_NEAR(p[1], 0.5 / 0.8, 1e-6);
  EXPECT_NEAR(p[3], 0.3 / 0.8, 1e-6);
  // After top-k 2 the renormalised probabilities are 0.625, 0.375: p = 0.6 keeps one.
  EXPECT_EQ(nonzero(kept(0.6f, 2)), 1);
  EXPECT_EQ(nonzero(kept(0.7f, 2)), 2);
}

TEST(Sampling, DrawsFollowTheDistributionAndTheSeed) {
  const std::vector<float> l = logits_for({0.1, 0.6, 0.3});
  SamplingOptions o;
  o.seed = 77;
  std::vector<int64_t> counts(3, 0);
  const int64_t n = 20000;
  for (int64_t s = 0; s < n; ++s) ++counts[size_t(sample_token(l, o, 0, uint64_t(s)))];
  EXPECT_NEAR(double(counts[0]) / n, 0.1, 0.015);
  EXPECT_NEAR(double(counts[1]) / n, 0.6, 0.015);
  EXPECT_NEAR(double(counts[2]) / n, 0.3, 0.015);
  // Same seed, row and step: same token; another seed gives another sequence.
  std::vector<int32_t> a, b, c;
  SamplingOptions other = o;
  other.seed = 78;
  for (uint64_t s = 0; s < 64; ++s) {
    a.push_back(sample_token(l, o, 2, s));
    b.push_back(sample_token(l, o, 2, s));
    c.push_back(sample_token(l, other, 2, s));
  }
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  o.top_k = 1;  // never draws a token outside the kept set
  for (uint64_t s = 0; s < 64; ++s) EXPECT_EQ(sample_token(l, o, 0, s), 1);
}

TEST(Sampling, ValidateNamesTheFlag) {
  SamplingOptions o;
  o.temperature = -1;
  EXPECT_THROW(o.validate(), UserError);
  o = {};
  o.top_p = 1.5f;
  try {
    o.validate();
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("--top-p"), std::string::npos);
  }
}

namespace {

GPTConfig tiny(bool llama) {
  GPTConfig c = test::tiny_gpt2_config(24, 50, 64);
  c.init_method_std = 0.3f;
  if (llama) {
    c = test::llama_variant(c);
    c.window_size_left = 4;
  }
  return c;
}

const std::vector<std::vector<int32_t>> kPrompts = {{3, 17, 8, 40, 2}, {11, 5}, {9, 9, 30, 1, 44, 7, 12}};

}  // namespace

TEST(Generate, KvCacheEqualsFullForwardGreedyAndSampled) {
  for (bool llama : {false, true}) {
    const auto ctx = make_cpu_context();
    GPTModel model(tiny(llama), *ctx);
    model.initialize(11);
    for (float temperature : {0.0f, 1.0f}) {
      GenerateOptions o;
      o.max_new_tokens = 10;
      o.sampling.temperature = temperature;
      o.sampling.top_p = 0.9f;
      o.sampling.seed = 5;
      const GenerateResult cached = generate(model, *ctx, kPrompts, o);
      o.use_kv_cache = false;
      const GenerateResult full = generate(model, *ctx, kPrompts, o);
      EXPECT_EQ(cached.tokens, full.tokens) << "llama " << llama << " temperature " << temperature;
      ASSERT_EQ(cached.tokens.size(), kPrompts.size());
      for (const auto& t : cached.tokens) EXPECT_EQ(t.size(), 10u);
      EXPECT_EQ(cached.generated_tokens, 30);
      EXPECT_EQ(cached.prompt_tokens, 14);
    }
  }
}

TEST(Generate, BatchRowsEqualSingleRuns) {
  const auto ctx = make_cpu_context();
  GPTModel model(tiny(true), *ctx);
  model.initialize(4);
  GenerateOptions o;
  o.max_new_tokens = 6;
  o.sampling.temperature = 0.0f;
  const GenerateResult all = generate(model, *ctx, kPrompts, o);
  for (size_t b = 0; b < kPrompts.size(); ++b)
    EXPECT_EQ(generate(model, *ctx, {kPrompts[b]}, o).tokens[0], all.tokens[b]) << "row " << b;
  // Sampling: row b draws from Philox stream b, so row 0 of a batch is what the first prompt gets alone.
  o.sampling.temperature = 0.8f;
  o.sampling.seed = 9;
  EXPECT_EQ(generate(model, *ctx, {kPrompts[0]}, o).tokens[0], generate(model, *ctx, kPrompts, o).tokens[0]);
}

TEST(Generate, StopsAtEodAndAtTheLastPosition) {
  const auto ctx = make_cpu_context();
  GPTModel model(tiny(false), *ctx);
  model.initialize(2);
  GenerateOptions o;
  o.sampling.temperature = 0.0f;
  o.max_new_tokens = 8;
  const GenerateResult free_run = generate(model, *ctx, {kPrompts[0]}, o);
  ASSERT_EQ(free_run.tokens[0].size(), 8u);
  o.eod = free_run.tokens[0][2];  // the third token ends the document
  const GenerateResult stopped = generate(model, *ctx, {kPrompts[0]}, o);
  const auto first_eod = std::find(free_run.tokens[0].begin(), free_run.tokens[0].end(), o.eod);
  EXPECT_EQ(stopped.tokens[0], std::vector<int32_t>(free_run.tokens[0].begin(), first_eod + 1));
  // 24 positions, a 20-token prompt: 5 new tokens fit (the last one is never fed back).
  o.eod = -1;
  o.max_new_tokens = 50;
  std::vector<int32_t> long_prompt(20, 7);
  std::vector<std::pair<int64_t, int32_t>> streamed;
  const GenerateResult r =
      generate(model, *ctx, {long_prompt}, o, [&](int64_t row, int32_t t) { streamed.push_back({row, t}); });
  EXPECT_TRUE(r.out_of_positions);
  EXPECT_EQ(r.tokens[0].size(), 5u);
  ASSERT_EQ(streamed.size(), 5u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(streamed[i].second, r.tokens[0][i]);
}

TEST(Generate, LoadsASavedCheckpoint) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("loom_generate_ckpt_" + std::to_string(::getpid()));
  fs::remove_all(root);
  const auto ctx = make_cpu_context();
  GPTConfig cfg = tiny(true);
  GPTModel model(cfg, *ctx);
  model.initialize(21);
  // The single-file layout of Loom 0.1.0, minus the optimizer: metadata.json (no "files" list, as the
  // earliest ones) + model.safetensors; today's reader still loads it.
  const std::string staging = begin_checkpoint(root.string(), 3);
  NamedTensors tensors;
  for (const Parameter& p : model.params().all()) tensors.emplace_back(p.name, p.value);
  write_checkpoint_tensors(staging, "model.safetensors", tensors);
  write_checkpoint_text(staging, "metadata.json",
                        R"({"format": "loom-checkpoint", "format_version": 1, "iteration": 3, "model_config": {
      "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 24,
      "vocab_size": 50, "padded_vocab_size": 64, "ffn_hidden_size": 48, "layernorm_epsilon": 1e-5,
      "normalization": "RMSNorm", "activation": "swiglu", "kv_channels": 8, "num_query_groups": 2,
      "add_bias_linear": false, "add_qkv_bias": false, "untie_embeddings_and_output_weights": true,
      "position_embedding_type": "rope", "rotary_base": 10000.0, "rotary_percent": 1.0,
      "rotary_interleaved": false, "use_rope_scaling": false, "rope_scaling_factor": 8.0,
      "window_size": [4, 0], "qk_layernorm": false}})");
  commit_checkpoint(root.string(), 3);
  const std::unique_ptr<GPTModel> loaded = load_model_for_inference(root.string(), *ctx, DType::kF32);
  EXPECT_EQ(loaded->config().window_size_left, 4);
  EXPECT_EQ(loaded->config().num_kv_heads(), 2);
  ASSERT_EQ(loaded->params().numel(), model.params().numel());
  const float* a = model.params().values().data<float>();
  const float* b = loaded->params().values().data<float>();
  EXPECT_TRUE(std::equal(a, a + model.params().numel(), b));
  GenerateOptions o;
  o.sampling.temperature = 0.0f;
  o.max_new_tokens = 5;
  EXPECT_EQ(generate(*loaded, *ctx, kPrompts, o).tokens, generate(model, *ctx, kPrompts, o).tokens);
  fs::remove_all(root);
}

// A MoE model with aux-loss-free balancing: the routers' expert biases (buffers saved next to the weights)
// come back with the weights, and generation routes with them.
TEST(Generate, LoadsTheExpertBiasesOfAMoeCheckpoint) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("loom_generate_moe_ckpt_" + std::to_string(::getpid()));
  fs::remove_all(root);
  const auto ctx = make_cpu_context();
  GPTConfig cfg = tiny(true);
  cfg.moe.num_experts = cfg.moe.router.num_experts = 4;
  cfg.moe.router.topk = 2;
  cfg.moe.router.score_function = MoeScoreFunction::kSigmoid;
  cfg.moe.router.enable_expert_bias = true;
  GPTModel model(cfg, *ctx);
  model.initialize(21);
  const std::vector<float> bias = {2.0f, -1.5f, 0.25f, -3.0f};  // large enough to change the choices
  NamedTensors tensors;
  for (const Parameter& p : model.params().all()) tensors.emplace_back(p.name, p.value);
  std::vector<Tensor> held;
  for (auto& [name, b] : model.expert_biases()) {
    *b = bias;
    held.push_back(Tensor::empty({4}, DType::kF32));
    std::copy(bias.begin(), bias.end(), held.back().data<float>());
    tensors.emplace_back(name, held.back());
  }
  ASSERT_EQ(held.size(), 2u);
  const std::string staging = begin_checkpoint(root.string(), 1);
  write_checkpoint_tensors(staging, "model.safetensors", tensors);
  nlohmann::json meta = {{"format", "loom-checkpoint"}, {"format_version", 1}, {"iteration", 1},
                         {"model_config", model_config_json(cfg)}};
  write_checkpoint_text(staging, "metadata.json", meta.dump());
  commit_checkpoint(root.string(), 1);
  const std::unique_ptr<GPTModel> loaded = load_model_for_inference(root.string(), *ctx, DType::kF32);
  for (auto& [name, b] : loaded->expert_biases()) EXPECT_EQ(*b, bias) << name;
  GenerateOptions o;
  o.sampling.temperature = 0.0f;
  o.max_new_tokens = 5;
  const std::vector<std::vector<int32_t>> with_bias = generate(*loaded, *ctx, kPrompts, o).tokens;
  EXPECT_EQ(with_bias, generate(model, *ctx, kPrompts, o).tokens);
  // Without them the routing (and here the text) differs: the biases are really in use.
  for (auto& [name, b] : loaded->expert_biases()) b->assign(4, 0.0f);
  EXPECT_NE(generate(*loaded, *ctx, kPrompts, o).tokens, with_bias);
  fs::remove_all(root);
}

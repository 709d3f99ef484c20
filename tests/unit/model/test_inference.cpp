// InferenceSession (KV-cached decoding): every step's logits equal a full GPTModel::forward over the whole
// prefix (evaluation) within 1e-5 relative in f32, for GPT-2 (learned positions), Llama with GQA + RoPE,
// Llama with a sliding window shorter than the sequence, and a mixed config (LayerNorm, GeGLU, MQA, q/k
// norms, partial interleaved RoPE, biases, tied output), and MoE layers (Mixtral's routing; Qwen2-MoE's with a
// dense layer and a gated shared expert); prefill chunks of any size and batch rows agree;
// bf16 stays close. Against PyTorch: greedy decoding of fixtures/generate_tiny.safetensors
// (tests/golden/gen_generate_reference.py) gives the reference tokens and logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "loom/ckpt/safetensors.h"
#include "loom/core/rng.h"
#include "loom/model/inference.h"
#include "model_test_util.h"

using namespace loom;

namespace {

GPTConfig gpt2_config() {
  GPTConfig c = test::tiny_gpt2_config(24, 50, 64);
  c.init_method_std = 0.3f;  // larger than GPT-2's so logits and attention are far from uniform
  return c;
}

GPTConfig llama_config() { return test::llama_variant(gpt2_config()); }

GPTConfig window_config() {
  GPTConfig c = llama_config();
  c.window_size_left = 3;  // 4 keys, sequences of 13
  return c;
}

GPTConfig mixed_config() {
  GPTConfig c = llama_config();
  c.normalization = NormKind::kLayerNorm;
  c.activation = MlpActivation::kGeGLU;
  c.num_query_groups = 1;
  c.kv_channels = 8;
  c.qk_layernorm = true;
  c.add_bias_linear = true;
  c.untie_embeddings_and_output_weights = false;
  c.rotary_percent = 0.5f;
  c.rotary_interleaved = true;
  c.window_size_left = 5;
  return c;
}

// Mixtral's layout (every layer MoE, top-2 of 4 experts, softmax over the chosen logits).
GPTConfig moe_config() { return test::moe_variant(llama_config(), 4, 2, 16); }

// Qwen2-MoE's: a dense layer between MoE layers, pre-softmax top-3 of 6, a gated shared expert, q/k/v biases.
GPTConfig moe_shared_config() {
  GPTConfig c = test::moe_variant(llama_config(), 6, 3, 12);
  c.num_layers = 3;
  c.moe.layer_pattern = {1, 0, 1};
  c.moe.router.pre_softmax = true;
  c.moe.shared_expert_intermediate_size = 20;
  c.moe.shared_expert_gate = true;
  c.add_qkv_bias = true;
  return c;
}

Tensor random_tokens(int64_t B, int64_t T, int64_t V, uint64_t seed) {
  Tensor t = Tensor::empty({B, T}, DType::kI32);
  for (int64_t i = 0; i < B * T; ++i) t.data<int32_t>()[i] = int32_t(philox4x32(seed, 7, uint64_t(i))[0] % uint32_t(V));
  return t;
}

// Columns [from, to) of tokens (B, T) as a new (B, to - from) tensor.
Tensor columns(const Tensor& tokens, int64_t from, int64_t to) {
  const int64_t B = tokens.size(0), T = tokens.size(1), n = to - from;
  Tensor out = Tensor::empty({B, n}, DType::kI32);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < n; ++t) out.data<int32_t>()[b * n + t] = tokens.data<int32_t>()[b * T + from + t];
  return out;
}

float as_f32(TensorView t, int64_t i) {
  if (t.dtype() == DType::kF32) return t.data<float>()[i];
  if (t.dtype() == DType::kBF16) return bf16_to_f32(t.data<uint16_t>()[i]);
  return f16_to_f32(t.data<uint16_t>()[i]);
}

// Full-forward logits (B, T, Vp) as f32.
std::vector<float> full_logits(GPTModel& model, const Tensor& tokens) {
  const Tensor targets = Tensor::zeros(tokens.shape(), DType::kI32);
  ForwardOptions fo;
  fo.training = false;
  model.forward(GPTBatch{tokens, targets, {}, {}, {}}, 0.0f, fo);
  const TensorView l = model.logits();
  std::vector<float> out(size_t(l.numel()));
  for (int64_t i = 0; i < l.numel(); ++i) out[size_t(i)] = as_f32(l, i);
  return out;
}

// max |got - ref| / max |ref| between session logits (B, Vp) and the full logits at position t.
double step_error(TensorView got, const std::vector<float>& full, int64_t B, int64_t T, int64_t Vp, int64_t t) {
  double maxref = 0, maxdiff = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t v = 0; v < Vp; ++v) {
      const double ref = full[size_t((b * T + t) * Vp + v)];
      maxref = std::max(maxref, std::fabs(ref));
      maxdiff = std::max(maxdiff, std::fabs(double(got.data<float>()[b * Vp + v]) - ref));
    }
  return maxdiff / std::max(maxref, 1e-30);
}

// Feeds `tokens` in the given chunk sizes and compares every returned row of logits with the full forward.
void check_against_full(const GPTConfig& cfg, const std::vector<int64_t>& chunks, DType dtype, double tol) {
  const auto ctx = make_cpu_context();
  ModelOptions mo;
  mo.compute_dtype = dtype;
  GPTModel model(cfg, *ctx, mo);
  model.initialize(42);
  int64_t T = 0;
  for (int64_t c : chunks) T += c;
  const int64_t B = 2, Vp = cfg.padded_vocab_size;
  const Tensor tokens = random_tokens(B, T, cfg.vocab_size, 5);
  const std::vector<float> full = full_logits(model, tokens);
  InferenceSession s(model, *ctx, B, T);
  int64_t pos = 0;
  for (int64_t c : chunks) {
    const TensorView got = s.forward(columns(tokens, pos, pos + c));
    pos += c;
    EXPECT_EQ(s.length(), pos);
    EXPECT_LE(step_error(got, full, B, T, Vp, pos - 1), tol) << "after position " << pos - 1;
  }
  EXPECT_EQ(s.cache_bytes(), 2 * cfg.num_layers * B * cfg.num_kv_heads() * T * cfg.head_dim() * 4);
}

}  // namespace

TEST(InferenceSession, Gpt2MatchesFullForward) {
  check_against_full(gpt2_config(), {4, 1, 1, 1, 1, 1, 1, 1, 1, 1}, DType::kF32, 1e-5);
}

TEST(InferenceSession, LlamaGqaRopeMatchesFullForward) {
  check_against_full(llama_config(), {5, 1, 1, 1, 1, 1, 1, 1, 1}, DType::kF32, 1e-5);
}

TEST(InferenceSession, SlidingWindowShorterThanSequence) {
  // 13 positions, window of 4 keys: decode steps must ignore the oldest cached keys.
  check_against_full(window_config(), {2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, DType::kF32, 1e-5);
  // Without the window the logits differ, so the check above really exercises it.
  const auto ctx = make_cpu_context();
  GPTModel windowed(window_config(), *ctx), plain(llama_config(), *ctx);
  windowed.initialize(42);
  plain.initialize(42);
  const Tensor tokens = random_tokens(1, 13, 50, 5);
  InferenceSession a(windowed, *ctx, 1, 13), b(plain, *ctx, 1, 13);
  const TensorView la = a.forward(tokens), lb = b.forward(tokens);
  double diff = 0;
  for (int64_t v = 0; v < 64; ++v) diff = std::max(diff, double(std::fabs(la.data<float>()[v] - lb.data<float>()[v])));
  EXPECT_GT(diff, 1e-3);
}

TEST(InferenceSession, MixedOptionsMatchFullForward) {
  check_against_full(mixed_config(), {3, 1, 4, 1, 1, 2, 1}, DType::kF32, 1e-5);
}

TEST(InferenceSession, MoeLayersMatchFullForward) {
  // The router sees only the new rows at each step (a prefill of several tokens, then one token); routing is
  // per token, so every step must reproduce the full forward's rows.
  check_against_full(moe_config(), {5, 1, 1, 1, 1, 1, 1, 1, 1}, DType::kF32, 1e-5);
  check_against_full(moe_config(), {1, 3, 1, 4, 1}, DType::kF32, 1e-5);
  check_against_full(moe_shared_config(), {4, 1, 1, 1, 1, 1, 1, 1, 1}, DType::kF32, 1e-5);
  check_against_full(moe_config(), {4, 1, 1, 1, 1}, DType::kBF16, 3e-2);
}

TEST(InferenceSession, ChunkedPrefillEqualsOneTokenSteps) {
  check_against_full(llama_config(), {1, 1, 1, 1, 1, 1, 1, 1}, DType::kF32, 1e-5);
  check_against_full(llama_config(), {8}, DType::kF32, 1e-5);
}

TEST(InferenceSession, Bf16StaysCloseToFullForward) {
  // Both paths round activations to bf16 at the same points except inside attention, so they agree to a
  // few bf16 ulps of the logits, not bit for bit.
  check_against_full(llama_config(), {4, 1, 1, 1, 1}, DType::kBF16, 3e-2);
}

TEST(InferenceSession, RowsAreIndependent) {
  const auto ctx = make_cpu_context();
  const GPTConfig cfg = llama_config();
  GPTModel model(cfg, *ctx);
  model.initialize(3);
  const Tensor both = random_tokens(2, 6, cfg.vocab_size, 9);
  InferenceSession pair(model, *ctx, 2, 6), single(model, *ctx, 1, 6);
  const TensorView lp = pair.forward(both);
  Tensor second = Tensor::empty({1, 6}, DType::kI32);
  std::copy(both.data<int32_t>() + 6, both.data<int32_t>() + 12, second.data<int32_t>());
  const TensorView ls = single.forward(second);
  for (int64_t v = 0; v < cfg.padded_vocab_size; ++v)
    EXPECT_NEAR(lp.data<float>()[cfg.padded_vocab_size + v], ls.data<float>()[v], 1e-4f);
}

TEST(InferenceSession, ResetStartsOver) {
  const auto ctx = make_cpu_context();
  GPTModel model(gpt2_config(), *ctx);
  model.initialize(1);
  const Tensor tokens = random_tokens(1, 5, 50, 2);
  InferenceSession s(model, *ctx, 1, 8);
  s.forward(tokens);
  s.reset();
  std::vector<float> a(64), b(64);
  const TensorView la = s.forward(tokens);
  std::copy(la.data<float>(), la.data<float>() + 64, a.begin());
  s.reset();
  const TensorView lb = s.forward(tokens);
  std::copy(lb.data<float>(), lb.data<float>() + 64, b.begin());
  EXPECT_EQ(a, b);
  EXPECT_EQ(s.length(), 5);
}

// ---- PyTorch reference (greedy decoding) --------------------------------------------------------------

namespace {

const SafetensorsFile& gen_fixture() {
  static const SafetensorsFile f =
      SafetensorsFile::open(std::string(LOOM_FIXTURE_DIR) + "/generate_tiny.safetensors");
  return f;
}

std::string gen_meta(const std::string& key) {
  const auto& m = gen_fixture().metadata();
  const auto it = m.find(key);
  LOOM_CHECK(it != m.end(), "generate_tiny.safetensors has no metadata ", key);
  return it->second;
}
int64_t gen_meta_int(const std::string& key) { return std::stoll(gen_meta(key)); }

// The GPTConfig gen_generate_reference.py describes for case `c`.
GPTConfig gen_case_config(const std::string& c) {
  GPTConfig cfg;
  cfg.num_layers = gen_meta_int("num_layers");
  cfg.hidden_size = gen_meta_int("hidden_size");
  cfg.num_attention_heads = gen_meta_int("num_attention_heads");
  cfg.vocab_size = gen_meta_int("vocab_size");
  cfg.padded_vocab_size = gen_meta_int("padded_vocab_size");
  cfg.max_position_embeddings = gen_meta_int("max_position_embeddings");
  cfg.layernorm_epsilon = std::stof(gen_meta("norm_epsilon"));
  cfg.normalization = parse_norm_kind(gen_meta(c + ".normalization"));
  const std::string act = gen_meta(c + ".activation");
  cfg.activation = act == "swiglu" ? MlpActivation::kSwiGLU : MlpActivation::kGeLU;
  cfg.ffn_hidden = gen_meta_int(c + ".ffn_hidden_size");
  cfg.kv_channels = gen_meta_int(c + ".kv_channels");
  cfg.num_query_groups = gen_meta_int(c + ".num_query_groups");
  cfg.group_query_attention = cfg.num_query_groups != cfg.num_attention_heads;
  cfg.add_bias_linear = gen_meta_int(c + ".add_bias_linear") != 0;
  cfg.untie_embeddings_and_output_weights = gen_meta_int(c + ".untie") != 0;
  cfg.position_embedding_type = parse_position_embedding_type(gen_meta(c + ".position_embedding_type"));
  cfg.rotary_base = std::stod(gen_meta(c + ".rotary_base"));
  cfg.window_size_left = gen_meta_int(c + ".window_left");
  return cfg;
}

void check_greedy_reference(const std::string& c) {
  const SafetensorsFile& f = gen_fixture();
  const GPTConfig cfg = gen_case_config(c);
  const auto ctx = make_cpu_context();
  GPTModel model(cfg, *ctx);
  int64_t n_fixture = 0;
  for (const std::string& name : f.names())
    if (name.rfind(c + ".param.", 0) == 0) ++n_fixture;
  ASSERT_EQ(n_fixture, int64_t(model.params().all().size())) << c << ": parameter sets differ";
  for (Parameter& p : model.params().all()) f.read_into(c + ".param." + p.name, p.value);
  model.sync_compute();
  const Tensor prompt = f.read(c + ".prompt"), ref_tokens = f.read(c + ".ref.tokens");
  const Tensor ref_logits = f.read(c + ".ref.logits");
  const int64_t Tp = prompt.numel(), steps = ref_tokens.numel(), V = cfg.vocab_size, Vp = cfg.padded_vocab_size;
  ASSERT_EQ(ref_logits.numel(), steps * Vp);
  InferenceSession s(model, *ctx, 1, Tp + steps);
  TensorView logits = s.forward(prompt.reshape({1, Tp}));
  std::vector<int32_t> got;
  for (int64_t k = 0; k < steps; ++k) {
    double maxref = 0, maxdiff = 0;
    for (int64_t v = 0; v < Vp; ++v) {
      const double ref = ref_logits.data<float>()[k * Vp + v];
      maxref = std::max(maxref, std::fabs(ref));
      maxdiff = std::max(maxdiff, std::fabs(double(logits.data<float>()[v]) - ref));
    }
    EXPECT_LE(maxdiff / maxref, 1e-5) << c << " step " << k;
    const float* row = logits.data<float>();
    const int32_t next = int32_t(std::max_element(row, row + V) - row);
    got.push_back(next);
    if (k + 1 < steps) {
      Tensor t = Tensor::empty({1, 1}, DType::kI32);
      t.data<int32_t>()[0] = next;
      logits = s.forward(t);
    }
  }
  const std::vector<int32_t> want(ref_tokens.data<int32_t>(), ref_tokens.data<int32_t>() + steps);
  EXPECT_EQ(got, want) << c;
}

}  // namespace

TEST(InferenceGolden, LlamaGqaRopeWindowGreedyMatchesPyTorch) { check_greedy_reference("llama"); }
TEST(InferenceGolden, Gpt2GreedyMatchesPyTorch) { check_greedy_reference("gpt2"); }

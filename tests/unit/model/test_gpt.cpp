// GPTModel: activation recomputation (bit-identical losses and gradients, buffers really gone), dropout
// (masks keyed by seed and micro-batch, gradients by finite differences), mixed precision (bf16/f16
// compute against f32, f32 master weights, f16 gradient accumulation) and the memory plan against the
// allocator's own count, for GPT-2 and for a Llama-style config with every architecture option on
// (RMSNorm, SwiGLU, GQA, --kv-channels, qk-layernorm, partial interleaved RoPE with Llama 3.1 scaling,
// sliding window, qkv bias only, untied output). The golden tests (tests/golden/test_golden_model.cpp,
// test_golden_llama_model.cpp) cover f32 numerics against PyTorch; test_llama.cpp the configuration.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "loom/model/gpt.h"

using namespace loom;

namespace {

constexpr int64_t kB = 2, kT = 32;

GPTConfig small_config(float hidden_dropout = 0.0f, float attention_dropout = 0.0f) {
  GPTConfig c;
  c.num_layers = 4;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.max_position_embeddings = kT;
  c.vocab_size = 100;
  c.padded_vocab_size = 128;
  c.hidden_dropout = hidden_dropout;
  c.attention_dropout = attention_dropout;
  return c;
}

// Every Llama-family option at once, on the same scale as small_config.
GPTConfig llama_config(float hidden_dropout = 0.0f, float attention_dropout = 0.0f) {
  GPTConfig c = small_config(hidden_dropout, attention_dropout);
  c.normalization = NormKind::kRMSNorm;
  c.activation = MlpActivation::kSwiGLU;
  c.ffn_hidden = 88;
  c.kv_channels = 12;  // NH · HS = 48 != C
  c.group_query_attention = true;
  c.num_query_groups = 2;
  c.add_bias_linear = false;
  c.add_qkv_bias = true;
  c.untie_embeddings_and_output_weights = true;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  c.rotary_percent = 0.5f;
  c.rotary_interleaved = true;
  c.use_rope_scaling = true;
  c.rotary_base = 500000.0;
  c.window_size_left = 9;
  c.qk_layernorm = true;
  return c;
}

GPTConfig arch_config(const std::string& arch, float hidden_dropout = 0.0f, float attention_dropout = 0.0f) {
  return arch == "llama" ? llama_config(hidden_dropout, attention_dropout)
                         : small_config(hidden_dropout, attention_dropout);
}

// Deterministic micro-batch `k`: tokens/targets in [0, V); with `segments`, each row packs two documents.
struct MicroBatch {
  Tensor tokens, targets, segment_ids;
  GPTBatch batch() const { return GPTBatch{tokens, targets, {}, {}, segment_ids}; }
};

MicroBatch make_batch(int64_t k, int64_t V, bool segments) {
  MicroBatch m;
  m.tokens = Tensor::empty({kB, kT}, DType::kI32);
  m.targets = Tensor::empty({kB, kT}, DType::kI32);
  uint64_t s = 0x1234567ull + uint64_t(k) * 7919u;
  auto next = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return int32_t((s >> 33) % uint64_t(V));
  };
  for (int64_t i = 0; i < kB * kT; ++i) {
    m.tokens.data<int32_t>()[i] = next();
    m.targets.data<int32_t>()[i] = next();
  }
  if (segments) {
    m.segment_ids = Tensor::empty({kB, kT}, DType::kI32);
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t t = 0; t < kT; ++t) m.segment_ids.data<int32_t>()[b * kT + t] = t < 11 + 5 * b ? 0 : 1;
  }
  return m;
}

ModelOptions recompute(RecomputeGranularity g, RecomputeMethod m = RecomputeMethod::kNone, int64_t n = 0,
                       DType dt = DType::kF32) {
  ModelOptions o;
  o.compute_dtype = dt;
  o.recompute_granularity = g;
  o.recompute_method = m;
  o.recompute_num_layers = n;
  return o;
}

std::string describe(const ModelOptions& o) {
  std::string s = dtype_name(o.compute_dtype);
  if (o.recompute_granularity == RecomputeGranularity::kSelective) s += " selective";
  if (o.recompute_granularity == RecomputeGranularity::kFull)
    s += std::string(o.recompute_method == RecomputeMethod::kUniform ? " full uniform " : " full block ") +
         std::to_string(o.recompute_num_layers);
  return s;
}

// Gradients as f32, whatever the grad dtype.
std::vector<float> grads_f32(const ParameterSet& ps) {
  std::vector<float> g(size_t(ps.numel()));
  const Tensor& t = ps.grads();
  for (int64_t i = 0; i < ps.numel(); ++i) {
    switch (t.dtype()) {
      case DType::kF32: g[size_t(i)] = t.data<float>()[i]; break;
      case DType::kF16: g[size_t(i)] = f16_to_f32(t.data<uint16_t>()[i]); break;
      case DType::kBF16: g[size_t(i)] = bf16_to_f32(t.data<uint16_t>()[i]); break;
      default: ADD_FAILURE() << "unexpected grad dtype"; break;
    }
  }
  return g;
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::fabs(double(x)));
  return m;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - double(b[i])));
  return m;
}

// Two training micro-batches (forward + backward each, gradients accumulating) with dropout keyed by
// micro-batch indices 10 and 11; returns the two losses.
std::vector<float> train_two_micro_batches(GPTModel& m, const std::vector<MicroBatch>& mbs) {
  std::vector<float> losses;
  for (size_t k = 0; k < mbs.size(); ++k) {
    ForwardOptions fo;
    fo.dropout_seed = 1234;
    fo.micro_batch_index = 10 + k;
    losses.push_back(m.forward(mbs[k].batch(), 1.0f / float(kB * kT), fo));
    m.backward(mbs[k].batch());
  }
  return losses;
}

class RecomputeBitIdentity : public ::testing::TestWithParam<std::tuple<std::string, DType>> {};
class GPTMemory : public ::testing::TestWithParam<std::string> {};

}  // namespace

// Every recomputation variant reproduces the losses and every gradient bit for bit, with hidden and
// attention dropout on, packed documents, and gradients accumulated over two micro-batches.
TEST_P(RecomputeBitIdentity, LossesAndGradientsMatchNoRecompute) {
  const auto& [arch, dt] = GetParam();
  auto ctx = make_cpu_context();
  const GPTConfig cfg = arch_config(arch, 0.1f, 0.1f);
  const std::vector<MicroBatch> mbs = {make_batch(0, cfg.vocab_size, true), make_batch(1, cfg.vocab_size, true)};

  GPTModel ref(cfg, *ctx, recompute(RecomputeGranularity::kNone, RecomputeMethod::kNone, 0, dt));
  ref.initialize(42);
  const std::vector<float> ref_losses = train_two_micro_batches(ref, mbs);
  const std::vector<float> ref_grads = grads_f32(ref.params());
  ASSERT_GT(max_abs(ref_grads), 0.0);

  using G = RecomputeGranularity;
  using M = RecomputeMethod;
  for (const ModelOptions& o :
       {recompute(G::kSelective, M::kNone, 0, dt), recompute(G::kFull, M::kUniform, 1, dt),
        recompute(G::kFull, M::kUniform, 2, dt), recompute(G::kFull, M::kUniform, 3, dt),
        recompute(G::kFull, M::kBlock, 1, dt), recompute(G::kFull, M::kBlock, 2, dt),
        recompute(G::kFull, M::kBlock, 4, dt)}) {
    SCOPED_TRACE(describe(o));
    GPTModel m(cfg, *ctx, o);
    m.initialize(42);
    const std::vector<float> losses = train_two_micro_batches(m, mbs);
    for (size_t k = 0; k < losses.size(); ++k)
      EXPECT_EQ(0, std::memcmp(&losses[k], &ref_losses[k], sizeof(float)))
          << describe(o) << " micro-batch " << k << ": " << losses[k] << " vs " << ref_losses[k];
    const std::vector<float> g = grads_f32(m.params());
    ASSERT_EQ(g.size(), ref_grads.size());
    EXPECT_EQ(0, std::memcmp(g.data(), ref_grads.data(), g.size() * sizeof(float)))
        << describe(o) << ": max |grad diff| " << max_abs_diff(g, ref_grads);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, RecomputeBitIdentity,
                         ::testing::Combine(::testing::Values("gpt2", "llama"),
                                            ::testing::Values(DType::kF32, DType::kBF16)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + dtype_name(std::get<1>(info.param));
                         });

// The planned buffers are exactly what the model allocates (the allocator's count agrees byte for byte),
// also after the micro-batch shape changes.
TEST_P(GPTMemory, PlanEqualsAllocatedBytes) {
  auto ctx = make_cpu_context();
  const GPTConfig cfg = arch_config(GetParam(), 0.1f, 0.1f);
  using G = RecomputeGranularity;
  using M = RecomputeMethod;
  ModelOptions f16_grads = recompute(G::kFull, M::kUniform, 3, DType::kF16);
  f16_grads.grad_dtype = DType::kF16;
  const MicroBatch mb = make_batch(0, cfg.vocab_size, false);
  Tensor tok = Tensor::empty({1, 8}, DType::kI32), tgt = Tensor::empty({1, 8}, DType::kI32);
  for (int64_t i = 0; i < 8; ++i) tok.data<int32_t>()[i] = tgt.data<int32_t>()[i] = int32_t(i);
  ModelOptions fp8 = recompute(G::kNone, M::kNone, 0, DType::kBF16);
  fp8.fp8 = Fp8Recipe{};
  fp8.fp8->amax_history_len = 3;
  for (const ModelOptions& o : {recompute(G::kNone), recompute(G::kSelective, M::kNone, 0, DType::kBF16),
                                recompute(G::kFull, M::kUniform, 2), recompute(G::kFull, M::kBlock, 3), f16_grads, fp8}) {
    SCOPED_TRACE(describe(o));
    const int64_t before = ctx->memory_stats().current_bytes;
    GPTModel m(cfg, *ctx, o);
    const GPTMemoryPlan plan = GPTModel::memory_plan(cfg, o, kB, kT);
    EXPECT_EQ(ctx->memory_stats().current_bytes - before, plan.parameter_bytes()) << describe(o);
    EXPECT_EQ(m.activation_bytes(), 0);
    m.initialize(1);
    m.forward(mb.batch(), 0.0f, ForwardOptions{false, 0, 0});
    EXPECT_EQ(m.activation_bytes(), plan.activation_bytes()) << describe(o);
    EXPECT_EQ(ctx->memory_stats().current_bytes - before, plan.total_bytes()) << describe(o);

    // A shorter micro-batch: the old buffers are freed, the new plan's are allocated.
    m.forward(GPTBatch{tok, tgt, {}, {}, {}}, 1.0f);
    m.backward(GPTBatch{tok, {}, {}, {}, {}});
    const GPTMemoryPlan small = GPTModel::memory_plan(cfg, o, 1, 8);
    EXPECT_EQ(m.activation_bytes(), small.activation_bytes()) << describe(o);
    EXPECT_EQ(ctx->memory_stats().current_bytes - before, small.total_bytes()) << describe(o);
  }
}

// An inference-only model (with_grads = false) allocates no gradient buffer (the plan drops params.grads
// and still equals the allocation), computes the same loss and logits, and refuses backward.
TEST(GPTInferenceModel, AllocatesNoGradients) {
  auto ctx = make_cpu_context();
  const GPTConfig cfg = small_config();
  ModelOptions inference;
  inference.compute_dtype = DType::kBF16;
  inference.with_grads = false;
  ModelOptions training = inference;
  training.with_grads = true;
  const GPTMemoryPlan plan = GPTModel::memory_plan(cfg, inference, kB, kT);
  const GPTMemoryPlan full = GPTModel::memory_plan(cfg, training, kB, kT);
  for (const PlannedBuffer& b : plan.parameters) EXPECT_NE(b.name, "params.grads");
  EXPECT_EQ(full.parameter_bytes() - plan.parameter_bytes(), cfg.num_parameters() * 4);  // f32 main grads
  const MicroBatch mb = make_batch(0, cfg.vocab_size, false);
  const int64_t before = ctx->memory_stats().current_bytes;
  GPTModel m(cfg, *ctx, inference);
  EXPECT_EQ(ctx->memory_stats().current_bytes - before, plan.parameter_bytes());
  EXPECT_FALSE(m.params().grads().defined());
  GPTModel ref(cfg, *ctx, training);
  m.initialize(4);
  ref.initialize(4);
  EXPECT_EQ(m.forward(mb.batch(), 0.0f, ForwardOptions{false, 0, 0}),
            ref.forward(mb.batch(), 0.0f, ForwardOptions{false, 0, 0}));
  EXPECT_EQ(0, std::memcmp(m.logits().raw(), ref.logits().raw(), size_t(m.logits().nbytes())));
  m.forward(mb.batch(), 1.0f);
  EXPECT_THROW(m.backward(mb.batch()), Error);
}

// Planned activation bytes and the measured peak of a forward + backward both fall strictly from no
// recomputation to selective to full; recomputed layers own no buffers. (Full block with N = 1 saves
// nothing: the one recomputed layer's activations move into a scratch of the same size.)
TEST_P(GPTMemory, RecomputationLowersActivationAndPeakBytes) {
  auto ctx = make_cpu_context();
  const GPTConfig cfg = arch_config(GetParam(), 0.1f, 0.1f);
  using G = RecomputeGranularity;
  using M = RecomputeMethod;
  const std::vector<ModelOptions> order = {recompute(G::kNone), recompute(G::kSelective),
                                           recompute(G::kFull, M::kBlock, 2), recompute(G::kFull, M::kBlock, 3),
                                           recompute(G::kFull, M::kUniform, 1)};
  std::vector<int64_t> planned, peaks;
  const MicroBatch mb = make_batch(0, cfg.vocab_size, false);
  for (const ModelOptions& o : order) {
    planned.push_back(GPTModel::memory_plan(cfg, o, kB, kT).activation_bytes());
    GPTModel m(cfg, *ctx, o);
    m.initialize(3);
    allocator_for(cpu_device()).reset_peak();
    const int64_t base = ctx->memory_stats().current_bytes;
    m.forward(mb.batch(), 1.0f / float(kB * kT), ForwardOptions{true, 5, 0});
    m.backward(mb.batch());
    peaks.push_back(ctx->memory_stats().peak_bytes - base);
  }
  for (size_t i = 1; i < order.size(); ++i) {
    EXPECT_LT(planned[i], planned[i - 1]) << describe(order[i]) << " vs " << describe(order[i - 1]);
    EXPECT_LT(peaks[i], peaks[i - 1]) << describe(order[i]) << " vs " << describe(order[i - 1]);
  }
  // Selective drops each layer's attention output (B·T·NH·HS compute dtype) and lse (B·NH·T f32) and adds
  // one shared copy of them.
  const int64_t att = kB * kT * cfg.num_attention_heads * cfg.head_dim() * 4,
                lse = kB * cfg.num_attention_heads * kT * 4;
  EXPECT_EQ(planned[0] - planned[1], (cfg.num_layers - 1) * (att + lse));
  // Full uniform N=1 keeps one (B, T, C) output per layer instead of all its activations.
  const GPTMemoryPlan full = GPTModel::memory_plan(cfg, order.back(), kB, kT);
  for (const PlannedBuffer& b : full.activations) {
    if (b.name.rfind("decoder.layers.", 0) == 0) {
      EXPECT_NE(b.name.find(".output"), std::string::npos) << b.name << " should not exist under full recompute";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Architectures, GPTMemory, ::testing::Values("gpt2", "llama"));

// Dropout: training differs from evaluation, masks are a function of (seed, micro-batch index) only,
// evaluation equals a model without dropout.
TEST(GPTDropout, MasksFollowSeedAndMicroBatch) {
  auto ctx = make_cpu_context();
  GPTModel m(small_config(0.1f, 0.1f), *ctx);
  GPTModel plain(small_config(0.0f, 0.0f), *ctx);
  m.initialize(9);
  plain.initialize(9);
  const MicroBatch mb = make_batch(0, 100, false);
  const GPTBatch b = mb.batch();
  auto loss = [&](bool training, uint64_t seed, uint64_t mbi) {
    return m.forward(b, 0.0f, ForwardOptions{training, seed, mbi});
  };
  const float eval = loss(false, 1, 0);
  const float train = loss(true, 1, 0);
  EXPECT_EQ(eval, plain.forward(b, 0.0f));
  EXPECT_EQ(eval, plain.forward(b, 0.0f, ForwardOptions{true, 1, 0}));  // p = 0: training has no dropout
  EXPECT_NE(train, eval);
  EXPECT_EQ(train, loss(true, 1, 0));
  EXPECT_NE(train, loss(true, 1, 1));
  EXPECT_NE(train, loss(true, 2, 0));
  EXPECT_EQ(eval, loss(false, 2, 7));  // evaluation ignores seed and counter

  // Only one of the two kinds on: each changes the loss by itself.
  GPTModel hidden_only(small_config(0.1f, 0.0f), *ctx), attention_only(small_config(0.0f, 0.1f), *ctx);
  hidden_only.initialize(9);
  attention_only.initialize(9);
  const float h = hidden_only.forward(b, 0.0f, ForwardOptions{true, 1, 0});
  const float a = attention_only.forward(b, 0.0f, ForwardOptions{true, 1, 0});
  EXPECT_NE(h, eval);
  EXPECT_NE(a, eval);
  EXPECT_NE(h, a);

  // An evaluation forward cannot prepare backward.
  EXPECT_THROW(m.forward(b, 1.0f, ForwardOptions{false, 1, 0}), Error);
  m.forward(b, 0.0f, ForwardOptions{false, 1, 0});
  EXPECT_THROW(m.backward(b), Error);
}

// The gradient with dropout on is the gradient of the loss with those masks: a central difference
// along a random direction agrees with <grad, direction>.
TEST(GPTDropout, GradientMatchesFiniteDifference) {
  auto ctx = make_cpu_context();
  GPTConfig cfg = small_config(0.1f, 0.1f);
  cfg.num_layers = 2;
  GPTModel m(cfg, *ctx);
  m.initialize(5);
  const MicroBatch mb = make_batch(3, cfg.vocab_size, true);
  const ForwardOptions fo{true, 77, 4};
  m.forward(mb.batch(), 1.0f / float(kB * kT), fo);
  m.backward(mb.batch());
  const std::vector<float> g = grads_f32(m.params());

  ParameterSet& ps = m.params();
  const int64_t n = ps.numel();
  std::vector<float> w0(static_cast<size_t>(n)), dir(static_cast<size_t>(n));
  std::memcpy(w0.data(), ps.values().raw(), size_t(n) * sizeof(float));
  uint64_t s = 99;
  double gd = 0;
  for (int64_t i = 0; i < n; ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    dir[size_t(i)] = ((s >> 40) & 1) ? 1.0f : -1.0f;
    gd += double(g[size_t(i)]) * dir[size_t(i)];
  }
  auto loss_at = [&](double eps) {
    float* w = ps.values().data<float>();
    for (int64_t i = 0; i < n; ++i) w[i] = float(double(w0[size_t(i)]) + eps * dir[size_t(i)]);
    return double(m.forward(mb.batch(), 0.0f, fo));
  };
  // Every weight moves by eps: small enough for the curvature, large enough for f32 losses.
  const double eps = 2e-4, tol = 2e-3 * std::fabs(gd) + 1e-4;
  const double fd = (loss_at(eps) - loss_at(-eps)) / (2 * eps);
  EXPECT_NEAR(fd, gd, tol) << "finite difference " << fd << " vs analytic " << gd;
  // Without dropout in the loss the same direction gives a clearly different slope, so the check above
  // does see the masks.
  GPTConfig plain_cfg = cfg;
  plain_cfg.hidden_dropout = plain_cfg.attention_dropout = 0;
  GPTModel plain(plain_cfg, *ctx);
  plain.initialize(5);
  plain.forward(mb.batch(), 1.0f / float(kB * kT), fo);
  plain.backward(mb.batch());
  const std::vector<float> gp = grads_f32(plain.params());
  double gpd = 0;
  for (int64_t i = 0; i < n; ++i) gpd += double(gp[size_t(i)]) * dir[size_t(i)];
  EXPECT_GT(std::fabs(gpd - gd), 10 * tol);
}

// bf16 and f16 compute track the f32 model: per-token losses and gradients agree to the formats'
// precision; the master weights stay f32. A larger init spreads the losses far from log(V), so agreement
// is not just "both near uniform".
TEST(GPTPrecision, HalfPrecisionTracksF32) {
  auto ctx = make_cpu_context();
  GPTConfig cfg = small_config();
  cfg.init_method_std = 0.1f;
  const MicroBatch mb = make_batch(0, cfg.vocab_size, false);
  GPTModel ref(cfg, *ctx);
  ref.initialize(11);
  const float ref_loss = ref.forward(mb.batch(), 1.0f / float(kB * kT));
  const std::vector<float> ref_losses(ref.losses().data<float>(), ref.losses().data<float>() + kB * kT);
  ref.backward(mb.batch());
  const std::vector<float> ref_g = grads_f32(ref.params());
  const auto [lo, hi] = std::minmax_element(ref_losses.begin(), ref_losses.end());
  ASSERT_GT(*hi - *lo, 2.0f);

  for (const DType dt : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(dt));
    ModelOptions o;
    o.compute_dtype = dt;
    GPTModel m(cfg, *ctx, o);
    m.initialize(11);
    const ParameterSet& ps = m.params();
    EXPECT_EQ(ps.values().dtype(), DType::kF32);
    EXPECT_EQ(ps.compute_values().dtype(), dt);
    EXPECT_EQ(ps.grads().dtype(), DType::kF32);  // f32 main grads by default
    EXPECT_NE(ps.compute_values().raw(), ps.values().raw());
    EXPECT_EQ(0, std::memcmp(ps.values().raw(), ref.params().values().raw(), size_t(ps.values().nbytes())));
    for (const Parameter& p : ps.all()) {
      EXPECT_EQ(p.value.dtype(), DType::kF32) << p.name;
      EXPECT_EQ(p.compute.dtype(), dt) << p.name;
    }
    const float loss = m.forward(mb.batch(), 1.0f / float(kB * kT));
    EXPECT_EQ(m.logits().dtype(), dt);
    ASSERT_EQ(m.losses().dtype(), DType::kF32);
    const std::vector<float> losses(m.losses().data<float>(), m.losses().data<float>() + kB * kT);
    const bool bf16 = dt == DType::kBF16;
    EXPECT_NEAR(loss, ref_loss, bf16 ? 5e-3 : 2e-3);
    EXPECT_LT(max_abs_diff(losses, ref_losses), bf16 ? 6e-2 : 8e-3);
    EXPECT_GT(max_abs_diff(losses, ref_losses), 0.0);  // it did compute in lower precision
    m.backward(mb.batch());
    const std::vector<float> g = grads_f32(m.params());
    EXPECT_LT(max_abs_diff(g, ref_g), (bf16 ? 3e-2 : 4e-3) * max_abs(ref_g));
  }
}

TEST(GPTPrecision, SyncComputeIsRoundToNearestEvenOfMaster) {
  auto ctx = make_cpu_context();
  for (const DType dt : {DType::kBF16, DType::kF16}) {
    ModelOptions o;
    o.compute_dtype = dt;
    GPTModel m(small_config(), *ctx, o);
    m.initialize(2);
    ParameterSet& ps = m.params();
    // What an optimizer step does: change the masters; the compute copy follows only on sync.
    float* w = ps.values().data<float>();
    for (int64_t i = 0; i < ps.numel(); ++i) w[i] = w[i] * 1.37f + 1e-3f * float(i % 17) + (i == 5 ? 1.00390625f : 0.0f);
    const uint16_t* c = ps.compute_values().data<uint16_t>();
    auto cast = [&](float x) { return dt == DType::kBF16 ? f32_to_bf16(x) : f32_to_f16(x); };
    int64_t stale = 0;
    for (int64_t i = 0; i < ps.numel(); ++i) stale += c[i] != cast(w[i]);
    EXPECT_GT(stale, 0);
    m.sync_compute();
    for (int64_t i = 0; i < ps.numel(); ++i) ASSERT_EQ(c[i], cast(w[i])) << dtype_name(dt) << " element " << i;
  }
  // f32 compute reads the master weights themselves: no copy.
  GPTModel f(small_config(), *ctx);
  EXPECT_EQ(f.params().compute_values().raw(), f.params().values().raw());
}

// --fp16 without --accumulate-allreduce-grads-in-fp32: gradients live and accumulate in f16.
TEST(GPTPrecision, F16GradientsAccumulate) {
  auto ctx = make_cpu_context();
  const GPTConfig cfg = small_config();
  const MicroBatch mb = make_batch(1, cfg.vocab_size, false);
  GPTModel ref(cfg, *ctx);
  ref.initialize(4);
  ref.forward(mb.batch(), 1.0f / float(kB * kT));
  ref.backward(mb.batch());
  const std::vector<float> ref_g = grads_f32(ref.params());

  ModelOptions o;
  o.compute_dtype = DType::kF16;
  o.grad_dtype = DType::kF16;
  GPTModel m(cfg, *ctx, o);
  m.initialize(4);
  EXPECT_EQ(m.params().grads().dtype(), DType::kF16);
  for (const Parameter& p : m.params().all()) EXPECT_EQ(p.grad.dtype(), DType::kF16) << p.name;
  m.forward(mb.batch(), 1.0f / float(kB * kT));
  m.backward(mb.batch());
  const std::vector<float> g1 = grads_f32(m.params());
  EXPECT_LT(max_abs_diff(g1, ref_g), 5e-3 * max_abs(ref_g));
  m.forward(mb.batch(), 1.0f / float(kB * kT));
  m.backward(mb.batch());
  const std::vector<float> g2 = grads_f32(m.params());
  std::vector<float> twice(g1.size());
  for (size_t i = 0; i < g1.size(); ++i) twice[i] = 2.0f * g1[i];
  EXPECT_LT(max_abs_diff(g2, twice), 1e-3 * max_abs(twice));  // a few f16 roundings
  EXPECT_GT(max_abs(g2), 1.5 * max_abs(g1));
  m.params().zero_grads(*ctx);
  EXPECT_EQ(max_abs(grads_f32(m.params())), 0.0);
}

namespace {
// The UserError message of building a model with `o`, or "" when it builds.
std::string option_error(const ModelOptions& o) {
  try {
    GPTModel::memory_plan(small_config(), o, 1, 1);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(GPTOptions, ValidationNamesTheMegatronFlags) {
  using G = RecomputeGranularity;
  using M = RecomputeMethod;
  EXPECT_NE(option_error(recompute(G::kFull, M::kNone, 2)).find("--recompute-method"), std::string::npos);
  EXPECT_NE(option_error(recompute(G::kFull, M::kUniform, 0)).find("--recompute-num-layers"), std::string::npos);
  EXPECT_NE(option_error(recompute(G::kFull, M::kBlock, 5)).find("[1, 4]"), std::string::npos);
  EXPECT_NE(option_error(recompute(G::kSelective, M::kUniform, 0)).find("--recompute-method"), std::string::npos);
  EXPECT_NE(option_error(recompute(G::kSelective, M::kNone, 2)).find("--recompute-num-layers"), std::string::npos);
  EXPECT_EQ(option_error(recompute(G::kNone, M::kUniform, 9)), "");  // ignored, as in Megatron
  EXPECT_EQ(option_error(recompute(G::kFull, M::kUniform, 4)), "");
  ModelOptions bad_grad;
  bad_grad.compute_dtype = DType::kBF16;
  bad_grad.grad_dtype = DType::kF16;
  EXPECT_NE(option_error(bad_grad).find("--accumulate-allreduce-grads-in-fp32"), std::string::npos);
  auto ctx = make_cpu_context();
  EXPECT_THROW({ GPTModel m(small_config(), *ctx, recompute(G::kFull, M::kBlock, 0)); }, UserError);
  EXPECT_THROW({ GPTModel m(small_config(1.0f, 0.0f), *ctx); }, UserError);
  EXPECT_THROW({ GPTModel m(small_config(0.0f, -0.1f), *ctx); }, UserError);

  EXPECT_EQ(parse_recompute_granularity("full"), G::kFull);
  EXPECT_EQ(parse_recompute_granularity("selective"), G::kSelective);
  EXPECT_THROW(parse_recompute_granularity("partial"), UserError);
  EXPECT_EQ(parse_recompute_method("uniform"), M::kUniform);
  EXPECT_EQ(parse_recompute_method("block"), M::kBlock);
  EXPECT_THROW(parse_recompute_method("blocks"), UserError);
}

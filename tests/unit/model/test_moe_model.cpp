// GPTModel with mixture-of-experts layers (model/moe_mlp.cpp): the parameter gradients of the router, an
// expert and the shared-expert gate against central differences of the training objective (mean loss +
// every MoE layer's aux and z losses), full and selective activation recomputation reproducing losses,
// gradients and router statistics bit for bit, gradient accumulation over two micro-batches equal to one
// micro-batch twice the size, and the router losses' gradient scale under a loss mask. The golden test (tests/golden/test_golden_moe_model.cpp) checks the
// numerics against PyTorch.
//
// Two MoE variants, Llama-style (RMSNorm, SwiGLU, GQA, RoPE, untied), one dense layer each:
//   softmax_shared   --moe-layer-freq [1,0,1]; softmax top-2, aux_loss, z-loss, gated shared experts
//   sigmoid_capacity --moe-layer-freq [0,1,1]; sigmoid top-2 with an expert bias, top-k scaling 2.5,
//                    capacity factor 1.0 (probs), seq_aux_loss, z-loss
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "loom/model/gpt.h"

using namespace loom;

namespace {

constexpr int64_t kB = 2, kT = 8;

GPTConfig moe_config(const std::string& variant, float hidden_dropout = 0.0f) {
  GPTConfig c;
  c.num_layers = 3;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.group_query_attention = true;
  c.num_query_groups = 2;
  c.max_position_embeddings = 4 * kT;
  c.vocab_size = 45;
  c.padded_vocab_size = 48;
  c.ffn_hidden = 24;
  c.normalization = NormKind::kRMSNorm;
  c.activation = MlpActivation::kSwiGLU;
  c.add_bias_linear = false;
  c.untie_embeddings_and_output_weights = true;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  c.hidden_dropout = hidden_dropout;
  // Router logits of order 1, so that routing decisions are well away from ties.
  c.init_method_std = 0.2f;
  MoeConfig& m = c.moe;
  m.num_experts = 4;
  m.ffn_hidden_size = 12;
  RouterConfig& r = m.router;
  r.num_experts = 4;
  r.topk = 2;
  r.z_loss_coeff = 0.03125;
  if (variant == "softmax_shared") {
    m.layer_pattern = {1, 0, 1};
    m.shared_expert_intermediate_size = 16;
    m.shared_expert_gate = true;
    r.aux_loss_coeff = 0.25;
  } else {
    m.layer_pattern = {0, 1, 1};
    r.score_function = MoeScoreFunction::kSigmoid;
    r.enable_expert_bias = true;
    r.topk_scaling_factor = 2.5;
    r.capacity_factor = 1.0;
    r.load_balancing = MoeLoadBalancing::kSeqAuxLoss;
    r.aux_loss_coeff = 0.25;
  }
  return c;
}

// A model initialised from `seed`, with a non-zero expert bias where there is one.
std::unique_ptr<GPTModel> make_model(const GPTConfig& cfg, const DeviceContext& ctx, const ModelOptions& o = {},
                                     uint64_t seed = 7) {
  auto m = std::make_unique<GPTModel>(cfg, ctx, o);
  m->initialize(seed);
  for (auto& [name, bias] : m->expert_biases())
    for (size_t e = 0; e < bias->size(); ++e) (*bias)[e] = 0.02f * float(int(e % 3) - 1);
  return m;
}

struct MicroBatch {
  Tensor tokens, targets;
  GPTBatch batch() const { return GPTBatch{tokens, targets, {}, {}, {}}; }
};

// Deterministic (B, T) tokens and targets; `seed` picks the sequence.
MicroBatch make_batch(int64_t B, int64_t V, uint64_t seed) {
  MicroBatch m;
  m.tokens = Tensor::empty({B, kT}, DType::kI32);
  m.targets = Tensor::empty({B, kT}, DType::kI32);
  uint64_t s = 0x9e3779b97f4a7c15ull ^ (seed * 7919u);
  auto next = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return int32_t((s >> 33) % uint64_t(V));
  };
  for (int64_t i = 0; i < B * kT; ++i) {
    m.tokens.data<int32_t>()[i] = next();
    m.targets.data<int32_t>()[i] = next();
  }
  return m;
}

// Rows [b0, b0 + nb) of a (B, T) micro-batch.
MicroBatch rows(const MicroBatch& mb, int64_t b0, int64_t nb) {
  MicroBatch r;
  r.tokens = Tensor::empty({nb, kT}, DType::kI32);
  r.targets = Tensor::empty({nb, kT}, DType::kI32);
  std::memcpy(r.tokens.raw(), mb.tokens.data<int32_t>() + b0 * kT, size_t(nb * kT) * sizeof(int32_t));
  std::memcpy(r.targets.raw(), mb.targets.data<int32_t>() + b0 * kT, size_t(nb * kT) * sizeof(int32_t));
  return r;
}

std::vector<float> grads_of(const ParameterSet& ps) {
  const Tensor& g = ps.grads();
  return std::vector<float>(g.data<float>(), g.data<float>() + ps.numel());
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

ModelOptions recompute(RecomputeGranularity g, RecomputeMethod m = RecomputeMethod::kNone, int64_t n = 0) {
  ModelOptions o;
  o.recompute_granularity = g;
  o.recompute_method = m;
  o.recompute_num_layers = n;
  return o;
}

class MoeModel : public ::testing::TestWithParam<std::string> {};

}  // namespace

// The training objective of one micro-batch is mean loss + Σ_layers (aux + z) (Megatron's
// MoEAuxLossAutoScaler scale is 1 for one FP32 micro-batch); GPTModel::forward returns the mean loss alone and
// MoeLayerStats the router losses without their coefficients. Its central differences along random ±1
// directions in single parameters agree with the backward's gradients: the routers (their own gradient
// path: probs, aux and z losses), routed experts' fc1 / fc2, and the shared-expert gate. The step eps = 1e-3
// per element moves router logits by about eps · sqrt(C) ≈ 0.006, inside the routing's margins (the token
// counts per expert stay put), and keeps the f32 forward's noise (~1e-7 on the objective) at ~5e-5 on the
// slope; the tolerance is 2e-3 relative + 1.5e-4.
TEST_P(MoeModel, GradientsMatchCentralDifferencesOfTheObjective) {
  const std::string variant = GetParam();
  auto ctx = make_cpu_context();
  const GPTConfig cfg = moe_config(variant);
  std::unique_ptr<GPTModel> m = make_model(cfg, *ctx);
  const MicroBatch mb = make_batch(kB, cfg.vocab_size, 3);
  const float dloss = 1.0f / float(kB * kT);
  // Objective (f64 sum of the f32 per-token losses and the router losses) of a forward + backward, and the
  // tokens per expert of its MoE layers.
  std::vector<double> counts;
  auto objective = [&] {
    m->reset_moe_stats();
    m->forward(mb.batch(), dloss);
    double sum = 0;
    for (int64_t i = 0; i < kB * kT; ++i) sum += double(m->losses().data<float>()[i]);
    m->backward(mb.batch());
    double obj = sum / double(kB * kT);
    counts.clear();
    for (const MoeLayerStats& s : m->moe_stats()) {
      obj += cfg.moe.router.aux_loss_coeff * s.load_balancing_loss + cfg.moe.router.z_loss_coeff * s.z_loss;
      counts.insert(counts.end(), s.tokens_per_expert.begin(), s.tokens_per_expert.end());
    }
    return obj;
  };
  objective();
  const std::vector<float> g = grads_of(m->params());
  const std::vector<double> counts0 = counts;

  const int64_t moe_layer = cfg.moe.layer_pattern[0] ? 0 : 1;
  const std::string p = "decoder.layers." + std::to_string(moe_layer) + ".mlp.";
  std::vector<std::string> names = {p + "router.weight", p + "experts.linear_fc1.weight1",
                                    "decoder.layers.2.mlp.router.weight", "decoder.layers.2.mlp.experts.linear_fc2.weight3"};
  if (cfg.moe.shared_expert_gate) names.push_back(p + "shared_experts.gate_weight");
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    Parameter* prm = m->params().find(name);
    ASSERT_NE(prm, nullptr);
    const int64_t n = prm->value.numel(), off = prm->offset;
    float* w = prm->value.data<float>();
    const std::vector<float> w0(w, w + n);
    std::vector<float> dir(static_cast<size_t>(n));
    uint64_t s = 12345 + uint64_t(n);
    double gd = 0;
    for (int64_t i = 0; i < n; ++i) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      dir[size_t(i)] = ((s >> 40) & 1) ? 1.0f : -1.0f;
      gd += double(g[size_t(off + i)]) * dir[size_t(i)];
    }
    const double eps = 1e-3;
    auto at = [&](double h) {
      for (int64_t i = 0; i < n; ++i) w[i] = float(double(w0[size_t(i)]) + h * dir[size_t(i)]);
      m->sync_compute();
      const double obj = objective();
      EXPECT_EQ(counts, counts0) << "the step " << h << " changed the routing";
      return obj;
    };
    const double fd = (at(eps) - at(-eps)) / (2 * eps);
    std::copy(w0.begin(), w0.end(), w);
    m->sync_compute();
    const double tol = 2e-3 * std::fabs(gd) + 1.5e-4;
    std::printf("  [fd] %-12s %-48s analytic %+.6e  central difference %+.6e  rel %.1e\n", variant.c_str(),
                name.c_str(), gd, fd, std::fabs(fd - gd) / std::max(std::fabs(gd), 1e-30));
    EXPECT_GT(std::fabs(gd), 20 * tol) << "the direction must carry a clear gradient";
    EXPECT_NEAR(fd, gd, tol);
  }
}

// Every recomputation variant reproduces the losses, every gradient and the router statistics bit for
// bit (routing is redone in the recomputed forward and must decide identically), with hidden dropout on
// and gradients accumulated over two micro-batches.
TEST_P(MoeModel, RecomputationIsBitIdentical) {
  const std::string variant = GetParam();
  auto ctx = make_cpu_context();
  const GPTConfig cfg = moe_config(variant, 0.1f);
  const std::vector<MicroBatch> mbs = {make_batch(kB, cfg.vocab_size, 1), make_batch(kB, cfg.vocab_size, 2)};
  auto train = [&](GPTModel& m) {
    std::vector<float> losses;
    for (size_t k = 0; k < mbs.size(); ++k) {
      ForwardOptions fo;
      fo.dropout_seed = 99;
      fo.micro_batch_index = 20 + k;
      losses.push_back(m.forward(mbs[k].batch(), 1.0f / float(2 * kB * kT), fo));
      m.backward(mbs[k].batch());
    }
    return losses;
  };
  std::unique_ptr<GPTModel> ref = make_model(cfg, *ctx);
  const std::vector<float> ref_losses = train(*ref);
  const std::vector<float> ref_grads = grads_of(ref->params());
  const std::vector<MoeLayerStats> ref_stats = ref->moe_stats();
  ASSERT_GT(max_abs(ref_grads), 0.0);

  using G = RecomputeGranularity;
  using M = RecomputeMethod;
  for (const auto& [o, what] : std::vector<std::pair<ModelOptions, std::string>>{
           {recompute(G::kSelective), "selective"},
           {recompute(G::kFull, M::kUniform, 1), "full uniform 1"},
           {recompute(G::kFull, M::kUniform, 2), "full uniform 2"},
           {recompute(G::kFull, M::kUniform, 3), "full uniform 3"},
           {recompute(G::kFull, M::kBlock, 1), "full block 1"},
           {recompute(G::kFull, M::kBlock, 2), "full block 2"},
           {recompute(G::kFull, M::kBlock, 3), "full block 3"}}) {
    SCOPED_TRACE(what);
    std::unique_ptr<GPTModel> m = make_model(cfg, *ctx, o);
    const std::vector<float> losses = train(*m);
    for (size_t k = 0; k < losses.size(); ++k)
      EXPECT_EQ(0, std::memcmp(&losses[k], &ref_losses[k], sizeof(float))) << losses[k] << " vs " << ref_losses[k];
    const std::vector<float> g = grads_of(m->params());
    EXPECT_EQ(0, std::memcmp(g.data(), ref_grads.data(), g.size() * sizeof(float)))
        << "max |grad diff| " << max_abs_diff(g, ref_grads);
    const std::vector<MoeLayerStats> stats = m->moe_stats();
    ASSERT_EQ(stats.size(), ref_stats.size());
    for (size_t l = 0; l < stats.size(); ++l) {
      EXPECT_EQ(stats[l].micro_batches, 2);
      EXPECT_EQ(stats[l].load_balancing_loss, ref_stats[l].load_balancing_loss);
      EXPECT_EQ(stats[l].z_loss, ref_stats[l].z_loss);
      EXPECT_EQ(stats[l].tokens_per_expert, ref_stats[l].tokens_per_expert);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, MoeModel, ::testing::Values("softmax_shared", "sigmoid_capacity"),
                         [](const auto& info) { return info.param; });

// Two micro-batches of B sequences with gradients accumulated (each with dloss_scale 1 / (2·B·T), the
// trainer's mean over micro-batches) equal one micro-batch of 2B sequences. This holds where the routing
// of a token does not depend on the other tokens of its micro-batch and the router losses average over
// micro-batches: seq_aux_loss (per sequence) and the z-loss (per token), no capacity (capacity is per
// micro-batch; so is the Switch aux_loss's count, which is not a sum of per-micro-batch terms).
TEST(MoeModelAccumulation, TwoMicroBatchesEqualOneDoubleMicroBatch) {
  auto ctx = make_cpu_context();
  GPTConfig cfg = moe_config("softmax_shared");
  cfg.moe.router.load_balancing = MoeLoadBalancing::kSeqAuxLoss;
  const MicroBatch both = make_batch(2 * kB, cfg.vocab_size, 5);

  std::unique_ptr<GPTModel> two = make_model(cfg, *ctx);
  double two_loss = 0;
  for (int64_t k = 0; k < 2; ++k) {
    const MicroBatch half = rows(both, k * kB, kB);
    two_loss += 0.5 * double(two->forward(half.batch(), 1.0f / float(2 * kB * kT)));
    two->backward(half.batch());
  }
  std::unique_ptr<GPTModel> one = make_model(cfg, *ctx);
  const double one_loss = one->forward(both.batch(), 1.0f / float(2 * kB * kT));
  one->backward(both.batch());

  EXPECT_NEAR(two_loss, one_loss, 1e-6 * one_loss);
  const std::vector<float> g2 = grads_of(two->params()), g1 = grads_of(one->params());
  const double rel = max_abs_diff(g2, g1) / max_abs(g1);
  std::printf("  [accumulation] max |grad diff| / max |grad| = %.2e\n", rel);
  EXPECT_LE(rel, 1e-5);  // the same sums in another order
  // The statistics: two micro-batches' figures add up to twice the double micro-batch's (a mean each),
  // the token counts to the same counts.
  const std::vector<MoeLayerStats> s2 = two->moe_stats(), s1 = one->moe_stats();
  ASSERT_EQ(s2.size(), s1.size());
  for (size_t l = 0; l < s1.size(); ++l) {
    EXPECT_NEAR(s2[l].load_balancing_loss, 2 * s1[l].load_balancing_loss, 1e-6 * s1[l].load_balancing_loss);
    EXPECT_NEAR(s2[l].z_loss, 2 * s1[l].z_loss, 1e-6 * s1[l].z_loss);
    EXPECT_EQ(s2[l].tokens_per_expert, s1[l].tokens_per_expert);
  }
  // The router's own gradient differs clearly between the seq_aux_loss objective above and the Switch
  // aux_loss one (whose count runs over the micro-batch), so the check sees the router losses.
  GPTConfig sw = cfg;
  sw.moe.router.load_balancing = MoeLoadBalancing::kAuxLoss;
  std::unique_ptr<GPTModel> two_sw = make_model(sw, *ctx);
  for (int64_t k = 0; k < 2; ++k) {
    const MicroBatch half = rows(both, k * kB, kB);
    two_sw->forward(half.batch(), 1.0f / float(2 * kB * kT));
    two_sw->backward(half.batch());
  }
  std::unique_ptr<GPTModel> one_sw = make_model(sw, *ctx);
  one_sw->forward(both.batch(), 1.0f / float(2 * kB * kT));
  one_sw->backward(both.batch());
  const Parameter* router = one_sw->params().find("decoder.layers.0.mlp.router.weight");
  const std::vector<float> a = grads_of(two_sw->params()), b = grads_of(one_sw->params());
  double d = 0, mag = 0;
  for (int64_t i = 0; i < router->value.numel(); ++i) {
    d = std::max(d, std::fabs(double(a[size_t(router->offset + i)]) - double(b[size_t(router->offset + i)])));
    mag = std::max(mag, std::fabs(double(b[size_t(router->offset + i)])));
  }
  EXPECT_GT(d, 1e-3 * mag) << "Switch aux_loss: the two should differ";
}

// The router losses' gradients enter with the main loss's backward scale (the factor on d(mean loss)),
// whatever the loss mask: their share of the gradient (with coefficients minus without) is the same for a
// micro-batch without a mask (dloss_scale 1 / (B·T)) and with a mask of 5 tokens (dloss_scale 1 / 5).
TEST(MoeModelLossMask, RouterLossGradientsIgnoreTheMask) {
  auto ctx = make_cpu_context();
  const GPTConfig cfg = moe_config("softmax_shared");
  GPTConfig off = cfg;
  off.moe.router.aux_loss_coeff = off.moe.router.z_loss_coeff = 0;
  const MicroBatch mb = make_batch(kB, cfg.vocab_size, 9);
  Tensor mask = Tensor::empty({kB, kT}, DType::kF32);
  for (int64_t i = 0; i < kB * kT; ++i) mask.data<float>()[i] = i % 3 == 1 ? 1.0f : 0.0f;  // 5 tokens
  auto router_loss_grads = [&](bool masked) {
    GPTBatch b = mb.batch();
    if (masked) b.loss_mask = mask;
    const float dloss = masked ? 1.0f / 5.0f : 1.0f / float(kB * kT);
    std::unique_ptr<GPTModel> with = make_model(cfg, *ctx), without = make_model(off, *ctx);
    with->forward(b, dloss);
    with->backward(b);
    without->forward(b, dloss);
    without->backward(b);
    std::vector<float> g = grads_of(with->params());
    const std::vector<float> g0 = grads_of(without->params());
    for (size_t i = 0; i < g.size(); ++i) g[i] -= g0[i];
    return g;
  };
  const std::vector<float> plain = router_loss_grads(false), masked = router_loss_grads(true);
  ASSERT_GT(max_abs(plain), 1e-3);
  const double rel = max_abs_diff(plain, masked) / max_abs(plain);
  std::printf("  [loss mask] router-loss gradients, masked vs not: max diff / max = %.2e\n", rel);
  EXPECT_LE(rel, 1e-4);  // differences of f32 gradients of size ~1 and ~0.1
}

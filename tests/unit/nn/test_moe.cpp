// MoE router and grouped MLP (loom/nn/moe.h): finite-difference checks of the router + permutation path on
// odd shapes (N = 1, 5, 217; E = 3, 8; k = 1, 2; softmax, pre-softmax, sigmoid, capacity), the documented
// tie-breaking, the expert-bias update rule, and the flag errors. PyTorch comparisons of the same pieces
// are in tests/golden/test_golden_moe.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>

#include "loom/backend/device_context.h"
#include "loom/nn/modules.h"
#include "loom/nn/moe.h"

namespace loom {
namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(MoeRouter, FlagErrorsNameTheFlag) {
  RouterConfig cfg;
  cfg.num_experts = 4;
  cfg.topk = 5;
  EXPECT_NE(error_of([&] { cfg.validate(); }).find("--moe-router-topk"), std::string::npos);
  cfg.topk = 1;
  EXPECT_NE(error_of([&] { cfg.validate(); }).find("--moe-router-pre-softmax"), std::string::npos);
  cfg.topk = 2;
  cfg.capacity_factor = 0.0;
  EXPECT_NE(error_of([&] { cfg.validate(); }).find("--moe-expert-capacity-factor must be > 0"), std::string::npos);
  cfg.capacity_factor = -1.0;
  EXPECT_THROW(cfg.validate(), UserError);
  cfg.capacity_factor.reset();
  cfg.pad_to_capacity = true;
  EXPECT_NE(error_of([&] { cfg.validate(); }).find("--moe-pad-expert-input-to-capacity"), std::string::npos);
  cfg.pad_to_capacity = false;
  cfg.enable_expert_bias = true;
  EXPECT_NE(error_of([&] { cfg.validate(); }).find("--moe-router-enable-expert-bias"), std::string::npos);
  EXPECT_NE(error_of([] { parse_moe_score_function("relu"); }).find("--moe-router-score-function"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_moe_load_balancing("balanced"); }).find("--moe-router-load-balancing-type"),
            std::string::npos);
  EXPECT_EQ(parse_moe_load_balancing("sinkhorn"), MoeLoadBalancing::kSinkhorn);
  cfg.enable_expert_bias = false;
  cfg.load_balancing = MoeLoadBalancing::kSinkhorn;
  cfg.aux_loss_coeff = 1e-2;
  EXPECT_NE(error_of([&] { cfg.validate(); }).find("does not take an aux loss"), std::string::npos);
  cfg.aux_loss_coeff = 0;
  cfg.capacity_factor = 1.0;
  EXPECT_NE(error_of([&] { cfg.validate(); }).find("drops no tokens"), std::string::npos);
  cfg.capacity_factor.reset();
  cfg.pre_softmax = true;
  EXPECT_NE(error_of([&] { cfg.validate(); }).find("has its own scores"), std::string::npos);
  cfg.pre_softmax = false;
  cfg.topk = 1;  // top-1 sinkhorn is a sigmoid router: no pre-softmax needed
  EXPECT_EQ(error_of([&] { cfg.validate(); }), "");
  cfg.load_balancing = MoeLoadBalancing::kAuxLoss;
  EXPECT_NE(error_of([] { parse_moe_drop_policy("random"); }).find("--moe-token-drop-policy"), std::string::npos);
  EXPECT_EQ(parse_moe_score_function("sigmoid"), MoeScoreFunction::kSigmoid);
  EXPECT_EQ(parse_moe_load_balancing("seq_aux_loss"), MoeLoadBalancing::kSeqAuxLoss);
  EXPECT_EQ(parse_moe_drop_policy("position"), MoeDropPolicy::kPosition);
}

// Megatron-Core's sinkhorn router on logits that all prefer expert 0: training balances the choices over
// the micro-batch (the top-k of the Sinkhorn-Knopp matrix; the expected experts were computed with
// Megatron's algorithm in PyTorch), evaluation takes the top-k of the activation; probs are the sigmoid
// (top-1) or the softmax over all experts (top-2) at the chosen experts, and their gradient is that
// activation's.
TEST(MoeRouter, SinkhornBalancesTheMicroBatch) {
  const float logits[] = {2.0f, 0.5f, 0.1f, 1.8f, 0.2f, 0.9f, 2.2f, 1.0f, 0.3f,
                          1.5f, 0.4f, 0.8f, 2.4f, 0.7f, 0.2f, 1.9f, 0.9f, 1.1f};
  RouterConfig cfg;
  cfg.num_experts = 3;
  cfg.load_balancing = MoeLoadBalancing::kSinkhorn;
  cfg.topk = 1;
  Routing r = route_tokens(cfg, logits, 6, 6, /*training=*/true, {});
  EXPECT_EQ(r.topk_idx, (std::vector<int32_t>{0, 2, 1, 2, 0, 2}));
  EXPECT_NEAR(r.topk_probs[1], 1.0 / (1.0 + std::exp(-0.9)), 1e-6);  // sigmoid of the chosen logit
  EXPECT_EQ(r.aux_loss, 0.0);
  EXPECT_EQ(route_tokens(cfg, logits, 6, 6, /*training=*/false, {}).topk_idx,
            (std::vector<int32_t>{0, 0, 0, 0, 0, 0}));
  cfg.topk = 2;
  r = route_tokens(cfg, logits, 6, 6, true, {});
  EXPECT_EQ(r.topk_idx, (std::vector<int32_t>{0, 1, 2, 0, 1, 0, 2, 1, 0, 1, 2, 1}));
  double z = 0;
  for (int e = 0; e < 3; ++e) z += std::exp(double(logits[3 + e]));
  EXPECT_NEAR(r.probs[3 + 2], std::exp(0.9) / z, 1e-6);  // softmax over all experts, not renormalised
  // Gradient: d(Σ w · probs)/d(logits) against central differences with the routing held (training
  // routing at logits ± eps is the same here: the balanced matrix moves smoothly and no choice is near a tie).
  for (int64_t k : {1, 2}) {
    cfg.topk = k;
    const Routing base = route_tokens(cfg, logits, 6, 6, true, {});
    std::vector<float> w(18), dl(18);
    for (int i = 0; i < 18; ++i) w[size_t(i)] = 0.3f + 0.1f * float(i % 5);
    route_tokens_backward(cfg, logits, base, w.data(), 6, true, 1.0, {}, dl.data());
    for (int i = 0; i < 18; ++i) {
      std::vector<float> lp(logits, logits + 18), lm = lp;
      const float eps = 1e-3f;
      lp[size_t(i)] += eps;
      lm[size_t(i)] -= eps;
      const Routing rp = route_tokens(cfg, lp.data(), 6, 6, true, {}), rm = route_tokens(cfg, lm.data(), 6, 6, true, {});
      ASSERT_EQ(rp.topk_idx, base.topk_idx) << "logit " << i;
      ASSERT_EQ(rm.topk_idx, base.topk_idx) << "logit " << i;
      double fd = 0;
      for (int j = 0; j < 18; ++j) fd += double(w[size_t(j)]) * (double(rp.probs[size_t(j)]) - double(rm.probs[size_t(j)]));
      EXPECT_NEAR(dl[size_t(i)], fd / (2.0 * eps), 2e-4) << "top-" << k << " logit " << i;
    }
  }
}

TEST(MoeRouter, TiesGoToTheLowerIndex) {
  RouterConfig cfg;
  cfg.num_experts = 4;
  cfg.topk = 2;
  // Token 0: experts 1, 2, 3 tie; token 1: all tie.
  const float logits[] = {0.0f, 1.0f, 1.0f, 1.0f, 0.5f, 0.5f, 0.5f, 0.5f};
  Routing r = route_tokens(cfg, logits, 2, 2, false, {});
  EXPECT_EQ(r.topk_idx, (std::vector<int32_t>{1, 2, 0, 1}));
  EXPECT_FLOAT_EQ(r.topk_probs[0], 0.5f);
  // Capacity 1 per expert (ceil(2·2/4 · 1)): by position, expert 1 keeps token 0 and drops token 1.
  cfg.capacity_factor = 1.0;
  cfg.drop_policy = MoeDropPolicy::kPosition;
  r = route_tokens(cfg, logits, 2, 2, false, {});
  // Element by element: Debian's GCC 12.2 at -O3 -march=native (AVX-512) folds a constant std::vector<int64_t>
  // {1, 1, 1, 0} (also via an array) into one broadcast store of 1s, so a literal here reads {1, 1, 1, 1}.
  ASSERT_EQ(r.group_sizes.size(), 4u);
  EXPECT_EQ(r.group_sizes[0], 1);
  EXPECT_EQ(r.group_sizes[1], 1);
  EXPECT_EQ(r.group_sizes[2], 1);
  EXPECT_EQ(r.group_sizes[3], 0);
  EXPECT_EQ(r.row_id_map, (std::vector<int32_t>{-1, 1, 2, -1, 0, -1, -1, -1}));
  EXPECT_EQ(r.topk_probs[3], 0.0f);  // token 1's expert 1 was dropped
}

TEST(MoeRouter, ExpertBiasUpdateIsMegatronsSignRule) {
  const std::vector<float> b = get_updated_expert_bias({4, 2, 3, 3}, {0.1f, 0.0f, -0.2f, 0.0f}, 0.01f);
  EXPECT_FLOAT_EQ(b[0], 0.09f);   // above the mean 3: bias down
  EXPECT_FLOAT_EQ(b[1], 0.01f);   // below: up
  EXPECT_FLOAT_EQ(b[2], -0.2f);   // at the mean: unchanged
  EXPECT_FLOAT_EQ(b[3], 0.0f);

  RouterConfig cfg;
  cfg.num_experts = 3;
  cfg.topk = 1;
  cfg.score_function = MoeScoreFunction::kSigmoid;
  cfg.enable_expert_bias = true;
  const float logits[] = {2.0f, 0.0f, 0.0f};
  EXPECT_EQ(route_tokens(cfg, logits, 1, 1, false, {0.0f, 0.0f, 0.0f}).topk_idx[0], 0);
  Routing r = route_tokens(cfg, logits, 1, 1, false, {0.0f, 0.9f, 0.0f});
  EXPECT_EQ(r.topk_idx[0], 1);  // the bias moves the choice ...
  EXPECT_FLOAT_EQ(r.topk_probs[0], 0.5f);  // ... but not the prob: sigmoid(0), k = 1 not renormalised
}

struct FdCase {
  int64_t N, T, E, k;
  MoeScoreFunction score;
  bool pre_softmax;
  double capacity;  // 0: none
  MoeLoadBalancing lb;
};

// J(x, Wr) = Σ y·dy + g·(aux + z) with y = unpermute(permute(x) · 1.5, probs): the router + permutation
// path; compares the module gradients with central differences.
TEST(MoeRouter, RouterAndPermutationGradientsMatchFiniteDifferences) {
  auto ctx = make_cpu_context();
  const OpTable& ops = ctx->ops();
  const FdCase cases[] = {
      {1, 1, 3, 1, MoeScoreFunction::kSoftmax, true, 0, MoeLoadBalancing::kAuxLoss},
      {5, 5, 3, 2, MoeScoreFunction::kSoftmax, true, 0, MoeLoadBalancing::kSeqAuxLoss},
      {5, 5, 8, 2, MoeScoreFunction::kSigmoid, false, 0, MoeLoadBalancing::kAuxLoss},
      {217, 31, 8, 2, MoeScoreFunction::kSoftmax, false, 1.0, MoeLoadBalancing::kAuxLoss},
      {217, 7, 3, 1, MoeScoreFunction::kSigmoid, false, 0, MoeLoadBalancing::kSeqAuxLoss},
  };
  const int64_t C = 6;
  const double g = 0.75;
  for (const FdCase& fc : cases) {
    SCOPED_TRACE("N=" + std::to_string(fc.N) + " E=" + std::to_string(fc.E) + " k=" + std::to_string(fc.k));
    RouterConfig cfg;
    cfg.num_experts = fc.E;
    cfg.topk = fc.k;
    cfg.score_function = fc.score;
    cfg.pre_softmax = fc.pre_softmax;
    cfg.load_balancing = fc.lb;
    cfg.aux_loss_coeff = 0.5;
    cfg.z_loss_coeff = 0.25;
    if (fc.capacity > 0) cfg.capacity_factor = fc.capacity;
    if (fc.score == MoeScoreFunction::kSigmoid) cfg.topk_scaling_factor = 1.5;
    ParameterSet ps;
    Router router(ps, "mlp", C, cfg, 0.5f);
    ps.allocate(*ctx);
    ps.initialize(1234 + uint64_t(fc.N));
    std::mt19937 rng(uint32_t(fc.N * 31 + fc.E));
    std::normal_distribution<float> nd;
    Tensor x = Tensor::empty({fc.N, C}, DType::kF32), dy = Tensor::empty({fc.N, C}, DType::kF32);
    for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = nd(rng), dy.data<float>()[i] = nd(rng);

    auto objective = [&](Router::Saved& s, Tensor& xp, Tensor& y) {
      router.forward(*ctx, s, x, fc.T, true);
      const int64_t M = s.routing.num_rows();
      xp = Tensor::empty({M, C}, DType::kF32);
      ops.moe_permute_forward(xp, x, s.row_id_map);
      for (int64_t i = 0; i < xp.numel(); ++i) xp.data<float>()[i] *= 1.5f;
      y = Tensor::empty({fc.N, C}, DType::kF32);
      ops.moe_unpermute_forward(y, xp, s.probs, s.row_id_map);
      double J = g * (s.routing.aux_loss + s.routing.z_loss);
      for (int64_t i = 0; i < y.numel(); ++i) J += double(y.data<float>()[i]) * dy.data<float>()[i];
      return J;
    };
    Router::Saved s;
    Tensor xp, y;
    objective(s, xp, y);
    const int64_t M = s.routing.num_rows();
    Tensor dxp = Tensor::empty({M, C}, DType::kF32), dprobs = Tensor::empty({fc.N, fc.E}, DType::kF32);
    ops.moe_unpermute_backward(dxp, dprobs, dy, xp, s.probs, s.row_id_map);
    for (int64_t i = 0; i < dxp.numel(); ++i) dxp.data<float>()[i] *= 1.5f;
    Tensor dx = Tensor::empty({fc.N, C}, DType::kF32), dx_router = Tensor::empty({fc.N, C}, DType::kF32);
    ops.moe_permute_backward(dx, dxp, s.row_id_map);
    router.backward(*ctx, dx_router, dprobs, x, s, g);
    for (int64_t i = 0; i < dx.numel(); ++i) dx.data<float>()[i] += dx_router.data<float>()[i];
    Tensor dw = Tensor::empty(router.weight().shape, DType::kF32);
    std::memcpy(dw.raw(), router.weight().grad.raw(), size_t(dw.nbytes()));

    const float h = 4e-3f;
    // Routing is piecewise constant: a difference is only valid when neither step changes the choices or
    // the drops (then it is skipped, NaN).
    auto same_routing = [&](const Router::Saved& a) {
      return a.routing.topk_idx == s.routing.topk_idx && a.routing.row_id_map == s.routing.row_id_map;
    };
    auto fd = [&](float* p) {
      const float v = *p;
      Router::Saved s2;
      Tensor a, b;
      *p = v + h;
      const double jp = objective(s2, a, b);
      const bool same_p = same_routing(s2);
      *p = v - h;
      const double jm = objective(s2, a, b);
      const bool same_m = same_routing(s2);
      *p = v;
      return same_p && same_m ? (jp - jm) / (2.0 * double(h)) : std::nan("");
    };
    double worst = 0, scale = 1e-3;
    int checked = 0;
    std::uniform_int_distribution<int64_t> pick_x(0, x.numel() - 1), pick_w(0, dw.numel() - 1);
    for (int i = 0; i < 24; ++i) {
      const int64_t ix = pick_x(rng), iw = pick_w(rng);
      const double ex = fd(x.data<float>() + ix), ew = fd(router.weight().value.data<float>() + iw);
      if (!std::isnan(ex)) {
        worst = std::max(worst, std::fabs(ex - dx.data<float>()[ix]));
        scale = std::max(scale, std::fabs(ex));
        ++checked;
      }
      if (!std::isnan(ew)) {
        worst = std::max(worst, std::fabs(ew - dw.data<float>()[iw]));
        scale = std::max(scale, std::fabs(ew));
        ++checked;
      }
    }
    EXPECT_GE(checked, 36) << "too many steps changed the routing";
    EXPECT_LE(worst / scale, 1e-2) << "worst abs error " << worst << " scale " << scale;
  }
}

TEST(MoeGroupedMlp, WeightsAreNamedPerExpertAndContiguous) {
  auto ctx = make_cpu_context();
  ParameterSet ps;
  GroupedMLP mlp(ps, "decoder.layers.2.mlp", 3, 4, 5, true, 0.02f, 0.01f);
  ps.allocate(*ctx);
  EXPECT_EQ(mlp.fc1()[0]->name, "decoder.layers.2.mlp.experts.linear_fc1.weight0");
  EXPECT_EQ(mlp.fc2()[2]->name, "decoder.layers.2.mlp.experts.linear_fc2.weight2");
  EXPECT_EQ(mlp.fc1_weight().shape(), (Shape{3, 10, 4}));
  EXPECT_EQ(mlp.fc2_grad().shape(), (Shape{3, 4, 5}));
}

}  // namespace
}  // namespace loom

// The mixture-of-experts building blocks end to end on the CPU against PyTorch (float64) references from
// tests/golden/gen_moe_ops.py (fixtures/ops_moe.safetensors): Router -> moe_permute -> GroupedMLP ->
// moe_unpermute, then the backward chain, for HF Mixtral's routing and Megatron-Core's variants
// (pre-softmax, sigmoid + scaling, expert bias, capacity with both drop policies and padding, aux_loss,
// seq_aux_loss, z-loss) on N = 1, 5, 10, 37, 217 tokens, E = 3, 8, k = 1, 2.
//
// Checked: the routing (top-k experts exactly, group sizes exactly, dense probs), the aux and z losses, the
// layer output, and every gradient: input (permutation path + router path, the router's including the
// aux/z-loss terms scaled by grad_scale), router weight, fc1 and fc2 of every expert. Parameter gradients
// start from a non-zero pattern and must end at pattern + reference (they accumulate); activation outputs
// start as NaN (they overwrite). Tolerance 1e-5 relative to max |ref| (f32 ops against f64 references).
#include <gtest/gtest.h>

#include <cstring>

#include "golden_util.h"
#include "loom/nn/modules.h"
#include "loom/nn/moe.h"

namespace loom {
namespace {

constexpr double kTol = 1e-5;

using namespace golden;

float scalar(const Fixture& fx, const std::string& c, const std::string& key) {
  return fx.get(c, key).data<float>()[0];
}

RouterConfig config_of(const Fixture& fx, const std::string& c) {
  RouterConfig cfg;
  cfg.num_experts = fx.param(c, "E");
  cfg.topk = fx.param(c, "topk");
  cfg.score_function = fx.param(c, "score") ? MoeScoreFunction::kSigmoid : MoeScoreFunction::kSoftmax;
  cfg.pre_softmax = fx.param(c, "pre_softmax") != 0;
  const int64_t lb = fx.param(c, "lb");
  cfg.load_balancing = lb == 0 ? MoeLoadBalancing::kAuxLoss : lb == 1 ? MoeLoadBalancing::kSeqAuxLoss
                                                                      : MoeLoadBalancing::kNone;
  cfg.aux_loss_coeff = scalar(fx, c, "aux_coeff");
  cfg.z_loss_coeff = scalar(fx, c, "z_coeff");
  cfg.topk_scaling_factor = scalar(fx, c, "scale");
  if (fx.param(c, "has_capacity")) cfg.capacity_factor = scalar(fx, c, "capacity");
  cfg.drop_policy = fx.param(c, "drop") ? MoeDropPolicy::kPosition : MoeDropPolicy::kProbs;
  cfg.pad_to_capacity = fx.param(c, "pad") != 0;
  cfg.enable_expert_bias = fx.param(c, "expert_bias") != 0;
  return cfg;
}

// Host f32 view of elements [e·n, (e+1)·n) of t, shaped s.
TensorView part(const Tensor& t, int64_t e, Shape s) { return t.view().slice_flat(e * s.numel(), s); }

TEST(GoldenMoe, RouterPermuteGroupedMlpUnpermuteForwardBackward) {
  Fixture fx("moe");
  ASSERT_EQ(fx.cases().size(), 9u);
  auto ctx = make_cpu_context();
  const OpTable& ops = ctx->ops();
  for (const std::string& c : fx.cases()) {
    SCOPED_TRACE(c);
    const int64_t N = fx.param(c, "N"), T = fx.param(c, "T"), C = fx.param(c, "C"), F = fx.param(c, "F");
    const int64_t E = fx.param(c, "E"), k = fx.param(c, "topk");
    const bool gated = fx.param(c, "gated") != 0;
    const RouterConfig cfg = config_of(fx, c);
    ParameterSet ps;
    Router router(ps, "decoder.layers.0.mlp", C, cfg, 0.02f);
    GroupedMLP mlp(ps, "decoder.layers.0.mlp", E, C, F, gated, 0.02f, 0.02f);
    ps.allocate(*ctx);
    const int64_t F1 = gated ? 2 * F : F;
    Tensor w1 = fx.get(c, "fc1"), w2 = fx.get(c, "fc2");
    ps.write_value(router.weight(), fx.get(c, "router_weight"));
    for (int64_t e = 0; e < E; ++e) {
      ps.write_value(*mlp.fc1()[e], part(w1, e, {F1, C}));
      ps.write_value(*mlp.fc2()[e], part(w2, e, {C, F}));
    }
    EXPECT_EQ(router.weight().name, "decoder.layers.0.mlp.router.weight");
    EXPECT_EQ(mlp.fc1()[E - 1]->name, "decoder.layers.0.mlp.experts.linear_fc1.weight" + std::to_string(E - 1));
    if (cfg.enable_expert_bias) {
      Tensor b = fx.get(c, "expert_bias");
      router.expert_bias().assign(b.data<float>(), b.data<float>() + E);
    }
    // Gradients accumulate: start them from a pattern.
    Tensor g0 = accum_init(ps.grads(), 3);
    std::memcpy(ps.grads().raw(), g0.raw(), size_t(g0.nbytes()));

    Tensor x = fx.get(c, "x"), dy = fx.get(c, "dy");
    Router::Saved rs;
    router.forward(*ctx, rs, x, T, /*training=*/true);
    Tensor ref_idx = fx.get(c, "topk_idx"), ref_sizes = fx.get(c, "group_sizes");
    for (int64_t i = 0; i < N * k; ++i) ASSERT_EQ(rs.routing.topk_idx[i], ref_idx.data<int32_t>()[i]) << "topk " << i;
    for (int64_t e = 0; e < E; ++e) ASSERT_EQ(rs.routing.group_sizes[e], ref_sizes.data<int32_t>()[e]) << "group " << e;
    expect_close(c + ".probs", rs.probs, fx.get(c, "probs"), kTol);
    Tensor aux = Tensor::empty({1}, DType::kF32), z = Tensor::empty({1}, DType::kF32);
    aux.data<float>()[0] = float(rs.routing.aux_loss);
    z.data<float>()[0] = float(rs.routing.z_loss);
    if (cfg.aux_loss_coeff != 0) expect_close(c + ".aux_loss", aux, fx.get(c, "aux_loss"), kTol);
    if (cfg.z_loss_coeff != 0) expect_close(c + ".z_loss", z, fx.get(c, "z_loss"), kTol);

    const int64_t M = rs.routing.num_rows();
    const std::vector<int64_t>& sizes = rs.routing.group_sizes;
    Tensor xp = nan_tensor({M, C}), yp = nan_tensor({M, C}), y = nan_tensor({N, C});
    ops.moe_permute_forward(xp, x, rs.row_id_map);
    GroupedMLP::Saved ms;
    mlp.forward(*ctx, yp, ms, xp, sizes);
    ops.moe_unpermute_forward(y, yp, rs.probs, rs.row_id_map);
    expect_close(c + ".y", y, fx.get(c, "y"), kTol);

    Tensor dyp = nan_tensor({M, C}), dprobs = nan_tensor({N, E}), dxp = nan_tensor({M, C});
    Tensor dx = nan_tensor({N, C}), dx_router = nan_tensor({N, C});
    ops.moe_unpermute_backward(dyp, dprobs, dy, yp, rs.probs, rs.row_id_map);
    mlp.backward(*ctx, dxp, dyp, xp, ms, sizes);
    ops.moe_permute_backward(dx, dxp, rs.row_id_map);
    router.backward(*ctx, dx_router, dprobs, x, rs, scalar(fx, c, "grad_scale"));
    for (int64_t i = 0; i < N * C; ++i) dx.data<float>()[i] += dx_router.data<float>()[i];
    expect_close(c + ".dx", dx, fx.get(c, "dx"), kTol);
    const Parameter& rw = router.weight();
    expect_close(c + ".drouter_weight (accumulate)", rw.grad, fx.get(c, "drouter_weight"), kTol,
                 g0.view().slice_flat(rw.offset, rw.shape));
    const TensorView g1 = mlp.fc1_grad(), g2 = mlp.fc2_grad();
    expect_close(c + ".dfc1 (accumulate)", g1, fx.get(c, "dfc1"), kTol,
                 g0.view().slice_flat(mlp.fc1()[0]->offset, g1.shape()));
    expect_close(c + ".dfc2 (accumulate)", g2, fx.get(c, "dfc2"), kTol,
                 g0.view().slice_flat(mlp.fc2()[0]->offset, g2.shape()));
  }
}

}  // namespace
}  // namespace loom

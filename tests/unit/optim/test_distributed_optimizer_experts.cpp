// DistributedOptimizer with mixture-of-experts units on one process (expert_dp is the self group): buckets
// never mix dense and expert units; an expert unit in its layer's reads has no hooks of its own and the
// layer's hooks gather it (ZeRO-3), bind its gradient bucket (ZeRO-2/3) and reduce it when the layer's
// backward is done; every strategy still equals plain AdamW bit for bit; inconsistent flags are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "loom/dist/parallel_state.h"
#include "loom/optim/distributed_optimizer.h"

using namespace loom;

namespace {

constexpr int kLayers = 3;

// As GPTModel lays out a MoE model: embedding; per layer its dense part (norm, router) as unit
// "decoder.layers.N" reading unit "decoder.layers.N.mlp.experts" (two experts' fc1/fc2, flagged), head.
// Unit indices: embedding 0, layer l dense 1 + 2l, experts 2 + 2l, head 1 + 2·kLayers.
std::vector<ParamUnit> build_moe_layout(ParameterSet& s, bool flag_experts = true) {
  std::vector<ParamUnit> units;
  auto unit = [&](const std::string& name, bool expert, auto add) {
    const int64_t begin = s.numel();
    add();
    units.push_back({name, begin, s.numel() - begin, {}, expert && flag_experts});
  };
  unit("embedding", false, [&] { s.add("embedding.word_embeddings.weight", {13, 7}, InitKind::kNormal, 0.02f, false); });
  for (int l = 0; l < kLayers; ++l) {
    const std::string p = "decoder.layers." + std::to_string(l) + ".";
    unit("decoder.layers." + std::to_string(l), false, [&] {
      s.add(p + "ln.weight", {7}, InitKind::kOnes, 0.0f, true);
      s.add(p + "mlp.router.weight", {4, 7}, InitKind::kNormal, 0.02f, false);
    });
    units.back().reads = {int(units.size())};
    unit(p + "mlp.experts", true, [&] {
      for (int e = 0; e < 2; ++e) {
        s.add(p + "mlp.experts.linear_fc1.weight" + std::to_string(e), {5, 7}, InitKind::kNormal, 0.02f, false)
            .expert = flag_experts;
        s.add(p + "mlp.experts.linear_fc2.weight" + std::to_string(e), {7, 5}, InitKind::kNormal, 0.01f, false)
            .expert = flag_experts;
      }
    });
  }
  unit("head", false, [&] {
    s.add("decoder.final_layernorm.weight", {7}, InitKind::kOnes, 0.0f, true);
    s.add("output_layer.weight", {9, 7}, InitKind::kNormal, 0.02f, false);
  });
  return units;
}

bool in_unit(const Parameter& p, const ParamUnit& u) { return p.offset >= u.offset && p.offset < u.offset + u.numel; }
bool hooked(int u) { return u == 0 || u % 2 == 1; }  // experts (even units but the embedding) are covered

// Exact in every summation order (multiples of 2^-12), so the comparison with AdamW is bit for bit.
float grad_value(int64_t i, int step, int mb) {
  return std::round(4096.0f * 0.05f * std::sin(0.37f * float(i) + 1.3f * float(step) + 0.71f * float(mb))) / 4096.0f;
}

const ShardingStrategy kStrategies[] = {ShardingStrategy::kNone, ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads,
                                        ShardingStrategy::kOptimGradsParams};

}  // namespace

TEST(DistributedOptimizerExperts, BucketsNeverMixExpertAndDenseUnits) {
  auto ctx = make_cpu_context();
  auto ps = ParallelState::create(ParallelConfig{}, 1, 0);
  for (ShardingStrategy sh : kStrategies)
    for (bool flagged : {true, false}) {
      SCOPED_TRACE(std::string(sharding_strategy_name(sh)) + (flagged ? " experts" : " dense only"));
      ParameterSet set;
      const std::vector<ParamUnit> units = build_moe_layout(set, flagged);
      set.allocate(*ctx, DType::kF32, DType::kF32, true, param_storage_for(sh));
      DDPConfig ddp;
      ddp.sharding = sh;
      ddp.bucket_size = 1'000'000;  // one bucket for the whole model, were it allowed
      DistributedOptimizer opt(*ctx, {&set}, {units}, *ps, ddp, OptimizerConfig{});
      const std::vector<DistributedOptimizer::BucketInfo> buckets = opt.bucket_info(0);
      const bool zero3 = sh == ShardingStrategy::kOptimGradsParams;
      // Backward order: head | experts 2 | layer 2 | ... | experts 0 | layer 0 + embedding (dense runs merge).
      const size_t want = zero3 ? units.size() : flagged ? size_t(2 * kLayers + 1) : 1;
      ASSERT_EQ(buckets.size(), want);
      int64_t covered = 0;
      for (const auto& b : buckets) {
        covered += b.end - b.begin;
        EXPECT_EQ(b.group_size, 1);
        for (const ParamUnit& u : units)
          if (u.offset >= b.begin && u.offset < b.end) {
            EXPECT_EQ(u.expert, b.expert) << u.name << " in a bucket at " << b.begin;
            EXPECT_LE(u.offset + u.numel, b.end) << u.name;
          }
      }
      EXPECT_EQ(covered, set.numel());
      if (flagged || zero3) {
        EXPECT_EQ(buckets.front().begin, units.back().offset);  // the head is reduced first
      }
      if (flagged && !zero3) {
        EXPECT_TRUE(buckets[1].expert);
        EXPECT_FALSE(buckets.back().expert);
        EXPECT_EQ(buckets.back().begin, 0);  // layer 0's dense part and the embedding together
      }
    }
}

// The layer's hooks cover its experts: during its backward the experts' gradients are bound (and under
// ZeRO-3 their parameters gathered), and a ZeRO-2/3 expert bucket is reduced (its buffer released) as
// soon as the layer's backward is done; the updates equal AdamW's bit for bit.
TEST(DistributedOptimizerExperts, LayerHooksCoverTheirExpertsAndEqualAdamW) {
  auto ctx = make_cpu_context();
  auto ps = ParallelState::create(ParallelConfig{}, 1, 0);
  for (ShardingStrategy sh : kStrategies)
    for (bool overlap : {false, true})
      for (DType cdt : {DType::kF32, DType::kBF16}) {
        SCOPED_TRACE(std::string(sharding_strategy_name(sh)) + (overlap ? " overlap " : " ") + dtype_name(cdt));
        const bool zero3 = sh == ShardingStrategy::kOptimGradsParams;
        const bool bucket_grads = sh == ShardingStrategy::kOptimGrads || zero3;
        ParameterSet ref, set;
        build_moe_layout(ref);
        ref.allocate(*ctx, cdt);
        ref.initialize(5);
        std::vector<ParamRange> ranges;
        for (const Parameter& p : ref.all()) ranges.push_back({p.offset, p.shape.numel(), !p.no_weight_decay});
        AdamW ref_opt(*ctx, ref.numel(), ranges, AdamWConfig{});
        const std::vector<ParamUnit> units = build_moe_layout(set);
        set.allocate(*ctx, cdt, DType::kF32, true, param_storage_for(sh));
        DDPConfig ddp;
        ddp.sharding = sh;
        ddp.bucket_size = 50;
        ddp.overlap_grad_reduce = overlap;
        ddp.overlap_param_gather = overlap && sh != ShardingStrategy::kNone;
        DistributedOptimizer opt(*ctx, {&set}, {units}, *ps, ddp, OptimizerConfig{});
        opt.initialize(5);
        ParamHooks* hooks = opt.hooks(0);
        const size_t cbytes = size_t(dtype_size(cdt));
        for (int step = 0; step < 2; ++step) {
          opt.start_step();
          for (int mb = 0; mb < 2; ++mb) {
            opt.set_last_microbatch(0, mb == 1);
            for (int u = 0; u < int(units.size()); ++u) {
              if (!hooked(u)) continue;
              hooks->before_forward(u);
              for (const Parameter& p : set.all()) {
                const bool reads = in_unit(p, units[size_t(u)]) ||
                                   (u > 0 && u + 1 < int(units.size()) && in_unit(p, units[size_t(u + 1)]) && p.expert);
                if (!reads) continue;
                ASSERT_TRUE(p.compute.defined()) << p.name << " in the forward of " << units[size_t(u)].name;
                ASSERT_EQ(std::memcmp(p.compute.raw(), ref.find(p.name)->compute.raw(), size_t(p.shape.numel()) * cbytes), 0)
                    << p.name;
              }
              hooks->after_forward(u);
            }
            for (int u = int(units.size()) - 1; u >= 0; --u) {
              if (!hooked(u)) continue;
              hooks->before_backward(u);
              const bool layer = u > 0 && u + 1 < int(units.size());
              for (Parameter& p : set.all()) {
                if (!in_unit(p, units[size_t(u)]) && !(layer && in_unit(p, units[size_t(u + 1)]))) continue;
                ASSERT_TRUE(p.grad.defined()) << p.name << " in the backward of " << units[size_t(u)].name;
                if (zero3) {
                  ASSERT_TRUE(p.compute.defined()) << p.name;
                }
                float* g = p.grad.data<float>();
                for (int64_t k = 0; k < p.shape.numel(); ++k) g[k] += grad_value(p.offset + k, step, mb);
              }
              hooks->after_backward(u);
              if (layer && bucket_grads) {  // reduced per micro-batch: the experts' bucket is gone
                for (const Parameter& p : set.all()) {
                  if (!p.expert || !in_unit(p, units[size_t(u + 1)])) continue;
                  ASSERT_FALSE(p.grad.defined()) << p.name;
                }
              }
            }
          }
          opt.finish_grad_sync();
          float* rg = ref.grads().data<float>();
          for (int64_t i = 0; i < ref.numel(); ++i) rg[i] = grad_value(i, step, 0) + grad_value(i, step, 1);
          ref_opt.step(ref.values(), ref.grads(), 1e-2f, 0.1f, 1.0f, true);
          ref.sync_compute(*ctx);
          opt.step(1e-2f, 0.1f, 1.0f);
          for (const StateShard& s : opt.state_shards())
            ASSERT_EQ(std::memcmp(s.master.raw(), ref.values().data<float>() + s.param->offset + s.begin,
                                  size_t(s.end - s.begin) * 4), 0)
                << s.param->name << " step " << step;
        }
        if (zero3) {
          for (const Parameter& p : set.all()) EXPECT_FALSE(p.compute.defined()) << p.name << " still bound";
        }
      }
}

TEST(DistributedOptimizerExperts, RejectsInconsistentExpertFlagsAndHooksOfCoveredUnits) {
  auto ctx = make_cpu_context();
  auto ps = ParallelState::create(ParallelConfig{}, 1, 0);
  auto expect_error = [&](std::vector<ParamUnit> units, ParameterSet& set, const std::string& needle) {
    try {
      DistributedOptimizer(*ctx, {&set}, {std::move(units)}, *ps, DDPConfig{}, OptimizerConfig{});
      ADD_FAILURE() << "accepted; expected an error mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  {  // an expert unit holding a dense parameter
    ParameterSet set;
    std::vector<ParamUnit> units = build_moe_layout(set);
    set.all()[3].expert = false;  // layer 0's first expert weight
    set.allocate(*ctx);
    expect_error(units, set, "decoder.layers.0.mlp.experts.linear_fc1.weight0 is not an expert's");
  }
  {  // an expert parameter in a dense unit
    ParameterSet set;
    std::vector<ParamUnit> units = build_moe_layout(set);
    set.all()[1].expert = true;  // layer 0's norm
    set.allocate(*ctx);
    expect_error(units, set, "decoder.layers.0.ln.weight is an expert's");
  }
  {  // two readers of one expert unit
    ParameterSet set;
    std::vector<ParamUnit> units = build_moe_layout(set);
    set.allocate(*ctx);
    units[3].reads = {2};
    expect_error(units, set, "is read by both");
  }
  ParameterSet set;
  std::vector<ParamUnit> units = build_moe_layout(set);
  set.allocate(*ctx);
  DistributedOptimizer opt(*ctx, {&set}, {units}, *ps, DDPConfig{}, OptimizerConfig{});
  try {
    opt.hooks(0)->before_backward(2);
    ADD_FAILURE() << "hooks of a covered expert unit accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("call the reader's hooks only"), std::string::npos) << e.what();
  }
}

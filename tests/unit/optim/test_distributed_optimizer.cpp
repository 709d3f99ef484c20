// DistributedOptimizer on one process (every group is the self group): each sharding strategy, with and
// without overlapped reduction, with two micro-batches driven through the hooks as the model drives them,
// must give exactly (bit for bit) what the plain AdamW path gives on the same gradients; plus the
// initialisation of a flat range, the skipped-step path and the memory figures.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "loom/dist/parallel_state.h"
#include "loom/optim/distributed_optimizer.h"

using namespace loom;

namespace {

// A small model layout with odd sizes: embedding, two layers, head; norms and biases skip weight decay.
std::vector<ParamUnit> build_layout(ParameterSet& s) {
  std::vector<ParamUnit> units;
  auto unit = [&](const std::string& name, auto add) {
    const int64_t begin = s.numel();
    add();
    units.push_back({name, begin, s.numel() - begin, {}});
  };
  unit("embedding", [&] { s.add("embedding.word_embeddings.weight", {13, 7}, InitKind::kNormal, 0.02f, false); });
  for (int l = 0; l < 2; ++l) {
    const std::string p = "decoder.layers." + std::to_string(l) + ".";
    unit("decoder.layers." + std::to_string(l), [&] {
      s.add(p + "ln.weight", {7}, InitKind::kOnes, 0.0f, true);
      s.add(p + "fc1.weight", {5 + 6 * l, 7}, InitKind::kNormal, 0.02f, false);
      s.add(p + "fc1.bias", {5 + 6 * l}, InitKind::kZeros, 0.0f, true);
      s.add(p + "fc2.weight", {7, 5 + 6 * l}, InitKind::kNormal, 0.01f, false);
    });
  }
  unit("head", [&] {
    s.add("decoder.final_layernorm.weight", {7}, InitKind::kOnes, 0.0f, true);
    s.add("output_layer.weight", {9, 7}, InitKind::kNormal, 0.02f, false);
  });
  return units;
}

// The gradient element i of micro-batch mb of step `step` contributes on data-parallel rank `rank`.
// Tabulated once: evaluated inline, the compiler may contract the expression into FMAs differently at
// each call site and the two paths under test would see different gradients.
float grad_value(int64_t i, int step, int mb, int rank) {
  static const std::vector<float> table = [] {
    std::vector<float> t(size_t(3 * 2 * 4 * 1024));
    for (size_t k = 0; k < t.size(); ++k) {
      const double x = double(k % 1024), st = double(k / 1024 / 8), m = double(k / 1024 / 4 % 2),
                   r = double(k / 1024 % 4);
      t[k] = float(0.05 * std::sin(0.37 * x + 1.3 * st + 0.71 * m + 2.1 * r) * (1.0 + 0.25 * double(k % 1024 % 5)));
    }
    return t;
  }();
  return table[size_t(((step * 2 + mb) * 4 + rank) * 1024 + i)];
}

std::vector<ParamRange> ranges_of(const ParameterSet& s) {
  std::vector<ParamRange> r;
  for (const Parameter& p : s.all()) r.push_back({p.offset, p.shape.numel(), !p.no_weight_decay});
  return r;
}

struct Case {
  ShardingStrategy sharding;
  bool overlap;
  DType compute;
  bool overlap_params = false;  // --overlap-param-gather
  // The head reads the embedding unit (a tied output layer, ParamUnit::reads) and its backward adds a
  // second gradient to the word embedding. Gradients are then multiples of 2^-10, so every summation
  // order gives the same bits (ZeRO-2/3 sum per micro-batch first, the others accumulate in place).
  bool tied = false;
};

constexpr uint64_t kSeed = 1234;
constexpr float kLr = 3e-3f, kWd = 0.1f, kScale = 0.5f;

void run_case(const Case& c, bool skip_a_step) {
  SCOPED_TRACE(std::string(sharding_strategy_name(c.sharding)) + (c.overlap ? " overlap " : " ") +
               dtype_name(c.compute) + (c.overlap_params ? " overlap-param-gather" : "") + (c.tied ? " tied" : ""));
  const auto value = [&](int64_t i, int step, int mb, int slot) {
    const float v = grad_value(i, step, mb, slot);
    return c.tied ? std::round(v * 1024.0f) / 1024.0f : v;
  };
  auto ctx = make_cpu_context();
  auto ps = ParallelState::create(ParallelConfig{}, 1, 0);

  ParameterSet ref;
  build_layout(ref);
  ref.allocate(*ctx, c.compute);
  ref.initialize(kSeed);
  AdamW ref_opt(*ctx, ref.numel(), ranges_of(ref), AdamWConfig{});

  ParameterSet set;
  std::vector<ParamUnit> units = build_layout(set);
  const int head = int(units.size()) - 1;
  if (c.tied) units.back().reads = {0};
  const int64_t emb_numel = units.front().numel;
  const bool zero3 = c.sharding == ShardingStrategy::kOptimGradsParams;
  set.allocate(*ctx, c.compute, DType::kF32, true, param_storage_for(c.sharding));
  DDPConfig ddp;
  ddp.sharding = c.sharding;
  ddp.bucket_size = 80;  // three buckets: {head, layer 1}, {layer 0}, {embedding}
  ddp.overlap_grad_reduce = c.overlap;
  ddp.overlap_param_gather = c.overlap_params;
  DistributedOptimizer opt(*ctx, {&set}, {units}, *ps, ddp, OptimizerConfig{});
  opt.initialize(kSeed);
  EXPECT_EQ(opt.num_buckets(0), zero3 ? 4 : 3);
  ParamHooks* hooks = opt.hooks(0);
  const int64_t n = ref.numel();
  const size_t cbytes = size_t(dtype_size(c.compute));

  for (int step = 0; step < 3; ++step) {
    // Reference: both micro-batches accumulate into one f32 gradient buffer.
    float* rg = ref.grads().data<float>();
    for (int mb = 0; mb < 2; ++mb) {
      if (c.tied)
        for (int64_t i = 0; i < emb_numel; ++i) rg[i] += value(i, step, mb, 1);
      for (int64_t i = 0; i < n; ++i) rg[i] += value(i, step, mb, 0);
    }
    double sq = 0;
    for (int64_t i = 0; i < n; ++i) sq += double(rg[i]) * double(rg[i]);

    const int attempts = skip_a_step && step == 1 ? 2 : 1;
    for (int attempt = 0; attempt < attempts; ++attempt) {
      const bool poisoned = attempt + 1 < attempts;  // an overflowed step the trainer skips
      opt.start_step();
      for (int mb = 0; mb < 2; ++mb) {
        opt.set_last_microbatch(0, mb == 1);
        for (int u = 0; u < int(units.size()); ++u) {
          hooks->before_forward(u);
          // What the model reads: the current compute copy of every parameter of the unit (and of the
          // embedding for a tied head).
          for (const Parameter& p : set.all()) {
            const bool tied_read = c.tied && u == head && p.offset < emb_numel;
            if (!tied_read &&
                (p.offset < units[size_t(u)].offset || p.offset >= units[size_t(u)].offset + units[size_t(u)].numel))
              continue;
            ASSERT_TRUE(p.compute.defined()) << p.name;
            const Parameter* rp = ref.find(p.name);
            ASSERT_EQ(std::memcmp(p.compute.raw(), rp->compute.raw(), size_t(p.shape.numel()) * cbytes), 0)
                << p.name << " step " << step;
          }
          hooks->after_forward(u);
        }
        for (int u = int(units.size()) - 1; u >= 0; --u) {
          hooks->before_backward(u);
          if (c.tied && u == head)  // the tied output layer's share of the word embedding's gradient
            for (Parameter& p : set.all())
              if (p.offset < emb_numel) {
                ASSERT_TRUE(p.grad.defined() && p.compute.defined()) << p.name;
                float* g = p.grad.data<float>();
                for (int64_t k = 0; k < p.shape.numel(); ++k) g[k] += value(p.offset + k, step, mb, 1);
              }
          for (Parameter& p : set.all()) {
            if (p.offset < units[size_t(u)].offset || p.offset >= units[size_t(u)].offset + units[size_t(u)].numel)
              continue;
            float* g = p.grad.data<float>();
            for (int64_t k = 0; k < p.shape.numel(); ++k) g[k] += value(p.offset + k, step, mb, 0);
            if (poisoned && u == 1) g[0] = std::numeric_limits<float>::quiet_NaN();
          }
          hooks->after_backward(u);
        }
      }
      opt.finish_grad_sync();
      EXPECT_EQ(opt.found_inf(), poisoned);
    }
    EXPECT_NEAR(opt.grad_norm(), std::sqrt(sq), 1e-12 * std::sqrt(sq));
    ref_opt.step(ref.values(), ref.grads(), kLr, kWd, kScale, true);
    ref.sync_compute(*ctx);
    opt.step(kLr, kWd, kScale);
    EXPECT_EQ(opt.num_steps(), step + 1);

    // Every element of the masters and Adam state is in exactly one state shard, equal to the reference.
    std::vector<int> seen(size_t(n), 0);
    for (const StateShard& s : opt.state_shards()) {
      const int64_t len = s.end - s.begin, off = s.param->offset + s.begin;
      for (int64_t k = 0; k < len; ++k) ++seen[size_t(off + k)];
      ASSERT_EQ(std::memcmp(s.master.raw(), ref.values().data<float>() + off, size_t(len) * 4), 0) << s.param->name;
      ASSERT_EQ(std::memcmp(s.exp_avg.raw(), ref_opt.exp_avg().data<float>() + off, size_t(len) * 4), 0);
      ASSERT_EQ(std::memcmp(s.exp_avg_sq.raw(), ref_opt.exp_avg_sq().data<float>() + off, size_t(len) * 4), 0);
    }
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(seen[size_t(i)], 1) << "element " << i;
    // Without --overlap-param-gather the parameters are final after step(); with it the next forward's
    // hooks wait for them (checked by the forward loop above and after the last step below).
    if (!zero3 && !c.overlap_params) {
      if (set.values().defined()) {
        ASSERT_EQ(std::memcmp(set.values().raw(), ref.values().raw(), size_t(n) * 4), 0);
      }
      ASSERT_EQ(std::memcmp(set.compute_values().raw(), ref.compute_values().raw(), size_t(n) * cbytes), 0);
    }
    if (set.grads().defined()) {
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(set.grads().data<float>()[i], 0.0f);  // ready for next step
    }
    // What each strategy keeps: full f32 values only where they are the compute copy or no sharding.
    EXPECT_EQ(set.values().defined(), !zero3 && (c.sharding == ShardingStrategy::kNone || c.compute == DType::kF32));
    EXPECT_EQ(set.grads().defined(), c.sharding == ShardingStrategy::kNone || c.sharding == ShardingStrategy::kOptim);
  }
  // The last update reaches the compute copy the next forward gathers (checked in the loop for earlier steps).
  for (int u = 0; u < int(units.size()); ++u) {
    hooks->before_forward(u);
    for (const Parameter& p : set.all()) {
      if (p.offset >= units[size_t(u)].offset && p.offset < units[size_t(u)].offset + units[size_t(u)].numel) {
        ASSERT_EQ(std::memcmp(p.compute.raw(), ref.find(p.name)->compute.raw(), size_t(p.shape.numel()) * cbytes), 0);
      }
    }
    hooks->after_forward(u);
  }
  if (zero3) {
    for (const Parameter& p : set.all()) EXPECT_FALSE(p.compute.defined()) << p.name << " still bound";
  }
}

const Case kCases[] = {
    {ShardingStrategy::kNone, false, DType::kF32},
    {ShardingStrategy::kNone, true, DType::kBF16},
    {ShardingStrategy::kOptim, false, DType::kF32},
    {ShardingStrategy::kOptim, true, DType::kBF16},
    {ShardingStrategy::kOptimGrads, false, DType::kBF16},
    {ShardingStrategy::kOptimGrads, true, DType::kF32},
    {ShardingStrategy::kOptimGradsParams, false, DType::kF32},
    {ShardingStrategy::kOptimGradsParams, true, DType::kBF16},
    {ShardingStrategy::kOptim, true, DType::kBF16, true},
    {ShardingStrategy::kOptimGrads, true, DType::kF32, true},
    {ShardingStrategy::kOptimGradsParams, true, DType::kF32, true},
    {ShardingStrategy::kNone, true, DType::kF32, false, true},
    {ShardingStrategy::kOptim, false, DType::kBF16, false, true},
    {ShardingStrategy::kOptimGrads, true, DType::kBF16, true, true},
    {ShardingStrategy::kOptimGradsParams, false, DType::kBF16, false, true},
    {ShardingStrategy::kOptimGradsParams, true, DType::kF32, true, true},
};

}  // namespace

TEST(DistributedOptimizer, SingleRankEqualsAdamWBitForBit) {
  for (const Case& c : kCases) run_case(c, false);
}

TEST(DistributedOptimizer, SkippedStepDropsItsGradients) {
  for (const Case& c : kCases) run_case(c, true);
}

TEST(DistributedOptimizer, MemoryFigures) {
  auto ctx = make_cpu_context();
  auto ps = ParallelState::create(ParallelConfig{}, 1, 0);
  for (DType cdt : {DType::kBF16, DType::kF32})
    for (ShardingStrategy s : {ShardingStrategy::kNone, ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads,
                               ShardingStrategy::kOptimGradsParams}) {
      SCOPED_TRACE(std::string(sharding_strategy_name(s)) + " " + dtype_name(cdt));
      ParameterSet set;
      auto units = build_layout(set);
      set.allocate(*ctx, cdt, DType::kF32, true, param_storage_for(s));
      DDPConfig ddp;
      ddp.sharding = s;
      DistributedOptimizer opt(*ctx, {&set}, {units}, *ps, ddp, OptimizerConfig{});
      const int64_t n = set.numel();
      const auto m = opt.memory();
      // DP = 1: every shard is the whole buffer, so the per-parameter bytes of the header's table with d = 1.
      const int64_t c = cdt == DType::kF32 ? 0 : 2;  // a separate 16-bit compute copy
      EXPECT_EQ(m.params, (4 + c) * n);  // f32 master (values or shard) + compute copy
      EXPECT_EQ(m.optimizer, 8 * n);     // exp_avg + exp_avg_sq
      EXPECT_EQ(m.grads, 4 * n);         // the f32 buffer (no_shard, ZeRO-1) or the f32 shard (ZeRO-2/3)
      EXPECT_EQ(m.buffers_peak, 0);      // nothing gathered or reduced yet
    }
}

// --optimizer sgd on one process: the update is torch.optim.SGD range by range (L2 weight decay only where
// the parameter decays), the momentum buffer is the only state (4 bytes per element, none without
// momentum), and the checkpoint names follow PyTorch's state keys.
TEST(DistributedOptimizer, SgdUpdatesRangeByRangeAndKeepsOnlyTheMomentumBuffer) {
  auto ctx = make_cpu_context();
  auto ps = ParallelState::create(ParallelConfig{}, 1, 0);
  for (float momentum : {0.0f, 0.9f}) {
    SCOPED_TRACE("momentum " + std::to_string(momentum));
    ParameterSet set, ref;
    auto units = build_layout(set);
    build_layout(ref);
    set.allocate(*ctx);
    ref.allocate(*ctx);
    OptimizerConfig oc;
    oc.kind = OptimizerKind::kSGD;
    oc.sgd_momentum = momentum;
    DistributedOptimizer opt(*ctx, {&set}, {units}, *ps, DDPConfig{}, oc);
    opt.initialize(7);
    ref.initialize(7);
    EXPECT_EQ(opt.kind(), OptimizerKind::kSGD);
    EXPECT_EQ(opt.memory().optimizer, momentum != 0.0f ? 4 * set.numel() : 0);
    Tensor buf = Tensor::zeros({ref.numel()}, DType::kF32);
    for (int step = 0; step < 3; ++step) {
      opt.start_step();
      for (int64_t i = 0; i < set.numel(); ++i)
        set.grads().data<float>()[i] = ref.grads().data<float>()[i] = grad_value(i, step, 0, 0);
      opt.finish_grad_sync();
      opt.step(0.05f, 0.1f, 0.5f);
      for (const Parameter& p : ref.all()) {
        SgdParams sp;
        sp.lr = 0.05f;
        sp.momentum = momentum;
        sp.weight_decay = p.no_weight_decay ? 0.0f : 0.1f;
        sp.grad_scale = 0.5f;
        sp.zero_grad = true;
        const Shape s{p.shape.numel()};
        ctx->ops().sgd_update(ref.values().slice_flat(p.offset, s), ref.grads().slice_flat(p.offset, s),
                              momentum != 0.0f ? buf.view().slice_flat(p.offset, s) : TensorView{}, sp);
      }
      ASSERT_EQ(std::memcmp(set.values().raw(), ref.values().raw(), size_t(set.numel()) * 4), 0) << "step " << step;
    }
    for (const StateShard& s : opt.state_shards()) {
      EXPECT_FALSE(s.exp_avg.defined());
      const auto state = s.optimizer_state();
      ASSERT_EQ(state.size(), momentum != 0.0f ? 1u : 0u);
      if (state.empty()) continue;
      EXPECT_STREQ(state[0].first, "momentum_buffer");
      EXPECT_EQ(std::memcmp(state[0].second.raw(), buf.data<float>() + s.param->offset + s.begin,
                            size_t(s.end - s.begin) * 4), 0)
          << s.param->name;
    }
  }
}

// --log-num-zeros-in-grad and --log-optimizer-states-to-tensorboard: the figures of the whole model,
// against direct sums over the state the optimizer reports.
TEST(DistributedOptimizer, ZeroCountAndStateStatistics) {
  auto ctx = make_cpu_context();
  auto ps = ParallelState::create(ParallelConfig{}, 1, 0);
  for (ShardingStrategy sh : {ShardingStrategy::kNone, ShardingStrategy::kOptimGrads}) {
    SCOPED_TRACE(sharding_strategy_name(sh));
    ParameterSet set;
    auto units = build_layout(set);
    set.allocate(*ctx, DType::kF32, DType::kF32, true, param_storage_for(sh));
    DDPConfig ddp;
    ddp.sharding = sh;
    DistributedOptimizer opt(*ctx, {&set}, {units}, *ps, ddp, OptimizerConfig{});
    opt.initialize(3);
    ParamHooks* hooks = opt.hooks(0);
    int64_t zeros = 0;
    opt.start_step();
    opt.set_last_microbatch(0, true);
    for (int u = int(units.size()) - 1; u >= 0; --u) {
      hooks->before_backward(u);
      for (Parameter& p : set.all()) {
        if (p.offset < units[size_t(u)].offset || p.offset >= units[size_t(u)].offset + units[size_t(u)].numel) continue;
        for (int64_t k = 0; k < p.shape.numel(); ++k) {
          const bool zero = (p.offset + k) % 3 == 0;
          p.grad.data<float>()[k] = zero ? 0.0f : grad_value(p.offset + k, 0, 0, 0) + 0.5f;
          zeros += zero;
        }
      }
      hooks->after_backward(u);
    }
    opt.finish_grad_sync();
    EXPECT_EQ(opt.num_zeros_in_grad(), zeros);
    opt.step(1e-2f, 0.0f, 1.0f);
    long double v2 = 0, v1 = 0, vs = 0, m2 = 0, m1 = 0, w2 = 0, w1 = 0;
    double vmax = 0, mmax = 0, wmax = 0;
    for (const StateShard& s : opt.state_shards())
      for (int64_t k = 0; k < s.end - s.begin; ++k) {
        const double v = s.exp_avg_sq.data<float>()[k], m = s.exp_avg.data<float>()[k], w = s.master.data<float>()[k];
        v2 += v * v, v1 += std::fabs(v), vs += std::sqrt(std::fabs(v)), vmax = std::max(vmax, std::fabs(v));
        m2 += m * m, m1 += std::fabs(m), mmax = std::max(mmax, std::fabs(m));
        w2 += w * w, w1 += std::fabs(w), wmax = std::max(wmax, std::fabs(w));
      }
    const OptimizerStateStats st = opt.state_stats();
    EXPECT_TRUE(st.has_variance && st.has_momentum);
    auto near = [](double got, long double want) { EXPECT_NEAR(got, double(want), 1e-10 * double(want) + 1e-300); };
    near(st.variance_l2, std::sqrt(v2));
    near(st.variance_sqrt_l2, std::sqrt(v1));
    near(st.variance_l1, v1);
    near(st.variance_sqrt_l1, vs);
    EXPECT_EQ(st.variance_abs_max, vmax);
    near(st.variance_sqrt_abs_max, std::sqrt((long double)vmax));
    near(st.momentum_l2, std::sqrt(m2));
    near(st.momentum_l1, m1);
    EXPECT_EQ(st.momentum_abs_max, mmax);
    near(st.weight_l2, std::sqrt(w2));
    near(st.weight_l1, w1);
    EXPECT_EQ(st.weight_abs_max, wmax);
  }
}

TEST(DistributedOptimizer, RejectsWrongStorageAndUnknownNames) {
  auto ctx = make_cpu_context();
  auto ps = ParallelState::create(ParallelConfig{}, 1, 0);
  ParameterSet set;
  auto units = build_layout(set);
  set.allocate(*ctx);
  DDPConfig ddp;
  ddp.sharding = ShardingStrategy::kOptimGradsParams;
  EXPECT_THROW(DistributedOptimizer(*ctx, {&set}, {units}, *ps, ddp, OptimizerConfig{}), Error);
  ddp.sharding = ShardingStrategy::kNone;
  units.pop_back();  // units no longer tile the buffer
  EXPECT_THROW(DistributedOptimizer(*ctx, {&set}, {units}, *ps, ddp, OptimizerConfig{}), Error);
  EXPECT_EQ(parse_sharding_strategy("optim_grads"), ShardingStrategy::kOptimGrads);
  EXPECT_THROW(parse_sharding_strategy("zero2"), UserError);
}

TEST(ParameterSet, InitializeRangeMatchesInitialize) {
  auto ctx = make_cpu_context();
  ParameterSet s;
  s.add("a", {5, 3}, InitKind::kNormal, 0.02f, false);
  s.add("b", {3}, InitKind::kOnes, 0.0f, true);
  // Two TP shards (rows 2..4 and 7..8 of 10): gated-fc1 style, global indices are not contiguous.
  s.add_sharded("c", {10, 3}, 0, {{2, 3}, {7, 2}}, InitKind::kNormal, 0.5f, false);
  s.add_sharded("d", {4, 6}, 1, {{1, 3}}, InitKind::kNormal, 1.0f, false);
  s.add("e", {2}, InitKind::kZeros, 0.0f, true);
  s.allocate(*ctx);
  s.initialize(77);
  const float* all = s.values().data<float>();
  const int64_t n = s.numel();
  for (int64_t b = 0; b < n; b += 3)
    for (int64_t e = b; e <= n; e += 5) {
      std::vector<float> out(size_t(e - b) + 1, -99.0f);
      s.initialize_range(77, b, e, out.data());
      for (int64_t i = b; i < e; ++i) ASSERT_EQ(out[size_t(i - b)], all[i]) << "[" << b << ", " << e << ") at " << i;
      ASSERT_EQ(out[size_t(e - b)], -99.0f);  // nothing written past the range
    }
  EXPECT_THROW(s.initialize_range(77, 0, n + 1, nullptr), Error);
}

// GPTModel's pipeline-stage API in one process: a model split in two stages (hand-off by copying
// output() -> input() and input_grad() -> output_grad()) computes the loss of the whole model bit for bit
// and the same gradients; activation slots keep micro-batches apart (interleaved forwards/backwards equal
// sequential ones); units() tile the parameter buffer and the hooks see every unit in order; the memory
// plan equals the allocation for stages and slots.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "model_test_util.h"
#include "loom/model/gpt.h"

using namespace loom;

namespace {

constexpr int64_t kB = 2, kT = 16;

GPTConfig stage_config(bool llama, float dropout) {
  GPTConfig c;
  c.num_layers = 4;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.max_position_embeddings = kT;
  c.vocab_size = 61;
  c.padded_vocab_size = 64;
  c.hidden_dropout = dropout;
  return llama ? test::llama_variant(c) : c;
}

using Batch = test::SyntheticBatch;
Batch make_batch(int k, int64_t V) { return test::synthetic_batch(kB, kT, V, 7 * k, 3 * k); }

ForwardOptions fwd(uint64_t mb) {
  ForwardOptions f;
  f.dropout_seed = 7;
  f.micro_batch_index = mb;
  return f;
}

std::vector<float> grad_of(const ParameterSet& ps, const std::string& name) {
  const Parameter* p = ps.find(name);
  EXPECT_NE(p, nullptr) << name;
  if (!p) return {};
  return std::vector<float>(p->grad.data<float>(), p->grad.data<float>() + p->grad.numel());
}

double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 1e-12;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::fabs(double(a[i]) - double(b[i])));
    m = std::max(m, std::fabs(double(b[i])));
  }
  return d / m;
}

class RecordingHooks : public ParamHooks {
 public:
  std::vector<std::string> log;
  void before_forward(int u) override { log.push_back(tag('F', u)); }
  void after_forward(int u) override { log.push_back(tag('f', u)); }
  void before_backward(int u) override { log.push_back(tag('B', u)); }
  void after_backward(int u) override { log.push_back(tag('b', u)); }

 private:
  // Built by appending: GCC 12 warns (-Wrestrict, a false positive) on "x" + std::to_string(u).
  static std::string tag(char c, int u) {
    std::string s(1, c);
    s += std::to_string(u);
    return s;
  }
};

class GPTStages : public ::testing::TestWithParam<bool> {};

}  // namespace

TEST_P(GPTStages, TwoStagesMatchTheWholeModel) {
  const GPTConfig cfg = stage_config(GetParam(), 0.1f);
  auto ctx = make_cpu_context();
  const Batch b = make_batch(0, cfg.vocab_size);
  const float scale = 1.0f / float(kB * kT);
  GPTModel whole(cfg, *ctx);
  whole.initialize(5);
  const float loss = whole.forward(b.view(), scale, fwd(3));
  whole.backward(b.view());

  ModelOptions oa, ob;
  oa.parallel.num_layers = 2;
  oa.parallel.post_process = false;
  ob.parallel.first_layer = 2;
  ob.parallel.pre_process = false;
  GPTModel a(cfg, *ctx, oa), s(cfg, *ctx, ob);
  a.initialize(5);
  s.initialize(5);
  EXPECT_EQ(a.forward(b.view(), scale, fwd(3)), 0.0f);
  s.prepare(kB, kT);
  ctx->copy(s.input(), a.output());
  EXPECT_EQ(s.forward(b.view(), scale, fwd(3)), loss);  // the same ops on the same values: bit-identical
  s.backward(b.view());
  ctx->copy(a.output_grad(), s.input_grad());
  a.backward(b.view());

  // Global layer names; every parameter of the whole model is on exactly one stage (the tied word
  // embedding on both: the last stage's copy carries the output layer's gradient).
  int64_t n = 0;
  for (const GPTModel* st : {&a, &s})
    for (const Parameter& p : st->params().all()) {
      ++n;
      std::vector<float> g = grad_of(st->params(), p.name);
      if (p.name == "embedding.word_embeddings.weight" && !cfg.untie_embeddings_and_output_weights) {
        const std::vector<float> other = grad_of((st == &a ? s : a).params(), p.name);
        EXPECT_TRUE(p.tied_embedding_copy == (st == &s));
        if (st == &s) continue;
        for (size_t i = 0; i < g.size(); ++i) g[i] += other[i];
      }
      EXPECT_LT(max_rel(g, grad_of(whole.params(), p.name)), 1e-5) << p.name;
      EXPECT_EQ(std::vector<float>(p.value.data<float>(), p.value.data<float>() + p.value.numel()),
                std::vector<float>(whole.params().find(p.name)->value.data<float>(),
                                   whole.params().find(p.name)->value.data<float>() + p.value.numel()))
          << p.name;
    }
  EXPECT_EQ(n, int64_t(whole.params().all().size()) + (cfg.untie_embeddings_and_output_weights ? 0 : 1));
  EXPECT_NE(a.params().find("decoder.layers.1.input_layernorm.weight"), nullptr);
  EXPECT_EQ(a.params().find("decoder.layers.2.input_layernorm.weight"), nullptr);
  EXPECT_NE(s.params().find("decoder.layers.3.input_layernorm.weight"), nullptr);
}

TEST_P(GPTStages, SlotsKeepMicroBatchesApart) {
  const GPTConfig cfg = stage_config(GetParam(), 0.1f);
  auto ctx = make_cpu_context();
  const std::vector<Batch> mbs{make_batch(0, cfg.vocab_size), make_batch(1, cfg.vocab_size)};
  const float scale = 1.0f / float(kB * kT);
  GPTModel seq(cfg, *ctx);
  seq.initialize(9);
  std::vector<float> want;
  for (int k = 0; k < 2; ++k) {
    want.push_back(seq.forward(mbs[size_t(k)].view(), scale, fwd(uint64_t(k))));
    seq.backward(mbs[size_t(k)].view());
  }
  ModelOptions o;
  o.activation_slots = 2;
  GPTModel m(cfg, *ctx, o);
  m.initialize(9);
  const int64_t before = ctx->memory_stats().current_bytes;
  for (int k = 0; k < 2; ++k) {
    m.set_slot(k);
    EXPECT_EQ(m.forward(mbs[size_t(k)].view(), scale, fwd(uint64_t(k))), want[size_t(k)]);
  }
  EXPECT_EQ(ctx->memory_stats().current_bytes - before, GPTModel::memory_plan(cfg, o, kB, kT).activation_bytes());
  EXPECT_EQ(m.activation_bytes(), GPTModel::memory_plan(cfg, o, kB, kT).activation_bytes());
  for (int k = 1; k >= 0; --k) {
    m.set_slot(k);
    m.backward(mbs[size_t(k)].view());
  }
  for (const Parameter& p : m.params().all())
    EXPECT_LT(max_rel(grad_of(m.params(), p.name), grad_of(seq.params(), p.name)), 1e-5) << p.name;
}

TEST_P(GPTStages, UnitsTileTheParametersAndHooksSeeThemInOrder) {
  const GPTConfig cfg = stage_config(GetParam(), 0.0f);
  auto ctx = make_cpu_context();
  ModelOptions o;
  o.parallel.first_layer = 1;
  o.parallel.num_layers = 2;
  o.recompute_granularity = RecomputeGranularity::kFull;
  o.recompute_method = RecomputeMethod::kUniform;
  o.recompute_num_layers = 2;
  GPTModel m(cfg, *ctx, o);
  m.initialize(1);
  const auto& u = m.units();
  ASSERT_EQ(u.size(), 4u);
  EXPECT_EQ(u[0].name, "embedding");
  EXPECT_EQ(u[1].name, "decoder.layers.1");
  EXPECT_EQ(u[2].name, "decoder.layers.2");
  EXPECT_EQ(u[3].name, "head");
  int64_t off = 0;
  for (const ParamUnit& x : u) {
    EXPECT_EQ(x.offset, off) << x.name;
    EXPECT_GT(x.numel, 0) << x.name;
    off += x.numel;
  }
  EXPECT_EQ(off, m.params().numel());
  for (const Parameter& p : m.params().all()) {
    const ParamUnit* owner = nullptr;
    for (const ParamUnit& x : u)
      if (p.offset >= x.offset && p.offset < x.offset + x.numel) owner = &x;
    ASSERT_NE(owner, nullptr) << p.name;
    const bool head = p.name.rfind("decoder.final_layernorm", 0) == 0 || p.name.rfind("output_layer", 0) == 0;
    const std::string want = p.name.rfind("embedding.", 0) == 0 ? "embedding"
                             : head                             ? "head"
                                                                : p.name.substr(0, p.name.find('.', 15));
    EXPECT_EQ(owner->name, want) << p.name;
  }
  RecordingHooks h;
  m.set_hooks(&h);
  const Batch b = make_batch(0, cfg.vocab_size);
  m.forward(b.view(), 1.0f / float(kB * kT), fwd(0));
  m.backward(b.view());
  // Full recomputation of the group {1, 2}: both layers' parameters are requested before it re-runs.
  const std::vector<std::string> want{"F0", "f0", "F1", "f1", "F2", "f2", "F3", "f3",
                                      "B3", "b3", "B2", "B1", "b2", "b1", "B0", "b0"};
  EXPECT_EQ(h.log, want);
}

TEST_P(GPTStages, MemoryPlanEqualsAllocationForStages) {
  const GPTConfig cfg = stage_config(GetParam(), 0.0f);
  auto ctx = make_cpu_context();
  for (int stage = 0; stage < 3; ++stage) {
    ModelOptions o;
    o.parallel.first_layer = stage == 0 ? 0 : stage == 1 ? 1 : 3;
    o.parallel.num_layers = stage == 1 ? 2 : 1;
    o.parallel.pre_process = stage == 0;
    o.parallel.post_process = stage == 2;
    o.activation_slots = 3 - stage;
    const GPTMemoryPlan plan = GPTModel::memory_plan(cfg, o, kB, kT);
    const int64_t before = ctx->memory_stats().current_bytes;
    GPTModel m(cfg, *ctx, o);
    EXPECT_EQ(ctx->memory_stats().current_bytes - before, plan.parameter_bytes()) << stage;
    m.prepare(kB, kT);
    EXPECT_EQ(ctx->memory_stats().current_bytes - before, plan.total_bytes()) << stage;
    EXPECT_EQ(m.activation_bytes(), plan.activation_bytes()) << stage;
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, GPTStages, ::testing::Values(false, true),
                         [](const auto& i) { return std::string(i.param ? "llama" : "gpt"); });

// GPTModel split over ranks (tensor, sequence and pipeline parallelism) against the single-process model
// built on every rank from the same seed: the loss and every parameter gradient must match (the sharded
// gradient against the same global index ranges of the full one). Small GPT (LayerNorm, GeLU, biases,
// learned positions, tied embeddings) and small Llama (RMSNorm, SwiGLU, RoPE, GQA, no bias, untied) in f32,
// with and without hidden dropout.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "model_test_util.h"
#include "loom/dist/parallel_state.h"
#include "loom/model/gpt.h"

using namespace loom;

namespace {

constexpr int64_t kB = 2, kT = 16;

const Communicator& world() {
  static std::unique_ptr<Communicator> w = init_world(std::chrono::minutes(2));
  return *w;
}

// A communicator that forwards to `world()` (ParallelState takes ownership of its world).
std::unique_ptr<Communicator> world_split() { return world().split(0, world().rank(), "world"); }

GPTConfig gpt_config(float hidden_dropout) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.max_position_embeddings = kT;
  c.vocab_size = 97;
  c.padded_vocab_size = 104;  // 97 padded to a multiple of 8 (divisible by TP 2 and 4)
  c.hidden_dropout = hidden_dropout;
  return c;
}

GPTConfig llama_config(float hidden_dropout) {
  GPTConfig c = test::llama_variant(gpt_config(hidden_dropout));
  c.ffn_hidden = 64;  // divisible by TP 4
  return c;
}

using Batch = test::SyntheticBatch;
Batch make_batch(int64_t V) { return test::synthetic_batch(kB, kT, V); }

// The elements of `full` (global_shape, row-major) this parameter's shard holds, in local order.
std::vector<float> shard_of(const Parameter& p, const float* full) {
  const Shape& g = p.global_shape;
  std::vector<float> out;
  if (p.shard.empty()) return std::vector<float>(full, full + g.numel());
  const int64_t rows = g[0], cols = g.ndim() == 2 ? g[1] : 1;
  if (p.partition_dim == 0) {
    for (const ShardRange& r : p.shard) out.insert(out.end(), full + r.start * cols, full + (r.start + r.size) * cols);
  } else {
    for (int64_t i = 0; i < rows; ++i)
      for (const ShardRange& r : p.shard)
        out.insert(out.end(), full + i * cols + r.start, full + i * cols + r.start + r.size);
  }
  return out;
}

// max |a - b| / max(max |b|, 1e-6) over the tensor.
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, mag = 1e-6;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - double(b[i])));
    mag = std::max(mag, std::abs(double(b[i])));
  }
  return diff / mag;
}

struct Layout {
  int tp = 1, pp = 1;
  bool sp = false;
  int cp = 1;
};

void run_case(const std::string& arch, const Layout& lay, float hidden_dropout) {
  const int world_size = world().size();
  if (world_size % (lay.tp * lay.pp * lay.cp) != 0) GTEST_SKIP() << "world size " << world_size << " does not fit the layout";
  const GPTConfig cfg = arch == "gpt" ? gpt_config(hidden_dropout) : llama_config(hidden_dropout);
  if (cfg.num_kv_heads() % lay.tp != 0) GTEST_SKIP() << "query groups not divisible by TP";
  ParallelConfig pc;
  pc.tensor_model_parallel_size = lay.tp;
  pc.pipeline_model_parallel_size = lay.pp;
  pc.context_parallel_size = lay.cp;
  auto ps = ParallelState::create(pc, world_split());
  auto ctx = make_cpu_context();
  const uint64_t seed = 1234;
  ForwardOptions fo;
  fo.dropout_seed = 99;
  fo.micro_batch_index = 3;
  const Batch batch = make_batch(cfg.vocab_size);
  const float scale = 1.0f / float(kB * kT);

  GPTModel ref(cfg, *ctx);
  ref.initialize(seed);
  const float ref_loss = ref.forward(batch.view(), scale, fo);
  ref.backward(batch.view());

  ModelOptions o;
  o.parallel.tp = &ps->tp();
  o.parallel.sequence_parallel = lay.sp;
  o.parallel.cp = &ps->cp();
  const int stage = ps->pp_rank();
  o.parallel.first_layer = stage * cfg.num_layers / lay.pp;
  o.parallel.num_layers = cfg.num_layers / lay.pp;
  o.parallel.pre_process = stage == 0;
  o.parallel.post_process = stage == lay.pp - 1;
  GPTModel m(cfg, *ctx, o);
  m.initialize(seed);
  m.prepare(kB, kT);
  const Communicator& pp = ps->pp();
  if (!o.parallel.pre_process) pp.recv(m.input(), stage - 1);
  const float loss = m.forward(batch.view(), scale, fo);
  if (!o.parallel.post_process) pp.send(m.output(), stage + 1);
  if (!o.parallel.post_process) pp.recv(m.output_grad(), stage + 1);
  m.backward(batch.view());
  if (!o.parallel.pre_process) pp.send(m.input_grad(), stage - 1);

  if (o.parallel.post_process) {
    EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss)) << arch;
  }
  ASSERT_GT(m.params().all().size(), 0u);
  for (const Parameter& p : m.params().all()) {
    const Parameter* r = ref.params().find(p.name);
    ASSERT_NE(r, nullptr) << p.name;
    ASSERT_EQ(p.global_shape, r->shape) << p.name;
    Tensor g = Tensor::empty(p.grad.shape(), DType::kF32);
    std::copy_n(p.grad.data<float>(), p.grad.numel(), g.data<float>());
    // Partial sums over the TP group (SP norms and row-parallel biases, qk-norms) are summed there; the
    // tied word embedding's two pipeline copies over the embedding group, as the optimizer does.
    if (p.sequence_parallel) ps->tp().all_reduce(g);
    // CP ranks hold CP x their share (the dp_cp average is the full gradient).
    if (lay.cp > 1) {
      ps->cp().all_reduce(g);
      ctx->ops().scale_(g, 1.0f / float(lay.cp));
    }
    if (p.name == "embedding.word_embeddings.weight" && !cfg.untie_embeddings_and_output_weights)
      ps->embedding().all_reduce(g);
    const std::vector<float> got(g.data<float>(), g.data<float>() + g.numel());
    const std::vector<float> want = shard_of(p, r->grad.data<float>());
    ASSERT_EQ(got.size(), want.size()) << p.name;
    EXPECT_LT(rel_err(got, want), 1e-4) << arch << " " << p.name << " (tp " << lay.tp << " sp " << lay.sp << " pp "
                                        << lay.pp << ")";
  }
  // The sharded parameter values are the same global elements as the full model's.
  for (const Parameter& p : m.params().all()) {
    const Parameter* r = ref.params().find(p.name);
    const std::vector<float> got(p.value.data<float>(), p.value.data<float>() + p.value.numel());
    EXPECT_EQ(got, shard_of(p, r->value.data<float>())) << p.name;
  }
}

class DistModel : public ::testing::TestWithParam<std::tuple<std::string, float>> {};

TEST_P(DistModel, TP2) { run_case(std::get<0>(GetParam()), {2, 1, false}, std::get<1>(GetParam())); }
TEST_P(DistModel, TP2SequenceParallel) {
  run_case(std::get<0>(GetParam()), {2, 1, true}, std::get<1>(GetParam()));
}
TEST_P(DistModel, TP4) { run_case(std::get<0>(GetParam()), {4, 1, false}, std::get<1>(GetParam())); }
TEST_P(DistModel, TP4SequenceParallel) {
  run_case(std::get<0>(GetParam()), {4, 1, true}, std::get<1>(GetParam()));
}
TEST_P(DistModel, PP2) { run_case(std::get<0>(GetParam()), {1, 2, false}, std::get<1>(GetParam())); }
TEST_P(DistModel, TP2PP2SequenceParallel) {
  run_case(std::get<0>(GetParam()), {2, 2, true}, std::get<1>(GetParam()));
}

// CP ranks draw the hidden dropout mask of their sequence chunks at the chunks' global offsets, so CP runs
// with dropout compare with the single process too.
TEST_P(DistModel, CP2) { run_case(std::get<0>(GetParam()), {1, 1, false, 2}, std::get<1>(GetParam())); }
TEST_P(DistModel, TP2CP2SequenceParallel) {
  run_case(std::get<0>(GetParam()), {2, 1, true, 2}, std::get<1>(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Archs, DistModel,
                         ::testing::Combine(::testing::Values("gpt", "llama"), ::testing::Values(0.0f, 0.1f)));

}  // namespace

// run_pipeline_step over real ranks with GPTModel chunks: the pipeline group is the whole world (PP =
// world size, TP = DP = 1). Every rank also builds the single-process model from the same seed and runs
// the step's micro-batches one after another (forward, backward: gradient accumulation); the last stage's
// loss sum and every parameter gradient of every chunk must match it (f32, 1e-5), with hidden dropout on
// so that the micro-batch index reaching each forward is checked too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "model_test_util.h"
#include "loom/dist/parallel_state.h"
#include "loom/pipeline/schedule.h"

using namespace loom;

namespace {

constexpr int64_t kB = 2, kT = 8, kLayers = 8;

const Communicator& world() {
  static std::unique_ptr<Communicator> w = init_world(std::chrono::minutes(2));
  return *w;
}

GPTConfig config(const std::string& arch) {
  GPTConfig c;
  c.num_layers = kLayers;
  c.hidden_size = 16;
  c.num_attention_heads = 2;
  c.max_position_embeddings = kT;
  c.vocab_size = 29;
  c.padded_vocab_size = 32;
  c.hidden_dropout = 0.1f;
  if (arch == "llama") {
    c = test::llama_variant(c);  // with grouped-query attention (2 groups)
    c.ffn_hidden = 32;
  }
  return c;
}

using Batch = test::SyntheticBatch;
std::vector<Batch> make_batches(int64_t nmb, int64_t V) {
  std::vector<Batch> out;
  for (int64_t m = 0; m < nmb; ++m) out.push_back(test::synthetic_batch(kB, kT, V, 5 * m, 3 * m));
  return out;
}

float scale_of(int64_t m, int64_t nmb) { return 1.0f / float(kB * kT * nmb) * (1.0f + 0.25f * float(m)); }

double rel_err(const float* a, const float* b, int64_t n) {
  double diff = 0, mag = 1e-6;
  for (int64_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - double(b[i])));
    mag = std::max(mag, std::abs(double(b[i])));
  }
  return diff / mag;
}

struct Case {
  std::string arch = "gpt";
  int chunks = 1;               // virtual stages per rank
  int64_t first_stage_layers = 0, last_stage_layers = 0;
  int64_t nmb = 4;
  bool forward_only = false;
};

void run_case(const Case& c) {
  const int P = world().size();
  const GPTConfig cfg = config(c.arch);
  ParallelConfig pc;
  pc.pipeline_model_parallel_size = P;
  auto ps = ParallelState::create(pc, world().split(0, world().rank(), "world"));
  auto ctx = make_cpu_context();
  const uint64_t seed = 77, dropout_seed = 5, first_index = 11;
  const std::vector<Batch> batches = make_batches(c.nmb, cfg.vocab_size);

  // Reference: the whole model, micro-batches in turn.
  GPTModel ref(cfg, *ctx);
  ref.initialize(seed);
  double ref_loss = 0;
  for (int64_t m = 0; m < c.nmb; ++m) {
    ForwardOptions fo;
    fo.training = !c.forward_only;
    fo.dropout_seed = dropout_seed;
    fo.micro_batch_index = first_index + uint64_t(m);
    ref_loss += ref.forward(batches[size_t(m)].view(), c.forward_only ? 0.0f : scale_of(m, c.nmb), fo);
    if (!c.forward_only) ref.backward(batches[size_t(m)].view());
  }

  const int rank = ps->pp_rank(), V = c.chunks;
  const auto split = pipeline_layer_split(kLayers, P, V, c.first_stage_layers, c.last_stage_layers);
  std::vector<std::unique_ptr<GPTModel>> models;
  std::vector<GPTModel*> chunks;
  for (int v = 0; v < V; ++v) {
    ModelOptions o;
    o.parallel.first_layer = split[size_t(rank)][size_t(v)].first_layer;
    o.parallel.num_layers = split[size_t(rank)][size_t(v)].num_layers;
    o.parallel.pre_process = rank == 0 && v == 0;
    o.parallel.post_process = rank == P - 1 && v == V - 1;
    o.activation_slots = pipeline_activation_slots(P, V, c.nmb);
    models.push_back(std::make_unique<GPTModel>(cfg, *ctx, o));
    models.back()->initialize(seed);
    chunks.push_back(models.back().get());
  }
  PipelineStepConfig sc;
  sc.num_microbatches = c.nmb;
  sc.dloss_scale = [&](int64_t m) { return scale_of(m, c.nmb); };
  sc.forward_only = c.forward_only;
  sc.dropout_seed = dropout_seed;
  sc.first_microbatch_index = first_index;
  PipelineCallbacks cb;
  cb.batch = [&](int64_t m) { return batches[size_t(m)].view(); };
  int64_t last_flags = 0;
  cb.before_backward = [&](int, int64_t m, bool last) { last_flags += last ? 1 : 0; EXPECT_EQ(last, m == c.nmb - 1); };
  const PipelineStepResult r = run_pipeline_step(chunks, ps->pp(), sc, cb);

  const bool last_stage = rank == P - 1;
  EXPECT_EQ(r.microbatches, last_stage ? c.nmb : 0);
  const double loss = ps->pp().all_reduce_scalar(last_stage ? r.loss_sum : 0.0);
  EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss));
  if (c.forward_only) return;
  EXPECT_EQ(last_flags, V);
  int64_t checked = 0;
  for (GPTModel* m : chunks)
    for (const Parameter& p : m->params().all()) {
      const Parameter* want = ref.params().find(p.name);
      ASSERT_NE(want, nullptr) << p.name;
      ASSERT_EQ(p.grad.numel(), want->grad.numel()) << p.name;
      Tensor g = Tensor::empty(p.grad.shape(), DType::kF32);
      std::copy_n(p.grad.data<float>(), p.grad.numel(), g.data<float>());
      // The tied word embedding lives on the first and the last stage; its gradient is their sum.
      if (p.name == "embedding.word_embeddings.weight" && !cfg.untie_embeddings_and_output_weights && P > 1)
        ps->embedding().all_reduce(g);
      EXPECT_LT(rel_err(g.data<float>(), want->grad.data<float>(), g.numel()), 1e-5)
          << p.name << " on stage " << rank;
      ++checked;
    }
  EXPECT_GT(checked, 0);
  // Every layer's gradient exists on exactly one rank.
  int64_t layers = 0;
  for (GPTModel* m : chunks) layers += m->options().parallel.num_layers;
  EXPECT_EQ(int64_t(ps->pp().all_reduce_scalar(double(layers))), kLayers);
}

TEST(DistPipeline, OneFOneB) {
  run_case({"gpt", 1, 0, 0, 4, false});
  run_case({"llama", 1, 0, 0, 4, false});
}
TEST(DistPipeline, OneFOneBFewerMicrobatchesThanStages) { run_case({"gpt", 1, 0, 0, 1, false}); }
TEST(DistPipeline, OneFOneBMoreMicrobatches) { run_case({"llama", 1, 0, 0, 7, false}); }
TEST(DistPipeline, Interleaved) {
  run_case({"gpt", 2, 0, 0, 4, false});
  run_case({"llama", 2, 0, 0, 2 * world().size(), false});
}
TEST(DistPipeline, UnevenFirstAndLastStages) {
  const int P = world().size();
  // 8 layers: PP 2 -> 3 + 5; PP 4 -> 1 + 3 + 3 + 1.
  if (P == 2) run_case({"llama", 1, 3, 5, 4, false});
  else run_case({"llama", 1, 1, 1, 4, false});
}
TEST(DistPipeline, ForwardOnly) {
  run_case({"gpt", 1, 0, 0, 3, true});
  run_case({"gpt", 2, 0, 0, 4, true});
}

}  // namespace

// Pipeline schedules: the per-rank orders against Megatron's (written out by hand), and whole steps of
// fake stages (y = a·x + b per model chunk, squared-error loss on the last) run by threads over the
// rendezvous test communicator: losses and every gradient must equal a sequential run exactly, each rank
// must run its schedule's order, no slot may be reused while its micro-batch is in flight, and after_loss
// follows every forward of the last stage's last chunk.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>

#include "loom/pipeline/schedule.h"
#include "unit/pipeline/thread_comm.h"

namespace loom {
namespace {

std::string order_string(const std::vector<PipelineOp>& ops, bool with_chunk) {
  std::string s;
  for (const PipelineOp& op : ops) {
    if (!s.empty()) s += ' ';
    s += op.backward ? 'B' : 'F';
    if (with_chunk) s += std::to_string(op.chunk) + ".";
    s += std::to_string(op.microbatch);
  }
  return s;
}

TEST(PipelineOrder, NoPipelining) {
  EXPECT_EQ(order_string(pipeline_schedule_order(1, 0, 1, 3, false), false), "F0 B0 F1 B1 F2 B2");
  EXPECT_EQ(order_string(pipeline_schedule_order(1, 0, 1, 3, true), false), "F0 F1 F2");
}

TEST(PipelineOrder, OneFOneBMatchesMegatronPP4) {
  // forward_backward_pipelining_without_interleaving: warm-up PP - rank - 1 forwards, then (F, B) pairs,
  // then the remaining backwards.
  const char* expected[4] = {
      "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
      "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
      "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
      "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
  };
  for (int r = 0; r < 4; ++r)
    EXPECT_EQ(order_string(pipeline_schedule_order(4, r, 1, 8, false), false), expected[r]) << "stage " << r;
  // Fewer micro-batches than stages: the warm-up is capped.
  EXPECT_EQ(order_string(pipeline_schedule_order(4, 0, 1, 2, false), false), "F0 F1 B0 B1");
  EXPECT_EQ(order_string(pipeline_schedule_order(4, 1, 1, 8, true), false), "F0 F1 F2 F3 F4 F5 F6 F7");
}

TEST(PipelineOrder, InterleavedMatchesMegatronPP2V2) {
  // forward_backward_pipelining_with_interleaving: warm-up (PP - rank - 1)·2 + (V - 1)·PP; the k-th
  // forward runs chunk (k mod PP·V) / PP on micro-batch (k / (PP·V))·PP + k mod PP, backwards mirror it.
  EXPECT_EQ(order_string(pipeline_schedule_order(2, 0, 2, 4, false), true),
            "F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 B1.2 B1.3 B0.2 B0.3");
  EXPECT_EQ(order_string(pipeline_schedule_order(2, 1, 2, 4, false), true),
            "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3 B0.2 B0.3");
  EXPECT_EQ(order_string(pipeline_schedule_order(2, 1, 2, 2, true), true), "F0.0 F0.1 F1.0 F1.1");
}

TEST(PipelineOrder, InterleavingNeedsMicrobatchesMultipleOfPP) {
  try {
    pipeline_schedule_order(4, 0, 2, 6, false);
    FAIL() << "expected a UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("--num-layers-per-virtual-pipeline-stage needs the number of "
                                         "micro-batches (6) to be a multiple of the pipeline size (4)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(pipeline_schedule_order(1, 0, 2, 4, false), UserError);
}

TEST(PipelineOrder, ActivationSlots) {
  EXPECT_EQ(pipeline_activation_slots(1, 1, 5), 1);
  EXPECT_EQ(pipeline_activation_slots(4, 1, 8), 4);
  EXPECT_EQ(pipeline_activation_slots(4, 1, 2), 2);
  EXPECT_EQ(pipeline_activation_slots(2, 2, 4), 4);  // chunk 0 of stage 0 runs F0.0..F0.3 before B0.0
  // Every op order keeps each chunk's micro-batches in order and every forward before its backward.
  for (int P : {1, 2, 3, 4})
    for (int V : {1, 2, 3}) {
      if (P == 1 && V > 1) continue;
      for (int64_t nmb : {int64_t(P), int64_t(2 * P), int64_t(3 * P)})
        for (int r = 0; r < P; ++r) {
          const auto ops = pipeline_schedule_order(P, r, V, nmb, false);
          ASSERT_EQ(int64_t(ops.size()), 2 * nmb * V);
          std::vector<int64_t> next_f(size_t(V), 0), next_b(size_t(V), 0);
          for (const PipelineOp& op : ops) {
            int64_t& n = op.backward ? next_b[size_t(op.chunk)] : next_f[size_t(op.chunk)];
            ASSERT_EQ(op.microbatch, n) << "P " << P << " V " << V << " rank " << r;
            ++n;
            if (op.backward) {
              ASSERT_LT(op.microbatch, next_f[size_t(op.chunk)]);
            }
          }
        }
    }
}

// ---- fake stages ----------------------------------------------------------------------------------

constexpr int64_t kN = 2 * 3 * 4;  // (B, T, C) elements of one activation

float input_value(int64_t m, int64_t i) { return std::sin(0.3f * float(m) + 0.7f * float(i)); }
float target_value(int64_t m, int64_t i) { return std::cos(0.5f * float(m) - 0.2f * float(i)); }
float dloss_scale(int64_t m) { return 1.0f / float(m + 2); }

// Model chunk g of a P·V-chunk model: y = a·x + b elementwise. The last chunk's loss is
// mean(0.5·(y - t)²); its gradient is scale·(y - t)/n.
struct ChunkMath {
  float a, b;
  explicit ChunkMath(int g) : a(1.0f + 0.1f * float(g + 1)), b(0.05f * float(g) - 0.1f) {}
  void forward(const float* x, float* y) const {
    for (int64_t i = 0; i < kN; ++i) y[i] = a * x[i] + b;
  }
  // dx may be null (first chunk); accumulates da, db.
  void backward(const float* x, const float* dy, float* dx, float& da, float& db) const {
    for (int64_t i = 0; i < kN; ++i) {
      da += x[i] * dy[i];
      db += dy[i];
      if (dx) dx[i] = a * dy[i];
    }
  }
};
float loss_and_grad(int64_t m, const float* y, float* dy, float scale) {
  double loss = 0;
  for (int64_t i = 0; i < kN; ++i) {
    const float d = y[i] - target_value(m, i);
    loss += 0.5 * double(d) * double(d);
    if (dy) dy[i] = scale * d / float(kN);
  }
  return float(loss / double(kN));
}

class FakeStage final : public PipelineStage {
 public:
  FakeStage(int global_chunk, bool first, bool last, int slots, bool forward_only)
      : math_(global_chunk), first_(first), last_(last), forward_only_(forward_only),
        bufs_(size_t(slots)), in_flight_(size_t(slots), -1) {
    for (auto& b : bufs_)
      for (auto* t : {&b.in, &b.out, &b.dout, &b.din}) *t = Tensor::zeros(Shape{2, 3, 4}, DType::kF32);
  }
  int slots() const override { return int(bufs_.size()); }
  void set_slot(int slot) override { slot_ = slot; }
  TensorView input() override { return bufs_[size_t(slot_)].in; }
  TensorView output() override { return bufs_[size_t(slot_)].out; }
  TensorView output_grad() override { return bufs_[size_t(slot_)].dout; }
  TensorView input_grad() override { return bufs_[size_t(slot_)].din; }
  double forward(int64_t m) override {
    log.push_back({false, 0, m});
    LOOM_CHECK(in_flight_[size_t(slot_)] == -1, "slot ", slot_, " reused while micro-batch ",
               in_flight_[size_t(slot_)], " is in flight");
    if (!forward_only_) in_flight_[size_t(slot_)] = m;
    Buffers& b = bufs_[size_t(slot_)];
    float* x = b.in.data<float>();
    if (first_)
      for (int64_t i = 0; i < kN; ++i) x[i] = input_value(m, i);
    math_.forward(x, b.out.data<float>());
    if (!last_) return 0;
    return loss_and_grad(m, b.out.data<float>(), forward_only_ ? nullptr : b.dout.data<float>(),
                         dloss_scale(m));
  }
  void backward(int64_t m) override {
    log.push_back({true, 0, m});
    LOOM_CHECK(in_flight_[size_t(slot_)] == m, "backward of ", m, " finds slot ", slot_, " holding ",
               in_flight_[size_t(slot_)]);
    in_flight_[size_t(slot_)] = -1;
    Buffers& b = bufs_[size_t(slot_)];
    math_.backward(b.in.data<float>(), b.dout.data<float>(), first_ ? nullptr : b.din.data<float>(), da, db);
  }
  float da = 0, db = 0;
  std::vector<PipelineOp> log;  // chunk filled in by the caller

 private:
  struct Buffers {
    Tensor in, out, dout, din;
  };
  ChunkMath math_;
  bool first_, last_, forward_only_;
  int slot_ = 0;
  std::vector<Buffers> bufs_;
  std::vector<int64_t> in_flight_;
};

struct Reference {
  std::vector<float> da, db;  // per global chunk
  double loss_sum = 0;
};
Reference sequential(int G, int64_t nmb, bool forward_only) {
  Reference ref;
  ref.da.assign(size_t(G), 0);
  ref.db.assign(size_t(G), 0);
  for (int64_t m = 0; m < nmb; ++m) {
    std::vector<std::vector<float>> xs(size_t(G) + 1, std::vector<float>(size_t(kN)));
    for (int64_t i = 0; i < kN; ++i) xs[0][size_t(i)] = input_value(m, i);
    for (int g = 0; g < G; ++g) ChunkMath(g).forward(xs[size_t(g)].data(), xs[size_t(g) + 1].data());
    std::vector<float> dy(static_cast<size_t>(kN)), dx(static_cast<size_t>(kN));
    ref.loss_sum += loss_and_grad(m, xs[size_t(G)].data(), dy.data(), dloss_scale(m));
    if (forward_only) continue;
    for (int g = G - 1; g >= 0; --g) {
      ChunkMath(g).backward(xs[size_t(g)].data(), dy.data(), dx.data(), ref.da[size_t(g)], ref.db[size_t(g)]);
      dy = dx;
    }
  }
  return ref;
}

void run_simulated(int P, int V, int64_t nmb, bool forward_only) {
  SCOPED_TRACE("PP " + std::to_string(P) + " V " + std::to_string(V) + " nmb " + std::to_string(nmb) +
               (forward_only ? " forward-only" : ""));
  const int G = P * V;
  const int slots = pipeline_activation_slots(P, V, nmb);
  test::ThreadWorld world(P);
  std::vector<std::vector<std::unique_ptr<FakeStage>>> stages(static_cast<size_t>(P));
  for (int s = 0; s < P; ++s)
    for (int v = 0; v < V; ++v) {
      const int g = v * P + s;
      stages[size_t(s)].push_back(std::make_unique<FakeStage>(g, g == 0, g == G - 1, slots, forward_only));
    }
  std::vector<PipelineStepResult> results(static_cast<size_t>(P));
  std::vector<std::map<std::string, int>> timer_depth(static_cast<size_t>(P));
  std::vector<std::vector<std::tuple<int, int64_t, bool>>> before(static_cast<size_t>(P));
  std::vector<std::vector<int64_t>> after_loss(static_cast<size_t>(P));
  test::run_ranks(P, [&](int r) {
    test::ThreadCommunicator comm(world, r);
    std::vector<PipelineStage*> chunks;
    for (auto& st : stages[size_t(r)]) chunks.push_back(st.get());
    PipelineCallbacks cb;
    cb.before_backward = [&, r](int c, int64_t m, bool last) { before[size_t(r)].emplace_back(c, m, last); };
    cb.after_loss = [&, r](int64_t m) {
      // Right after micro-batch m's forward on the last chunk: nothing ran on that chunk since.
      const std::vector<PipelineOp>& log = stages[size_t(r)].back()->log;
      LOOM_CHECK(!log.empty() && log.back() == (PipelineOp{false, 0, m}), "after_loss(", m, ") not right after its forward");
      after_loss[size_t(r)].push_back(m);
    };
    cb.timer = [&, r](const char* phase, bool start) {
      int& d = timer_depth[size_t(r)][phase];
      d += start ? 1 : -1;
      LOOM_CHECK(d == 0 || d == 1, "timer ", phase, " nested or stopped before started");
    };
    results[size_t(r)] = run_pipeline_schedule(chunks, comm, nmb, forward_only, cb);
  });
  const Reference ref = sequential(G, nmb, forward_only);
  for (int s = 0; s < P; ++s) {
    const bool last_stage = s == P - 1;
    EXPECT_EQ(results[size_t(s)].microbatches, last_stage ? nmb : 0);
    EXPECT_EQ(results[size_t(s)].loss_sum, last_stage ? ref.loss_sum : 0.0);
    // The executed order is the schedule's.
    std::vector<PipelineOp> executed;
    std::vector<size_t> pos(size_t(V), 0);
    for (const PipelineOp& op : pipeline_schedule_order(P, s, V, nmb, forward_only)) {
      FakeStage& st = *stages[size_t(s)][size_t(op.chunk)];
      ASSERT_LT(pos[size_t(op.chunk)], st.log.size());
      PipelineOp got = st.log[pos[size_t(op.chunk)]++];
      got.chunk = op.chunk;
      EXPECT_EQ(got, op) << "stage " << s;
    }
    for (int v = 0; v < V; ++v) {
      const FakeStage& st = *stages[size_t(s)][size_t(v)];
      EXPECT_EQ(pos[size_t(v)], st.log.size());
      const int g = v * P + s;
      EXPECT_EQ(st.da, ref.da[size_t(g)]) << "chunk " << g;
      EXPECT_EQ(st.db, ref.db[size_t(g)]) << "chunk " << g;
    }
    // after_loss: once per micro-batch, in forward order, on the last stage only.
    std::vector<int64_t> want_after;
    if (last_stage)
      for (const PipelineOp& op : stages[size_t(s)].back()->log)
        if (!op.backward) want_after.push_back(op.microbatch);
    EXPECT_EQ(after_loss[size_t(s)], want_after) << "stage " << s;
    EXPECT_EQ(int64_t(after_loss[size_t(s)].size()), last_stage ? nmb : 0);
    for (const auto& [phase, d] : timer_depth[size_t(s)]) EXPECT_EQ(d, 0) << phase;
    if (!forward_only) {
      EXPECT_TRUE(timer_depth[size_t(s)].count("backward-compute"));
      ASSERT_EQ(int64_t(before[size_t(s)].size()), nmb * V);
      for (const auto& [c, m, last] : before[size_t(s)]) EXPECT_EQ(last, m == nmb - 1);
    } else {
      EXPECT_TRUE(before[size_t(s)].empty());
    }
  }
  if (!forward_only) {
    for (int g = 0; g < G; ++g) EXPECT_NE(ref.da[size_t(g)], 0.0f);  // the comparison means something
  }
}

TEST(PipelineSchedule, NoPipeliningAccumulates) {
  run_simulated(1, 1, 1, false);
  run_simulated(1, 1, 5, false);
  run_simulated(1, 1, 3, true);
}

TEST(PipelineSchedule, OneFOneB) {
  for (int P : {2, 3, 4})
    for (int64_t nmb : {1, 2, 3, 4, 5, 8}) {
      run_simulated(P, 1, nmb, false);
      run_simulated(P, 1, nmb, true);
    }
}

TEST(PipelineSchedule, Interleaved) {
  for (int P : {2, 3, 4})
    for (int V : {2, 3})
      for (int64_t k : {1, 2, 3}) {
        run_simulated(P, V, k * P, false);
        run_simulated(P, V, k * P, true);
      }
}

TEST(PipelineSchedule, TooFewSlotsIsAnError) {
  // PP = 1 needs a single slot.
  FakeStage alone(0, true, true, 1, false);
  std::vector<PipelineStage*> one{&alone};
  auto self = make_self_communicator("pipeline");
  EXPECT_NO_THROW(run_pipeline_schedule(one, *self, 2, false, {}));
  // 1F1B with PP = 2 keeps two micro-batches in flight on stage 0; the check fires before any message.
  test::ThreadWorld world(2, std::chrono::milliseconds(200));
  test::ThreadCommunicator comm(world, 0);
  FakeStage first(0, true, false, 1, false);
  std::vector<PipelineStage*> chunks{&first};
  EXPECT_THROW(run_pipeline_schedule(chunks, comm, 4, false, {}), Error);
}

}  // namespace
}  // namespace loom

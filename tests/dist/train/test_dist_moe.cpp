// Mixture of experts under mpirun against the single process (issue 18): every layout — expert parallelism
// with both dispatchers, expert tensor parallelism (split tokens under SP, replicated without, ETP other
// than TP), TP x EP, PP, CP (the micro-batch's tokens routed together over the CP and SP ranks), ZeRO over
// the expert-data-parallel group — gives the single-process losses within 1e-5 in FP32, with and without
// token dropping (capacity decisions see the whole micro-batch, so the same tokens are dropped), and
// checkpoints reshard across EP sizes (4 -> 2 -> 1 -> 4 -> 2 x ETP 2).
#include <gtest/gtest.h>

#include <sstream>

#include "dist/train/dist_train_util.h"

namespace loom::e2e {
namespace {

// Llama-style, 4 layers: layer 1 dense, the others MoE with 4 experts top-2, shared experts with a gate,
// the load-balancing and z losses on.
const char* kMoe =
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--normalization RMSNorm --swiglu --ffn-hidden-size 64 --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 2 --clip-grad 1.0 --weight-decay 0.1 --mock-data --vocab-size 97 --log-interval 1 "
    "--hidden-dropout 0 --attention-dropout 0 --eval-iters 0 --seed 7 "
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-layer-freq [1,0,1,1] "
    "--moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate --moe-aux-loss-coeff 1e-2 "
    "--moe-z-loss-coeff 1e-3 ";

struct Layout {
  int np;
  const char* flags;
};

void check_layouts(const std::string& model, const std::vector<Layout>& layouts, int iters, const std::string& what) {
  const std::vector<double> ref = train_losses(model, "", 1, iters);
  ASSERT_EQ(ref.size(), size_t(iters)) << what;
  EXPECT_NE(ref.front(), ref.back()) << what << ": did not train";
  for (const Layout& l : layouts)
    expect_close(ref, train_losses(model, l.flags, l.np, iters), 1e-5,
                 what + " np " + std::to_string(l.np) + " " + l.flags);
}

TEST(DistMoe, LayoutsMatchSingleProcess) {
  const std::vector<Layout> layouts = {
      {2, "--expert-model-parallel-size 2"},                                            // EP2 (DP2), allgather
      {2, "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"},       // EP2, alltoall
      {2, "--tensor-model-parallel-size 2"},                                            // ETP = TP, tokens replicated
      {2, "--tensor-model-parallel-size 2 --sequence-parallel --moe-token-dispatcher-type alltoall"},  // ETP 2 split
      {2, "--tensor-model-parallel-size 2 --sequence-parallel"},                        // ETP 2 split, allgather
      {2, "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1"},  // interleaved 1F1B
      {4, "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 "
          "--expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall --moe-shared-expert-overlap"},
      {4, "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2"},  // ETP2 x EP2 allgather
      // ETP other than TP: experts split over data-parallel ranks (TP 1), over more ranks than TP, with EP.
      {2, "--expert-tensor-parallel-size 2"},
      {2, "--expert-tensor-parallel-size 2 --moe-token-dispatcher-type alltoall"},
      {4, "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 4 "
          "--moe-token-dispatcher-type alltoall --moe-shared-expert-overlap"},
      {4, "--expert-tensor-parallel-size 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
          "--use-distributed-optimizer"},
      {4, "--pipeline-model-parallel-size 2 --expert-tensor-parallel-size 2"},
      {4, "--context-parallel-size 2 --expert-tensor-parallel-size 2 --expert-model-parallel-size 2 "
          "--moe-token-dispatcher-type alltoall"},
      {4, "--pipeline-model-parallel-size 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"},
      {2, "--context-parallel-size 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"},
      {4, "--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel"},  // routing over tp x cp
      {4, "--expert-model-parallel-size 4 --data-parallel-sharding-strategy optim_grads_params --overlap-grad-reduce "
          "--overlap-param-gather --moe-token-dispatcher-type alltoall"},
      {4, "--expert-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce"},
      {2, "--expert-model-parallel-size 2 --recompute-granularity full --recompute-method uniform "
          "--recompute-num-layers 2"},
  };
  check_layouts(kMoe, layouts, 10, "MoE");
}

// Capacity-based dropping (and padding), the per-sequence loss, aux-loss-free balancing and Sinkhorn depend on
// the whole micro-batch: the token group routes it together, so the layouts drop the same tokens.
TEST(DistMoe, DroppingAndBalancingMatchSingleProcess) {
  const std::vector<Layout> layouts = {
      {4, "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 "
          "--expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall"},
      {2, "--context-parallel-size 2 --expert-model-parallel-size 2"},
      {2, "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"},
  };
  check_layouts(std::string(kMoe) + "--moe-expert-capacity-factor 1.0 --moe-token-drop-policy probs", layouts, 6,
                "capacity 1.0, probs");
  check_layouts(std::string(kMoe) + "--moe-expert-capacity-factor 0.75 --moe-token-drop-policy position "
                                    "--moe-pad-expert-input-to-capacity",
                layouts, 6, "capacity 0.75, position, padded");
  check_layouts(std::string(kMoe) + "--moe-router-load-balancing-type seq_aux_loss --moe-router-score-function "
                                    "sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-2",
                layouts, 6, "seq_aux_loss, sigmoid, expert bias");
  check_layouts(std::string(kMoe) + "--moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 0", layouts, 6,
                "sinkhorn");
}

// Saved at EP 4, resumed at EP 2, then 1, then 4 again, then EP 2 x ETP 2: each continues the uninterrupted
// single-process run.
TEST(DistMoe, CheckpointsReshardAcrossExpertParallelSizes) {
  const std::string model = std::string(kMoe) + "--moe-router-score-function sigmoid --moe-router-enable-expert-bias ";
  const std::vector<double> ref = train_losses(model, "", 1, 20);
  ASSERT_EQ(ref.size(), 20u);
  TempDir ck("ckpt");
  const std::string dir = (ck / "c");
  auto leg = [&](int np, const std::string& layout, int until) {
    return train_losses(model, layout + " --save " + dir + " --load " + dir + " --save-interval 4 --exit-interval " +
                                   std::to_string(until),
                        np, 20);
  };
  const std::vector<double> a = leg(4, "--expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall", 4);
  expect_close({ref.begin(), ref.begin() + 4}, a, 1e-5, "EP4");
  const std::vector<double> b = leg(2, "--expert-model-parallel-size 2 --use-distributed-optimizer", 8);
  expect_close({ref.begin() + 4, ref.begin() + 8}, b, 1e-5, "EP4 -> EP2 ZeRO-1");
  const std::vector<double> c = leg(1, "", 12);
  expect_close({ref.begin() + 8, ref.begin() + 12}, c, 1e-5, "EP2 -> one process");
  const std::vector<double> d = leg(4, "--expert-model-parallel-size 4", 16);
  expect_close({ref.begin() + 12, ref.begin() + 16}, d, 1e-5, "one process -> EP4");
  const std::vector<double> e = leg(4, "--expert-model-parallel-size 2 --expert-tensor-parallel-size 2", 20);
  expect_close({ref.begin() + 16, ref.end()}, e, 1e-5, "EP4 -> EP2 x ETP2");
}

// The alltoall dispatcher's traffic equals the analytic figure. Per MoE layer and micro-batch a rank sends
// its M = B·T·k routed rows twice (dispatch, the backward of combine) and the R rows its experts received
// twice (combine, the backward of dispatch), C floats each, plus the (EP x E/EP) i32 count exchange; R over
// a step is the logged token count of its experts (EP = DP: the EP group sees every token of the step).
TEST(DistMoe, AllToAllVolumeMatchesTheAnalyticFigure) {
  std::string log;
  const std::string flags = "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --timing-log-level 2";
  const std::vector<double> losses = train_losses(kMoe, flags, 2, 3, &log);
  ASSERT_EQ(losses.size(), 3u);
  const int64_t C = 32, k = 2, BT = 2 * 16, nmb = 2, E = 4, EP = 2;
  // Per iteration: the printing (last) rank's all_to_all megabytes, and the tokens per expert of each layer.
  std::vector<double> measured;
  std::vector<std::vector<std::vector<int64_t>>> tokens(1);
  for (const std::string& line : lines_of(log)) {
    const size_t a = line.find("expert-model-parallel all_to_all: ");
    if (a != std::string::npos) {
      const std::string rest = line.substr(a + 35);
      measured.push_back(std::stod(rest.substr(rest.find('|') + 1)));
      tokens.emplace_back();
    }
    const size_t t = line.find("tokens per expert:");
    if (t != std::string::npos) {
      std::istringstream in(line.substr(t + 18));
      std::vector<int64_t> v;
      for (int64_t x; in >> x;) v.push_back(x);
      ASSERT_EQ(v.size(), size_t(E)) << line;
      tokens.back().push_back(v);
    }
  }
  // The communication block comes before the token lines of the same iteration.
  ASSERT_EQ(measured.size(), 3u) << log;
  for (size_t it = 0; it < measured.size(); ++it) {
    const auto& layers = tokens[it + 1];
    ASSERT_EQ(layers.size(), 3u) << "iteration " << it + 1 << "\n" << log;
    double bytes = 0;
    for (const auto& v : layers) {
      const int64_t M = nmb * BT * k, R = v[2] + v[3];  // rank 1 holds experts 2 and 3
      bytes += double(2 * M + 2 * R) * double(C) * 4.0 + double(nmb) * double(EP * (E / EP)) * 4.0;
    }
    EXPECT_NEAR(measured[it], bytes / 1048576.0, 0.0006) << "iteration " << it + 1;
  }
}

}  // namespace
}  // namespace loom::e2e

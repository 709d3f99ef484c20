// ParallelState over the MPI world (2, 4 or 8 ranks): for every layout whose TP·CP·PP divides the world
// size (on 8 ranks: TP2xPP2xDP2, TP2xCP2xDP2, PP4xDP2, DP8, TP8, ...), every group's global ranks are
// checked against Megatron's order rank = tp + TP·(cp + CP·(dp + DP·pp)), computed here independently
// by enumerating all ranks, and a sum over each group proves the group really communicates. Impossible
// layouts are rejected on every rank with a message naming the flags.
#include <gtest/gtest.h>

#include <functional>

#include "comm_test_util.h"
#include "loom/dist/parallel_state.h"

namespace loom {
namespace {

using testing_dist::world;

struct Coord {
  int tp, cp, dp, pp;
};

struct Layout {
  int TP, CP, DP, PP;
  Coord coord(int rank) const {
    return {rank % TP, (rank / TP) % CP, (rank / (TP * CP)) % DP, rank / (TP * CP * DP)};
  }
  int world() const { return TP * CP * DP * PP; }
};

// The ranks that `same` says belong with `me`, in the group's rank order (`order` ascending).
std::vector<int> expected_group(const Layout& l, int me, const std::function<bool(Coord, Coord)>& same,
                                const std::function<int(Coord)>& order) {
  std::vector<std::pair<int, int>> members;
  for (int r = 0; r < l.world(); ++r)
    if (same(l.coord(me), l.coord(r))) members.push_back({order(l.coord(r)), r});
  std::sort(members.begin(), members.end());
  std::vector<int> ranks;
  for (auto& m : members) ranks.push_back(m.second);
  return ranks;
}

void check_group(const Communicator& g, const std::vector<int>& expect, const std::string& name, int me) {
  SCOPED_TRACE(name);
  EXPECT_EQ(g.name(), name);
  EXPECT_EQ(g.global_ranks(), expect);
  EXPECT_EQ(g.size(), int(expect.size()));
  ASSERT_GE(g.rank(), 0);
  ASSERT_LT(g.rank(), g.size());
  EXPECT_EQ(expect[size_t(g.rank())], me);
  double sum = 0;
  for (int r : expect) sum += r;
  EXPECT_EQ(g.all_reduce_scalar(me), sum);
}

TEST(MpiParallelState, EveryLayoutMatchesMegatronOrder) {
  const Communicator& w = world();
  const int n = w.size(), me = w.rank();
  int layouts = 0;
  for (int TP = 1; TP <= n; ++TP)
    for (int CP = 1; TP * CP <= n; ++CP)
      for (int PP = 1; TP * CP * PP <= n; ++PP) {
        if (n % (TP * CP * PP) != 0) continue;
        const Layout l{TP, CP, n / (TP * CP * PP), PP};
        SCOPED_TRACE(testing::Message() << "TP" << TP << " CP" << CP << " PP" << PP << " DP" << l.DP);
        ParallelConfig cfg;
        cfg.tensor_model_parallel_size = TP;
        cfg.context_parallel_size = CP;
        cfg.pipeline_model_parallel_size = PP;
        auto ps = ParallelState::create(cfg, w.split(0, me, "world"));
        ++layouts;
        const Coord c = l.coord(me);
        EXPECT_EQ(ps->world_size(), n);
        EXPECT_EQ(ps->rank(), me);
        EXPECT_EQ(ps->dp_size(), l.DP);
        EXPECT_EQ(ps->tp_rank(), c.tp);
        EXPECT_EQ(ps->cp_rank(), c.cp);
        EXPECT_EQ(ps->dp_rank(), c.dp);
        EXPECT_EQ(ps->pp_rank(), c.pp);
        EXPECT_EQ(ps->rank_of(c.tp, c.cp, c.dp, c.pp), me);
        EXPECT_EQ(ps->is_pipeline_first_stage(), c.pp == 0);
        EXPECT_EQ(ps->is_pipeline_last_stage(), c.pp == PP - 1);

        auto eq = [](std::initializer_list<bool> v) { return std::all_of(v.begin(), v.end(), [](bool b) { return b; }); };
        check_group(ps->tp(),
                    expected_group(l, me, [&](Coord a, Coord b) { return eq({a.cp == b.cp, a.dp == b.dp, a.pp == b.pp}); },
                                   [](Coord x) { return x.tp; }),
                    "tensor-model-parallel", me);
        check_group(ps->cp(),
                    expected_group(l, me, [&](Coord a, Coord b) { return eq({a.tp == b.tp, a.dp == b.dp, a.pp == b.pp}); },
                                   [](Coord x) { return x.cp; }),
                    "context-parallel", me);
        check_group(ps->dp(),
                    expected_group(l, me, [&](Coord a, Coord b) { return eq({a.tp == b.tp, a.cp == b.cp, a.pp == b.pp}); },
                                   [](Coord x) { return x.dp; }),
                    "data-parallel", me);
        check_group(ps->dp_cp(),
                    expected_group(l, me, [&](Coord a, Coord b) { return eq({a.tp == b.tp, a.pp == b.pp}); },
                                   [&](Coord x) { return x.cp + CP * x.dp; }),
                    "data-parallel (with context-parallel)", me);
        check_group(ps->pp(),
                    expected_group(l, me, [&](Coord a, Coord b) { return eq({a.tp == b.tp, a.cp == b.cp, a.dp == b.dp}); },
                                   [](Coord x) { return x.pp; }),
                    "pipeline-model-parallel", me);
        check_group(ps->mp(),
                    expected_group(l, me, [&](Coord a, Coord b) { return eq({a.cp == b.cp, a.dp == b.dp}); },
                                   [&](Coord x) { return x.tp + TP * x.pp; }),
                    "model-parallel", me);
        if (c.pp == 0 || c.pp == PP - 1) {
          check_group(ps->embedding(),
                      expected_group(l, me,
                                     [&](Coord a, Coord b) {
                                       return eq({a.tp == b.tp, a.cp == b.cp, a.dp == b.dp,
                                                  b.pp == 0 || b.pp == PP - 1});
                                     },
                                     [](Coord x) { return x.pp; }),
                      "embedding", me);
        } else {
          EXPECT_EQ(ps->embedding().size(), 1);
          EXPECT_EQ(ps->embedding().global_ranks(), std::vector<int>{me});  // itself, for messages
        }
        EXPECT_EQ(ps->world().size(), n);
        EXPECT_EQ(ps->world().all_reduce_scalar(1.0), double(n));
      }
  // 2 ranks: 4 layouts; 4 ranks: 10; 8 ranks: 20.
  EXPECT_GE(layouts, 4);
}

TEST(MpiParallelState, NamedLayoutsOnEightRanks) {
  const Communicator& w = world();
  if (w.size() != 8) GTEST_SKIP() << "needs 8 ranks";
  // Spot values from Megatron's documentation of the rank grid.
  ParallelConfig cfg;
  cfg.tensor_model_parallel_size = 2;
  cfg.pipeline_model_parallel_size = 2;
  auto ps = ParallelState::create(cfg, w.split(0, w.rank(), "world"));
  EXPECT_EQ(ps->dp_size(), 2);
  if (w.rank() == 5) {  // tp 1, dp 0, pp 1
    EXPECT_EQ(ps->tp().global_ranks(), (std::vector<int>{4, 5}));
    EXPECT_EQ(ps->dp().global_ranks(), (std::vector<int>{5, 7}));
    EXPECT_EQ(ps->pp().global_ranks(), (std::vector<int>{1, 5}));
    EXPECT_EQ(ps->mp().global_ranks(), (std::vector<int>{0, 1, 4, 5}));
    EXPECT_EQ(ps->embedding().global_ranks(), (std::vector<int>{1, 5}));
  }
  cfg = ParallelConfig{};
  cfg.pipeline_model_parallel_size = 4;
  ps = ParallelState::create(cfg, w.split(0, w.rank(), "world"));
  if (w.rank() == 3) {  // dp 1, pp 1: a middle stage, not in the embedding group
    EXPECT_EQ(ps->pp().global_ranks(), (std::vector<int>{1, 3, 5, 7}));
    EXPECT_EQ(ps->dp().global_ranks(), (std::vector<int>{2, 3}));
    EXPECT_EQ(ps->embedding().size(), 1);
  }
  if (w.rank() == 6) {
    EXPECT_EQ(ps->embedding().global_ranks(), (std::vector<int>{0, 6}));
  }
}

TEST(MpiParallelState, RejectsImpossibleLayoutsNamingTheFlags) {
  const Communicator& w = world();
  const int n = w.size();
  auto expect_rejected = [&](ParallelConfig cfg, const std::string& flag) {
    try {
      ParallelState::create(cfg, w.split(0, w.rank(), "world"));
      ADD_FAILURE() << "accepted a layout that should be rejected for " << flag;
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(flag), std::string::npos) << e.what();
    }
  };
  ParallelConfig cfg;
  cfg.tensor_model_parallel_size = n + 1;  // never divides n
  expect_rejected(cfg, "--tensor-model-parallel-size");
  cfg = ParallelConfig{};
  cfg.pipeline_model_parallel_size = 3 * n;
  expect_rejected(cfg, "--pipeline-model-parallel-size");
  cfg = ParallelConfig{};
  cfg.context_parallel_size = 0;
  expect_rejected(cfg, "--context-parallel-size");
  cfg = ParallelConfig{};
  cfg.tensor_model_parallel_size = 2;
  cfg.context_parallel_size = n;  // 2n does not divide n
  expect_rejected(cfg, "world size " + std::to_string(n) + " is not divisible");
  // The ranks still agree afterwards (no rank is left inside a collective).
  EXPECT_EQ(w.all_reduce_scalar(1.0), double(n));
}

}  // namespace
}  // namespace loom

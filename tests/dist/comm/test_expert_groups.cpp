// ParallelState's expert grid over the MPI world (2, 4 or 8 ranks), checked two ways:
//  - hand-written tables, worked out on paper from Megatron-Core's expert RankGenerator rules
//    (megatron/core/parallel_state.py, initialize_model_parallel: tp = ETP, ep = EP, dp = world /
//    (ETP·EP·PP), pp = PP, cp = 1, order "tp-cp-ep-dp-pp"; a group lists the ranks that differ only in
//    its masked coordinates, in ascending rank order);
//  - every layout on the world with EP > 1 or ETP != TP, against the grid enumerated here independently.
// Each group is also used: a sum proves its members communicate, and an all_to_all_v over the expert-
// model-parallel group moves tokens the way the dispatcher will.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>

#include "comm_test_util.h"
#include "loom/dist/parallel_state.h"

namespace loom {
namespace {

using testing_dist::world;
using Groups = std::vector<std::vector<int>>;

struct Case {
  int world, TP, CP, PP, EP, ETP;  // ETP 0: unset (= TP)
  Groups ep, etp, etp_ep, expert_dp, expert_mp;
};

// Megatron-Core layouts worked out by hand (world 8, 4 and 2).
const std::vector<Case>& cases() {
  static const std::vector<Case> c = {
      // TP2 EP2 (ETP = TP = 2): EDP = 8 / (2·2) = 2; expert rank = etp + 2 (ep + 2 edp).
      {8, 2, 1, 1, 2, 0,
       {{0, 2}, {1, 3}, {4, 6}, {5, 7}},
       {{0, 1}, {2, 3}, {4, 5}, {6, 7}},
       {{0, 1, 2, 3}, {4, 5, 6, 7}},
       {{0, 4}, {1, 5}, {2, 6}, {3, 7}},
       {{0, 1, 2, 3}, {4, 5, 6, 7}}},
      // TP2 EP4 ETP1: EDP = 2; expert rank = ep + 4 edp.
      {8, 2, 1, 1, 4, 1,
       {{0, 1, 2, 3}, {4, 5, 6, 7}},
       {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}},
       {{0, 1, 2, 3}, {4, 5, 6, 7}},
       {{0, 4}, {1, 5}, {2, 6}, {3, 7}},
       {{0, 1, 2, 3}, {4, 5, 6, 7}}},
      // PP2 EP2: EDP = 8 / (1·2·2) = 2; expert rank = ep + 2 (edp + 2 pp).
      {8, 1, 1, 2, 2, 0,
       {{0, 1}, {2, 3}, {4, 5}, {6, 7}},
       {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}},
       {{0, 1}, {2, 3}, {4, 5}, {6, 7}},
       {{0, 2}, {1, 3}, {4, 6}, {5, 7}},
       {{0, 1, 4, 5}, {2, 3, 6, 7}}},
      // TP2 CP2 EP2 ETP1: EP runs over what the dense grid calls TP; EDP = 4.
      {8, 2, 2, 1, 2, 1,
       {{0, 1}, {2, 3}, {4, 5}, {6, 7}},
       {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}},
       {{0, 1}, {2, 3}, {4, 5}, {6, 7}},
       {{0, 2, 4, 6}, {1, 3, 5, 7}},
       {{0, 1}, {2, 3}, {4, 5}, {6, 7}}},
      // TP1 EP1 ETP2 (expert TP wider than dense TP): EDP = 4.
      {8, 1, 1, 1, 1, 2,
       {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}},
       {{0, 1}, {2, 3}, {4, 5}, {6, 7}},
       {{0, 1}, {2, 3}, {4, 5}, {6, 7}},
       {{0, 2, 4, 6}, {1, 3, 5, 7}},
       {{0, 1}, {2, 3}, {4, 5}, {6, 7}}},
      // 4 ranks, TP2 EP2: EDP = 1.
      {4, 2, 1, 1, 2, 0,
       {{0, 2}, {1, 3}},
       {{0, 1}, {2, 3}},
       {{0, 1, 2, 3}},
       {{0}, {1}, {2}, {3}},
       {{0, 1, 2, 3}}},
      // 4 ranks, PP2 EP2: EDP = 1.
      {4, 1, 1, 2, 2, 0,
       {{0, 1}, {2, 3}},
       {{0}, {1}, {2}, {3}},
       {{0, 1}, {2, 3}},
       {{0}, {1}, {2}, {3}},
       {{0, 1, 2, 3}}},
      // 2 ranks, EP2.
      {2, 1, 1, 1, 2, 0, {{0, 1}}, {{0}, {1}}, {{0, 1}}, {{0}, {1}}, {{0, 1}}},
  };
  return c;
}

ParallelConfig config(int TP, int CP, int PP, int EP, int ETP) {
  ParallelConfig cfg;
  cfg.tensor_model_parallel_size = TP;
  cfg.context_parallel_size = CP;
  cfg.pipeline_model_parallel_size = PP;
  cfg.expert_model_parallel_size = EP;
  cfg.expert_tensor_parallel_size = ETP;
  return cfg;
}

std::vector<int> group_of(const Groups& groups, int me) {
  for (const auto& g : groups)
    if (std::find(g.begin(), g.end(), me) != g.end()) return g;
  ADD_FAILURE() << "rank " << me << " is in no group of the table";
  return {};
}

void check_group(const Communicator& g, const std::vector<int>& expect, const std::string& name, int me) {
  SCOPED_TRACE(name);
  EXPECT_EQ(g.name(), name);
  EXPECT_EQ(g.global_ranks(), expect);
  ASSERT_EQ(g.size(), int(expect.size()));
  EXPECT_EQ(expect[size_t(g.rank())], me);
  double sum = 0;
  for (int r : expect) sum += r;
  EXPECT_EQ(g.all_reduce_scalar(me), sum);
}

void check_all(const ParallelState& ps, const Groups& ep, const Groups& etp, const Groups& etp_ep,
               const Groups& edp, const Groups& emp, int me) {
  check_group(ps.ep(), group_of(ep, me), "expert-model-parallel", me);
  check_group(ps.etp(), group_of(etp, me), "expert-tensor-parallel", me);
  check_group(ps.etp_ep(), group_of(etp_ep, me), "expert-tensor-and-model-parallel", me);
  check_group(ps.expert_dp(), group_of(edp, me), "expert-data-parallel", me);
  check_group(ps.expert_mp(), group_of(emp, me), "expert-tensor-model-pipeline-parallel", me);
}

TEST(MpiExpertGroups, MatchHandWrittenMegatronTables) {
  const Communicator& w = world();
  const int me = w.rank();
  int ran = 0;
  for (const Case& c : cases()) {
    if (c.world != w.size()) continue;
    SCOPED_TRACE(testing::Message() << "TP" << c.TP << " CP" << c.CP << " PP" << c.PP << " EP" << c.EP << " ETP"
                                    << c.ETP);
    auto ps = ParallelState::create(config(c.TP, c.CP, c.PP, c.EP, c.ETP), w.split(0, me, "world"));
    ++ran;
    check_all(*ps, c.ep, c.etp, c.etp_ep, c.expert_dp, c.expert_mp, me);
    EXPECT_EQ(ps->ep_size(), c.EP);
    EXPECT_EQ(ps->ep_rank(), ps->ep().rank());
    EXPECT_EQ(ps->etp_rank(), ps->etp().rank());
    EXPECT_EQ(ps->expert_dp_rank(), ps->expert_dp().rank());
    EXPECT_EQ(ps->expert_dp_size(), ps->expert_dp().size());
    EXPECT_EQ(ps->expert_rank_of(ps->etp_rank(), ps->ep_rank(), ps->expert_dp_rank(), ps->pp_rank()), me);
    // The dense grid is unchanged by the expert flags.
    EXPECT_EQ(ps->tp().size(), c.TP);
    EXPECT_EQ(ps->dp_size(), c.world / (c.TP * c.CP * c.PP));
    // A token exchange over the expert-model-parallel group: rank r sends r+1 rows of 2 to each peer.
    const Communicator& g = ps->ep();
    std::vector<int64_t> in_counts(size_t(g.size()), g.rank() + 1), out_counts;
    for (int p = 0; p < g.size(); ++p) out_counts.push_back(p + 1);
    const int64_t out_rows = int64_t(g.size()) * (g.size() + 1) / 2;
    Tensor inp = Tensor::zeros(Shape{int64_t(g.size()) * (g.rank() + 1), 2}, DType::kF32);
    Tensor out = Tensor::zeros(Shape{out_rows, 2}, DType::kF32);
    for (int64_t i = 0; i < inp.numel(); ++i) inp.view().data<float>()[i] = float(100 * me + i / 2 / (g.rank() + 1));
    g.all_to_all_v(out.view(), out_counts, inp.view(), in_counts);
    int64_t row = 0;
    for (int p = 0; p < g.size(); ++p)
      for (int i = 0; i < p + 1; ++i, ++row)
        EXPECT_EQ(out.view().data<float>()[2 * row], float(100 * g.global_ranks()[size_t(p)] + g.rank()));
  }
  EXPECT_GT(ran, 0);
}

// Without expert flags the expert groups are the dense ones (no new communicators).
TEST(MpiExpertGroups, DefaultsAreTheDenseGroups) {
  const Communicator& w = world();
  ParallelConfig cfg;
  cfg.tensor_model_parallel_size = w.size() % 2 == 0 ? 2 : 1;
  auto ps = ParallelState::create(cfg, w.split(0, w.rank(), "world"));
  EXPECT_EQ(ps->ep().size(), 1);
  EXPECT_EQ(ps->ep().name(), "expert-model-parallel");
  EXPECT_EQ(&ps->etp(), &ps->tp());
  EXPECT_EQ(&ps->etp_ep(), &ps->tp());
  EXPECT_EQ(&ps->expert_dp(), &ps->dp_cp());
  EXPECT_EQ(&ps->expert_mp(), &ps->mp());
  EXPECT_EQ(ps->etp_size(), ps->tp_size());
  EXPECT_EQ(ps->expert_dp_size(), ps->dp_size() * ps->cp_size());
}

// Every layout of this world with expert parallelism, against an independent enumeration of the grid.
TEST(MpiExpertGroups, EveryLayoutMatchesTheExpertGrid) {
  const Communicator& w = world();
  const int n = w.size(), me = w.rank();
  int layouts = 0;
  for (int TP = 1; TP <= n; TP *= 2)
    for (int CP = 1; CP <= 2 && TP * CP <= n; CP *= 2)  // CP 4 adds time, not cases
      for (int PP = 1; TP * CP * PP <= n; PP *= 2)
        for (int EP = 1; EP * PP <= n; EP *= 2)
          for (int ETP : {1, 2}) {
            if (n % (TP * CP * PP) != 0 || n % (ETP * EP * PP) != 0) continue;
            if (EP == 1 && ETP == TP) continue;  // the dense groups, checked above
            SCOPED_TRACE(testing::Message() << "TP" << TP << " CP" << CP << " PP" << PP << " EP" << EP << " ETP" << ETP);
            auto ps = ParallelState::create(config(TP, CP, PP, EP, ETP), w.split(0, me, "world"));
            ++layouts;
            const int EDP = n / (ETP * EP * PP);
            // Expert coordinates of every rank; a group: ranks equal to `me` outside its mask.
            auto coord = [&](int r) {
              return std::array<int, 4>{r % ETP, (r / ETP) % EP, (r / (ETP * EP)) % EDP, r / (ETP * EP * EDP)};
            };
            auto groups = [&](std::array<bool, 4> mask) {
              Groups gs(1);
              for (int r = 0; r < n; ++r) {
                bool same = true;
                for (int k = 0; k < 4; ++k) same = same && (mask[size_t(k)] || coord(r)[size_t(k)] == coord(me)[size_t(k)]);
                if (same) gs[0].push_back(r);
              }
              return gs;
            };
            EXPECT_EQ(ps->pp_rank(), coord(me)[3]);  // the stages agree between the grids
            check_all(*ps, groups({false, true, false, false}), groups({true, false, false, false}),
                      groups({true, true, false, false}), groups({false, false, true, false}),
                      groups({true, true, false, true}), me);
          }
  EXPECT_GT(layouts, 0);
}

TEST(MpiExpertGroups, RejectsLayoutsMegatronRejects) {
  const Communicator& w = world();
  const int n = w.size();
  try {
    ParallelState::create(config(1, 1, 1, 2 * n, 0), w.split(0, w.rank(), "world"));
    ADD_FAILURE() << "EP larger than the world was accepted";
  } catch (const UserError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--expert-model-parallel-size (" + std::to_string(2 * n) + ")"), std::string::npos) << m;
    EXPECT_NE(m.find("--expert-tensor-parallel-size (1, the tensor-model-parallel size)"), std::string::npos) << m;
  }
  EXPECT_EQ(w.all_reduce_scalar(1.0), double(n));
}

}  // namespace
}  // namespace loom

// All-to-all on the self communicator (the copy, and the same argument checks every backend makes) and
// the expert grid's arithmetic in one process (ParallelState::create with an explicit world size, as
// `loom calc` uses it): coordinates, validation messages, and the one-process expert groups.
#include <gtest/gtest.h>

#include <functional>
#include <numeric>
#include <vector>

#include "loom/dist/communicator.h"
#include "loom/dist/parallel_state.h"

namespace loom {
namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(SelfAllToAll, CopiesEveryVariant) {
  auto c = make_self_communicator("expert-model-parallel");
  std::vector<float> x(10), y(10, 0.0f);
  std::iota(x.begin(), x.end(), 1.0f);
  TensorView xv(x.data(), DType::kF32, Shape{5, 2}), yv(y.data(), DType::kF32, Shape{5, 2});
  c->all_to_all(yv, xv);
  EXPECT_EQ(y, x);
  y.assign(10, 0.0f);
  c->all_to_all_v(yv, {5}, xv, {5});
  EXPECT_EQ(y, x);
  y.assign(10, 0.0f);
  auto w = c->all_to_all_v_async(yv, {5}, xv, {5});
  EXPECT_TRUE(w->done());
  EXPECT_EQ(y, x);
  y.assign(10, 0.0f);
  c->all_to_all_async(yv, xv)->wait();
  EXPECT_EQ(y, x);
  // Other dtypes are bytes moved; zero rows is an empty exchange.
  std::vector<uint16_t> h = {1, 2, 3}, g(3);
  c->all_to_all_v(TensorView(g.data(), DType::kBF16, Shape{3}), {3}, TensorView(h.data(), DType::kBF16, Shape{3}),
                  {3});
  EXPECT_EQ(g, h);
  std::vector<int64_t> i64 = {7, -8}, o64(2);
  c->all_to_all(TensorView(o64.data(), DType::kI64, Shape{2, 1}), TensorView(i64.data(), DType::kI64, Shape{2, 1}));
  EXPECT_EQ(o64, i64);
  c->all_to_all_v(TensorView(nullptr, DType::kF32, Shape{0, 4}), {0}, TensorView(nullptr, DType::kF32, Shape{0, 4}),
                  {0});
}

TEST(SelfAllToAll, ChecksArgumentsLikeEveryBackend) {
  auto c = make_self_communicator("expert-model-parallel");
  std::vector<float> x(6), y(6), z(6);
  TensorView xv(x.data(), DType::kF32, Shape{3, 2}), yv(y.data(), DType::kF32, Shape{3, 2});
  std::string m = error_of([&] { c->all_to_all_v(yv, {3}, xv, {3, 0}); });
  EXPECT_NE(m.find("in_counts has 2 entries, expected one per group rank (1)"), std::string::npos) << m;
  m = error_of([&] { c->all_to_all_v(yv, {3}, xv, {-1}); });
  EXPECT_NE(m.find("in_counts[0] = -1 is negative"), std::string::npos) << m;
  m = error_of([&] { c->all_to_all_v(yv, {2}, xv, {3}); });
  EXPECT_NE(m.find("out_counts sum to 2 rows but out"), std::string::npos) << m;
  m = error_of([&] { c->all_to_all_v(yv, {3}, xv.slice_flat(0, Shape{3, 2}), {3}); });
  EXPECT_EQ(m, "");
  m = error_of([&] { c->all_to_all_v(TensorView(z.data(), DType::kF32, Shape{2, 3}), {2}, xv, {3}); });
  EXPECT_NE(m.find("trailing shape"), std::string::npos) << m;
  m = error_of([&] { c->all_to_all_v(TensorView(z.data(), DType::kI32, Shape{3, 2}), {3}, xv, {3}); });
  EXPECT_NE(m.find("differ in dtype"), std::string::npos) << m;
  m = error_of([&] { c->all_to_all_v(xv, {3}, xv, {3}); });
  EXPECT_NE(m.find("overlap; all-to-all cannot run in place"), std::string::npos) << m;
  m = error_of([&] { c->all_to_all(TensorView(z.data(), DType::kF32, Shape{6}), xv); });
  EXPECT_NE(m.find("must have the same dtype and shape"), std::string::npos) << m;
  m = error_of([&] { c->all_to_all(TensorView(z.data(), DType::kF32, Shape{}), TensorView(x.data(), DType::kF32, Shape{})); });
  EXPECT_NE(m.find("[all_to_all]"), std::string::npos) << m;
}

ParallelConfig expert_layout(int tp, int cp, int pp, int ep, int etp) {
  ParallelConfig c;
  c.tensor_model_parallel_size = tp;
  c.context_parallel_size = cp;
  c.pipeline_model_parallel_size = pp;
  c.expert_model_parallel_size = ep;
  c.expert_tensor_parallel_size = etp;
  return c;
}

TEST(ExpertGrid, CoordinatesFollowMegatronsExpertRankGenerator) {
  // TP2 CP2 PP2 EP4 ETP1 on 16 ranks: EDP = 16 / (1·4·2) = 2; expert rank = ep + 4 (edp + 2 pp).
  for (int rank = 0; rank < 16; ++rank) {
    auto ps = ParallelState::create(expert_layout(2, 2, 2, 4, 1), 16, rank);
    EXPECT_EQ(ps->ep_size(), 4);
    EXPECT_EQ(ps->etp_size(), 1);
    EXPECT_EQ(ps->expert_dp_size(), 2);
    EXPECT_EQ(ps->etp_rank(), 0);
    EXPECT_EQ(ps->ep_rank(), rank % 4);
    EXPECT_EQ(ps->expert_dp_rank(), (rank / 4) % 2);
    EXPECT_EQ(ps->pp_rank(), rank / 8);  // the same stages in both grids
    EXPECT_EQ(ps->expert_rank_of(ps->etp_rank(), ps->ep_rank(), ps->expert_dp_rank(), ps->pp_rank()), rank);
  }
  // ETP unset is TP (Megatron's default): TP2 EP2 on 8 ranks, EDP 2, expert rank = etp + 2 (ep + 2 edp).
  auto ps = ParallelState::create(expert_layout(2, 1, 1, 2, 0), 8, 6);
  EXPECT_EQ(ps->etp_size(), 2);
  EXPECT_EQ(ps->expert_dp_size(), 2);
  EXPECT_EQ(ps->etp_rank(), 0);
  EXPECT_EQ(ps->ep_rank(), 1);
  EXPECT_EQ(ps->expert_dp_rank(), 1);
}

TEST(ExpertGrid, RejectsLayoutsNamingTheFlags) {
  auto message = [](ParallelConfig cfg, int world) { return error_of([&] { ParallelState::create(cfg, world, 0); }); };
  std::string m = message(expert_layout(1, 1, 2, 8, 1), 8);
  EXPECT_NE(m.find("world size 8 is not divisible by --expert-tensor-parallel-size (1) x --expert-model-parallel-size "
                   "(8) x --pipeline-model-parallel-size (2) = 16"),
            std::string::npos)
      << m;
  m = message(expert_layout(4, 1, 1, 4, 0), 8);
  EXPECT_NE(m.find("--expert-tensor-parallel-size (4, the tensor-model-parallel size)"), std::string::npos) << m;
  EXPECT_NE(message(expert_layout(1, 1, 1, 0, 0), 8).find("--expert-model-parallel-size must be >= 1"),
            std::string::npos);
  EXPECT_NE(message(expert_layout(1, 1, 1, 1, -1), 8).find("--expert-tensor-parallel-size must be >= 1"),
            std::string::npos);
  // EP with CP is a valid Megatron layout (EP spans the context ranks in the expert grid).
  EXPECT_EQ(message(expert_layout(1, 4, 1, 4, 1), 8), "");
}

TEST(ExpertGrid, OneProcessGroupsAreTheDenseSelfGroups) {
  for (int k = 0; k < 2; ++k) {
    auto ps = k == 0 ? ParallelState::create(ParallelConfig{}, 1, 0)
                     : ParallelState::create(ParallelConfig{}, make_self_communicator("world"));
    EXPECT_EQ(ps->ep().name(), "expert-model-parallel");
    EXPECT_EQ(ps->ep().size(), 1);
    EXPECT_EQ(&ps->etp(), &ps->tp());
    EXPECT_EQ(&ps->etp_ep(), &ps->tp());
    EXPECT_EQ(&ps->expert_dp(), &ps->dp_cp());
    EXPECT_EQ(&ps->expert_mp(), &ps->mp());
  }
}

}  // namespace
}  // namespace loom

// dist layer in one process: the self communicator's identities and refusals, ParallelState's layout
// validation and grid arithmetic (create with an explicit world size, as `loom calc` uses it), and
// init_world without a launcher (size 1, the self communicator).
#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "loom/dist/communicator.h"
#include "loom/dist/parallel_state.h"

namespace loom {
namespace {

TEST(SelfCommunicator, CollectivesAreIdentities) {
  auto c = make_self_communicator("tensor-model-parallel");
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->name(), "tensor-model-parallel");
  EXPECT_EQ(c->global_ranks(), std::vector<int>{0});
  std::vector<float> x = {1.5f, -2.0f, 3.25f}, y(3, 0.0f);
  TensorView xv(x.data(), DType::kF32, Shape{3}), yv(y.data(), DType::kF32, Shape{3});
  c->all_reduce(xv, ReduceOp::kMax);
  EXPECT_EQ(x, (std::vector<float>{1.5f, -2.0f, 3.25f}));
  EXPECT_EQ(c->all_reduce_scalar(2.5), 2.5);
  c->broadcast(xv, 0);
  c->all_gather(yv, xv);
  EXPECT_EQ(y, x);
  y.assign(3, 0.0f);
  c->reduce_scatter(yv, xv);
  EXPECT_EQ(y, x);
  y.assign(3, 0.0f);
  c->all_gather_async(yv, xv)->wait();
  EXPECT_EQ(y, x);
  auto w = c->all_reduce_async(xv);
  EXPECT_TRUE(w->done());
  c->barrier();
}

TEST(SelfCommunicator, RefusesWhatOneRankCannotDo) {
  auto c = make_self_communicator("pipeline-model-parallel");
  std::vector<float> x(3), y(4);
  TensorView xv(x.data(), DType::kF32, Shape{3}), yv(y.data(), DType::kF32, Shape{4});
  EXPECT_THROW(c->send(xv, 0), Error);
  EXPECT_THROW(c->recv(xv, 0), Error);
  EXPECT_THROW(c->send_async(xv, 1), Error);
  EXPECT_THROW(c->broadcast(xv, 1), Error);
  EXPECT_THROW(c->all_gather(yv, xv), Error);  // sizes differ
}

TEST(SelfCommunicator, Split) {
  auto c = make_self_communicator("world");
  EXPECT_EQ(c->split(-1, 0, "none"), nullptr);
  auto s = c->split(3, 7, "data-parallel");
  ASSERT_TRUE(s);
  EXPECT_EQ(s->name(), "data-parallel");
  EXPECT_EQ(s->size(), 1);
}

ParallelConfig layout(int tp, int pp, int cp) {
  ParallelConfig c;
  c.tensor_model_parallel_size = tp;
  c.pipeline_model_parallel_size = pp;
  c.context_parallel_size = cp;
  return c;
}

TEST(ParallelStateLayout, GridCoordinatesFollowMegatronOrder) {
  // TP2 x CP2 x PP2 on 16 ranks: DP 2; rank = tp + 2 (cp + 2 (dp + 2 pp)).
  for (int rank = 0; rank < 16; ++rank) {
    auto ps = ParallelState::create(layout(2, 2, 2), 16, rank);
    EXPECT_EQ(ps->dp_size(), 2);
    EXPECT_EQ(ps->tp_rank(), rank % 2);
    EXPECT_EQ(ps->cp_rank(), (rank / 2) % 2);
    EXPECT_EQ(ps->dp_rank(), (rank / 4) % 2);
    EXPECT_EQ(ps->pp_rank(), rank / 8);
    EXPECT_EQ(ps->rank_of(ps->tp_rank(), ps->cp_rank(), ps->dp_rank(), ps->pp_rank()), rank);
    EXPECT_EQ(ps->is_pipeline_first_stage(), rank < 8);
    EXPECT_EQ(ps->is_pipeline_last_stage(), rank >= 8);
  }
  auto dp8 = ParallelState::create(layout(1, 1, 1), 8, 5);
  EXPECT_EQ(dp8->dp_size(), 8);
  EXPECT_EQ(dp8->dp_rank(), 5);
}

TEST(ParallelStateLayout, RejectsImpossibleLayoutsNamingTheFlags) {
  auto message = [](ParallelConfig cfg, int world) -> std::string {
    try {
      ParallelState::create(cfg, world, 0);
    } catch (const UserError& e) {
      return e.what();
    }
    return "";
  };
  std::string m = message(layout(3, 1, 1), 8);
  EXPECT_NE(m.find("world size 8 is not divisible by --tensor-model-parallel-size (3)"), std::string::npos) << m;
  EXPECT_NE(m.find("--pipeline-model-parallel-size (1)"), std::string::npos) << m;
  EXPECT_NE(m.find("--context-parallel-size (1)"), std::string::npos) << m;
  m = message(layout(2, 2, 4), 8);
  EXPECT_NE(m.find("= 16"), std::string::npos) << m;
  EXPECT_NE(message(layout(0, 1, 1), 8).find("--tensor-model-parallel-size must be >= 1"), std::string::npos);
  EXPECT_NE(message(layout(1, -1, 1), 8).find("--pipeline-model-parallel-size must be >= 1"), std::string::npos);
  EXPECT_NE(message(layout(1, 1, 0), 8).find("--context-parallel-size must be >= 1"), std::string::npos);
  EXPECT_NE(message(layout(2, 1, 1), 1).find("world size 1"), std::string::npos);
}

TEST(ParallelStateLayout, SingleProcessGroupsAreNamedSelfGroups) {
  auto ps = ParallelState::create(layout(1, 1, 1), 1, 0);
  EXPECT_EQ(ps->world().name(), "world");
  EXPECT_EQ(ps->tp().name(), "tensor-model-parallel");
  EXPECT_EQ(ps->dp().name(), "data-parallel");
  EXPECT_EQ(ps->pp().name(), "pipeline-model-parallel");
  EXPECT_EQ(ps->embedding().size(), 1);
  // Through a world communicator (the self one here): the same groups, built by split.
  auto ps2 = ParallelState::create(layout(1, 1, 1), make_self_communicator("world"));
  EXPECT_EQ(ps2->world_size(), 1);
  EXPECT_EQ(ps2->dp().name(), "data-parallel");
  EXPECT_EQ(ps2->mp().name(), "model-parallel");
  EXPECT_EQ(ps2->embedding().name(), "embedding");
  EXPECT_THROW(ParallelState::create(layout(2, 1, 1), make_self_communicator("world")), UserError);
}

TEST(InitWorld, WithoutLauncherIsTheSelfCommunicator) {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMIX_SIZE", "PMIX_RANK",
                          "SLURM_PROCID", "SLURM_NTASKS"})
    unsetenv(var);
  auto w = init_world(std::chrono::milliseconds(1000));
  EXPECT_EQ(w->size(), 1);
  EXPECT_EQ(w->rank(), 0);
  EXPECT_EQ(w->name(), "world");
  // An sbatch script's single task (SLURM_PROCID set, one task) is not a multi-rank launch either.
  setenv("SLURM_PROCID", "0", 1);
  setenv("SLURM_NTASKS", "1", 1);
  EXPECT_EQ(init_world(std::chrono::milliseconds(1000))->size(), 1);
  unsetenv("SLURM_PROCID");
  unsetenv("SLURM_NTASKS");
  EXPECT_THROW(init_world(std::chrono::milliseconds(0)), Error);
}

TEST(InitWorld, AbortJobWithoutMpiExitsWithTheCodeAndMessage) {
  EXPECT_EXIT(abort_job("stage 3 lost its peer", 7), ::testing::ExitedWithCode(7),
              "\\[loom\\] rank 0: stage 3 lost its peer");
}

TEST(NcclCommunicator, StubOrRealAnswersConsistently) {
  auto self = make_self_communicator("data-parallel");
  if (!nccl_compiled_in()) {
    try {
      make_nccl_communicator(*self);
      FAIL() << "the stub returned a communicator";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("no NCCL"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("data-parallel"), std::string::npos) << e.what();
    }
  }
}

TEST(MpiHooks, MaxMessageElementsRejectsNegative) {
  EXPECT_THROW(set_mpi_max_message_elements(-1), Error);
  set_mpi_max_message_elements(0);
}

}  // namespace
}  // namespace loom

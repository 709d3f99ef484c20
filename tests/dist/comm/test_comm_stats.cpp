// Communication statistics under mpirun (2, 4 or 8 ranks): a known sequence of operations on the world
// and on split groups gives exactly the expected calls and payload bytes per (group, op) on every rank;
// the recorded time is the time the caller was held up (a late rank makes the others wait, not itself;
// an async operation that finished in the background costs only the polls).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <thread>
#include <tuple>

#include "comm_test_util.h"

namespace loom {
namespace {

using testing_dist::world;

using Clock = std::chrono::steady_clock;

struct Buf {
  std::vector<char> bytes;
  TensorView t;
  Buf(DType dt, int64_t n) : bytes(size_t(std::max<int64_t>(n, 1)) * dtype_size(dt)) {
    t = TensorView(bytes.data(), dt, Shape{n});
  }
};

const CommStat* find_stat(const std::vector<CommStat>& stats, const std::string& group, const std::string& op) {
  for (const CommStat& s : stats)
    if (s.group == group && s.op == op) return &s;
  return nullptr;
}

class CommStats : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(mpi_compiled_in());
    ASSERT_GE(world().size(), 2) << "run under mpirun -np 2, 4 or 8";
    if (world().size() % 2) GTEST_SKIP() << "pairs of ranks need an even world size";
  }
};

TEST_F(CommStats, CountsCallsAndBytesPerGroupAndOp) {
  const Communicator& w = world();
  const int me = w.rank(), partner = me ^ 1;
  // Pairs of neighbours, and the ranks of equal parity: the group names are the split names.
  auto tp = w.split(me / 2, me, "tensor-model-parallel");
  auto dp = w.split(me % 2, me, "data-parallel");
  ASSERT_TRUE(tp && dp);
  ASSERT_EQ(tp->size(), 2);
  w.barrier();
  reset_comm_stats();
  EXPECT_TRUE(comm_stats().empty()) << "reset left " << comm_stats().size() << " entries";

  Buf ar(DType::kF32, 100);
  for (int k = 0; k < 3; ++k) w.all_reduce(ar.t);
  Buf ag_out(DType::kBF16, 400), ag_in(DType::kBF16, 200);
  tp->all_gather(ag_out.t, ag_in.t);
  Buf rs_in(DType::kF32, 64), rs_out(DType::kF32, 32);
  tp->reduce_scatter(rs_out.t, rs_in.t);
  Buf msg(DType::kI64, 10);
  if (me % 2 == 0)
    w.send(msg.t, partner);
  else
    w.recv(msg.t, partner);
  Buf ex_out(DType::kF32, 7), ex_in(DType::kF32, 7);
  tp->send_recv_async(ex_out.t, tp->rank() ^ 1, ex_in.t, tp->rank() ^ 1)->wait();
  w.all_reduce_scalar(1.0);
  Buf bc(DType::kI32, 17);
  dp->broadcast(bc.t, 0);
  // A staged 16-bit reduction counts the bf16 bytes (100), not the f32 staging buffer's (200).
  Buf half(DType::kBF16, 50);
  dp->all_reduce_async(half.t)->wait();
  w.barrier();

  std::vector<std::tuple<std::string, std::string, int64_t, int64_t>> expect = {
      {"data-parallel", "all_reduce", 1, 100},
      {"data-parallel", "broadcast", 1, 68},
      {"tensor-model-parallel", "all_gather", 1, 800},
      {"tensor-model-parallel", "reduce_scatter", 1, 256},
      {"tensor-model-parallel", "recv", 1, 28},
      {"tensor-model-parallel", "send", 1, 28},
      {"world", "all_reduce", 3, 1200},
      {"world", "all_reduce_scalar", 1, 8},
      {"world", "barrier", 1, 0},
      {"world", me % 2 == 0 ? "send" : "recv", 1, 80},
  };
  std::sort(expect.begin(), expect.end());
  const std::vector<CommStat> got = comm_stats();
  ASSERT_EQ(got.size(), expect.size()) << "rank " << me;
  for (size_t i = 0; i < got.size(); ++i) {
    const auto& [group, op, calls, bytes] = expect[i];
    EXPECT_EQ(got[i].group, group) << "entry " << i << " on rank " << me;
    EXPECT_EQ(got[i].op, op) << "entry " << i << " on rank " << me;
    EXPECT_EQ(got[i].calls, calls) << group << " " << op << " on rank " << me;
    EXPECT_EQ(got[i].bytes, bytes) << group << " " << op << " on rank " << me;
    EXPECT_TRUE(std::isfinite(got[i].wait_seconds) && got[i].wait_seconds >= 0.0)
        << group << " " << op << ": " << got[i].wait_seconds;
  }

  // Reset clears everything; the next operation starts from zero.
  reset_comm_stats();
  EXPECT_TRUE(comm_stats().empty());
  w.all_reduce_scalar(2.0);
  const std::vector<CommStat> after = comm_stats();
  ASSERT_EQ(after.size(), 1u);
  EXPECT_EQ(after[0].group, "world");
  EXPECT_EQ(after[0].op, "all_reduce_scalar");
  EXPECT_EQ(after[0].calls, 1);
  EXPECT_EQ(after[0].bytes, 8);
}

TEST_F(CommStats, BlockingWaitIsTheTimeHeldUpByTheLateRank) {
  // Rank 0 arrives 200 ms late at an all_reduce: the others are held up that long, rank 0 is not.
  const Communicator& w = world();
  w.barrier();
  reset_comm_stats();
  if (w.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  Buf x(DType::kF32, 100);
  w.all_reduce(x.t);
  const std::vector<CommStat> stats = comm_stats();
  const CommStat* s = find_stat(stats, "world", "all_reduce");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->calls, 1);
  EXPECT_EQ(s->bytes, 400);
  if (w.rank() == 0)
    EXPECT_LT(s->wait_seconds, 0.1) << "the late rank did not wait for anyone";
  else
    EXPECT_GE(s->wait_seconds, 0.15) << "rank " << w.rank() << " waited for rank 0's 200 ms";
}

TEST_F(CommStats, AsyncCountsOnlyTheTimeInsideDoneAndWait) {
  // Rank 0 joins 200 ms late; the others post early, poll done() between "compute" sleeps until it
  // completes, then wait(). Only the polls and the wait count, not the 200 ms the operation was open.
  const Communicator& w = world();
  w.barrier();
  reset_comm_stats();
  Buf x(DType::kF32, 100);
  const auto start = Clock::now();
  if (w.rank() == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    w.all_reduce_async(x.t)->wait();
  } else {
    auto work = w.all_reduce_async(x.t);
    int polls = 0;
    while (!work->done()) {
      ++polls;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    work->wait();
    EXPECT_GT(polls, 0) << "the operation completed before rank 0 joined";
    EXPECT_GE(std::chrono::duration<double>(Clock::now() - start).count(), 0.15);
  }
  const std::vector<CommStat> stats = comm_stats();
  const CommStat* s = find_stat(stats, "world", "all_reduce");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->calls, 1);
  EXPECT_EQ(s->bytes, 400);
  EXPECT_GE(s->wait_seconds, 0.0);
  EXPECT_LT(s->wait_seconds, 0.1) << "rank " << w.rank() << " counted time outside done()/wait()";
}

}  // namespace
}  // namespace loom

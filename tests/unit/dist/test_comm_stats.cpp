// Communication statistics in one process: the registry behind comm_stats() (sorting, reset, entries
// that outlive a reset, concurrent recording) and the self communicator, which records nothing.
#include <gtest/gtest.h>

#include <set>
#include <thread>
#include <vector>

#include "dist/dist_util.h"
#include "loom/dist/communicator.h"

namespace loom {
namespace {

TEST(CommStats, SelfCommunicatorRecordsNothing) {
  reset_comm_stats();
  auto c = make_self_communicator("tensor-model-parallel");
  std::vector<float> x(4, 1.0f), y(4, 0.0f);
  TensorView xv(x.data(), DType::kF32, Shape{4}), yv(y.data(), DType::kF32, Shape{4});
  c->all_reduce(xv);
  c->all_reduce_async(xv)->wait();
  c->all_reduce_scalar(1.0);
  c->broadcast(xv, 0);
  c->all_gather(yv, xv);
  c->reduce_scatter(yv, xv);
  c->barrier();
  EXPECT_TRUE(comm_stats().empty());
}

TEST(CommStats, OpNamesAreTheDocumentedOnes) {
  std::set<std::string> names;
  for (int i = 0; i < dist::kCommOps; ++i) names.insert(dist::comm_op_name(dist::CommOp(i)));
  EXPECT_EQ(names, (std::set<std::string>{"all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv",
                                          "all_reduce_scalar", "barrier", "all_to_all"}));
}

TEST(CommStats, RecordsPerGroupAndOpSortedAndResets) {
  reset_comm_stats();
  const dist::CommRecorder world("world"), dp("data-parallel"), none;
  EXPECT_TRUE(world.active());
  EXPECT_FALSE(none.active());
  world.call(dist::CommOp::kAllReduce, 400);
  world.call(dist::CommOp::kAllReduce, 100);
  world.wait(dist::CommOp::kAllReduce, 0.25);
  world.wait(dist::CommOp::kAllReduce, 0.5);
  world.wait(dist::CommOp::kAllReduce, -1.0);  // a clock step backwards never subtracts
  dp.call(dist::CommOp::kReduceScatter, 64);
  dp.call(dist::CommOp::kAllGather, 32);
  none.call(dist::CommOp::kBarrier, 0);  // records nothing
  none.wait(dist::CommOp::kBarrier, 1.0);

  std::vector<CommStat> s = comm_stats();
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].group, "data-parallel");
  EXPECT_EQ(s[0].op, "all_gather");
  EXPECT_EQ(s[0].calls, 1);
  EXPECT_EQ(s[0].bytes, 32);
  EXPECT_EQ(s[0].wait_seconds, 0.0);
  EXPECT_EQ(s[1].group, "data-parallel");
  EXPECT_EQ(s[1].op, "reduce_scatter");
  EXPECT_EQ(s[1].bytes, 64);
  EXPECT_EQ(s[2].group, "world");
  EXPECT_EQ(s[2].op, "all_reduce");
  EXPECT_EQ(s[2].calls, 2);
  EXPECT_EQ(s[2].bytes, 500);
  EXPECT_DOUBLE_EQ(s[2].wait_seconds, 0.75);

  reset_comm_stats();
  EXPECT_TRUE(comm_stats().empty());
  // Recorders made before the reset keep recording into the same (zeroed) entries.
  world.call(dist::CommOp::kBarrier, 0);
  s = comm_stats();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].op, "barrier");
  EXPECT_EQ(s[0].calls, 1);
  EXPECT_EQ(s[0].bytes, 0);
  // A second recorder for the same group name adds to the same entries (the NCCL communicator and
  // its host group share a name).
  dist::CommRecorder("world").call(dist::CommOp::kBarrier, 0);
  EXPECT_EQ(comm_stats()[0].calls, 2);
  reset_comm_stats();
}

TEST(CommStats, ConcurrentRecordingLosesNothing) {
  reset_comm_stats();
  constexpr int kThreads = 4, kCalls = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([t] {
      // Half the threads make their own recorder (creating entries while others record).
      const dist::CommRecorder rec(t % 2 ? "pipeline-model-parallel" : "world");
      for (int i = 0; i < kCalls; ++i) {
        rec.call(dist::CommOp::kSend, 3);
        rec.wait(dist::CommOp::kSend, 0.5);
      }
    });
  for (auto& th : threads) th.join();
  const std::vector<CommStat> s = comm_stats();
  ASSERT_EQ(s.size(), 2u);
  for (const CommStat& e : s) {
    EXPECT_EQ(e.op, "send");
    EXPECT_EQ(e.calls, int64_t(kThreads / 2) * kCalls) << e.group;
    EXPECT_EQ(e.bytes, int64_t(kThreads / 2) * kCalls * 3) << e.group;
    EXPECT_DOUBLE_EQ(e.wait_seconds, double(kThreads / 2) * kCalls * 0.5) << e.group;
  }
  reset_comm_stats();
}

}  // namespace
}  // namespace loom

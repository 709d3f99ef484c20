// MPI communicator under mpirun (2, 4 or 8 ranks): every collective for every dtype and odd sizes with
// exact expected values (small integers, exactly representable and exactly summable; 8-bit floats are
// compared against the once-rounded exact sum), the f32 accumulation of 16-bit reductions, in-place
// and chunked (> max message count) paths, async twins, point-to-point patterns and split groups.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <thread>

#include "comm_test_util.h"

namespace loom {
namespace {

using testing_dist::all_dtypes;
using testing_dist::get_value;
using testing_dist::rounded;
using testing_dist::set_value;
using testing_dist::world;

// The value rank r contributes at element i: small integers, some negative (unsigned types shift).
double contribution(DType dt, int r, int64_t i) {
  const double v = double((i * 3 + r * 5) % 11) - 5;
  return dt == DType::kU16 ? v + 5 : v;
}

struct Buf {
  std::vector<char> bytes;
  TensorView t;
  Buf(DType dt, int64_t n) : bytes(size_t(std::max<int64_t>(n, 1)) * dtype_size(dt)) {
    t = TensorView(bytes.data(), dt, Shape{n});
  }
};

const int64_t kSizes[] = {1, 5, 217};

double reduce_expected(DType dt, ReduceOp op, int size, int64_t i) {
  double acc = contribution(dt, 0, i);
  for (int r = 1; r < size; ++r) {
    const double v = contribution(dt, r, i);
    acc = op == ReduceOp::kSum ? acc + v : op == ReduceOp::kMax ? std::max(acc, v) : std::min(acc, v);
  }
  return rounded(dt, acc);
}

class MpiComm : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(mpi_compiled_in());
    ASSERT_GE(world().size(), 2) << "run under mpirun -np 2, 4 or 8";
  }
  void TearDown() override { set_mpi_max_message_elements(0); }
};

TEST_F(MpiComm, WorldDescribesItself) {
  const Communicator& w = world();
  EXPECT_EQ(w.name(), "world");
  std::vector<int> iota(size_t(w.size()));
  std::iota(iota.begin(), iota.end(), 0);
  EXPECT_EQ(w.global_ranks(), iota);
  EXPECT_GE(w.rank(), 0);
  EXPECT_LT(w.rank(), w.size());
  // The rank is unique: the sum over ranks of rank is 0 + 1 + ... + (size - 1).
  EXPECT_EQ(w.all_reduce_scalar(w.rank()), w.size() * (w.size() - 1) / 2.0);
}

void check_all_reduce(const Communicator& c, bool async) {
  for (DType dt : all_dtypes())
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin})
      for (int64_t n : kSizes) {
        Buf b(dt, n);
        for (int64_t i = 0; i < n; ++i) set_value(b.t, i, contribution(dt, c.rank(), i));
        if (async) {
          auto w = c.all_reduce_async(b.t, op);
          w->wait();
          EXPECT_TRUE(w->done());
        } else {
          c.all_reduce(b.t, op);
        }
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(get_value(b.t, i), reduce_expected(dt, op, c.size(), i))
              << dtype_name(dt) << " op " << int(op) << " n " << n << " i " << i;
      }
}

TEST_F(MpiComm, AllReduceEveryDtypeAndOp) { check_all_reduce(world(), false); }
TEST_F(MpiComm, AllReduceAsyncEveryDtypeAndOp) { check_all_reduce(world(), true); }

TEST_F(MpiComm, AllReduceChunked) {
  set_mpi_max_message_elements(4);  // 217 elements go as 55 calls
  check_all_reduce(world(), false);
}

// 16-bit sums accumulate in f32 and round once: 256 + 1 + 1 + ... in bf16 (spacing 2 at 256) stays 256
// when every partial sum is rounded, but the once-rounded 256 + (size - 1) is 260 on 4 ranks, 264 on 8.
TEST_F(MpiComm, HalfPrecisionSumRoundsOnce) {
  const Communicator& w = world();
  for (DType dt : {DType::kBF16, DType::kF16}) {
    const double big = dt == DType::kBF16 ? 256 : 2048;  // f16 spacing is 2 at 2048
    Buf b(dt, 3);
    for (int64_t i = 0; i < 3; ++i) set_value(b.t, i, w.rank() == 0 ? big : 1);
    w.all_reduce(b.t);
    const double exact = big + (w.size() - 1);
    for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(get_value(b.t, i), rounded(dt, exact)) << dtype_name(dt);
    if (w.size() >= 4) {
      EXPECT_GT(get_value(b.t, 0), big) << dtype_name(dt) << ": rounded at every step";
    }
  }
}

TEST_F(MpiComm, AllReduceScalar) {
  const Communicator& w = world();
  const int n = w.size();
  EXPECT_EQ(w.all_reduce_scalar(0.5 * (w.rank() + 1)), 0.25 * n * (n + 1));
  EXPECT_EQ(w.all_reduce_scalar(w.rank() * 1.5, ReduceOp::kMax), (n - 1) * 1.5);
  EXPECT_EQ(w.all_reduce_scalar(-w.rank() - 2.0, ReduceOp::kMin), -(n - 1) - 2.0);
}

void check_broadcast(const Communicator& c) {
  for (DType dt : all_dtypes())
    for (int64_t n : kSizes)
      for (int root = 0; root < c.size(); ++root) {
        Buf b(dt, n);
        for (int64_t i = 0; i < n; ++i) set_value(b.t, i, contribution(dt, c.rank(), i));
        c.broadcast(b.t, root);
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(get_value(b.t, i), contribution(dt, root, i)) << dtype_name(dt) << " root " << root;
      }
}

TEST_F(MpiComm, BroadcastFromEveryRoot) { check_broadcast(world()); }
TEST_F(MpiComm, BroadcastChunked) {
  set_mpi_max_message_elements(8);
  check_broadcast(world());
}

// mode 0: separate buffers, 1: inp is this rank's slice of out (in place), 2: async.
void check_all_gather(const Communicator& c, int mode) {
  const int p = c.size();
  for (DType dt : all_dtypes())
    for (int64_t m : kSizes) {
      Buf out(dt, m * p), inp(dt, m);
      TensorView src = mode == 1 ? out.t.slice_flat(c.rank() * m, Shape{m}) : inp.t;
      for (int64_t i = 0; i < m; ++i) set_value(src, i, contribution(dt, c.rank(), i));
      if (mode == 2)
        c.all_gather_async(out.t, src)->wait();
      else
        c.all_gather(out.t, src);
      for (int r = 0; r < p; ++r)
        for (int64_t i = 0; i < m; ++i)
          ASSERT_EQ(get_value(out.t, r * m + i), contribution(dt, r, i))
              << dtype_name(dt) << " m " << m << " mode " << mode << " from rank " << r;
    }
}

TEST_F(MpiComm, AllGather) { check_all_gather(world(), 0); }
TEST_F(MpiComm, AllGatherInPlace) { check_all_gather(world(), 1); }
TEST_F(MpiComm, AllGatherAsync) { check_all_gather(world(), 2); }
TEST_F(MpiComm, AllGatherChunked) {
  set_mpi_max_message_elements(16);
  for (int mode : {0, 1, 2}) check_all_gather(world(), mode);
}

// mode 0: separate buffers, 1: out is this rank's slice of inp (aliasing), 2: async.
void check_reduce_scatter(const Communicator& c, int mode) {
  const int p = c.size();
  for (DType dt : all_dtypes())
    for (int64_t m : kSizes) {
      Buf out(dt, m), inp(dt, m * p);
      for (int64_t i = 0; i < m * p; ++i) set_value(inp.t, i, contribution(dt, c.rank(), i));
      TensorView dst = mode == 1 ? inp.t.slice_flat(c.rank() * m, Shape{m}) : out.t;
      if (mode == 2)
        c.reduce_scatter_async(dst, inp.t)->wait();
      else
        c.reduce_scatter(dst, inp.t);
      for (int64_t i = 0; i < m; ++i)
        ASSERT_EQ(get_value(dst, i), reduce_expected(dt, ReduceOp::kSum, p, c.rank() * m + i))
            << dtype_name(dt) << " m " << m << " mode " << mode << " i " << i;
    }
}

TEST_F(MpiComm, ReduceScatter) { check_reduce_scatter(world(), 0); }
TEST_F(MpiComm, ReduceScatterAliased) { check_reduce_scatter(world(), 1); }
TEST_F(MpiComm, ReduceScatterAsync) { check_reduce_scatter(world(), 2); }
TEST_F(MpiComm, ReduceScatterChunked) {
  set_mpi_max_message_elements(16);
  for (int mode : {0, 1, 2}) check_reduce_scatter(world(), mode);
}

TEST_F(MpiComm, CollectivesCheckSizesNamingTheGroup) {
  const Communicator& w = world();
  Buf out(DType::kF32, 3 * w.size() + 1), inp(DType::kF32, 3), bad(DType::kI32, 3);
  try {
    w.all_gather(out.t, inp.t);
    FAIL() << "all_gather accepted a wrong out size";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[all_gather] on group world (global ranks 0,1"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(w.reduce_scatter(inp.t, out.t), Error);  // n not divisible by the group size
  Buf out_ok(DType::kF32, 3 * w.size());
  EXPECT_THROW(w.all_gather(out_ok.t, bad.t), Error);  // dtypes differ
  EXPECT_THROW(w.broadcast(inp.t, w.size()), Error);
  EXPECT_THROW(w.send(inp.t, w.rank()), Error);
  EXPECT_THROW(w.recv(inp.t, -1), Error);
  TensorView on_gpu(inp.bytes.data(), DType::kF32, Shape{3}, Device{DeviceType::kCUDA, 0});
  EXPECT_THROW(w.all_reduce(on_gpu), Error);
}

TEST_F(MpiComm, BarrierWaitsForTheLastRank) {
  // The last rank arrives 300 ms late: every other rank must spend about that long in the barrier.
  const Communicator& w = world();
  w.barrier();
  const auto start = std::chrono::steady_clock::now();
  if (w.rank() == w.size() - 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  w.barrier();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(ms, 250.0);
}

// Ring: every rank sends to the next and receives from the previous, several messages in a row,
// which must arrive in order; every dtype and size.
void check_ring(const Communicator& c) {
  const int p = c.size(), next = (c.rank() + 1) % p, prev = (c.rank() + p - 1) % p;
  for (DType dt : all_dtypes())
    for (int64_t n : kSizes) {
      std::vector<Buf> out, in;
      std::vector<std::unique_ptr<Work>> sends;
      for (int k = 0; k < 3; ++k) {
        out.emplace_back(dt, n);
        in.emplace_back(dt, n);
      }
      for (int k = 0; k < 3; ++k) {
        for (int64_t i = 0; i < n; ++i) set_value(out[size_t(k)].t, i, contribution(dt, c.rank() + k, i));
        sends.push_back(c.send_async(out[size_t(k)].t, next));
      }
      for (int k = 0; k < 3; ++k) c.recv(in[size_t(k)].t, prev);
      for (auto& s : sends) s->wait();
      for (int k = 0; k < 3; ++k)
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(get_value(in[size_t(k)].t, i), contribution(dt, prev + k, i))
              << dtype_name(dt) << " n " << n << " message " << k;
    }
}

TEST_F(MpiComm, SendRecvRing) { check_ring(world()); }
TEST_F(MpiComm, SendRecvRingChunked) {
  set_mpi_max_message_elements(10);
  check_ring(world());
}

// Blocking pairs (even ranks send first, odd ranks receive first) and async receive posted early.
TEST_F(MpiComm, SendRecvPairs) {
  const Communicator& w = world();
  const int me = w.rank();
  const int peer = me ^ 1;
  if (peer >= w.size()) GTEST_SKIP();
  Buf a(DType::kI64, 217), b(DType::kI64, 217);
  for (int64_t i = 0; i < 217; ++i) set_value(a.t, i, double(me * 1000 + i));
  auto pending = w.recv_async(b.t, peer);
  if (me % 2 == 0) {
    w.send(a.t, peer);
  } else {
    w.send_async(a.t, peer)->wait();
  }
  pending->wait();
  for (int64_t i = 0; i < 217; ++i) ASSERT_EQ(get_value(b.t, i), double(peer * 1000 + i));
}

// Pairwise exchange in both directions as one operation (the pipeline's send-forward/recv-backward),
// large enough that blocking sends in the same order would not both go eagerly; and the ring shift
// with one half skipped at the ends.
TEST_F(MpiComm, SendRecvExchange) {
  const Communicator& w = world();
  const int me = w.rank(), p = w.size();
  const int peer = me ^ 1;
  if (peer < p) {
    const int64_t n = 1 << 18;  // 1 MiB of f32: beyond OpenMPI's eager limit
    Buf out(DType::kF32, n), in(DType::kF32, n);
    for (int64_t i = 0; i < n; i += 4099) set_value(out.t, i, double(me * 10 + (i % 7)));
    w.send_recv_async(out.t, peer, in.t, peer)->wait();
    for (int64_t i = 0; i < n; i += 4099) ASSERT_EQ(get_value(in.t, i), double(peer * 10 + (i % 7)));
  }
  // Chain: rank r sends to r + 1 and receives from r - 1; the first rank only sends, the last only receives.
  Buf out(DType::kI32, 5), in(DType::kI32, 5);
  for (int64_t i = 0; i < 5; ++i) set_value(out.t, i, double(me * 100 + i));
  auto work = w.send_recv_async(me + 1 < p ? out.t : TensorView(), me + 1, me > 0 ? in.t : TensorView(), me - 1);
  work->wait();
  EXPECT_TRUE(work->done());
  if (me > 0) {
    for (int64_t i = 0; i < 5; ++i) ASSERT_EQ(get_value(in.t, i), double((me - 1) * 100 + i));
  }
}

TEST_F(MpiComm, RecvOfAShorterMessageFails) {
  const Communicator& w = world();
  const int peer = w.rank() ^ 1;
  if (peer >= w.size()) {
    w.barrier();
    return;
  }
  Buf small(DType::kF32, 5), big(DType::kF32, 6);
  if (w.rank() % 2 == 0) {
    w.send(small.t, peer);
  } else {
    try {
      w.recv(big.t, peer);
      ADD_FAILURE() << "a 5-element message was accepted into 6 elements";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("the message had 5 elements where 6 were expected"), std::string::npos)
          << e.what();
    }
  }
  w.barrier();
}

// Several async operations in flight at once, completed in reverse order; done() polls.
TEST_F(MpiComm, ManyAsyncInFlight) {
  const Communicator& w = world();
  const int p = w.size();
  Buf x(DType::kF32, 217), y(DType::kBF16, 5), g_out(DType::kI32, 5 * p), g_in(DType::kI32, 5);
  Buf rs_out(DType::kF16, 5), rs_in(DType::kF16, 5 * p);
  for (int64_t i = 0; i < 217; ++i) set_value(x.t, i, contribution(DType::kF32, w.rank(), i));
  for (int64_t i = 0; i < 5; ++i) {
    set_value(y.t, i, contribution(DType::kBF16, w.rank(), i));
    set_value(g_in.t, i, contribution(DType::kI32, w.rank(), i));
  }
  for (int64_t i = 0; i < 5 * p; ++i) set_value(rs_in.t, i, contribution(DType::kF16, w.rank(), i));
  std::vector<std::unique_ptr<Work>> works;
  works.push_back(w.all_reduce_async(x.t, ReduceOp::kSum));
  works.push_back(w.all_reduce_async(y.t, ReduceOp::kMax));
  works.push_back(w.all_gather_async(g_out.t, g_in.t));
  works.push_back(w.reduce_scatter_async(rs_out.t, rs_in.t));
  while (!works.back()->done()) {
  }
  for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
  for (int64_t i = 0; i < 217; ++i) ASSERT_EQ(get_value(x.t, i), reduce_expected(DType::kF32, ReduceOp::kSum, p, i));
  for (int64_t i = 0; i < 5; ++i) {
    ASSERT_EQ(get_value(y.t, i), reduce_expected(DType::kBF16, ReduceOp::kMax, p, i));
    ASSERT_EQ(get_value(rs_out.t, i), reduce_expected(DType::kF16, ReduceOp::kSum, p, w.rank() * 5 + i));
  }
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < 5; ++i) ASSERT_EQ(get_value(g_out.t, r * 5 + i), contribution(DType::kI32, r, i));
  // A Work destroyed before wait() completes first (the buffer is final once the destructor ran).
  Buf z(DType::kF32, 5);
  for (int64_t i = 0; i < 5; ++i) set_value(z.t, i, 1);
  { auto dropped = w.all_reduce_async(z.t); }
  for (int64_t i = 0; i < 5; ++i) ASSERT_EQ(get_value(z.t, i), double(p));
}

// Split by parity with reversed keys: members ordered by descending world rank; rank 0 opts out of a
// second split and gets null.
TEST_F(MpiComm, SplitGroups) {
  const Communicator& w = world();
  const int me = w.rank(), p = w.size();
  auto half = w.split(me % 2, -me, "parity");
  ASSERT_TRUE(half);
  std::vector<int> expect;
  for (int r = p - 1; r >= 0; --r)
    if (r % 2 == me % 2) expect.push_back(r);
  EXPECT_EQ(half->global_ranks(), expect);
  EXPECT_EQ(half->name(), "parity");
  EXPECT_EQ(half->size(), int(expect.size()));
  EXPECT_EQ(expect[size_t(half->rank())], me);
  // A collective inside the group sums only its members.
  double members = 0;
  for (int r : expect) members += r;
  EXPECT_EQ(half->all_reduce_scalar(me), members);
  if (half->size() > 1) {
    check_all_reduce(*half, true);
    check_broadcast(*half);
    check_all_gather(*half, 0);
    check_reduce_scatter(*half, 1);
    check_ring(*half);
  }
  // Nested split of a split, and opting out.
  auto rest = w.split(me == 0 ? -1 : 0, me, "rest");
  if (me == 0) {
    EXPECT_EQ(rest, nullptr);
  } else {
    ASSERT_TRUE(rest);
    EXPECT_EQ(rest->size(), p - 1);
    EXPECT_EQ(rest->global_ranks().front(), 1);
    auto single = rest->split(rest->rank(), 0, "single");
    ASSERT_TRUE(single);
    EXPECT_EQ(single->size(), 1);
    EXPECT_EQ(single->global_ranks(), std::vector<int>{me});
    Buf b(DType::kF32, 5);
    for (int64_t i = 0; i < 5; ++i) set_value(b.t, i, 3);
    single->all_reduce(b.t);
    EXPECT_EQ(get_value(b.t, 4), 3.0);
  }
}

TEST_F(MpiComm, InitWorldAgainSharesTheOneMpiInit) {
  auto again = init_world(std::chrono::milliseconds(60000));
  EXPECT_EQ(again->size(), world().size());
  EXPECT_EQ(again->rank(), world().rank());
  EXPECT_EQ(again->all_reduce_scalar(1.0), double(world().size()));
}

}  // namespace
}  // namespace loom

// all_to_all and all_to_all_v over the MPI world (2, 4 or 8 ranks): every dtype, uneven per-peer row
// counts with zeros (a rank that sends nothing, ranks that receive nothing), multi-dimensional rows, the
// async twins with two exchanges in flight, the chunked path (a tiny message limit), the statistics
// entry, and argument errors raised on every rank before anything is posted. Each element carries its
// (sender, receiver, row, column) so a misplaced row is caught.
#include <gtest/gtest.h>

#include <numeric>

#include "comm_test_util.h"

namespace loom {
namespace {

using testing_dist::all_dtypes;
using testing_dist::get_value;
using testing_dist::rounded;
using testing_dist::set_value;
using testing_dist::world;

// A value that identifies (sender s, receiver d, row i, element j), kept exact in the narrow dtypes.
double tag(DType dt, int s, int d, int64_t i, int64_t j) {
  const int64_t v = 1000 * s + 100 * d + 10 * i + j;
  switch (dtype_size(dt)) {
    case 1: return double(v % 16);
    case 2: return double(v % 256);
    default: return double(v);
  }
}

// Rows sender s sends to receiver d under the named pattern.
int64_t rows_of(int pattern, int s, int d) {
  switch (pattern) {
    case 0: return (s + 2 * d + 1) % 4;  // uneven, with zeros
    case 1: return d == 0 ? s + 1 : 0;   // everything to rank 0: the others receive 0 rows
    case 2: return s == 1 ? 0 : 2;       // rank 1 sends nothing
    default: return 3;                   // equal
  }
}

struct Exchange {
  std::vector<int64_t> in_counts, out_counts;
  Tensor inp, out;
};

// This rank's tensors for `pattern`: rows of `row` shape (trailing dims), inp filled with tags.
Exchange make_exchange(const Communicator& c, int pattern, DType dt, Shape row) {
  const int me = c.rank(), n = c.size();
  Exchange x;
  for (int p = 0; p < n; ++p) {
    x.in_counts.push_back(rows_of(pattern, me, p));
    x.out_counts.push_back(rows_of(pattern, p, me));
  }
  const int64_t in_rows = std::accumulate(x.in_counts.begin(), x.in_counts.end(), int64_t(0));
  const int64_t out_rows = std::accumulate(x.out_counts.begin(), x.out_counts.end(), int64_t(0));
  auto shape = [&](int64_t rows) {
    std::vector<int64_t> d{rows};
    for (int i = 0; i < row.ndim(); ++i) d.push_back(row[i]);
    return Shape(std::span<const int64_t>(d));
  };
  x.inp = Tensor::zeros(shape(in_rows), dt);
  x.out = Tensor::zeros(shape(out_rows), dt);
  const int64_t re = row.numel();
  int64_t r = 0;
  for (int p = 0; p < n; ++p)
    for (int64_t i = 0; i < x.in_counts[size_t(p)]; ++i, ++r)
      for (int64_t j = 0; j < re; ++j) set_value(x.inp.view(), r * re + j, tag(dt, me, p, i, j));
  return x;
}

void expect_received(const Communicator& c, const Exchange& x, DType dt) {
  const int me = c.rank();
  const int64_t re = x.out.numel() / std::max<int64_t>(1, x.out.shape()[0]);
  int64_t r = 0;
  for (int p = 0; p < c.size(); ++p)
    for (int64_t i = 0; i < x.out_counts[size_t(p)]; ++i, ++r)
      for (int64_t j = 0; j < re; ++j)
        ASSERT_EQ(get_value(x.out.view(), r * re + j), rounded(dt, tag(dt, p, me, i, j)))
            << dtype_name(dt) << " from rank " << p << " row " << i << " element " << j;
}

TEST(MpiAllToAll, VariableCountsEveryDtype) {
  const Communicator& w = world();
  for (DType dt : all_dtypes())
    for (int pattern = 0; pattern < 4; ++pattern) {
      SCOPED_TRACE(testing::Message() << dtype_name(dt) << " pattern " << pattern);
      Exchange x = make_exchange(w, pattern, dt, Shape{3});
      w.all_to_all_v(x.out.view(), x.out_counts, x.inp.view(), x.in_counts);
      expect_received(w, x, dt);
    }
}

TEST(MpiAllToAll, MultiDimensionalRowsAndSubGroups) {
  const Communicator& w = world();
  // Two interleaved halves when the world is even: an all-to-all on each, at the same time.
  auto half = w.split(w.rank() % 2, w.rank(), "a2a-half");
  for (const Communicator* c : {&w, static_cast<const Communicator*>(half.get())}) {
    Exchange x = make_exchange(*c, 0, DType::kF32, Shape{2, 3});
    c->all_to_all_v(x.out.view(), x.out_counts, x.inp.view(), x.in_counts);
    expect_received(*c, x, DType::kF32);
  }
}

TEST(MpiAllToAll, EqualSplits) {
  const Communicator& w = world();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kI64, DType::kF8E4M3}) {
    SCOPED_TRACE(dtype_name(dt));
    Exchange x = make_exchange(w, 3, dt, Shape{5});
    w.all_to_all(x.out.view(), x.inp.view());
    expect_received(w, x, dt);
    Exchange y = make_exchange(w, 3, dt, Shape{5});
    w.all_to_all_async(y.out.view(), y.inp.view())->wait();
    expect_received(w, y, dt);
  }
  // Zero rows per peer is a valid (empty) exchange.
  Tensor a = Tensor::zeros(Shape{0, 4}, DType::kF32), b = Tensor::zeros(Shape{0, 4}, DType::kF32);
  w.all_to_all(b.view(), a.view());
}

TEST(MpiAllToAll, AsyncTwoInFlight) {
  const Communicator& w = world();
  Exchange x = make_exchange(w, 0, DType::kBF16, Shape{4});
  Exchange y = make_exchange(w, 2, DType::kI32, Shape{1});
  auto wx = w.all_to_all_v_async(x.out.view(), x.out_counts, x.inp.view(), x.in_counts);
  auto wy = w.all_to_all_v_async(y.out.view(), y.out_counts, y.inp.view(), y.in_counts);
  wy->wait();
  while (!wx->done()) {
  }
  expect_received(w, x, DType::kBF16);
  expect_received(w, y, DType::kI32);
}

TEST(MpiAllToAll, ChunkedWhenMessagesExceedTheLimit) {
  const Communicator& w = world();
  set_mpi_max_message_elements(2);  // every per-peer run of rows goes as several messages
  Exchange x = make_exchange(w, 0, DType::kF32, Shape{3});
  w.all_to_all_v(x.out.view(), x.out_counts, x.inp.view(), x.in_counts);
  Exchange y = make_exchange(w, 3, DType::kF16, Shape{2});  // equal splits: too large for one MPI_Ialltoall
  w.all_to_all(y.out.view(), y.inp.view());
  set_mpi_max_message_elements(0);
  expect_received(w, x, DType::kF32);
  expect_received(w, y, DType::kF16);
}

TEST(MpiAllToAll, CountsBytesUnderAllToAll) {
  const Communicator& w = world();
  auto g = w.split(0, w.rank(), "a2a-stats");
  reset_comm_stats();
  Exchange x = make_exchange(*g, 0, DType::kF32, Shape{3});
  g->all_to_all_v(x.out.view(), x.out_counts, x.inp.view(), x.in_counts);
  Exchange y = make_exchange(*g, 3, DType::kBF16, Shape{2});
  g->all_to_all_async(y.out.view(), y.inp.view())->wait();
  int64_t calls = 0, bytes = 0;
  for (const CommStat& s : comm_stats())
    if (s.group == "a2a-stats") {
      EXPECT_EQ(s.op, "all_to_all");
      calls += s.calls;
      bytes += s.bytes;
    }
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(bytes, x.inp.view().nbytes() + y.inp.view().nbytes());
}

TEST(MpiAllToAll, BadArgumentsFailOnEveryRankBeforePosting) {
  const Communicator& w = world();
  const int n = w.size(), me = w.rank();
  auto message = [&](auto call) -> std::string {
    try {
      call();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  };
  Tensor inp = Tensor::zeros(Shape{int64_t(n), 2}, DType::kF32), out = Tensor::zeros(Shape{int64_t(n), 2}, DType::kF32);
  std::vector<int64_t> ones(size_t(n), 1);
  std::string m = message([&] { w.all_to_all_v(out.view(), ones, inp.view(), std::vector<int64_t>(size_t(n + 1), 1)); });
  EXPECT_NE(m.find("in_counts has " + std::to_string(n + 1) + " entries"), std::string::npos) << m;
  std::vector<int64_t> more = ones;
  more[0] = 2;
  m = message([&] { w.all_to_all_v(out.view(), more, inp.view(), ones); });
  EXPECT_NE(m.find("out_counts sum to " + std::to_string(n + 1) + " rows"), std::string::npos) << m;
  std::vector<int64_t> self_mismatch = ones, self_mismatch_out = ones;
  self_mismatch[size_t(me)] = 2;
  self_mismatch[size_t((me + 1) % n)] = 0;
  if (n > 1) {
    m = message([&] { w.all_to_all_v(out.view(), self_mismatch_out, inp.view(), self_mismatch); });
    EXPECT_NE(m.find("sends itself 2 rows"), std::string::npos) << m;
  }
  Tensor odd = Tensor::zeros(Shape{int64_t(n), 3}, DType::kF32);
  m = message([&] { w.all_to_all_v(odd.view(), ones, inp.view(), ones); });
  EXPECT_NE(m.find("trailing shape"), std::string::npos) << m;
  m = message([&] { w.all_to_all_v(inp.view(), ones, inp.view(), ones); });
  EXPECT_NE(m.find("overlap"), std::string::npos) << m;
  Tensor ragged = Tensor::zeros(Shape{int64_t(n) + 1, 2}, DType::kF32);
  Tensor ragged_out = Tensor::zeros(Shape{int64_t(n) + 1, 2}, DType::kF32);
  if (n > 1) {
    m = message([&] { w.all_to_all(ragged_out.view(), ragged.view()); });
    EXPECT_NE(m.find("equal chunks"), std::string::npos) << m;
  }
  // Nothing was posted: the ranks still agree.
  EXPECT_EQ(w.all_reduce_scalar(1.0), double(n));
}

}  // namespace
}  // namespace loom

// NCCL communicator under mpirun, one GPU per rank: the same exact-value checks as the MPI tests on
// device tensors (f32 and bf16 sums of small integers, all_gather, reduce_scatter, broadcast, a paired
// exchange, async twins, split, all-to-all with uneven and zero counts). Skipped when the build has no NCCL or there are fewer GPUs than ranks
// (NCCL refuses two ranks of one communicator on the same GPU).
#include <gtest/gtest.h>

#include "comm_test_util.h"

#ifdef LOOM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace loom {
namespace {

using testing_dist::world;

#ifdef LOOM_HAVE_CUDA
// A device buffer of n floats with host mirrors for setting and checking.
struct DeviceF32 {
  float* d = nullptr;
  int64_t n;
  explicit DeviceF32(int64_t n_) : n(n_) { EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), size_t(n) * 4), cudaSuccess); }
  ~DeviceF32() { cudaFree(d); }
  TensorView view() const { return TensorView(d, DType::kF32, Shape{n}, Device{DeviceType::kCUDA, device()}); }
  void set(const std::vector<float>& h) { cudaMemcpy(d, h.data(), size_t(n) * 4, cudaMemcpyHostToDevice); }
  std::vector<float> get() const {
    cudaDeviceSynchronize();
    std::vector<float> h(static_cast<size_t>(n));
    cudaMemcpy(h.data(), d, size_t(n) * 4, cudaMemcpyDeviceToHost);
    return h;
  }
  static int device() {
    int dev = 0;
    cudaGetDevice(&dev);
    return dev;
  }
};
#endif

class NcclComm : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!nccl_compiled_in()) GTEST_SKIP() << "no NCCL in this build";
#ifdef LOOM_HAVE_CUDA
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count < world().size())
      GTEST_SKIP() << "needs one GPU per rank (" << count << " GPUs for " << world().size() << " ranks)";
    ASSERT_EQ(cudaSetDevice(world().rank()), cudaSuccess);
#endif
  }
};

TEST_F(NcclComm, CollectivesOnDeviceTensors) {
#ifdef LOOM_HAVE_CUDA
  const Communicator& w = world();
  const int me = w.rank(), p = w.size();
  auto nccl = make_nccl_communicator(w);
  EXPECT_EQ(nccl->size(), p);
  EXPECT_EQ(nccl->global_ranks(), w.global_ranks());
  const int64_t m = 217;
  auto value = [](int r, int64_t i) { return float((i * 3 + r * 5) % 11) - 5.0f; };

  DeviceF32 x(m);
  std::vector<float> h(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) h[size_t(i)] = value(me, i);
  x.set(h);
  nccl->all_reduce(x.view());
  auto got = x.get();
  for (int64_t i = 0; i < m; ++i) {
    float want = 0;
    for (int r = 0; r < p; ++r) want += value(r, i);
    ASSERT_EQ(got[size_t(i)], want) << i;
  }

  // Async max on the side stream, then wait orders the main stream after it.
  x.set(h);
  auto work = nccl->all_reduce_async(x.view(), ReduceOp::kMax);
  work->wait();
  got = x.get();
  for (int64_t i = 0; i < m; ++i) {
    float want = value(0, i);
    for (int r = 1; r < p; ++r) want = std::max(want, value(r, i));
    ASSERT_EQ(got[size_t(i)], want);
  }

  DeviceF32 gathered(m * p);
  x.set(h);
  nccl->all_gather(gathered.view(), x.view());
  got = gathered.get();
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < m; ++i) ASSERT_EQ(got[size_t(r * m + i)], value(r, i));

  DeviceF32 full(m * p), part(m);
  std::vector<float> hf(static_cast<size_t>(m * p));
  for (int64_t i = 0; i < m * p; ++i) hf[size_t(i)] = value(me, i);
  full.set(hf);
  nccl->reduce_scatter_async(part.view(), full.view())->wait();
  got = part.get();
  for (int64_t i = 0; i < m; ++i) {
    float want = 0;
    for (int r = 0; r < p; ++r) want += value(r, me * m + i);
    ASSERT_EQ(got[size_t(i)], want);
  }

  x.set(h);
  nccl->broadcast(x.view(), p - 1);
  got = x.get();
  for (int64_t i = 0; i < m; ++i) ASSERT_EQ(got[size_t(i)], value(p - 1, i));

  // Paired exchange with the neighbour (both ranks send first: would deadlock unpaired).
  const int peer = me ^ 1;
  if (peer < p) {
    DeviceF32 in(m);
    x.set(h);
    nccl->send_recv_async(x.view(), peer, in.view(), peer)->wait();
    got = in.get();
    for (int64_t i = 0; i < m; ++i) ASSERT_EQ(got[size_t(i)], value(peer, i));
  }

  auto half = nccl->split(me % 2, me, "parity");
  ASSERT_TRUE(half);
  x.set(h);
  half->all_reduce(x.view());
  got = x.get();
  for (int64_t i = 0; i < m; ++i) {
    float want = 0;
    for (int r = me % 2; r < p; r += 2) want += value(r, i);
    ASSERT_EQ(got[size_t(i)], want);
  }
  nccl->barrier();
  EXPECT_EQ(nccl->all_reduce_scalar(1.0), double(p));
#endif
}

// Rank s sends (s + 2d + 1) % 4 rows of 3 to rank d (zeros included), then an equal split on the side
// stream; each element carries (sender, receiver, row, column).
TEST_F(NcclComm, AllToAllOnDeviceTensors) {
#ifdef LOOM_HAVE_CUDA
  const Communicator& w = world();
  const int me = w.rank(), p = w.size();
  auto nccl = make_nccl_communicator(w);
  auto rows = [](int s, int d) { return int64_t((s + 2 * d + 1) % 4); };
  auto value = [](int s, int d, int64_t i, int64_t j) { return float(1000 * s + 100 * d + 10 * i + j); };
  std::vector<int64_t> in_counts, out_counts;
  int64_t in_rows = 0, out_rows = 0;
  for (int d = 0; d < p; ++d) {
    in_counts.push_back(rows(me, d));
    out_counts.push_back(rows(d, me));
    in_rows += in_counts.back();
    out_rows += out_counts.back();
  }
  DeviceF32 inp(std::max<int64_t>(1, in_rows * 3)), out(std::max<int64_t>(1, out_rows * 3));
  std::vector<float> h(size_t(inp.n));
  int64_t r = 0;
  for (int d = 0; d < p; ++d)
    for (int64_t i = 0; i < in_counts[size_t(d)]; ++i, ++r)
      for (int64_t j = 0; j < 3; ++j) h[size_t(r * 3 + j)] = value(me, d, i, j);
  inp.set(h);
  const Device dev{DeviceType::kCUDA, DeviceF32::device()};
  nccl->all_to_all_v(TensorView(out.d, DType::kF32, Shape{out_rows, 3}, dev), out_counts,
                     TensorView(inp.d, DType::kF32, Shape{in_rows, 3}, dev), in_counts);
  auto got = out.get();
  r = 0;
  for (int s = 0; s < p; ++s)
    for (int64_t i = 0; i < out_counts[size_t(s)]; ++i, ++r)
      for (int64_t j = 0; j < 3; ++j) ASSERT_EQ(got[size_t(r * 3 + j)], value(s, me, i, j)) << s << " " << i;

  const int64_t m = 5;  // rows per peer
  DeviceF32 a(m * p * 2), b(m * p * 2);
  std::vector<float> ha(size_t(a.n));
  for (int d = 0; d < p; ++d)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < 2; ++j) ha[size_t((d * m + i) * 2 + j)] = value(me, d, i, j);
  a.set(ha);
  nccl->all_to_all_async(TensorView(b.d, DType::kF32, Shape{m * p, 2}, dev), TensorView(a.d, DType::kF32, Shape{m * p, 2}, dev))
      ->wait();
  got = b.get();
  for (int s = 0; s < p; ++s)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < 2; ++j) ASSERT_EQ(got[size_t((s * m + i) * 2 + j)], value(s, me, i, j));
#endif
}

}  // namespace
}  // namespace loom

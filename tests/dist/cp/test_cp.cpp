// Context-parallel attention (loom/parallel/context_parallel.h) against the single-process attention on the
// whole sequence: every rank builds the same random qkv / dout for the full sequence, computes the reference
// attention_forward/backward, slices its two chunks (cp_slice_sequence), runs the ring forward and backward,
// and compares its out, lse and dqkv with its slice of the reference (f32 1e-5; bf16 looser), with and
// without a sliding window, with document segments and with attention dropout (global mask indices).
// CpSim* run the ranks as threads over an in-process communicator (thread_group.h), so they need no MPI;
// CpMpi* run under mpirun (np 2 and 4; with 4 ranks also two CP groups of 2 from world.split) and skip
// when started as a single process.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dist/cp/thread_group.h"
#include "loom/backend/device_context.h"
#include "loom/dist/communicator.h"
#include "loom/parallel/context_parallel.h"

namespace loom {
namespace {

struct CpCase {
  int64_t B = 2, T = 16, NH = 4, NKV = 2, HS = 8, window = -1;
  DType dtype = DType::kF32;
  float dropout_p = 0;
  bool segments = false;
  int64_t qkv_cols() const { return NKV * (NH / NKV + 2) * HS; }
  AttentionParams params() const {
    AttentionParams p;
    p.num_heads = NH;
    p.num_kv_heads = NKV;
    p.head_dim = HS;
    p.softmax_scale = 1.0f / std::sqrt(float(HS));
    p.window = window;
    p.dropout_p = dropout_p;
    p.dropout_seed = 77;
    p.dropout_stream = 3;
    return p;
  }
  std::string name() const {
    return "T" + std::to_string(T) + "_W" + std::to_string(window) + "_" + dtype_name(dtype) +
           (dropout_p > 0 ? "_dropout" : "") + (segments ? "_segments" : "");
  }
};

Tensor random_tensor(const DeviceContext& ctx, Shape s, DType dt, uint32_t seed) {
  Tensor f = Tensor::empty(s, DType::kF32);
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int64_t i = 0; i < f.numel(); ++i) f.data<float>()[i] = dist(gen);
  if (dt == DType::kF32) return f;
  Tensor t = ctx.empty(s, dt);
  ctx.ops().cast(t, f);
  return t;
}

std::vector<double> to_f64(const DeviceContext& ctx, TensorView t) {
  Tensor f = Tensor::empty(t.shape(), DType::kF32);
  ctx.ops().cast(f, t);
  return std::vector<double>(f.data<float>(), f.data<float>() + f.numel());
}

void expect_near(const std::vector<double>& got, const std::vector<double>& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 5; ++i) {
    if (std::isinf(want[i]) && got[i] == want[i]) continue;
    if (!(std::abs(got[i] - want[i]) <= tol + tol * std::abs(want[i]))) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
      ++bad;
    }
  }
}

// This rank's ring run against its slice of the whole-sequence reference.
void check_rank(const Communicator& cp, const CpCase& c) {
  SCOPED_TRACE(c.name() + " cp" + std::to_string(cp.size()) + " rank " + std::to_string(cp.rank()));
  const auto ctx = make_cpu_context();
  const OpTable& ops = ctx->ops();
  const int n = cp.size(), r = cp.rank();
  const int64_t Tl = c.T / n;
  const AttentionParams p = c.params();
  const Tensor qkv = random_tensor(*ctx, Shape{c.B, c.T, c.qkv_cols()}, c.dtype, 101);
  const Tensor dout = random_tensor(*ctx, Shape{c.B, c.T, c.NH * c.HS}, c.dtype, 202);
  Tensor seg;
  if (c.segments) {
    seg = Tensor::empty(Shape{c.B, c.T}, DType::kI32);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t t = 0; t < c.T; ++t) seg.data<int32_t>()[b * c.T + t] = int32_t(t < 3 + 5 * b ? 0 : t < 13 ? 1 : 2);
  }
  Tensor out = ctx->empty(Shape{c.B, c.T, c.NH * c.HS}, c.dtype), lse = ctx->empty(Shape{c.B, c.NH, c.T}, DType::kF32);
  Tensor dqkv = ctx->empty(qkv.shape(), c.dtype);
  ops.attention_forward(out, lse, qkv, p, seg);
  ops.attention_backward(dqkv, dout, qkv, out, lse, p, seg);

  Tensor qkv_l = ctx->empty(Shape{c.B, Tl, c.qkv_cols()}, c.dtype), dout_l = ctx->empty(Shape{c.B, Tl, c.NH * c.HS}, c.dtype);
  cp_slice_sequence(*ctx, qkv_l, qkv, n, r);
  cp_slice_sequence(*ctx, dout_l, dout, n, r);
  Tensor seg_l;
  if (c.segments) {
    seg_l = ctx->empty(Shape{c.B, Tl}, DType::kI32);
    cp_slice_sequence(*ctx, seg_l, seg, n, r);
  }
  Tensor out_l = ctx->empty(dout_l.shape(), c.dtype), lse_l = ctx->empty(Shape{c.B, c.NH, Tl}, DType::kF32);
  Tensor dqkv_l = ctx->empty(qkv_l.shape(), c.dtype);
  ContextParallelAttention::forward(*ctx, out_l, lse_l, qkv_l, p, cp, seg_l);
  ContextParallelAttention::backward(*ctx, dqkv_l, dout_l, qkv_l, out_l, lse_l, p, cp, seg_l);

  Tensor out_want = ctx->empty(out_l.shape(), c.dtype), dqkv_want = ctx->empty(dqkv_l.shape(), c.dtype);
  cp_slice_sequence(*ctx, out_want, out, n, r);
  cp_slice_sequence(*ctx, dqkv_want, dqkv, n, r);
  const std::vector<int32_t> pos = cp_local_positions(c.T, n, r);
  std::vector<double> lse_want;
  for (int64_t bh = 0; bh < c.B * c.NH; ++bh)
    for (int32_t t : pos) lse_want.push_back(lse.data<float>()[bh * c.T + t]);
  const bool f32 = c.dtype == DType::kF32;
  expect_near(to_f64(*ctx, out_l), to_f64(*ctx, out_want), f32 ? 1e-5 : 2e-2, "out");
  expect_near(to_f64(*ctx, lse_l), lse_want, f32 ? 1e-5 : 1e-3, "lse");
  expect_near(to_f64(*ctx, dqkv_l), to_f64(*ctx, dqkv_want), f32 ? 1e-5 : 5e-2, "dqkv");
}

std::vector<CpCase> cases(int cp) {
  std::vector<CpCase> v;
  const int64_t T = cp == 3 ? 24 : 16;
  v.push_back(CpCase{2, T, 4, 2, 8, -1});
  v.push_back(CpCase{2, cp == 4 ? 32 : 24, 4, 2, 8, 5});
  CpCase bf{2, T, 4, 2, 8, -1};
  bf.dtype = DType::kBF16;
  v.push_back(bf);
  bf.window = 3;
  v.push_back(bf);
  CpCase drop{2, T, 4, 2, 8, -1};
  drop.dropout_p = 0.2f;
  v.push_back(drop);
  CpCase seg{2, T, 4, 2, 8, 6};
  seg.segments = true;
  v.push_back(seg);
  return v;
}

// ---- ranks as threads -----------------------------------------------------------------------------

void run_threads(int n, const CpCase& c) {
  test::ThreadGroup group(n);
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        test::ThreadComm comm(group, r);
        check_rank(comm, c);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[size_t(r)], "") << c.name() << " rank " << r;
}

TEST(CpSim, RingEqualsFullSequence) {
  for (int n : {2, 3, 4})
    for (const CpCase& c : cases(n)) run_threads(n, c);
}

TEST(CpSim, SingleRankIsTheFusedOp) {
  const auto self = make_self_communicator("context-parallel");
  check_rank(*self, CpCase{2, 16, 4, 2, 8, 5});
}

TEST(CpSim, LayoutHelpers) {
  EXPECT_EQ(cp_local_positions(16, 2, 0), (std::vector<int32_t>{0, 1, 2, 3, 12, 13, 14, 15}));
  EXPECT_EQ(cp_local_positions(16, 2, 1), (std::vector<int32_t>{4, 5, 6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(cp_local_positions(12, 3, 2), (std::vector<int32_t>{4, 5, 6, 7}));
  EXPECT_THROW(cp_local_positions(10, 2, 0), UserError);
  // Slicing then unslicing every rank's part rebuilds the tensor (each token lands in exactly one rank).
  const auto ctx = make_cpu_context();
  Tensor full = Tensor::empty(Shape{2, 12, 3}, DType::kI32), back = Tensor::zeros(Shape{2, 12, 3}, DType::kI32);
  for (int64_t i = 0; i < full.numel(); ++i) full.data<int32_t>()[i] = int32_t(i + 1);
  for (int r = 0; r < 3; ++r) {
    Tensor part = Tensor::empty(Shape{2, 4, 3}, DType::kI32);
    cp_slice_sequence(*ctx, part, full, 3, r);
    const std::vector<int32_t> pos = cp_local_positions(12, 3, r);
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t t = 0; t < 4; ++t)
        EXPECT_EQ(part.data<int32_t>()[(b * 4 + t) * 3], full.data<int32_t>()[(b * 12 + pos[size_t(t)]) * 3]);
    cp_unslice_sequence(*ctx, back, part, 3, r);
  }
  EXPECT_EQ(std::memcmp(full.raw(), back.raw(), size_t(full.nbytes())), 0);
}

// ---- MPI ranks ------------------------------------------------------------------------------------

const Communicator& world() {
  static const std::unique_ptr<Communicator> w = init_world(std::chrono::minutes(2));
  return *w;
}

TEST(CpMpi, RingEqualsFullSequence) {
  if (world().size() == 1) GTEST_SKIP() << "not started by mpirun";
  for (const CpCase& c : cases(world().size())) check_rank(world(), c);
}

TEST(CpMpi, TwoGroupsOfTwo) {
  if (world().size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const auto cp = world().split(world().rank() / 2, world().rank(), "context-parallel");
  for (const CpCase& c : cases(2)) check_rank(*cp, c);
}

}  // namespace
}  // namespace loom

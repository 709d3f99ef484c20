// CPU attention core (attention_forward / attention_backward) against a naive f64 reference that
// materialises the T x T scores, on odd shapes (T and HS in {1, 5, 217} x {1, 5, 64}) for MHA, GQA and
// MQA, with and without a sliding window; plus finite differences of sum(out * R), bit-identical results
// across OpenMP thread counts, and argument checks.
// Tolerance: f32 kernel vs f64 reference, max abs error <= 1e-5 * max |reference| per tensor.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_test_util.h"
#include "backend/cpu/cpu_ops.h"

namespace loom::cpu {
namespace {

using namespace attn_test;

// ---- the shape sweep: {MHA, GQA, MQA} x window {unlimited, 3} x T x HS x B ----------------------------

struct Heads {
  int64_t NH, NKV;
};

class AttentionSweep : public ::testing::TestWithParam<std::tuple<Heads, int64_t, int64_t, int64_t, int64_t>> {};

TEST_P(AttentionSweep, MatchesF64Reference) {
  const auto [heads, window, T, HS, B] = GetParam();
  const Case c{B, T, heads.NH, heads.NKV, HS, window};
  expect_matches_reference(c, uint32_t(T * 131 + HS * 7 + B + heads.NH * 1000 + heads.NKV * 10000));
}

std::string sweep_name(const ::testing::TestParamInfo<AttentionSweep::ParamType>& info) {
  const auto& [heads, window, T, HS, B] = info.param;
  return Case{B, T, heads.NH, heads.NKV, HS, window}.name();
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionSweep,
                         ::testing::Combine(::testing::Values(Heads{3, 3}, Heads{6, 2}, Heads{3, 1}),
                                            ::testing::Values(int64_t(-1), int64_t(3)),
                                            ::testing::Values(int64_t(1), int64_t(5), int64_t(217)),
                                            ::testing::Values(int64_t(1), int64_t(5), int64_t(64)),
                                            ::testing::Values(int64_t(1), int64_t(2))),
                         sweep_name);

// Block edges and column chunking: T at and around the 64-row block, windows that cross block edges,
// window 1 (each query sees only itself), head sizes that need several / partial column chunks,
// non-causal attention, and a long windowed sequence.
TEST(CpuAttention, BlockEdgesWindowsAndHeadSizes) {
  const Case cases[] = {
      {1, 64, 2, 2, 16, -1},  {1, 65, 2, 1, 16, -1}, {1, 128, 2, 2, 32, 64}, {2, 200, 4, 2, 8, 70},
      {1, 150, 2, 2, 5, 1},   {1, 100, 2, 1, 128, -1}, {1, 97, 2, 2, 80, 33}, {1, 90, 2, 2, 17, 200},
      {2, 217, 3, 3, 64, -1, false}, {1, 70, 4, 2, 5, -1, false},
      {1, 3000, 2, 1, 16, 100},  // long sequence: the window's key range slides over many blocks
  };
  uint32_t seed = 7;
  for (const Case& c : cases) expect_matches_reference(c, seed++);
}

// Large score magnitudes: the online softmax must rescale without overflow (scores up to ~100).
TEST(CpuAttention, LargeScoresStayFinite) {
  const Case c{1, 150, 2, 1, 64, -1};
  auto qkv = randn(c.B * c.T * c.qkv_cols(), 99);
  for (auto& x : qkv) x *= 4.0f;
  auto dout = randn(c.B * c.T * c.NH * c.HS, 100);
  const Outputs got = run_op(c, qkv, dout);
  const Reference want = reference(c, qkv, dout);
  EXPECT_LE(rel_error(got.out, want.out), 1e-5);
  EXPECT_LE(rel_error(got.lse, want.lse), 1e-5);
  EXPECT_LE(rel_error(got.dqkv, want.dqkv), 2e-5);  // P is nearly one-hot: dS amplifies f32 rounding (seen 5e-6)
}

// d/dx sum(out * R) by central differences of the f32 op itself, against attention_backward with dout = R,
// at entries of a query, key and value head in each group.
TEST(CpuAttention, FiniteDifferences) {
  const Case c{2, 9, 4, 2, 5, 4};
  auto qkv = randn(c.B * c.T * c.qkv_cols(), 5);
  auto r = randn(c.B * c.T * c.NH * c.HS, 6);
  const Outputs base = run_op(c, qkv, r);
  const int64_t HS = c.HS;
  // (b, t, column): q head 1 (group 0), k of group 0, v of group 0, q head 2 (group 1), k and v of group 1.
  const std::vector<Probe> probes = {{0, 3, 1 * HS + 2}, {0, 1, 2 * HS + 0}, {1, 5, 3 * HS + 4}, {1, 8, 4 * HS + 1},
                                     {0, 6, 6 * HS + 3}, {1, 2, 7 * HS + 2}, {0, 0, 6 * HS + 1}, {1, 7, 5 * HS + 0}};
  EXPECT_GE(expect_gradient_matches_finite_differences(c, qkv, r, {}, base.dqkv, probes), 6);
}

// Same inputs, 1, 2 and 3 threads (and a repeat): every output bit-identical.
TEST(CpuAttention, BitIdenticalAcrossThreadCounts) {
  for (const Case& c : {Case{2, 217, 6, 2, 64, -1}, Case{3, 130, 4, 4, 5, 50}, Case{1, 100, 3, 1, 64, -1}}) {
    SCOPED_TRACE(c.name());
    auto qkv = randn(c.B * c.T * c.qkv_cols(), 11);
    auto dout = randn(c.B * c.T * c.NH * c.HS, 12);
    expect_bit_identical_across_threads(c, qkv, dout);
  }
}

TEST(CpuAttention, RejectsInconsistentArguments) {
  CpuOps ops;
  const Case c{1, 5, 4, 2, 8, -1};  // T != NH, so a transposed lse shape differs
  std::vector<float> qkv(size_t(c.B * c.T * c.qkv_cols())), out(size_t(c.B * c.T * c.NH * c.HS)),
      lse(size_t(c.B * c.NH * c.T));
  TensorView tqkv(qkv.data(), DType::kF32, Shape{c.B, c.T, c.qkv_cols()});
  TensorView tout(out.data(), DType::kF32, Shape{c.B, c.T, c.NH * c.HS});
  TensorView tlse(lse.data(), DType::kF32, Shape{c.B, c.NH, c.T});
  EXPECT_NO_THROW(ops.attention_forward(tout, tlse, tqkv, c.params()));
  AttentionParams p = c.params();
  p.num_kv_heads = 3;  // 4 % 3 != 0
  EXPECT_THROW(ops.attention_forward(tout, tlse, tqkv, p), Error);
  p = c.params();
  p.num_kv_heads = 4;  // qkv would need 4 * 3 * 8 columns
  EXPECT_THROW(ops.attention_forward(tout, tlse, tqkv, p), Error);
  p = c.params();
  p.window = 0;
  EXPECT_THROW(ops.attention_forward(tout, tlse, tqkv, p), Error);
  p = c.params();
  p.window = 3;
  p.causal = false;  // a window is defined for causal attention only
  EXPECT_THROW(ops.attention_forward(tout, tlse, tqkv, p), Error);
  TensorView bad_lse(lse.data(), DType::kF32, Shape{c.B, c.T, c.NH});
  EXPECT_THROW(ops.attention_forward(tout, bad_lse, tqkv, c.params()), Error);
  EXPECT_THROW(ops.attention_backward(tqkv, tout, tqkv, tout, bad_lse, c.params()), Error);
}

}  // namespace
}  // namespace loom::cpu

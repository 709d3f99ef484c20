// CPU attention core with document segments (segment_ids, Megatron's --reset-attention-mask): key j is
// visible to query i only when both are in the same segment, on top of the causal/window rule.
// Checked against a naive f64 reference that applies the full mask from its definition, on odd shapes
// (T in {1, 5, 217}, head sizes 5 and 64) for MHA, GQA and MQA, with and without a sliding window and
// non-causal, with random segment boundaries that include one-token segments, boundaries at the 64-row
// block edges (63/64/65) and non-consecutive ids; plus finite differences, bit-identical results across
// thread counts, bit-identical results for one segment per row versus no segment_ids, isolation between
// documents (changing one document leaves the others' bits alone) and argument checks.
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

// Segment ids (B, T) with a boundary before every position in `cuts` (when < T) and, elsewhere, before a
// position with probability 1/mean_len. Ids start at an arbitrary value and step by 1 or 3 (only equality
// matters, not consecutiveness).
std::vector<int32_t> make_segments(int64_t B, int64_t T, const std::vector<int64_t>& cuts, int64_t mean_len,
                                   uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> ids(size_t(B * T));
  for (int64_t b = 0; b < B; ++b) {
    int32_t id = int32_t(gen() % 5) - 2;
    for (int64_t t = 0; t < T; ++t) {
      const bool cut = t > 0 && (std::count(cuts.begin(), cuts.end(), t) > 0 ||
                                 (mean_len > 0 && gen() % uint32_t(mean_len) == 0));
      if (cut) id += gen() % 2 ? 1 : 3;
      ids[size_t(b * T + t)] = id;
    }
  }
  return ids;
}

// Boundaries every case gets: a one-token segment at 3, boundaries at 63/64/65 (block edges) and 130, 131
// (another one-token segment) when T reaches them.
const std::vector<int64_t> kCuts = {3, 4, 63, 64, 65, 130, 131};

// ---- the shape sweep: {MHA, GQA, MQA} x window {unlimited, 3} x T x HS, B = 2 --------------------------

struct Heads {
  int64_t NH, NKV;
};

class SegmentSweep : public ::testing::TestWithParam<std::tuple<Heads, int64_t, int64_t, int64_t, int64_t>> {};

// Row 0 gets the fixed cuts plus random ones (mean length mean_len), row 1 its own random layout.
TEST_P(SegmentSweep, MatchesF64Reference) {
  const auto [heads, window, T, HS, mean_len] = GetParam();
  const Case c{2, T, heads.NH, heads.NKV, HS, window};
  const uint32_t seed = uint32_t(T * 131 + HS * 7 + heads.NH * 1000 + heads.NKV * 10000 + mean_len);
  expect_matches_reference(c, seed, make_segments(c.B, c.T, kCuts, mean_len, seed));
}

std::string sweep_name(const ::testing::TestParamInfo<SegmentSweep::ParamType>& info) {
  const auto& [heads, window, T, HS, mean_len] = info.param;
  return Case{2, T, heads.NH, heads.NKV, HS, window}.name() + "_len" + std::to_string(mean_len);
}

INSTANTIATE_TEST_SUITE_P(Shapes, SegmentSweep,
                         ::testing::Combine(::testing::Values(Heads{3, 3}, Heads{6, 2}, Heads{3, 1}),
                                            ::testing::Values(int64_t(-1), int64_t(3)),
                                            ::testing::Values(int64_t(1), int64_t(5), int64_t(217)),
                                            ::testing::Values(int64_t(5), int64_t(64)),
                                            ::testing::Values(int64_t(4), int64_t(50))),
                         sweep_name);

// Layouts that stress the block logic: every token its own segment; one boundary exactly at each block
// edge; a single long segment after a short one (whole key blocks skipped); a segment of one token at the
// very start and end; windows wider than a segment and crossing block edges; non-causal attention (the
// segment end then limits keys too); head sizes needing several column chunks; a long sequence.
TEST(CpuAttentionSegments, BlockEdgesAndExtremeLayouts) {
  struct Layout {
    Case c;
    std::vector<int64_t> cuts;
    int64_t mean_len;
  };
  std::vector<int64_t> every(300);
  for (int64_t t = 0; t < 300; ++t) every[size_t(t)] = t;
  const Layout layouts[] = {
      {{1, 130, 2, 2, 16, -1}, every, 0},
      {{1, 200, 2, 1, 16, -1}, {64, 128, 192}, 0},
      {{1, 200, 2, 1, 16, -1}, {63, 127, 191}, 0},
      {{1, 200, 2, 1, 16, -1}, {65, 129, 193}, 0},
      {{2, 217, 2, 2, 8, -1}, {2, 150}, 0},
      {{1, 217, 2, 2, 8, -1}, {1, 216}, 0},
      {{1, 217, 4, 2, 16, 70}, {64, 65, 100}, 0},
      {{1, 200, 2, 2, 16, 1}, {}, 7},
      {{2, 217, 3, 3, 64, -1, false}, kCuts, 40},
      {{1, 150, 2, 1, 5, -1, false}, {1, 2, 64, 149}, 0},
      {{1, 100, 2, 1, 128, -1}, kCuts, 20},
      {{1, 97, 2, 2, 80, 33}, kCuts, 30},
      {{1, 1500, 2, 1, 16, 100}, {}, 120},
      {{1, 1500, 2, 1, 16, -1}, {}, 300},
  };
  uint32_t seed = 17;
  for (const Layout& l : layouts) {
    SCOPED_TRACE(seed);
    expect_matches_reference(l.c, seed, make_segments(l.c.B, l.c.T, l.cuts, l.mean_len, seed));
    ++seed;
  }
}

// One segment per row (any id value) must give exactly the bits of no segment_ids.
TEST(CpuAttentionSegments, OneSegmentPerRowIsBitIdenticalToNone) {
  for (const Case& c : {Case{2, 217, 6, 2, 64, -1}, Case{1, 5, 3, 1, 5, 3}, Case{3, 130, 4, 4, 5, 50},
                        Case{2, 100, 3, 3, 17, -1, false}, Case{1, 1, 2, 1, 64, -1}, Case{1, 64, 2, 2, 16, -1}}) {
    SCOPED_TRACE(c.name());
    auto qkv = randn(c.B * c.T * c.qkv_cols(), 21);
    auto dout = randn(c.B * c.T * c.NH * c.HS, 22);
    std::vector<int32_t> none, same(size_t(c.B * c.T));
    for (int64_t b = 0; b < c.B; ++b)
      std::fill(same.begin() + b * c.T, same.begin() + (b + 1) * c.T, int32_t(7 * b - 3));
    expect_same_bits(run_op(c, qkv, dout, none), run_op(c, qkv, dout, same));
  }
}

// Changing every qkv value outside one document leaves that document's out, lse and dqkv bit-identical
// (masked keys contribute exact zeros, never a rounding difference), and changes the others.
TEST(CpuAttentionSegments, DocumentsAreIsolated) {
  for (const Case& c : {Case{2, 217, 6, 2, 64, -1}, Case{1, 180, 2, 2, 5, 40}, Case{1, 150, 3, 1, 16, -1, false}}) {
    SCOPED_TRACE(c.name());
    std::vector<int32_t> seg(size_t(c.B * c.T));
    const int64_t doc_lo = 60, doc_hi = 131;  // document [60, 131) straddles two block edges
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t t = 0; t < c.T; ++t)
        seg[size_t(b * c.T + t)] = t < doc_lo ? 0 : t < doc_hi ? 1 : 2 + int32_t(t / 100);
    auto qkv = randn(c.B * c.T * c.qkv_cols(), 31);
    auto dout = randn(c.B * c.T * c.NH * c.HS, 32);
    const Outputs a = run_op(c, qkv, dout, seg);
    auto qkv2 = qkv, dout2 = dout;
    const int64_t C3 = c.qkv_cols(), CO = c.NH * c.HS;
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t t = 0; t < c.T; ++t) {
        if (t >= doc_lo && t < doc_hi) continue;
        for (int64_t k = 0; k < C3; ++k) qkv2[size_t((b * c.T + t) * C3 + k)] *= -1.5f;
        for (int64_t k = 0; k < CO; ++k) dout2[size_t((b * c.T + t) * CO + k)] += 1.0f;
      }
    const Outputs b = run_op(c, qkv2, dout2, seg);
    int64_t changed_outside = 0;
    for (int64_t bt = 0; bt < c.B * c.T; ++bt) {
      const int64_t t = bt % c.T;
      const bool inside = t >= doc_lo && t < doc_hi;
      const bool same_out = std::memcmp(&a.out[size_t(bt * CO)], &b.out[size_t(bt * CO)], size_t(CO) * 4) == 0;
      const bool same_dx = std::memcmp(&a.dqkv[size_t(bt * C3)], &b.dqkv[size_t(bt * C3)], size_t(C3) * 4) == 0;
      if (inside) {
        ASSERT_TRUE(same_out && same_dx) << "position " << t << " of batch row " << bt / c.T;
      } else {
        changed_outside += !same_out && !same_dx;
      }
    }
    EXPECT_EQ(changed_outside, c.B * (c.T - (doc_hi - doc_lo)));
  }
}

// d/dx sum(out * R) by central differences of the f32 op itself, against attention_backward with dout = R,
// at q, k and v entries on both sides of a segment boundary (so masked pairs would show up as a gradient).
TEST(CpuAttentionSegments, FiniteDifferences) {
  const Case c{2, 11, 4, 2, 5, 6};
  std::vector<int32_t> seg = {0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2,   // row 0: [0,4) [4,9) [9,11)
                              5, 6, 6, 6, 6, 6, 6, 6, 6, 9, 9};  // row 1: [0,1) [1,9) [9,11)
  auto qkv = randn(c.B * c.T * c.qkv_cols(), 5);
  auto r = randn(c.B * c.T * c.NH * c.HS, 6);
  const Outputs base = run_op(c, qkv, r, seg);
  const int64_t C3 = c.qkv_cols(), HS = c.HS;
  // (b, t, column): q head 1 (group 0), k/v of group 0, q head 2 (group 1), k/v of group 1.
  const std::vector<Probe> probes = {{0, 3, 1 * HS + 2}, {0, 4, 2 * HS + 0}, {0, 3, 3 * HS + 4}, {0, 8, 4 * HS + 1},
                                     {0, 9, 6 * HS + 3}, {1, 1, 7 * HS + 2}, {1, 0, 6 * HS + 1}, {1, 8, 5 * HS + 0},
                                     {1, 10, 3 * HS + 2}, {1, 2, 2 * HS + 4}};
  EXPECT_GE(expect_gradient_matches_finite_differences(c, qkv, r, seg, base.dqkv, probes), 7);
  // A one-token segment's key is seen only by its own query, whose softmax is then a constant 1: zero key
  // gradient (up to rounding of dP - D), while its value gradient is dout itself.
  const size_t one = size_t((1 * c.T + 0) * C3);
  for (int64_t d = 0; d < HS; ++d) {
    EXPECT_NEAR(base.dqkv[one + size_t(2 * HS + d)], 0.0, 1e-6);
    EXPECT_NEAR(base.dqkv[one + size_t(3 * HS + d)], double(r[size_t(1 * c.T * 4 * HS + d)]) +
                                                         double(r[size_t(1 * c.T * 4 * HS + HS + d)]), 1e-6);
  }
}

// Same inputs and segments, 1, 2 and 3 threads (and a repeat): every output bit-identical.
TEST(CpuAttentionSegments, BitIdenticalAcrossThreadCounts) {
  for (const Case& c : {Case{2, 217, 6, 2, 64, -1}, Case{3, 130, 4, 4, 5, 50}, Case{1, 100, 3, 1, 64, -1, false}}) {
    SCOPED_TRACE(c.name());
    auto qkv = randn(c.B * c.T * c.qkv_cols(), 11);
    auto dout = randn(c.B * c.T * c.NH * c.HS, 12);
    expect_bit_identical_across_threads(c, qkv, dout, make_segments(c.B, c.T, kCuts, 30, 13));
  }
}

TEST(CpuAttentionSegments, RejectsBadSegmentIds) {
  CpuOps ops;
  const Case c{2, 6, 2, 1, 8, -1};
  const OpBuffers v(c);
  const TensorView &tqkv = v.qkv, &tdqkv = v.dqkv, &tout = v.out, &tlse = v.lse;
  std::vector<int32_t> seg = {0, 0, 1, 1, 1, 2, 3, 3, 3, 3, 3, 3};
  TensorView tseg(seg.data(), DType::kI32, Shape{c.B, c.T});
  EXPECT_NO_THROW(ops.attention_forward(tout, tlse, tqkv, c.params(), tseg));
  EXPECT_NO_THROW(ops.attention_backward(tdqkv, tout, tqkv, tout, tlse, c.params(), tseg));
  seg[9] = 2;  // row 1 decreases: 3, 3, 3, 2
  EXPECT_THROW(ops.attention_forward(tout, tlse, tqkv, c.params(), tseg), Error);
  EXPECT_THROW(ops.attention_backward(tdqkv, tout, tqkv, tout, tlse, c.params(), tseg), Error);
  try {
    ops.attention_forward(tout, tlse, tqkv, c.params(), tseg);
    ADD_FAILURE() << "decreasing segment_ids were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("segment_ids[1, 2] = 3 > segment_ids[1, 3] = 2"), std::string::npos)
        << e.what();
  }
  seg[9] = 3;
  TensorView transposed(seg.data(), DType::kI32, Shape{c.T, c.B});
  EXPECT_THROW(ops.attention_forward(tout, tlse, tqkv, c.params(), transposed), Error);
  std::vector<float> fseg(seg.begin(), seg.end());
  TensorView as_float(fseg.data(), DType::kF32, Shape{c.B, c.T});
  EXPECT_THROW(ops.attention_forward(tout, tlse, tqkv, c.params(), as_float), Error);
}

}  // namespace
}  // namespace loom::cpu

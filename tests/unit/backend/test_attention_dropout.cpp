// CPU attention with attention dropout (AttentionParams::dropout_p > 0) against the naive f64 reference of
// attention_test_util.h, which builds the explicit mask from dropout_keep: MHA/GQA/MQA, causal, sliding
// window, non-causal and document segments, T across the 64-row block edges and T not a multiple of 4 (mask
// indices of consecutive query rows then start at different Philox words). Plus: finite differences of
// sum(out * R) with the mask held fixed (same seed and stream), the kept fraction of a large mask read back
// through the op, different seeds/streams giving different masks, p = 0 being bit-identical to no dropout
// whatever the seed, bit-identical results across OpenMP thread counts, and argument checks.
// Tolerance: f32 kernel vs f64 reference, max abs error <= 2e-5 * max |reference| per tensor (the 1e-5 of
// the dropout-free tests, doubled because kept probabilities are scaled by up to 1 / (1 - 0.5) = 2 while the
// normaliser is not, so rounding errors of P grow relative to the output's magnitude).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attention_test_util.h"
#include "backend/cpu/cpu_ops.h"
#include "loom/core/rng.h"

namespace loom::cpu {
namespace {

using namespace attn_test;

constexpr double kTol = 2e-5;

// Segment ids (B, T): boundaries before each position in cuts (when < T), ids stepping by 1.
std::vector<int32_t> segments(int64_t B, int64_t T, const std::vector<int64_t>& cuts) {
  std::vector<int32_t> ids(size_t(B * T));
  for (int64_t b = 0; b < B; ++b) {
    int32_t id = int32_t(b);
    for (int64_t t = 0; t < T; ++t) {
      if (std::count(cuts.begin(), cuts.end(), t + b) > 0) ++id;  // row b's cuts are shifted by b
      ids[size_t(b * T + t)] = id;
    }
  }
  return ids;
}

// ---- sweep: {MHA, GQA, MQA} x window x T x HS x p -------------------------------------------------------

struct Heads {
  int64_t NH, NKV;
};

class DropoutSweep
    : public ::testing::TestWithParam<std::tuple<Heads, int64_t, int64_t, int64_t, float>> {};

TEST_P(DropoutSweep, MatchesF64Reference) {
  const auto [heads, window, T, HS, p] = GetParam();
  Case c{2, T, heads.NH, heads.NKV, HS, window};
  c.dropout_p = p;
  c.seed = 1234 + uint64_t(T);
  c.stream = hash_stream("attention_dropout_sweep") + uint64_t(HS);
  expect_matches_reference(c, uint32_t(T * 131 + HS * 7 + heads.NH * 1000 + heads.NKV * 10000), {}, kTol);
}

std::string sweep_name(const ::testing::TestParamInfo<DropoutSweep::ParamType>& info) {
  const auto& [heads, window, T, HS, p] = info.param;
  Case c{2, T, heads.NH, heads.NKV, HS, window};
  c.dropout_p = p;
  return c.name();
}

INSTANTIATE_TEST_SUITE_P(Shapes, DropoutSweep,
                         ::testing::Combine(::testing::Values(Heads{3, 3}, Heads{6, 2}, Heads{3, 1}),
                                            ::testing::Values(int64_t(-1), int64_t(3)),
                                            ::testing::Values(int64_t(1), int64_t(5), int64_t(130)),
                                            ::testing::Values(int64_t(5), int64_t(64)),
                                            ::testing::Values(0.1f, 0.5f)),
                         sweep_name);

// Block edges (63/64/65 and 128/129 keys), windows crossing block edges with key ranges that start at any
// offset, non-causal attention, odd head sizes, a high drop rate, and document segments (cuts at 3, 4 (a
// one-token segment), 63, 64, 65 and 130).
TEST(CpuAttentionDropout, BlockEdgesWindowsSegmentsAndNonCausal) {
  struct Spec {
    Case c;
    float p;
    bool seg;
  };
  const Spec specs[] = {
      {{1, 64, 2, 2, 16, -1}, 0.2f, false},  {{1, 65, 2, 1, 16, -1}, 0.3f, false},
      {{1, 129, 2, 2, 32, 64}, 0.1f, false}, {{2, 200, 4, 2, 8, 70}, 0.25f, true},
      {{1, 150, 2, 2, 5, 1}, 0.5f, false},   {{1, 97, 2, 2, 80, 33}, 0.15f, true},
      {{2, 217, 3, 3, 64, -1, false}, 0.1f, false}, {{1, 70, 4, 2, 5, -1, false}, 0.3f, true},
      {{2, 131, 6, 2, 64, -1}, 0.9f, true},  {{1, 1, 2, 1, 4, -1}, 0.5f, false},
  };
  const std::vector<int64_t> cuts = {3, 4, 63, 64, 65, 130};
  uint32_t seed = 21;
  for (Spec s : specs) {
    s.c.dropout_p = s.p;
    s.c.seed = seed;
    s.c.stream = 77;
    expect_matches_reference(s.c, seed++, s.seg ? segments(s.c.B, s.c.T, cuts) : std::vector<int32_t>{}, kTol);
  }
}

// The dropout fields are ignored at p = 0: bit-identical to default parameters, whatever the seed.
TEST(CpuAttentionDropout, ZeroProbabilityIsBitIdenticalToNoDropout) {
  const Case plain{2, 150, 6, 2, 64, -1};
  Case seeded = plain;
  seeded.seed = 99;
  seeded.stream = 1234;
  auto qkv = randn(plain.B * plain.T * plain.qkv_cols(), 3);
  auto dout = randn(plain.B * plain.T * plain.NH * plain.HS, 4);
  expect_same_bits(run_op(plain, qkv, dout), run_op(seeded, qkv, dout));
}

// lse is the log-normaliser of the undropped scores, so it does not depend on p or the mask.
TEST(CpuAttentionDropout, LseIgnoresTheMask) {
  Case c{1, 100, 4, 2, 16, -1};
  auto qkv = randn(c.B * c.T * c.qkv_cols(), 8);
  auto dout = randn(c.B * c.T * c.NH * c.HS, 9);
  const Outputs plain = run_op(c, qkv, dout);
  c.dropout_p = 0.4f;
  c.seed = 5;
  const Outputs dropped = run_op(c, qkv, dout);
  EXPECT_TRUE(same_bits(plain.lse, dropped.lse));
  EXPECT_FALSE(same_bits(plain.out, dropped.out));
}

// d/dx sum(out * R) by central differences of the f32 op with the mask held fixed (same seed and stream),
// against attention_backward with dout = R, at q, k and v entries of both groups, with a window and
// document segments.
TEST(CpuAttentionDropout, FiniteDifferences) {
  Case c{2, 11, 4, 2, 5, 6};
  c.dropout_p = 0.3f;
  c.seed = 2024;
  c.stream = 3;
  const std::vector<int32_t> seg = {0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 5, 6, 6, 6, 6, 6, 6, 6, 6, 9, 9};
  auto qkv = randn(c.B * c.T * c.qkv_cols(), 5);
  auto r = randn(c.B * c.T * c.NH * c.HS, 6);
  const Outputs base = run_op(c, qkv, r, seg);
  const int64_t HS = c.HS;
  // (b, t, column): q head 1 (group 0), k/v of group 0, q head 2 (group 1), k/v of group 1.
  const std::vector<Probe> probes = {{0, 3, 1 * HS + 2}, {0, 4, 2 * HS + 0}, {0, 3, 3 * HS + 4}, {0, 8, 4 * HS + 1},
                                     {0, 9, 6 * HS + 3}, {1, 1, 7 * HS + 2}, {1, 6, 6 * HS + 1}, {1, 8, 5 * HS + 0},
                                     {1, 10, 3 * HS + 2}, {1, 5, 2 * HS + 4}, {1, 7, 0 * HS + 1}, {0, 2, 8 * HS + 3}};
  EXPECT_GE(expect_gradient_matches_finite_differences(c, qkv, r, seg, base.dqkv, probes), 8);
}

// Reads the op's mask back: with q = 0 every visible score is equal, so non-causal P = 1/T, and with
// HS = 1 and v = 1, out[b, i, h] = (number of kept keys of row i) / (T (1 - p)). Over B*NH*T*T = 2M mask
// entries the kept fraction must be within 5 standard deviations of 1 - p, each row's count must match
// dropout_keep, and other seeds or streams must give other masks.
TEST(CpuAttentionDropout, KeptFractionAndSeedsThroughTheOp) {
  Case c{2, 512, 4, 4, 1, -1, false};
  c.dropout_p = 0.3f;
  c.seed = 42;
  c.stream = 7;
  std::vector<float> qkv(size_t(c.B * c.T * c.qkv_cols()), 0.0f);
  for (int64_t bt = 0; bt < c.B * c.T; ++bt)
    for (int64_t h = 0; h < c.NH; ++h) qkv[size_t(bt * c.qkv_cols() + h * 3 + 2)] = 1.0f;  // v of head h
  std::vector<float> dout(size_t(c.B * c.T * c.NH), 0.0f);
  auto counts = [&](const Case& cc) {
    const Outputs o = run_op(cc, qkv, dout);
    std::vector<int64_t> n(o.out.size());
    for (size_t k = 0; k < n.size(); ++k) n[k] = std::llround(double(o.out[k]) * double(c.T) * (1.0 - cc.dropout_p));
    return n;
  };
  const std::vector<int64_t> kept = counts(c);
  const uint32_t threshold = dropout_threshold(c.dropout_p);
  double total = 0;
  int64_t rows_checked = 0;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t i = 0; i < c.T; ++i)
      for (int64_t h = 0; h < c.NH; ++h) {
        const int64_t got = kept[size_t((b * c.T + i) * c.NH + h)];
        total += double(got);
        if ((i + h) % 37 == 0) {  // a sample of rows counted directly from the rule
          int64_t want = 0;
          for (int64_t j = 0; j < c.T; ++j)
            want += dropout_keep(c.seed, c.stream, (uint64_t(b * c.NH + h) * c.T + i) * c.T + j, threshold);
          EXPECT_EQ(got, want) << "b " << b << " i " << i << " h " << h;
          ++rows_checked;
        }
      }
  EXPECT_GT(rows_checked, 50);
  const double n = double(c.B * c.NH * c.T * c.T), q = 1.0 - double(c.dropout_p);
  EXPECT_NEAR(total / n, q, 5.0 * std::sqrt(q * (1.0 - q) / n));
  // Another seed, another stream: different masks (rows whose counts agree are a minority).
  for (auto [seed, stream] : {std::pair<uint64_t, uint64_t>{43, 7}, std::pair<uint64_t, uint64_t>{42, 8}}) {
    Case other = c;
    other.seed = seed;
    other.stream = stream;
    const std::vector<int64_t> k2 = counts(other);
    int64_t same = 0;
    for (size_t k = 0; k < kept.size(); ++k) same += k2[k] == kept[k];
    EXPECT_LT(same, int64_t(kept.size() / 10)) << "seed " << seed << " stream " << stream;
  }
}

// Same inputs, 1 and 2 threads (and 3, and a repeat): every output bit-identical, with dropout, GQA,
// windows and segments.
TEST(CpuAttentionDropout, BitIdenticalAcrossThreadCounts) {
  const std::vector<int64_t> cuts = {30, 64, 100};
  for (Case c : {Case{2, 217, 6, 2, 64, -1}, Case{3, 130, 4, 4, 5, 50}, Case{1, 100, 3, 1, 64, -1, false}}) {
    c.dropout_p = 0.2f;
    c.seed = 17;
    c.stream = 4;
    SCOPED_TRACE(c.name());
    auto qkv = randn(c.B * c.T * c.qkv_cols(), 11);
    auto dout = randn(c.B * c.T * c.NH * c.HS, 12);
    expect_bit_identical_across_threads(c, qkv, dout, segments(c.B, c.T, cuts));
  }
}

TEST(CpuAttentionDropout, RejectsBadProbabilities) {
  CpuOps ops;
  const Case c{1, 5, 2, 1, 8, -1};
  const OpBuffers v(c);
  for (float p : {1.0f, -0.1f, 1.5f, std::numeric_limits<float>::quiet_NaN()}) {
    AttentionParams ap = c.params();
    ap.dropout_p = p;
    EXPECT_THROW(ops.attention_forward(v.out, v.lse, v.qkv, ap), Error) << p;
    EXPECT_THROW(ops.attention_backward(v.dqkv, v.out, v.qkv, v.out, v.lse, ap), Error) << p;
  }
  AttentionParams ap = c.params();
  ap.dropout_p = 0.999f;
  EXPECT_NO_THROW(ops.attention_forward(v.out, v.lse, v.qkv, ap));
}

}  // namespace
}  // namespace loom::cpu

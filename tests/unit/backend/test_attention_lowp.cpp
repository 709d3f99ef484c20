// CPU attention with bf16 and f16 activations (qkv, out, dout, dqkv in the low-precision dtype, lse f32).
// The op widens rows to f32 exactly and runs the f32 kernels, so its results must be the f32 op's on the
// widened inputs, rounded once:
//   - forward: lse bit-identical, out = round(out_f32) bit for bit;
//   - backward (f32 op given the same widened out, dout and lse): dqkv within 1 unit in the last place of
//     the dtype of round(dqkv_f32). Exact equality is expected too (same kernels, same order), but the
//     contract only promises the same f32 arithmetic up to summation order: the only per-row reduction
//     outside the tile kernels, D_i = dO_i . O_i, reads a widened copy of O in the low-precision path, and a
//     differently ordered f32 sum may move a result by a few f32 ulps, which can flip one rounding step.
// Also: against the f64 reference on the rounded inputs (tolerances in check_lowp), with dropout, GQA, windows, segments and
// non-causal; bit-identical across thread counts; and dtype checks.
// On CPUs with AVX512-BF16, bf16 takes another path by default (attention_bf16.h: products on VDPBF16PS, P and
// dS rounded to bf16 as on the GPU). The contract above is checked on the f32 path (switched on for it), and
// the bf16 path against the f64 reference with the tolerance its two extra roundings need (check_bf16_dot),
// against the staging and product kernels' definitions, and across thread counts.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attention_test_util.h"
#include "backend/cpu/attention_bf16.h"
#include "backend/cpu/attention_tiles.h"
#include "backend/cpu/cpu_ops.h"
#include "loom/core/dtype.h"

namespace loom::cpu {
namespace {

using namespace attn_test;

uint16_t encode(DType dt, float x) { return dt == DType::kBF16 ? f32_to_bf16(x) : f32_to_f16(x); }
float decode(DType dt, uint16_t x) { return dt == DType::kBF16 ? bf16_to_f32(x) : f16_to_f32(x); }

std::vector<uint16_t> encode(DType dt, const std::vector<float>& v) {
  std::vector<uint16_t> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = encode(dt, v[i]);
  return r;
}
std::vector<float> decode(DType dt, const std::vector<uint16_t>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = decode(dt, v[i]);
  return r;
}

// Spacing of the dtype's values at |x| (its ulp), for the 1-ulp comparison.
double ulp(DType dt, float x) {
  const int mbits = dt == DType::kBF16 ? 7 : 10;
  const int min_exp = dt == DType::kBF16 ? -126 : -14;
  const int e = x == 0.0f ? min_exp : std::max(std::ilogb(x), min_exp);
  return std::ldexp(1.0, e - mbits);
}

struct LowpOutputs {
  std::vector<uint16_t> out, dqkv;
  std::vector<float> lse;
};

// Forward and backward with qkv and dout in dtype dt; outputs start as NaN.
LowpOutputs run_lowp(DType dt, const Case& c, const std::vector<uint16_t>& qkv, const std::vector<uint16_t>& dout,
                     std::vector<int32_t> seg = {}) {
  const uint16_t nan = encode(dt, std::numeric_limits<float>::quiet_NaN());
  LowpOutputs r;
  r.out.assign(size_t(c.B * c.T * c.NH * c.HS), nan);
  r.dqkv.assign(qkv.size(), nan);
  r.lse.assign(size_t(c.B * c.NH * c.T), std::numeric_limits<float>::quiet_NaN());
  std::vector<uint16_t> x = qkv, dy = dout;
  const Shape qkv_s{c.B, c.T, c.qkv_cols()}, out_s{c.B, c.T, c.NH * c.HS};
  TensorView tqkv(x.data(), dt, qkv_s), tout(r.out.data(), dt, out_s), tdout(dy.data(), dt, out_s);
  TensorView tdqkv(r.dqkv.data(), dt, qkv_s), tlse(r.lse.data(), DType::kF32, Shape{c.B, c.NH, c.T});
  TensorView tseg = seg.empty() ? TensorView() : TensorView(seg.data(), DType::kI32, Shape{c.B, c.T});
  CpuOps ops;
  ops.attention_forward(tout, tlse, tqkv, c.params(), tseg);
  ops.attention_backward(tdqkv, tdout, tqkv, tout, tlse, c.params(), tseg);
  return r;
}

// Selects bf16 attention's path (attn::set_bf16_attention) for a scope.
struct Bf16Path {
  bool saved = attn::bf16_attention_enabled();
  explicit Bf16Path(bool dot) { attn::set_bf16_attention(dot); }
  ~Bf16Path() { attn::set_bf16_attention(saved); }
};

void check_lowp(DType dt, const Case& c, uint32_t seed, std::vector<int32_t> seg = {}) {
  SCOPED_TRACE(std::string(dtype_name(dt)) + "_" + c.name() + (seg.empty() ? "" : "_segments"));
  const Bf16Path f32_path(false);
  const auto qkv16 = encode(dt, randn(c.B * c.T * c.qkv_cols(), seed));
  const auto dout16 = encode(dt, randn(c.B * c.T * c.NH * c.HS, seed + 1));
  const LowpOutputs got = run_lowp(dt, c, qkv16, dout16, seg);

  // The f32 op on the widened inputs; its backward sees the low-precision op's out, widened.
  auto qkv = decode(dt, qkv16), dout = decode(dt, dout16), out_lp = decode(dt, got.out);
  std::vector<float> lse_lp = got.lse;
  std::vector<float> out(out_lp.size()), lse(got.lse.size()), dqkv(qkv.size());
  const Shape qkv_s{c.B, c.T, c.qkv_cols()}, out_s{c.B, c.T, c.NH * c.HS};
  TensorView tseg = seg.empty() ? TensorView() : TensorView(seg.data(), DType::kI32, Shape{c.B, c.T});
  CpuOps ops;
  ops.attention_forward(TensorView(out.data(), DType::kF32, out_s), TensorView(lse.data(), DType::kF32,
                        Shape{c.B, c.NH, c.T}), TensorView(qkv.data(), DType::kF32, qkv_s), c.params(), tseg);
  ops.attention_backward(TensorView(dqkv.data(), DType::kF32, qkv_s), TensorView(dout.data(), DType::kF32, out_s),
                         TensorView(qkv.data(), DType::kF32, qkv_s), TensorView(out_lp.data(), DType::kF32, out_s),
                         TensorView(lse_lp.data(), DType::kF32, Shape{c.B, c.NH, c.T}), c.params(), tseg);
  EXPECT_EQ(0, std::memcmp(lse.data(), got.lse.data(), lse.size() * sizeof(float)));
  int64_t out_diff = 0, dx_far = 0;
  for (size_t i = 0; i < out.size(); ++i) out_diff += got.out[i] != encode(dt, out[i]);
  for (size_t i = 0; i < dqkv.size(); ++i) {
    const float want = decode(dt, encode(dt, dqkv[i]));
    const float have = decode(dt, got.dqkv[i]);
    dx_far += !(std::abs(double(have) - double(want)) <= ulp(dt, want));  // NaN counts as far
  }
  EXPECT_EQ(out_diff, 0);
  EXPECT_EQ(dx_far, 0);

  // Sanity against the f64 reference on the same rounded inputs. out: its own rounding (one unit u =
  // 2^-8 bf16, 2^-11 f16, relative to the largest element, plus the f32 slack). dqkv: the backward reads out
  // rounded to the dtype, so D_i = dO_i . O_i carries an error up to u/2 * sum_d |dO_i,d O_i,d| that enters
  // every dS of the row; where dP - D nearly cancels (T = 1: exactly) this is not small against dqkv, so
  // the bound is 4u (seen: 1.5u).
  const Reference ref = reference(c, qkv, dout, seg);
  const double u = dt == DType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  EXPECT_LE(rel_error(out_lp, ref.out), u + 2e-5);
  EXPECT_LE(rel_error(got.lse, ref.lse), 2e-5);
  EXPECT_LE(rel_error(decode(dt, got.dqkv), ref.dqkv), 4 * u);
}

// rel_error of the dq, dk or dv columns of dqkv alone (part 0, 1, 2), each against its own largest value: dq
// and dk are about softmax_scale times smaller than dv, so one error measure over all of dqkv would hide them.
double part_error(const Case& c, const std::vector<float>& got, const std::vector<double>& want, int part) {
  const int64_t G = c.NH / c.NKV, group = (G + 2) * c.HS, cols = c.qkv_cols();
  std::vector<float> g;
  std::vector<double> w;
  for (size_t i = 0; i < want.size(); ++i) {
    const int64_t head = (int64_t(i) % cols) % group / c.HS;
    if ((head < G ? 0 : head == G ? 1 : 2) != part) continue;
    g.push_back(got[i]);
    w.push_back(want[i]);
  }
  return rel_error(g, w);
}

// The VDPBF16PS path against the f64 reference on the same rounded inputs (callers skip without AVX512-BF16).
// Besides the output's own rounding (u), out carries the rounding of P (relative 2^-9 per probability) and
// dq, dk, dv that of dS and P: bounds of 1.5u for out and the f32 path's 4u for dqkv, and with more than one
// key tile also for each of dq, dk and dv relative to its own largest value (seen: 0.84u, 1.27u and 1.3u).
// lse comes from f32 sums of exact bf16 products,
// as on the f32 path. The results differ from the f32 path's (else the switch did nothing).
void check_bf16_dot(const Case& c, uint32_t seed, std::vector<int32_t> seg = {}) {
  SCOPED_TRACE("bf16_dot_" + c.name() + (seg.empty() ? "" : "_segments"));
  const DType dt = DType::kBF16;
  const auto qkv16 = encode(dt, randn(c.B * c.T * c.qkv_cols(), seed));
  const auto dout16 = encode(dt, randn(c.B * c.T * c.NH * c.HS, seed + 1));
  LowpOutputs dot, f32;
  {
    const Bf16Path path(true);
    dot = run_lowp(dt, c, qkv16, dout16, seg);
  }
  {
    const Bf16Path path(false);
    f32 = run_lowp(dt, c, qkv16, dout16, seg);
  }
  const Reference ref = reference(c, decode(dt, qkv16), decode(dt, dout16), seg);
  const double u = std::ldexp(1.0, -8);
  const double e_out = rel_error(decode(dt, dot.out), ref.out);
  EXPECT_LE(e_out, 1.5 * u);
  EXPECT_LE(rel_error(dot.lse, ref.lse), 2e-5);
  const std::vector<float> dx = decode(dt, dot.dqkv);
  const double e_dx = rel_error(dx, ref.dqkv);
  EXPECT_LE(e_dx, 4 * u);
  double e_parts[3] = {0, 0, 0};
  if (c.T > 64) {  // with a few keys, dq and dk nearly cancel (T = 1: exactly 0), so only the sum measures them
    for (int part = 0; part < 3; ++part) {
      e_parts[part] = part_error(c, dx, ref.dqkv, part);
      EXPECT_LE(e_parts[part], 4 * u) << "part " << "qkv"[part];
    }
    EXPECT_NE(dot.dqkv, f32.dqkv);
  }
  std::printf("[bf16 dot] %s: out %.2fu dqkv %.2fu (dq %.2fu dk %.2fu dv %.2fu)\n", c.name().c_str(), e_out / u,
              e_dx / u, e_parts[0] / u, e_parts[1] / u, e_parts[2] / u);
}

class LowpSweep : public ::testing::TestWithParam<std::tuple<DType, int64_t, int64_t, int64_t, float>> {};

TEST_P(LowpSweep, EqualsRoundedF32) {
  const auto [dt, window, T, HS, p] = GetParam();
  Case c{2, T, 6, 2, HS, window};  // GQA; MHA and MQA are in SegmentsNonCausalAndMqa
  c.dropout_p = p;
  c.seed = 9;
  c.stream = 10;
  check_lowp(dt, c, uint32_t(T * 17 + HS));
  if (dt == DType::kBF16 && attn::bf16_dot_supported()) check_bf16_dot(c, uint32_t(T * 17 + HS));
}

std::string sweep_name(const ::testing::TestParamInfo<LowpSweep::ParamType>& info) {
  const auto& [dt, window, T, HS, p] = info.param;
  return std::string(dtype_name(dt)) + "_T" + std::to_string(T) + "_HS" + std::to_string(HS) + "_W" +
         (window < 0 ? "inf" : std::to_string(window)) + (p > 0 ? "_drop" : "");
}

INSTANTIATE_TEST_SUITE_P(Shapes, LowpSweep,
                         ::testing::Combine(::testing::Values(DType::kBF16, DType::kF16),
                                            ::testing::Values(int64_t(-1), int64_t(40)),
                                            ::testing::Values(int64_t(1), int64_t(5), int64_t(130)),
                                            ::testing::Values(int64_t(5), int64_t(72)),
                                            ::testing::Values(0.0f, 0.2f)),
                         sweep_name);

TEST(CpuAttentionLowp, SegmentsNonCausalAndMqa) {
  std::vector<int32_t> seg(size_t(2 * 140));
  for (int64_t t = 0; t < 140; ++t) {
    seg[size_t(t)] = int32_t(t / 50);
    seg[size_t(140 + t)] = t < 3 ? 0 : t < 64 ? 1 : 2;
  }
  for (DType dt : {DType::kBF16, DType::kF16}) {
    check_lowp(dt, Case{2, 140, 4, 1, 64, -1}, 31, seg);
    check_lowp(dt, Case{1, 140, 3, 3, 24, -1}, 34, std::vector<int32_t>(seg.begin(), seg.begin() + 140));
    check_lowp(dt, Case{2, 140, 4, 2, 16, -1, false}, 32, seg);
    Case c{2, 140, 6, 3, 32, 20};
    c.dropout_p = 0.3f;
    c.seed = 1;
    check_lowp(dt, c, 33, seg);
  }
}

// The bf16 VDPBF16PS path on the cases above and on ones that exercise its own edges: several key tiles per
// query block (head size 128), a head size padded 80 -> 96, and a block whose first visible key is odd
// (segment starting at 37, so the tile starts at key 36, which no query of the block sees).
TEST(CpuAttentionLowp, Bf16DotPathAgainstReference) {
  if (!attn::bf16_dot_supported()) GTEST_SKIP() << "no AVX512-BF16 on this CPU: bf16 attention takes the f32 path";
  std::vector<int32_t> seg(size_t(2 * 140));
  for (int64_t t = 0; t < 140; ++t) {
    seg[size_t(t)] = int32_t(t / 50);
    seg[size_t(140 + t)] = t < 3 ? 0 : t < 64 ? 1 : 2;
  }
  check_bf16_dot(Case{2, 140, 4, 1, 64, -1}, 31, seg);
  check_bf16_dot(Case{1, 140, 3, 3, 24, -1}, 34, std::vector<int32_t>(seg.begin(), seg.begin() + 140));
  check_bf16_dot(Case{2, 140, 4, 2, 16, -1, false}, 32, seg);
  Case c{2, 140, 6, 3, 32, 20};
  c.dropout_p = 0.3f;
  c.seed = 1;
  check_bf16_dot(c, 33, seg);
  check_bf16_dot(Case{2, 300, 4, 2, 128, -1}, 35);
  std::vector<int32_t> odd(257);
  for (int64_t t = 0; t < 257; ++t) odd[size_t(t)] = t < 37 ? 0 : t < 150 ? 1 : 2;
  check_bf16_dot(Case{1, 257, 2, 1, 80, -1}, 36, odd);
  check_bf16_dot(Case{1, 257, 4, 2, 80, 77}, 37);
}

// Same inputs, 1, 2 and 3 threads: every output bit-identical (bf16 on both paths). The second case has one
// batch row of two heads, so the forward cuts each head's query blocks into 2, 4 and 5 runs (tasks that start
// past the first block) at 1, 2 and 3 threads.
TEST(CpuAttentionLowp, BitIdenticalAcrossThreadCounts) {
  const int saved = omp_get_max_threads();
  for (int variant = 0; variant < 6; ++variant) {
    const DType dt = variant % 3 == 2 ? DType::kF16 : DType::kBF16;
    const Bf16Path path(variant % 3 == 0);
    Case c = variant < 3 ? Case{2, 150, 6, 2, 64, -1} : Case{1, 300, 2, 1, 64, -1};
    c.dropout_p = 0.1f;
    c.seed = 3;
    SCOPED_TRACE(c.name() + (variant % 3 == 0 ? " bf16 path" : " f32 path"));
    const auto qkv = encode(dt, randn(c.B * c.T * c.qkv_cols(), 4));
    const auto dout = encode(dt, randn(c.B * c.T * c.NH * c.HS, 5));
    omp_set_num_threads(1);
    const LowpOutputs one = run_lowp(dt, c, qkv, dout);
    for (int threads : {2, 3}) {
      omp_set_num_threads(threads);
      const LowpOutputs many = run_lowp(dt, c, qkv, dout);
      EXPECT_EQ(one.out, many.out) << threads;
      EXPECT_EQ(0, std::memcmp(one.lse.data(), many.lse.data(), one.lse.size() * sizeof(float))) << threads;
      EXPECT_EQ(one.dqkv, many.dqkv) << threads;
    }
  }
  omp_set_num_threads(saved);
}

TEST(CpuAttentionLowp, RejectsMixedDtypes) {
  CpuOps ops;
  const Case c{1, 5, 2, 1, 8, -1};
  std::vector<uint16_t> qkv(size_t(c.B * c.T * c.qkv_cols()), 0), out(size_t(c.B * c.T * c.NH * c.HS), 0),
      dqkv(qkv.size(), 0);
  std::vector<float> out32(out.size()), lse(size_t(c.B * c.NH * c.T));
  std::vector<uint16_t> lse16(lse.size());
  const Shape qkv_s{c.B, c.T, c.qkv_cols()}, out_s{c.B, c.T, c.NH * c.HS}, lse_s{c.B, c.NH, c.T};
  TensorView tqkv(qkv.data(), DType::kBF16, qkv_s), tout(out.data(), DType::kBF16, out_s);
  TensorView tlse(lse.data(), DType::kF32, lse_s), tdqkv(dqkv.data(), DType::kBF16, qkv_s);
  EXPECT_NO_THROW(ops.attention_forward(tout, tlse, tqkv, c.params()));
  EXPECT_NO_THROW(ops.attention_backward(tdqkv, tout, tqkv, tout, tlse, c.params()));
  EXPECT_THROW(ops.attention_forward(TensorView(out32.data(), DType::kF32, out_s), tlse, tqkv, c.params()), Error);
  EXPECT_THROW(ops.attention_forward(TensorView(out.data(), DType::kF16, out_s), tlse, tqkv, c.params()), Error);
  EXPECT_THROW(ops.attention_forward(tout, TensorView(lse16.data(), DType::kBF16, lse_s), tqkv, c.params()), Error);
  EXPECT_THROW(ops.attention_backward(TensorView(dqkv.data(), DType::kF16, qkv_s), tout, tqkv, tout, tlse,
                                      c.params()),
               Error);
  EXPECT_THROW(ops.attention_backward(tdqkv, TensorView(out32.data(), DType::kF32, out_s), tqkv, tout, tlse,
                                      c.params()),
               Error);
  std::vector<int32_t> ids(qkv.size());
  EXPECT_THROW(ops.attention_forward(tout, tlse, TensorView(ids.data(), DType::kI32, qkv_s), c.params()), Error);
}

}  // namespace
}  // namespace loom::cpu

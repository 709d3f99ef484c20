// FP8 with per-tensor delayed scaling on the CPU backend:
//   - fp8_quantize equals its definition element by element (core's saturating RNE of x · scale, in f32)
//     for f32 and bf16 inputs and both formats, and its amax is max |x| accumulated over calls, +inf once
//     a non-finite value was seen;
//   - fp8_dequantize equals decode · scale_inv rounded once, and a quantise/dequantise round trip of
//     in-range values is within the format's half-ulp (2^-4 relative for E4M3, 2^-3 for E5M2);
//   - fp8_update_scaling follows the rule of loom/fp8/fp8.h: max vs most_recent, margin, amax 0 / inf keep
//     the scale, an infinite scale clamps to FLT_MAX, scale_inv = 1 / scale, the history rolls;
//   - fp8_gemm equals the f64 product of the decoded, scaled operands plus bias (f32 accumulation), with
//     accumulate adding into the old output and 16-bit outputs rounded once; E5M2 x E5M2 is refused;
//   - transpose moves 1-, 2- and 4-byte elements exactly;
//   - Fp8ScalingGroup wires them (scales start at 1; recipe formats; flag parsing and validation errors).
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "loom/backend/device_context.h"
#include "loom/core/dtype.h"
#include "loom/dist/communicator.h"
#include "loom/fp8/fp8.h"

namespace loom {
namespace {

Tensor host_f32(const std::vector<float>& v, Shape s) {
  Tensor t = Tensor::empty(s, DType::kF32);
  std::copy(v.begin(), v.end(), t.data<float>());
  return t;
}
Tensor scalar(float v) { return host_f32({v}, Shape{1}); }

std::vector<float> sample(int64_t n, uint32_t seed, float spread) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(gen) * std::exp2(spread * d(gen));  // many magnitudes
  return v;
}

float decode(DType dt, uint8_t b) { return dt == DType::kF8E4M3 ? fp8_e4m3_to_f32(b) : fp8_e5m2_to_f32(b); }
uint8_t encode(DType dt, float x) { return dt == DType::kF8E4M3 ? f32_to_fp8_e4m3(x) : f32_to_fp8_e5m2(x); }

TEST(Fp8Ops, QuantizeMatchesDefinitionAndTracksAmax) {
  auto ctx = make_cpu_context();
  for (DType fdt : {DType::kF8E4M3, DType::kF8E5M2})
    for (DType idt : {DType::kF32, DType::kBF16})
      for (int64_t n : {int64_t(1), int64_t(5), int64_t(1023), int64_t(1025), int64_t(70001)}) {
        const std::vector<float> v = sample(n, uint32_t(n), 3.0f);
        Tensor x32 = host_f32(v, Shape{n});
        Tensor x = Tensor::empty({n}, idt);
        ctx->ops().cast(x, x32);
        Tensor xs = Tensor::empty({n}, DType::kF32);  // what the op sees after widening
        ctx->ops().cast(xs, x);
        Tensor q = Tensor::empty({n}, fdt);
        const float s = 37.5f;
        Tensor sc = scalar(s), am = scalar(0.25f);
        ctx->ops().fp8_quantize(q, x, sc, am);
        float want_amax = 0.25f;
        int64_t bad = 0;
        for (int64_t i = 0; i < n; ++i) {
          const float xi = xs.data<float>()[i];
          bad += q.data<uint8_t>()[i] != encode(fdt, xi * s);
          want_amax = std::max(want_amax, std::fabs(xi));
        }
        EXPECT_EQ(bad, 0) << dtype_name(fdt) << " from " << dtype_name(idt) << " n " << n;
        EXPECT_EQ(am.data<float>()[0], want_amax);
      }
}

// The backend's encoder against the core's reference codec over a sweep of the whole f32 range (every
// 4099th bit pattern: both signs, subnormals, rounding ties, saturation, infinities, NaNs).
TEST(Fp8Ops, QuantizeEqualsTheCoreCodecOverTheF32Range) {
  auto ctx = make_cpu_context();
  const int64_t step = 4099, n = int64_t((uint64_t(1) << 32) / uint64_t(step));
  Tensor x = Tensor::empty({n}, DType::kF32);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = uint32_t(uint64_t(i) * uint64_t(step));
    std::memcpy(x.data<float>() + i, &bits, 4);
  }
  Tensor one = scalar(1.0f), am = scalar(0.0f);
  for (DType fdt : {DType::kF8E4M3, DType::kF8E5M2}) {
    Tensor q = Tensor::empty({n}, fdt);
    ctx->ops().fp8_quantize(q, x, one, am);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad += q.data<uint8_t>()[i] != encode(fdt, x.data<float>()[i]);
    EXPECT_EQ(bad, 0) << dtype_name(fdt);
  }
}

TEST(Fp8Ops, QuantizeSaturatesAndFlagsNonFinite) {
  auto ctx = make_cpu_context();
  const float inf = std::numeric_limits<float>::infinity();
  Tensor x = host_f32({1000.0f, -1000.0f, 1.0f}, Shape{3});
  Tensor q = Tensor::empty({3}, DType::kF8E4M3);
  Tensor sc = scalar(1.0f), am = scalar(0.0f);
  ctx->ops().fp8_quantize(q, x, sc, am);
  EXPECT_EQ(fp8_e4m3_to_f32(q.data<uint8_t>()[0]), 448.0f);  // saturated, not NaN
  EXPECT_EQ(fp8_e4m3_to_f32(q.data<uint8_t>()[1]), -448.0f);
  EXPECT_EQ(am.data<float>()[0], 1000.0f);
  for (float bad : {inf, std::numeric_limits<float>::quiet_NaN()}) {
    Tensor y = host_f32({1.0f, bad, 2.0f}, Shape{3});
    Tensor a = scalar(5.0f);
    ctx->ops().fp8_quantize(q, y, sc, a);
    EXPECT_EQ(a.data<float>()[0], inf) << bad;
    Tensor z = host_f32({1.0f}, Shape{1});
    ctx->ops().fp8_quantize(q.view().slice_flat(0, Shape{1}), z, sc, a);  // stays +inf once seen
    EXPECT_EQ(a.data<float>()[0], inf);
  }
}

TEST(Fp8Ops, DequantizeAndRoundTrip) {
  auto ctx = make_cpu_context();
  for (DType fdt : {DType::kF8E4M3, DType::kF8E5M2}) {
    const int64_t n = 256;
    Tensor all = Tensor::empty({n}, fdt);
    for (int64_t i = 0; i < n; ++i) all.data<uint8_t>()[i] = uint8_t(i);
    Tensor si = scalar(0.125f);
    Tensor out32 = Tensor::empty({n}, DType::kF32), out16 = Tensor::empty({n}, DType::kBF16);
    ctx->ops().fp8_dequantize(out32, all, si);
    ctx->ops().fp8_dequantize(out16, all, si);
    for (int64_t i = 0; i < n; ++i) {
      const float want = decode(fdt, uint8_t(i)) * 0.125f;
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(out32.data<float>()[i]));
        continue;
      }
      EXPECT_EQ(out32.data<float>()[i], want) << i;
      EXPECT_EQ(out16.data<uint16_t>()[i], f32_to_bf16(want)) << i;
    }
    // Round trip with the scale that maps the amax onto the format's maximum (what delayed scaling aims for).
    const std::vector<float> v = sample(4096, 7, 1.0f);
    float amax = 0;
    for (float x : v) amax = std::max(amax, std::fabs(x));
    const float s = float(dtype_max(fdt)) / amax;
    Tensor x = host_f32(v, Shape{4096}), q = Tensor::empty({4096}, fdt), back = Tensor::empty({4096}, DType::kF32);
    Tensor sc = scalar(s), inv = scalar(1.0f / s), am = scalar(0.0f);
    ctx->ops().fp8_quantize(q, x, sc, am);
    ctx->ops().fp8_dequantize(back, q, inv);
    const double half_ulp = fdt == DType::kF8E4M3 ? 1.0 / 16 : 1.0 / 8;
    const double min_normal = fdt == DType::kF8E4M3 ? std::ldexp(1.0, -6) : std::ldexp(1.0, -14);
    for (int64_t i = 0; i < 4096; ++i) {
      const double xi = v[size_t(i)], yi = back.data<float>()[i];
      if (std::fabs(xi) * s < min_normal) continue;  // subnormal range: absolute, not relative, error
      ASSERT_LE(std::fabs(yi - xi), half_ulp * std::fabs(xi) * 1.0001) << dtype_name(fdt) << " x " << xi;
    }
  }
}

TEST(Fp8Ops, DelayedScalingUpdateRule) {
  auto ctx = make_cpu_context();
  const float inf = std::numeric_limits<float>::infinity();
  // L = 3 steps (row 0 = this step), n = 5 tensors.
  const std::vector<float> hist = {
      2.0f, 0.0f, inf,  1e-30f, 1.0f,   // this step
      8.0f, 0.0f, 1.0f, 0.0f,   4.0f,   // one step ago
      1.0f, 3.0f, 1.0f, 0.0f,   16.0f,  // two steps ago
  };
  const float fmax = 448.0f;
  for (bool use_max : {true, false})
    for (int margin : {0, 2}) {
      Tensor h = host_f32(hist, Shape{3, 5});
      Tensor sc = host_f32({0.5f, 0.5f, 0.5f, 0.5f, 0.5f}, Shape{5}), si = Tensor::empty({5}, DType::kF32);
      ctx->ops().fp8_update_scaling(h, sc, si, fmax, margin, use_max);
      const float m = std::ldexp(1.0f, margin);
      const float a0 = use_max ? 8.0f : 2.0f;
      EXPECT_EQ(sc.data<float>()[0], (fmax / a0) / m);
      // Tensor 1: amax 0 now; with "max" the history's 3 counts, with most_recent the scale is kept.
      EXPECT_EQ(sc.data<float>()[1], use_max ? (fmax / 3.0f) / m : 0.5f);
      EXPECT_EQ(sc.data<float>()[2], 0.5f);  // an inf amax keeps the scale
      // A tiny amax (the only non-zero one of its history) gives a huge but finite scale.
      EXPECT_EQ(sc.data<float>()[3], (fmax / 1e-30f) / m);
      EXPECT_EQ(sc.data<float>()[4], (fmax / (use_max ? 16.0f : 1.0f)) / m);
      for (int j = 0; j < 5; ++j) EXPECT_EQ(si.data<float>()[j], 1.0f / sc.data<float>()[j]) << j;
      // Rolled: row 0 zero, row 1 = the old row 0, row 2 = the old row 1 (the oldest dropped).
      for (int j = 0; j < 5; ++j) {
        EXPECT_EQ(h.data<float>()[j], 0.0f);
        EXPECT_EQ(h.data<float>()[5 + j], hist[size_t(j)]);
        EXPECT_EQ(h.data<float>()[10 + j], hist[size_t(5 + j)]);
      }
    }
  // The clamp itself: amax so small that fp8_max / amax is +inf in f32.
  Tensor h = host_f32({1e-39f}, Shape{1, 1}), sc = scalar(1.0f), si = scalar(1.0f);
  ctx->ops().fp8_update_scaling(h, sc, si, fmax, 0, false);
  EXPECT_EQ(sc.data<float>()[0], std::numeric_limits<float>::max());
}

TEST(Fp8Ops, GemmMatchesTheDefinition) {
  auto ctx = make_cpu_context();
  for (auto [M, N, K] : {std::array<int64_t, 3>{1, 1, 1}, {5, 3, 7}, {37, 19, 24}, {16, 32, 48}, {3, 2, 0}})
    for (DType out_dt : {DType::kF32, DType::kBF16})
      for (bool accumulate : {false, true})
        for (bool with_bias : {false, true}) {
          SCOPED_TRACE(testing::Message() << M << "x" << N << "x" << K << " out " << dtype_name(out_dt)
                                          << (accumulate ? " accumulate" : "") << (with_bias ? " bias" : ""));
          const std::vector<float> av = sample(M * K, 11, 1.0f), bv = sample(N * K, 12, 1.0f);
          Tensor a = Tensor::empty({M, K}, DType::kF8E4M3), b = Tensor::empty({N, K}, DType::kF8E5M2);
          for (int64_t i = 0; i < M * K; ++i) a.data<uint8_t>()[i] = encode(DType::kF8E4M3, av[size_t(i)]);
          for (int64_t i = 0; i < N * K; ++i) b.data<uint8_t>()[i] = encode(DType::kF8E5M2, bv[size_t(i)]);
          const float sa = 0.125f, sb = 3.0f;
          Tensor bias = host_f32(sample(N, 13, 0.0f), Shape{N});
          Tensor out32 = host_f32(sample(M * N, 14, 0.0f), Shape{M, N});
          Tensor out = Tensor::empty({M, N}, out_dt);
          ctx->ops().cast(out, out32);
          Tensor old = Tensor::empty({M, N}, DType::kF32);
          ctx->ops().cast(old, out);
          ctx->ops().fp8_gemm(out, a, scalar(sa), b, scalar(sb), with_bias ? bias.view() : TensorView(), accumulate);
          Tensor got = Tensor::empty({M, N}, DType::kF32);
          ctx->ops().cast(got, out);
          double worst = 0;
          for (int64_t i = 0; i < M; ++i)
            for (int64_t j = 0; j < N; ++j) {
              double want = with_bias ? double(bias.data<float>()[j]) : 0.0;
              for (int64_t k = 0; k < K; ++k)
                want += double(decode(DType::kF8E4M3, a.data<uint8_t>()[i * K + k]) * sa) *
                        double(decode(DType::kF8E5M2, b.data<uint8_t>()[j * K + k]) * sb);
              if (accumulate) want += old.data<float>()[i * N + j];
              const double err = std::fabs(got.data<float>()[i * N + j] - want) / std::max(1.0, std::fabs(want));
              worst = std::max(worst, err);
            }
          EXPECT_LT(worst, out_dt == DType::kF32 ? 1e-5 : 8e-3);
        }
  Tensor e5 = Tensor::empty({2, 2}, DType::kF8E5M2), o = Tensor::empty({2, 2}, DType::kF32);
  EXPECT_THROW(ctx->ops().fp8_gemm(o, e5, scalar(1), e5, scalar(1), TensorView(), false), Error);
  Tensor a3 = Tensor::empty({2, 3}, DType::kF8E4M3);
  EXPECT_THROW(ctx->ops().fp8_gemm(o, a3, scalar(1), e5, scalar(1), TensorView(), false), Error);  // K differs
}

TEST(Fp8Ops, TransposeMovesEveryElement) {
  auto ctx = make_cpu_context();
  for (DType dt : {DType::kF8E4M3, DType::kBF16, DType::kF32})
    for (auto [R, C] : {std::array<int64_t, 2>{1, 1}, {1, 7}, {5, 1}, {33, 65}, {217, 64}}) {
      Tensor x = Tensor::empty({R, C}, dt), y = Tensor::empty({C, R}, dt);
      auto* xb = static_cast<uint8_t*>(x.raw());
      const size_t es = dtype_size(dt);
      for (int64_t i = 0; i < x.nbytes(); ++i) xb[i] = uint8_t(i * 131 + 7);
      ctx->ops().transpose(y, x);
      const auto* yb = static_cast<const uint8_t*>(y.raw());
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c)
          ASSERT_EQ(std::memcmp(yb + size_t(c * R + r) * es, xb + size_t(r * C + c) * es, es), 0)
              << dtype_name(dt) << " " << R << "x" << C << " at (" << r << ", " << c << ")";
    }
  Tensor x = Tensor::empty({2, 3}, DType::kF32), bad = Tensor::empty({2, 3}, DType::kF32);
  EXPECT_THROW(ctx->ops().transpose(bad, x), Error);
}

TEST(Fp8ScalingGroup, QuantizeUpdateQuantize) {
  auto ctx = make_cpu_context();
  Fp8Recipe r;
  r.amax_history_len = 4;
  r.amax_compute_algo = AmaxComputeAlgo::kMax;
  r.margin = 1;
  Fp8ScalingGroup g(*ctx, r.backward_dtype(), 2, r);
  EXPECT_EQ(g.dtype(), DType::kF8E5M2);  // hybrid: gradients in E5M2
  EXPECT_EQ(g.scale(1).data<float>()[0], 1.0f);
  EXPECT_EQ(g.scale_inv(0).data<float>()[0], 1.0f);
  Tensor x = host_f32({0.5f, -3.0f, 2.0f}, Shape{3}), q = Tensor::empty({3}, DType::kF8E5M2);
  ctx->ops().fp8_quantize(q, x, g.scale(0), g.amax(0));
  EXPECT_EQ(g.current_amaxes().data<float>()[0], 3.0f);
  EXPECT_EQ(g.current_amaxes().data<float>()[1], 0.0f);
  g.reduce_amaxes(*make_self_communicator("data-parallel"));
  g.update();
  EXPECT_EQ(g.scale(0).data<float>()[0], (57344.0f / 3.0f) / 2.0f);
  EXPECT_EQ(g.scale(1).data<float>()[0], 1.0f);  // never saw a value: kept
  EXPECT_EQ(g.current_amaxes().data<float>()[0], 0.0f);
  // The next step's quantisation uses the new scale: 3 maps to fp8_max / 2 (the margin's headroom).
  ctx->ops().fp8_quantize(q, x, g.scale(0), g.amax(0));
  EXPECT_EQ(fp8_e5m2_to_f32(q.data<uint8_t>()[1]), -28672.0f);
  g.update();  // history max still 3 (one step ago)
  EXPECT_EQ(g.scale(0).data<float>()[0], (57344.0f / 3.0f) / 2.0f);
}

TEST(Fp8Recipe, FlagsAndFormats) {
  EXPECT_EQ(parse_fp8_format("e4m3"), Fp8Format::kE4M3);
  EXPECT_EQ(parse_fp8_format("hybrid"), Fp8Format::kHybrid);
  EXPECT_THROW(parse_fp8_format("e5m2"), UserError);
  EXPECT_EQ(parse_amax_compute_algo("max"), AmaxComputeAlgo::kMax);
  EXPECT_EQ(parse_amax_compute_algo("most_recent"), AmaxComputeAlgo::kMostRecent);
  EXPECT_THROW(parse_amax_compute_algo("mean"), UserError);
  Fp8Recipe r;
  EXPECT_EQ(r.forward_dtype(), DType::kF8E4M3);
  EXPECT_EQ(r.backward_dtype(), DType::kF8E5M2);
  r.format = Fp8Format::kE4M3;
  EXPECT_EQ(r.backward_dtype(), DType::kF8E4M3);
  r.margin = -1;
  EXPECT_THROW(r.validate(), UserError);
  r.margin = 0;
  r.amax_history_len = 0;
  EXPECT_THROW(r.validate(), UserError);
}

}  // namespace
}  // namespace loom

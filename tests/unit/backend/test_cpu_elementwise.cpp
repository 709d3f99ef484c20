// CPU elementwise ops: residual, GeLU forward/backward, bias add/backward, scale_, fill_, cast,
// has_inf_or_nan. References are f64 loops (or the core scalar conversions for casts, which
// test_core.cpp checks against an independent brute-force rounding). Tolerances are stated per check.
#include <bit>
#include <functional>

#include "cpu_test_util.h"

namespace loom::test {
namespace {

const int64_t kOddSizes[] = {1, 5, 217};

double gelu_ref(double x) {
  const double k0 = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k0 * (x + 0.044715 * x * x * x)));
}

// x in [-6, 6] plus the extremes where the tanh form saturates.
Tensor gelu_inputs(int64_t n, uint64_t seed) {
  Tensor t = uniform_tensor({n}, seed, -6.0f, 6.0f);
  const float special[] = {0.0f, -0.0f, 1e-20f, -1e-20f, 10.0f, -10.0f, 30.0f, -30.0f, 100.0f, -100.0f};
  for (int i = 0; i < 10 && i < n; ++i) t.data<float>()[i] = special[i];
  return t;
}

TEST(CpuElementwise, ResidualIsExactAndMayRunInPlace) {
  const int64_t n = 100003;  // parallel, with a tail
  Tensor a = uniform_tensor({n}, 1), b = uniform_tensor({n}, 2), out = filled({n}, 0);
  ops().residual_forward(out, a, b);
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(out.data<float>()[i], float(double(a.data<float>()[i]) + b.data<float>()[i]));
  ops().residual_forward(a, a, b);
  EXPECT_TRUE(same_bits(a, out));
  Tensor wrong = filled({n - 1}, 0);
  EXPECT_THROW(ops().residual_forward(wrong, a, b), Error);
}

TEST(CpuElementwise, GeluForwardMatchesReference) {
  for (int64_t n : {int64_t(1), int64_t(5), int64_t(217), int64_t(70001)}) {
    Tensor x = gelu_inputs(n, 3), out = filled({n}, 9);
    ops().gelu_forward(out, x);
    std::vector<double> want;
    for (int64_t i = 0; i < n; ++i) want.push_back(gelu_ref(x.data<float>()[i]));
    // sigmoid form with fast_exp, no cancellation in the negative tail, where the result ~x e^{2u} is
    // conditioned by u: one f32 rounding of u moves it by ~|2u| * 6e-8 relative (|2u| <= ~20 where the
    // result is above 1e-9). Hence 4e-6 relative, and 1e-9 absolute for the far tail.
    expect_close(out, want, 1e-9, 4e-6, "gelu n=" + std::to_string(n));
  }
}

TEST(CpuElementwise, GeluBackwardMatchesFiniteDifferencesAndOverwrites) {
  for (int64_t n : {int64_t(1), int64_t(5), int64_t(217), int64_t(70001)}) {
    Tensor x = gelu_inputs(n, 4), dout = uniform_tensor({n}, 5), dinp = filled({n}, 123.0f);
    ops().gelu_backward(dinp, x, dout);
    std::vector<double> want;
    for (int64_t i = 0; i < n; ++i) {
      const double xi = x.data<float>()[i], h = 1e-5;  // central difference on the f64 forward
      want.push_back((gelu_ref(xi + h) - gelu_ref(xi - h)) / (2 * h) * dout.data<float>()[i]);
    }
    // gelu' is O(1): 1e-6 abs (FD error ~1e-10, f32 ~1e-7) + 1e-5 rel.
    expect_close(dinp, want, 1e-6, 1e-5, "gelu' n=" + std::to_string(n));
    ops().gelu_backward(dout, x, dout);  // dinp may alias dout
    EXPECT_TRUE(same_bits(dout, dinp));
  }
}

// gelu_backward's `out`: gelu(inp) from the backward's own pass, gelu_forward's bits, with dinp unchanged
// (also when dinp aliases dout) in every dtype and thread count; out must be a buffer of its own.
TEST(CpuElementwise, GeluBackwardWithOutWritesTheForwardsBits) {
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16})
    for (int64_t n : {int64_t(1), int64_t(217), int64_t(5000)}) {
      const std::string t = std::string(dtype_name(dt)) + " n=" + std::to_string(n);
      Tensor x = uniform_of({n}, dt, 70, -7, 7), dy = uniform_of({n}, dt, 71);
      Tensor want_out = Tensor::empty({n}, dt), want_dx = Tensor::empty({n}, dt);
      ops().gelu_forward(want_out, x);
      ops().gelu_backward(want_dx, x, dy);
      for (int threads : {1, 2, 3})
        with_threads(threads, [&] {
          Tensor out = Tensor::empty({n}, dt), dx = Tensor::empty({n}, dt);
          ops().gelu_backward(dx, x, dy, out);
          EXPECT_TRUE(same_bits(out, want_out)) << t << " out, threads " << threads;
          EXPECT_TRUE(same_bits(dx, want_dx)) << t << " dinp, threads " << threads;
          Tensor alias = clone(dy), out2 = Tensor::empty({n}, dt);
          ops().gelu_backward(alias, x, alias, out2);
          EXPECT_TRUE(same_bits(out2, want_out)) << t << " out (dinp = dout), threads " << threads;
          EXPECT_TRUE(same_bits(alias, want_dx)) << t << " dinp = dout, threads " << threads;
        });
    }
  Tensor x = uniform_tensor({8}, 72), dy = uniform_tensor({8}, 73), dx = filled({8}, 0);
  EXPECT_THROW(ops().gelu_backward(dx, x, dy, dy), Error);                            // out = dout
  EXPECT_THROW(ops().gelu_backward(dx, x, dy, dx), Error);                            // out = dinp
  EXPECT_THROW(ops().gelu_backward(dx, x, dy, x.slice_flat(0, {8})), Error);          // out = inp
  EXPECT_THROW(ops().gelu_backward(dx, x, dy, filled({7}, 0)), Error);                // size
  EXPECT_THROW(ops().gelu_backward(dx, x, dy, lowp_uniform({8}, DType::kBF16, 74)), Error);  // dtype
}

TEST(CpuElementwise, BiasAddIsExactPerRow) {
  for (int64_t N : kOddSizes)
    for (int64_t C : kOddSizes) {
      Tensor out = uniform_tensor({N, C}, 6), bias = uniform_tensor({C}, 7);
      Tensor before = clone(out);
      ops().bias_add_forward(out, bias);
      for (int64_t r = 0; r < N; ++r)
        for (int64_t c = 0; c < C; ++c)
          ASSERT_EQ(out.data<float>()[r * C + c],
                    float(double(before.data<float>()[r * C + c]) + bias.data<float>()[c]));
    }
}

TEST(CpuElementwise, BiasBackwardMatchesFiniteDifferencesAndAccumulates) {
  for (int64_t N : {int64_t(1), int64_t(5), int64_t(217), int64_t(1000)})
    for (int64_t C : kOddSizes) {
      Tensor R = uniform_tensor({N, C}, 8), db = uniform_tensor({C}, 9);
      std::vector<double> want = to_f64(db);
      ops().bias_backward(db, R);
      // L(b) = sum_{r,c} (x[r,c] + b[c]) R[r,c] is linear in b: the central difference is exact up to
      // f64 rounding, so this checks the contract (column sums, +=) rather than calculus.
      std::vector<double> b(size_t(C), 0.5);
      auto objective = [&] {
        double L = 0;
        for (int64_t r = 0; r < N; ++r)
          for (int64_t c = 0; c < C; ++c) L += (1.0 + b[c]) * R.data<float>()[r * C + c];
        return L;
      };
      for (int64_t c = 0; c < C; ++c) {
        const double h = 1e-3, b0 = b[c];
        b[c] = b0 + h;
        const double lp = objective();
        b[c] = b0 - h;
        const double lm = objective();
        b[c] = b0;
        want[c] += (lp - lm) / (2 * h);
      }
      // f32 block sums of up to 1000 values in [-1, 1]: 1e-5 abs + 1e-6 rel.
      expect_close(db, want, 1e-5, 1e-6, "dbias N" + std::to_string(N) + " C" + std::to_string(C));
    }
}

TEST(CpuElementwise, BiasBackwardAcceptsBf16AndIsThreadCountIndependent) {
  const int64_t N = 1000, C = 217;
  Tensor dout = uniform_tensor({N, C}, 10), dout16 = Tensor::empty({N, C}, DType::kBF16);
  ops().cast(dout16, dout);
  Tensor db16 = filled({C}, 1.0f);
  ops().bias_backward(db16, dout16);
  std::vector<double> want(size_t(C), 1.0);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t c = 0; c < C; ++c) want[c] += bf16_to_f32(static_cast<uint16_t*>(dout16.raw())[r * C + c]);
  expect_close(db16, want, 1e-5, 1e-6, "dbias from bf16");

  Tensor db0 = uniform_tensor({C}, 11);
  std::vector<Tensor> dbs;
  for (int threads : {1, 2, 3}) {
    dbs.push_back(clone(db0));
    with_threads(threads, [&] { ops().bias_backward(dbs.back(), dout); });
  }
  EXPECT_TRUE(same_bits(dbs[0], dbs[1]));
  EXPECT_TRUE(same_bits(dbs[0], dbs[2]));
}

// The summation order is a contract: the CUDA op reproduces it for an f32 dbias, and the thread-count
// independence above rests on it. Rows in blocks of 64 summed in f32 in row order, the block sums added in
// order in f64, the old value plus that total rounded once; the result must be those bits exactly, for every
// dtype pair, on 1 and 2 threads (a row count past several blocks, with a partial last block).
TEST(CpuElementwise, BiasBackwardSumsInTheDocumentedOrder) {
  constexpr int64_t kBlock = 64;
  const int64_t N = 3 * kBlock + 37, C = 1100;  // C with a vector tail (1100 = 68 x 16 + 12)
  for (DType dt : {DType::kF32, DType::kBF16})
    for (DType bt : {DType::kF32, DType::kBF16}) {
      if (bt == DType::kBF16 && dt == DType::kF32) continue;  // a bf16 dbias goes with a bf16 dout
      Tensor dout32 = uniform_tensor({N, C}, 21), dout = Tensor::empty({N, C}, dt);
      ops().cast(dout, dout32);
      Tensor db0_32 = uniform_tensor({C}, 22), db0 = Tensor::empty({C}, bt);
      ops().cast(db0, db0_32);
      Tensor xw = Tensor::empty({N, C}, DType::kF32);  // the values the op sums (bf16 widens exactly)
      ops().cast(xw, dout);
      const float* x = xw.data<float>();
      Tensor oldw = Tensor::empty({C}, DType::kF32);
      ops().cast(oldw, db0);
      Tensor want32 = Tensor::empty({C}, DType::kF32);
      for (int64_t c = 0; c < C; ++c) {
        double total = 0;
        for (int64_t r0 = 0; r0 < N; r0 += kBlock) {
          float part = 0;
          for (int64_t r = r0; r < std::min(N, r0 + kBlock); ++r) part += x[r * C + c];
          total += double(part);
        }
        want32.data<float>()[c] = float(double(oldw.data<float>()[c]) + total);
      }
      Tensor want = Tensor::empty({C}, bt);
      ops().cast(want, want32);  // one RNE rounding of the f32 value, as the op's narrowing
      for (int threads : {1, 2}) {
        Tensor db = clone(db0);
        with_threads(threads, [&] { ops().bias_backward(db, dout); });
        EXPECT_TRUE(same_bits(db, want)) << "dout " << dtype_name(dt) << " dbias " << dtype_name(bt) << ", "
                                         << threads << " threads";
      }
    }
}

TEST(CpuElementwise, ScaleAndFill) {
  const int64_t n = 40001;
  Tensor x = uniform_tensor({n}, 12), before = clone(x);
  ops().scale_(x, 0.3f);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(x.data<float>()[i], before.data<float>()[i] * 0.3f);
  Tensor xb = Tensor::empty({n}, DType::kBF16);
  ops().cast(xb, before);
  ops().scale_(xb, -2.5f);
  for (int64_t i = 0; i < n; i += 7) {
    const uint16_t b = f32_to_bf16(before.data<float>()[i]);
    ASSERT_EQ(static_cast<uint16_t*>(xb.raw())[i], f32_to_bf16(bf16_to_f32(b) * -2.5f));
  }

  ops().fill_(x, 1.25f);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(x.data<float>()[i], 1.25f);
  struct Case {
    DType dt;
    uint32_t bits;  // expected pattern of 1.25 (or 3 for integers)
  };
  for (Case k : {Case{DType::kBF16, f32_to_bf16(1.25f)}, Case{DType::kF16, f32_to_f16(1.25f)},
                 Case{DType::kF8E4M3, f32_to_fp8_e4m3(1.25f)}, Case{DType::kF8E5M2, f32_to_fp8_e5m2(1.25f)}}) {
    Tensor t = Tensor::empty({n}, k.dt);
    ops().fill_(t, 1.25f);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t got =
          dtype_size(k.dt) == 2 ? static_cast<uint16_t*>(t.raw())[i] : static_cast<uint8_t*>(t.raw())[i];
      ASSERT_EQ(got, k.bits) << dtype_name(k.dt);
    }
  }
  Tensor i32 = Tensor::empty({n}, DType::kI32), i64 = Tensor::empty({n}, DType::kI64);
  ops().fill_(i32, 3.0f);
  ops().fill_(i64, -3.0f);
  EXPECT_EQ(i32.data<int32_t>()[n - 1], 3);
  EXPECT_EQ(i64.data<int64_t>()[0], -3);
}

// ---- casts ---------------------------------------------------------------------------------------

bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}

struct Format {
  DType dt;
  int bits;
  std::function<float(uint32_t)> decode;
  std::function<uint32_t(float)> encode;
};

std::vector<Format> formats() {
  return {
      {DType::kBF16, 16, [](uint32_t b) { return bf16_to_f32(uint16_t(b)); },
       [](float x) { return uint32_t(f32_to_bf16(x)); }},
      {DType::kF16, 16, [](uint32_t b) { return f16_to_f32(uint16_t(b)); },
       [](float x) { return uint32_t(f32_to_f16(x)); }},
      {DType::kF8E4M3, 8, [](uint32_t b) { return fp8_e4m3_to_f32(uint8_t(b)); },
       [](float x) { return uint32_t(f32_to_fp8_e4m3(x)); }},
      {DType::kF8E5M2, 8, [](uint32_t b) { return fp8_e5m2_to_f32(uint8_t(b)); },
       [](float x) { return uint32_t(f32_to_fp8_e5m2(x)); }},
  };
}

uint32_t get_bits(const Tensor& t, int64_t i) {
  return dtype_size(t.dtype()) == 2 ? static_cast<const uint16_t*>(t.raw())[i]
                                    : static_cast<const uint8_t*>(t.raw())[i];
}

// Values that stress rounding: every representable value of the format, the midpoints between
// neighbours (ties) and one f32 ulp either side, both signs; then f32 patterns with every upper-16-bit
// combination and low halves at the bf16 rounding boundary; random bit patterns; specials.
std::vector<float> hard_inputs(const Format& f) {
  std::vector<float> v;
  const uint32_t n = 1u << f.bits;
  for (uint32_t b = 0; b + 1 < n; ++b) {
    const float lo = f.decode(b), hi = f.decode(b + 1);
    v.push_back(lo);
    if (!std::isfinite(lo) || !std::isfinite(hi) || std::signbit(lo) != std::signbit(hi)) continue;
    const float mid = float((double(lo) + double(hi)) / 2);
    v.push_back(mid);
    v.push_back(std::nextafter(mid, INFINITY));
    v.push_back(std::nextafter(mid, -INFINITY));
  }
  for (uint32_t hi = 0; hi < 65536; ++hi)
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu, 0x1000u, 0x0FFFu, 0x2000u, 0x3000u})
      v.push_back(std::bit_cast<float>((hi << 16) | lo));
  std::mt19937 g(99);
  for (int i = 0; i < 1 << 20; ++i) v.push_back(std::bit_cast<float>(uint32_t(g())));
  for (float s : {INFINITY, -INFINITY, NAN, -NAN, 0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, 448.0f, 464.0f, 480.0f,
                  1e6f, 57344.0f, 61440.0f, 1e-8f, 5.96e-8f, 2.98e-8f, 3e-8f})
    v.push_back(s);
  return v;
}

TEST(CpuCast, DecodesEveryPatternLikeTheCoreConversions) {
  for (const Format& f : formats()) {
    const int64_t n = int64_t(1) << f.bits;
    Tensor src = Tensor::empty({n}, f.dt), out = filled({n}, 0);
    for (int64_t i = 0; i < n; ++i) {
      if (f.bits == 16)
        static_cast<uint16_t*>(src.raw())[i] = uint16_t(i);
      else
        static_cast<uint8_t*>(src.raw())[i] = uint8_t(i);
    }
    ops().cast(out, src);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_TRUE(same_float(out.data<float>()[i], f.decode(uint32_t(i)))) << dtype_name(f.dt) << " pattern " << i;
  }
}

TEST(CpuCast, EncodesLikeTheCoreConversionsIncludingTiesSubnormalsAndOverflow) {
  for (const Format& f : formats()) {
    const std::vector<float> in = hard_inputs(f);
    const int64_t n = int64_t(in.size());
    Tensor src = Tensor::empty({n}, DType::kF32), out = Tensor::empty({n}, f.dt);
    std::copy(in.begin(), in.end(), src.data<float>());
    ops().cast(out, src);
    int64_t mismatches = 0;
    for (int64_t i = 0; i < n; ++i)
      if (get_bits(out, i) != f.encode(in[size_t(i)]) && mismatches++ < 5)
        ADD_FAILURE() << dtype_name(f.dt) << " input " << in[size_t(i)] << " (0x" << std::hex
                      << std::bit_cast<uint32_t>(in[size_t(i)]) << ") got 0x" << get_bits(out, i) << " want 0x"
                      << f.encode(in[size_t(i)]);
    EXPECT_EQ(mismatches, 0) << dtype_name(f.dt) << " of " << n;
  }
}

TEST(CpuCast, NarrowToNarrowGoesThroughF32AndSameTypeCopies) {
  const int64_t n = 65536;
  Tensor bf = Tensor::empty({n}, DType::kBF16), h = Tensor::empty({n}, DType::kF16),
         e4 = Tensor::empty({n}, DType::kF8E4M3);
  for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(bf.raw())[i] = uint16_t(i);
  ops().cast(h, bf);
  ops().cast(e4, bf);
  for (int64_t i = 0; i < n; ++i) {
    const float x = bf16_to_f32(uint16_t(i));
    ASSERT_EQ(get_bits(h, i), f32_to_f16(x)) << i;
    ASSERT_EQ(get_bits(e4, i), f32_to_fp8_e4m3(x)) << i;
  }
  Tensor copy = Tensor::empty({n}, DType::kBF16);
  ops().cast(copy, bf);
  EXPECT_TRUE(same_bits(copy, bf));
  Tensor ints = Tensor::empty({n}, DType::kI32);
  EXPECT_THROW(ops().cast(ints, bf), Error);
}

TEST(CpuCast, HasInfOrNan) {
  const int64_t n = 100003;
  Tensor x = uniform_tensor({n}, 13, -1e30f, 1e30f);
  EXPECT_FALSE(ops().has_inf_or_nan(x));
  x.data<float>()[n - 1] = INFINITY;
  EXPECT_TRUE(ops().has_inf_or_nan(x));
  x.data<float>()[n - 1] = 0;
  x.data<float>()[0] = NAN;
  EXPECT_TRUE(ops().has_inf_or_nan(x));
  x.data<float>()[0] = 3.0e38f;  // finite in f32 and bf16
  EXPECT_FALSE(ops().has_inf_or_nan(x));
  for (const Format& f : formats()) {
    Tensor t = Tensor::empty({n}, f.dt);
    ops().cast(t, x);  // FP8 saturates, bf16 keeps 3.4e38 finite, f16 overflows to inf
    EXPECT_EQ(ops().has_inf_or_nan(t), f.dt == DType::kF16) << dtype_name(f.dt);
    Tensor y = clone(x);
    y.data<float>()[n / 2] = NAN;
    ops().cast(t, y);
    EXPECT_TRUE(ops().has_inf_or_nan(t)) << dtype_name(f.dt);
  }
}

}  // namespace
}  // namespace loom::test

// CUDA optimizer and buffer utilities against the CPU reference: AdamW over several steps (weight decay,
// grad_scale, zero_grad; within 1 ulp, by design bit-identical), sum_squares (relative 1e-12, the same
// bits twice and for an unaligned view of the same data), has_inf_or_nan (NaN last, inf in the middle,
// none), scale_ and fill_ (bit-identical), and cast over every pair of f32/bf16/f16/fp8e4m3/fp8e5m2 bit for
// bit (NaN, inf, subnormals, values beyond the fp8 range, every 8- and 16-bit pattern). Sizes 1, 5, 217 and
// 1000003; aligned (vectorised) and unaligned (scalar) views. Skips without a GPU.
#if defined(LOOM_HAVE_CUDA)
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cast.cuh"
#include "backend/cuda/optimizer.cuh"
#include "cuda_test_util.h"

namespace loom::test {
namespace {

const std::vector<int64_t> kSizes = {1, 5, 217, 1000003};
const std::vector<DType> kFloatDTypes = {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kF8E5M2};

uint32_t bits(float x) { return std::bit_cast<uint32_t>(x); }

// Units in the last place between two finite f32 of the same sign (or both zero).
int64_t ulp_diff(float a, float b) {
  if (a == b) return 0;
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<int64_t>::max();
  auto key = [](float x) {
    const int64_t u = int64_t(std::bit_cast<uint32_t>(x) & 0x7FFFFFFFu);
    return std::signbit(x) ? -u : u;
  };
  return std::llabs(key(a) - key(b));
}

int64_t max_ulp(const Tensor& got, const Tensor& ref) {
  int64_t worst = 0;
  for (int64_t i = 0; i < ref.numel(); ++i)
    worst = std::max(worst, ulp_diff(got.data<float>()[i], ref.data<float>()[i]));
  return worst;
}

// Element-wise byte comparison; reports the first few differing elements in hex.
void expect_same_elements(const Tensor& got, const Tensor& ref, const std::string& what) {
  ASSERT_EQ(got.nbytes(), ref.nbytes()) << what;
  const size_t es = dtype_size(ref.dtype());
  const auto* g = static_cast<const uint8_t*>(got.raw());
  const auto* r = static_cast<const uint8_t*>(ref.raw());
  int64_t mismatches = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    if (std::memcmp(g + i * es, r + i * es, es) == 0) continue;
    if (++mismatches <= 5) {
      uint64_t gb = 0, rb = 0;
      std::memcpy(&gb, g + i * es, es);
      std::memcpy(&rb, r + i * es, es);
      ADD_FAILURE() << what << ": element " << i << " got 0x" << std::hex << gb << " want 0x" << rb;
    }
  }
  EXPECT_EQ(mismatches, 0) << what;
}

// ---- AdamW ---------------------------------------------------------------------------------------------

TEST(CudaOptimizer, AdamWMatchesCpuOverSteps) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  for (int64_t n : kSizes) {
    for (int64_t offset : {0, 1}) {
      const std::string tag = "n=" + std::to_string(n) + " offset=" + std::to_string(offset);
      Tensor hp = random_host({n}, DType::kF32, 1 + uint64_t(n), -1.0f, 1.0f);
      Tensor hm = random_host({n}, DType::kF32, 2, -0.01f, 0.01f);
      Tensor hv = random_host({n}, DType::kF32, 3, 0.0f, 1e-4f);
      Tensor dp = to_device_at(hp, offset), dm = to_device_at(hm, offset), dv = to_device_at(hv, offset);
      AdamWParams a;
      a.lr = 3e-3f;
      a.beta1 = 0.9f;
      a.beta2 = 0.95f;
      a.eps = 1e-8f;
      a.weight_decay = 0.1f;
      for (int64_t step = 1; step <= 4; ++step) {
        a.step = step;
        a.grad_scale = step == 2 ? 0.5f : (step == 3 ? 1.0f / 65536.0f : 1.0f);
        a.zero_grad = step % 2 == 0;
        const float gmax = step == 3 ? 65536.0f : 2.0f;
        Tensor hg = random_host({n}, DType::kF32, 100 + uint64_t(step), -gmax, gmax);
        Tensor dg = to_device_at(hg, offset);
        Tensor hg_before = host_clone(hg);
        cpu_ref().adamw_update(hp, hg, hm, hv, a);
        cuda::adamw_update(ctx, dp, dg, dm, dv, a);
        const Tensor gp = to_host(dp), gm = to_host(dm), gv = to_host(dv), gg = to_host(dg);
        EXPECT_LE(max_ulp(gp, hp), 1) << "param " << tag << " step " << step;
        EXPECT_LE(max_ulp(gm, hm), 1) << "exp_avg " << tag << " step " << step;
        EXPECT_LE(max_ulp(gv, hv), 1) << "exp_avg_sq " << tag << " step " << step;
        if (a.zero_grad) {
          for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bits(gg.data<float>()[i]), 0u) << tag;
        } else {
          EXPECT_TRUE(same_bytes(gg, hg_before)) << "grad must be left alone without zero_grad " << tag;
        }
        // Keep both sides on identical state so each step is compared on its own.
        ctx.copy(dp, hp);
        ctx.copy(dm, hm);
        ctx.copy(dv, hv);
      }
    }
  }
}

TEST(CudaOptimizer, AdamWIsDeterministicAndChecksArguments) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  const int64_t n = 217;
  Tensor hp = random_host({n}, DType::kF32, 5), hg = random_host({n}, DType::kF32, 6);
  Tensor hz = Tensor::zeros({n}, DType::kF32);
  AdamWParams a;
  a.lr = 1e-3f;
  a.weight_decay = 0.01f;
  Tensor out[2];
  for (int r = 0; r < 2; ++r) {
    Tensor p = to_device(hp), g = to_device(hg), m = to_device(hz), v = to_device(hz);
    cuda::adamw_update(ctx, p, g, m, v, a);
    out[r] = to_host(p);
  }
  EXPECT_TRUE(same_bytes(out[0], out[1]));
  Tensor p = to_device(hp), g = to_device(hg), m = to_device(hz), v = to_device(hz);
  Tensor short_v = ctx.empty({n - 1}, DType::kF32), bf = ctx.empty({n}, DType::kBF16);
  EXPECT_NE(what_of([&] { cuda_ops().adamw_update(p, g, m, short_v, a); }).find("exp_avg_sq"), std::string::npos);
  EXPECT_NE(what_of([&] { cuda_ops().adamw_update(p, bf, m, v, a); }).find("f32"), std::string::npos);
  AdamWParams bad = a;
  bad.step = 0;
  EXPECT_NE(what_of([&] { cuda_ops().adamw_update(p, g, m, v, bad); }).find("1-based"), std::string::npos);
  Tensor host_p = host_clone(hp);
  EXPECT_NE(what_of([&] { cuda_ops().adamw_update(host_p, g, m, v, a); }), "no exception");
}

// The compute copy an update refreshes: the device's updated param cast to bf16/f16, bit for bit as the
// device's own cast gives it (and the CPU op's cast of the CPU's param where the params agree bitwise).
TEST(CudaOptimizer, UpdatesRefreshTheComputeCopy) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  const int64_t n = 4099;
  const Tensor hp = random_host({n}, DType::kF32, 7), hg = random_host({n}, DType::kF32, 8);
  const Tensor hz = Tensor::zeros({n}, DType::kF32);
  AdamWParams a;
  a.lr = 1e-3f;
  a.weight_decay = 0.01f;
  SgdParams sg;
  sg.lr = 1e-2f;
  for (DType dt : {DType::kBF16, DType::kF16})
    for (bool adam : {true, false}) {
      Tensor p = to_device(hp), g = to_device(hg), m = to_device(hz), v = to_device(hz);
      Tensor compute = ctx.empty({n}, dt), want = ctx.empty({n}, dt);
      cuda_ops().fill_(compute, std::numeric_limits<float>::quiet_NaN());  // an update that skips it fails
      if (adam)
        cuda_ops().adamw_update(p, g, m, v, a, compute);
      else
        cuda_ops().sgd_update(p, g, TensorView{}, sg, compute);
      cuda::cast(ctx, want, p);
      expect_same_elements(to_host(compute), to_host(want),
                           std::string(adam ? "adamw " : "sgd ") + dtype_name(dt) + " compute copy");
    }
}

// ---- SGD and count_zeros (--optimizer sgd, --log-num-zeros-in-grad) ------------------------------------

TEST(CudaOptimizer, SgdMatchesCpuBitForBit) {
  REQUIRE_GPU();
  for (int64_t n : kSizes)
    for (float momentum : {0.0f, 0.9f})
      for (float wd : {0.0f, 0.1f}) {
        const std::string tag = "n=" + std::to_string(n) + " momentum=" + std::to_string(momentum) +
                                " wd=" + std::to_string(wd);
        Tensor hp = random_host({n}, DType::kF32, 1 + uint64_t(n), -1.0f, 1.0f);
        Tensor hb = momentum != 0.0f ? random_host({n}, DType::kF32, 2, -0.1f, 0.1f) : Tensor{};
        Tensor dp = to_device_at(hp, 1), db = hb.defined() ? to_device_at(hb, 1) : Tensor{};
        SgdParams s;
        s.momentum = momentum;
        s.weight_decay = wd;
        for (int step = 1; step <= 3; ++step) {
          s.lr = 0.01f * float(step);
          s.grad_scale = step == 2 ? 0.5f : 1.0f;
          s.zero_grad = step == 3;
          Tensor hg = random_host({n}, DType::kF32, 100 + uint64_t(step), -2.0f, 2.0f);
          Tensor dg = to_device_at(hg, 1);
          cpu_ref().sgd_update(hp, hg, hb.defined() ? hb.view() : TensorView{}, s);
          cuda_ops().sgd_update(dp, dg, db.defined() ? db.view() : TensorView{}, s);
          expect_same_elements(to_host(dp), hp, "param " + tag);
          if (hb.defined()) expect_same_elements(to_host(db), hb, "momentum_buffer " + tag);
          expect_same_elements(to_host(dg), hg, "grad " + tag);
        }
      }
}

TEST(CudaOptimizer, CountZerosMatchesCpu) {
  REQUIRE_GPU();
  for (int64_t n : kSizes)
    for (DType dt : kFloatDTypes) {
      Tensor h32 = random_host({n}, DType::kF32, 7 + uint64_t(n), -1.0f, 1.0f);
      for (int64_t i = 0; i < n; i += 3) h32.data<float>()[i] = (i % 2) ? -0.0f : 0.0f;
      Tensor h = Tensor::empty({n}, dt);
      cpu_ref().cast(h, h32);
      const int64_t want = cpu_ref().count_zeros(h);
      EXPECT_GE(want, (n + 2) / 3);
      EXPECT_EQ(cuda_ops().count_zeros(to_device_at(h, 1)), want) << dtype_name(dt) << " n=" << n;
    }
}

TEST(CudaOptimizer, AbsStatsMatchesCpu) {
  REQUIRE_GPU();
  for (int64_t n : kSizes) {
    Tensor h = random_host({n}, DType::kF32, 9 + uint64_t(n), -2.0f, 2.0f);
    const AbsStats want = cpu_ref().abs_stats(h);
    const AbsStats got = cuda_ops().abs_stats(to_device_at(h, 1));
    EXPECT_NEAR(got.sum_abs, want.sum_abs, 1e-12 * want.sum_abs) << n;
    EXPECT_NEAR(got.sum_sqrt_abs, want.sum_sqrt_abs, 1e-12 * want.sum_sqrt_abs) << n;
    EXPECT_EQ(got.max_abs, want.max_abs) << n;
  }
}

// ---- sum_squares ---------------------------------------------------------------------------------------

TEST(CudaOptimizer, SumSquaresMatchesCpuAndIsDeterministic) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  for (DType dt : kFloatDTypes) {
    for (int64_t n : kSizes) {
      const std::string tag = std::string(dtype_name(dt)) + " n=" + std::to_string(n);
      Tensor h = random_host({n}, dt, 11 + uint64_t(n), -3.0f, 3.0f);
      const double ref = cpu_ref().sum_squares(h);
      Tensor d = to_device(h);
      const double got = cuda::sum_squares(ctx, d);
      EXPECT_NEAR(got, ref, 1e-12 * std::fabs(ref)) << tag;
      const double again = cuda::sum_squares(ctx, d);
      EXPECT_EQ(std::bit_cast<uint64_t>(got), std::bit_cast<uint64_t>(again)) << "not deterministic: " << tag;
      // The split depends on numel only: an unaligned copy of the same data gives the same bits.
      Tensor u = to_device_at(h, 1);
      EXPECT_EQ(std::bit_cast<uint64_t>(cuda::sum_squares(ctx, u)), std::bit_cast<uint64_t>(got))
          << "alignment changed the result: " << tag;
    }
  }
  // Exact small case and the empty tensor.
  Tensor h = Tensor::empty({3}, DType::kF32);
  h.data<float>()[0] = 1.0f;
  h.data<float>()[1] = -2.0f;
  h.data<float>()[2] = 0.5f;
  EXPECT_EQ(cuda::sum_squares(ctx, to_device(h)), 5.25);
  EXPECT_EQ(cuda::sum_squares(ctx, ctx.empty({0}, DType::kF32)), 0.0);
  EXPECT_NE(what_of([&] { cuda_ops().sum_squares(ctx.empty({4}, DType::kI32)); }), "no exception");
}

// ---- has_inf_or_nan ------------------------------------------------------------------------------------

TEST(CudaOptimizer, HasInfOrNanMatchesCpu) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  for (DType dt : kFloatDTypes) {
    for (int64_t n : kSizes) {
      for (int64_t offset : {0, 1}) {
        const std::string tag =
            std::string(dtype_name(dt)) + " n=" + std::to_string(n) + " offset=" + std::to_string(offset);
        Tensor h = random_host({n}, dt, 21 + uint64_t(n), -100.0f, 100.0f);
        EXPECT_FALSE(cuda::has_inf_or_nan(ctx, to_device_at(h, offset))) << "none: " << tag;
        EXPECT_FALSE(cpu_ref().has_inf_or_nan(h)) << tag;

        Tensor nan_last = host_clone(h);
        host_set(nan_last, n - 1, -std::numeric_limits<float>::quiet_NaN());
        EXPECT_TRUE(cuda::has_inf_or_nan(ctx, to_device_at(nan_last, offset))) << "NaN last: " << tag;

        Tensor inf_mid = host_clone(h);
        // The FP8 codec saturates (TE's conversion), so E5M2's infinity is written as its bits, 0x7C.
        if (dt == DType::kF8E5M2)
          inf_mid.data<uint8_t>()[n / 2] = 0x7C;
        else
          host_set(inf_mid, n / 2, std::numeric_limits<float>::infinity());
        // e4m3 has no inf (it saturates to 448): the CPU decides what the GPU must answer.
        EXPECT_EQ(cuda::has_inf_or_nan(ctx, to_device_at(inf_mid, offset)), cpu_ref().has_inf_or_nan(inf_mid))
            << "inf in the middle: " << tag;
        if (dt != DType::kF8E4M3) {
          EXPECT_TRUE(cpu_ref().has_inf_or_nan(inf_mid)) << tag;
        }
      }
    }
  }
  // Largest finite values are finite.
  for (DType dt : kFloatDTypes) {
    Tensor h = Tensor::empty({5}, dt);
    for (int64_t i = 0; i < 5; ++i) host_set(h, i, i % 2 ? float(dtype_max(dt)) : -float(dtype_max(dt)));
    EXPECT_FALSE(cuda::has_inf_or_nan(ctx, to_device(h))) << dtype_name(dt);
  }
  EXPECT_FALSE(cuda::has_inf_or_nan(ctx, ctx.empty({0}, DType::kBF16)));
}

// ---- scale_ and fill_ ------------------------------------------------------------------------------------

// Random values plus the hard ones (signed NaN, inf, zero, subnormal, near-max), rounded to dt.
Tensor hard_values(DType dt, int64_t n, uint64_t seed) {
  Tensor h = random_host({n}, dt, seed, -4.0f, 4.0f);
  const float special[] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                           std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                           0.0f, -0.0f, 1e-40f, -3e-8f, float(dtype_max(dt)), 1.5e-5f};
  for (int64_t i = 0; i < n && i < int64_t(std::size(special)); ++i) host_set(h, (i * 7) % n, special[i]);
  return h;
}

TEST(CudaOptimizer, ScaleMatchesCpuBitForBit) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  for (DType dt : kFloatDTypes) {
    for (int64_t n : kSizes) {
      for (int64_t offset : {0, 1}) {
        for (float s : {0.37f, -2.0f, 1e-3f}) {
          const std::string tag = std::string(dtype_name(dt)) + " n=" + std::to_string(n) + " offset=" +
                                  std::to_string(offset) + " s=" + std::to_string(s);
          Tensor h = hard_values(dt, n, 31 + uint64_t(n));
          Tensor d = to_device_at(h, offset);
          cpu_ref().scale_(h, s);
          cuda::scale_(ctx, d, s);
          expect_same_elements(to_host(d), h, "scale_ " + tag);
        }
      }
    }
  }
}

TEST(CudaOptimizer, FillMatchesCpuBitForBit) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  std::vector<DType> dts = kFloatDTypes;
  dts.insert(dts.end(), {DType::kI32, DType::kI64, DType::kU16});
  for (DType dt : dts) {
    for (int64_t n : kSizes) {
      for (int64_t offset : {0, 1}) {
        for (float value : {0.0f, 1.7f, -3.25f, 1e6f, 1e-6f}) {
          if (dt == DType::kU16 && (value < 0 || value > 65535.0f)) continue;  // no u16 value: UB to convert
          const std::string tag = std::string(dtype_name(dt)) + " n=" + std::to_string(n) +
                                  " offset=" + std::to_string(offset) + " value=" + std::to_string(value);
          Tensor h = Tensor::empty({n}, dt);
          std::memset(h.raw(), 0x5A, size_t(h.nbytes()));
          Tensor d = to_device_at(h, offset);
          cpu_ref().fill_(h, value);
          cuda::fill_(ctx, d, value);
          expect_same_elements(to_host(d), h, "fill_ " + tag);
        }
      }
    }
  }
  // Elements around the view are untouched.
  Tensor big = ctx.empty({7}, DType::kF32);
  cuda::fill_(ctx, big, 2.0f);
  cuda::fill_(ctx, big.slice_flat(1, {5}), -1.0f);
  Tensor back = to_host(big);
  EXPECT_EQ(back.data<float>()[0], 2.0f);
  EXPECT_EQ(back.data<float>()[1], -1.0f);
  EXPECT_EQ(back.data<float>()[5], -1.0f);
  EXPECT_EQ(back.data<float>()[6], 2.0f);
}

// ---- cast ------------------------------------------------------------------------------------------------

// Inputs in dt that cover its whole encoding: every pattern (8- and 16-bit formats, cycled over n), or for
// f32 the hard values (signed NaNs with payloads, inf, f32 subnormals, ties of every narrower format,
// values beyond the fp8 and f16 ranges) then random bit patterns and random normals of several scales.
Tensor cast_inputs(DType dt, int64_t n, uint64_t seed) {
  Tensor h = Tensor::empty({n}, dt);
  std::mt19937_64 g(seed);
  if (dt == DType::kF32) {
    const float f32_special[] = {
        0.0f, -0.0f, 1.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
        std::bit_cast<float>(0x7F800001u), std::bit_cast<float>(0xFFC12345u), std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::denorm_min(), -1e-40f,
        std::numeric_limits<float>::min(), std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
        448.0f, 464.0f, 480.0f, -500.0f, 57344.0f, 61440.0f, 1e5f, 65504.0f, 65519.0f, 65520.0f, 70000.0f,
        std::bit_cast<float>(0x3F808000u), std::bit_cast<float>(0x3F818000u), std::ldexp(1.0f, -9),
        std::ldexp(1.5f, -10), std::ldexp(1.0f, -16), std::ldexp(3.0f, -18), std::ldexp(1.0f, -24),
        std::ldexp(1.0f, -25), std::ldexp(1.5f, -24), std::ldexp(1.0f, -14), std::ldexp(1.0f, -6),
        std::ldexp(1.0f, -7), std::ldexp(1.0f, -10), std::ldexp(1.0f, -17), std::ldexp(1.25f, -15)};
    std::uniform_int_distribution<uint32_t> any_bits;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const float scales[] = {1.0f, 1e-3f, 1e-6f, 300.0f, 5e4f, 1e-8f};
    float* p = h.data<float>();
    for (int64_t i = 0; i < n; ++i) {
      if (i < int64_t(std::size(f32_special))) p[i] = f32_special[i];
      else if (i % 3 == 0) p[i] = std::bit_cast<float>(any_bits(g));
      else p[i] = normal(g) * scales[i % 6];
    }
  } else if (dtype_size(dt) == 2) {
    uint16_t* p = static_cast<uint16_t*>(h.raw());
    for (int64_t i = 0; i < n; ++i) p[i] = uint16_t((i * 40503) ^ (i >> 16));  // every pattern once per 65536
  } else {
    uint8_t* p = static_cast<uint8_t*>(h.raw());
    for (int64_t i = 0; i < n; ++i) p[i] = uint8_t(i * 37 + (i >> 8));
  }
  return h;
}

// f16 -> f32 NaNs: the CPU's vector widening may set the quiet bit where the scalar one does not (NaN
// payloads are not part of the widening contract); every other element must match bit for bit.
void expect_cast_equal(const Tensor& got, const Tensor& ref, DType in_dt, const std::string& what) {
  if (!(in_dt == DType::kF16 && ref.dtype() == DType::kF32)) return expect_same_elements(got, ref, what);
  int64_t mismatches = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const uint32_t g = bits(got.data<float>()[i]), r = bits(ref.data<float>()[i]);
    const bool ok = g == r || (std::isnan(ref.data<float>()[i]) && (g | 0x00400000u) == (r | 0x00400000u));
    if (!ok && ++mismatches <= 5)
      ADD_FAILURE() << what << ": element " << i << " got 0x" << std::hex << g << " want 0x" << r;
  }
  EXPECT_EQ(mismatches, 0) << what;
}

TEST(CudaOptimizer, CastEveryPairMatchesCpuBitForBit) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  for (DType in_dt : kFloatDTypes) {
    for (DType out_dt : kFloatDTypes) {
      for (int64_t n : {int64_t(1), int64_t(5), int64_t(217), int64_t(65536 + 1003)}) {
        for (int64_t offset : {0, 1}) {
          const std::string tag = std::string(dtype_name(in_dt)) + " -> " + dtype_name(out_dt) +
                                  " n=" + std::to_string(n) + " offset=" + std::to_string(offset);
          Tensor h = cast_inputs(in_dt, n, 41 + uint64_t(n));
          Tensor ref = Tensor::empty({n}, out_dt);
          cpu_ref().cast(ref, h);
          Tensor d_in = to_device_at(h, offset);
          Tensor d_out = Tensor::empty({n + offset}, out_dt, ctx.device()).slice_flat(offset, {n});
          cuda::cast(ctx, d_out, d_in);
          expect_cast_equal(to_host(d_out), ref, in_dt, "cast " + tag);
        }
      }
    }
  }
}

TEST(CudaOptimizer, CastChecksArguments) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  Tensor a = ctx.empty({4}, DType::kF32), b = ctx.empty({5}, DType::kBF16), i32 = ctx.empty({4}, DType::kI32);
  EXPECT_NE(what_of([&] { cuda_ops().cast(b, a); }).find("elements"), std::string::npos);
  EXPECT_NE(what_of([&] { cuda_ops().cast(i32, a); }), "no exception");
  EXPECT_NE(what_of([&] { cuda_ops().cast(a, i32); }), "no exception");
  Tensor host = Tensor::empty({4}, DType::kF32);
  EXPECT_NE(what_of([&] { cuda_ops().cast(a, host); }), "no exception");
  // Empty tensors are a no-op.
  cuda::cast(ctx, ctx.empty({0}, DType::kF16), ctx.empty({0}, DType::kF8E4M3));
}

}  // namespace
}  // namespace loom::test
#endif  // LOOM_HAVE_CUDA

// CUDA FP8 ops against the CPU reference: quantise (bits and amax, including NaN/inf inputs and every kind of
// old amax), dequantise (all 256 codes of both formats into f32/bf16/f16), the delayed-scaling update (amax
// 0, inf, NaN, tiny amaxes whose scale overflows, history roll), all bit-identical to the CPU (two NaNs count
// as equal: their payloads are not part of the contract); fp8_gemm for both formats, out dtypes, f32 and
// 16-bit biases (out's dtype or another), accumulate, on shapes that take cuBLASLt's FP8 path (K, N multiples
// of 16) and shapes that take the dequantise fallback; transpose for 1-, 2- and 4-byte elements. Aligned and
// unaligned views.
// Skips without a visible GPU.
#include <gtest/gtest.h>

#if defined(LOOM_HAVE_CUDA)
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/fp8.cuh"
#include "cuda_test_util.h"

namespace loom::test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

Tensor host_scalar(float v) {
  Tensor t = Tensor::empty({1}, DType::kF32);
  t.data<float>()[0] = v;
  return t;
}

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

// Element-wise bit equality; two NaNs (in the tensors' dtype) are equal.
void expect_same_bits(const Tensor& got, const Tensor& ref, const std::string& what) {
  ASSERT_EQ(got.dtype(), ref.dtype()) << what;
  ASSERT_EQ(got.numel(), ref.numel()) << what;
  const size_t es = dtype_size(got.dtype());
  for (int64_t i = 0; i < got.numel(); ++i) {
    const float g = host_get(got, i), r = host_get(ref, i);
    if (std::isnan(g) && std::isnan(r)) continue;
    if (std::memcmp(static_cast<const char*>(got.raw()) + i * es, static_cast<const char*>(ref.raw()) + i * es, es)) {
      ADD_FAILURE() << what << ": element " << i << " differs (got " << g << ", ref " << r << ")";
      return;
    }
  }
}

// A device tensor holding `host`'s bytes at element offset 1 of a longer buffer (an unaligned view), and the
// buffer that keeps it alive.
struct OffsetView {
  Tensor buf;
  TensorView view;
};
OffsetView offset_device(const Tensor& host) {
  const int64_t n = host.numel();
  Tensor h = Tensor::zeros({n + 1}, host.dtype());
  std::memcpy(static_cast<char*>(h.raw()) + dtype_size(host.dtype()), host.raw(), size_t(host.nbytes()));
  OffsetView o;
  o.buf = to_device(h);
  o.view = o.buf.view().slice_flat(1, host.shape());
  return o;
}

Tensor random_fp8_codes(int64_t n, DType dt, uint64_t seed) {
  Tensor t = Tensor::empty({n}, dt);
  std::mt19937_64 g(seed);
  for (int64_t i = 0; i < n; ++i) t.data<uint8_t>()[i] = uint8_t(i < 256 ? i : g() & 0xFF);  // every code first
  return t;
}

// ---- quantise -------------------------------------------------------------------------------------------------

TEST(CudaFp8, QuantizeBitIdenticalToCpu) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  uint64_t seed = 1;
  const float old_amaxes[] = {0.0f, 0.25f, 1e6f, NAN, kInf, -1.0f};
  for (DType in_dt : {DType::kF32, DType::kBF16, DType::kF16})
    for (DType out_dt : {DType::kF8E4M3, DType::kF8E5M2})
      for (int64_t n : {int64_t(1), int64_t(5), int64_t(217), int64_t(4099), int64_t(1 << 20) + 3})
        for (int special = 0; special < 3; ++special)  // 0: plain, 1: saturating/tiny values, 2: NaN and inf too
          for (float old_amax : old_amaxes) {
            Tensor inp = random_host({n}, in_dt, seed++, -8.0f, 8.0f);
            if (special >= 1 && n >= 5) {
              host_set(inp, 0, 6e4f);     // saturates e4m3 (and e5m2 after scaling)
              host_set(inp, 1, -1e-6f);   // underflows to a subnormal or -0
              host_set(inp, 2, -0.0f);
              host_set(inp, 3, 0.0137f);  // a subnormal fp8 code after scaling
            }
            if (special == 2 && n >= 5) {
              host_set(inp, 4, NAN);
              host_set(inp, n - 1, -kInf);
            }
            const float scale = 3.7f;
            Tensor out_ref = Tensor::empty({n}, out_dt), amax_ref = host_scalar(old_amax);
            cpu_ref().fp8_quantize(out_ref, inp, host_scalar(scale), amax_ref);
            Tensor d_out = Tensor::empty({n}, out_dt, ctx.device()), d_amax = to_device(host_scalar(old_amax));
            cuda::fp8_quantize(ctx, d_out, to_device(inp), to_device(host_scalar(scale)), d_amax);
            const std::string what = std::string("quantize ") + dtype_name(in_dt) + " -> " + dtype_name(out_dt) +
                                     " n=" + std::to_string(n) + " special=" + std::to_string(special) +
                                     " old amax " + std::to_string(old_amax);
            expect_same_bits(to_host(d_out), out_ref, what);
            const float got_amax = to_host(d_amax).data<float>()[0], ref_amax = amax_ref.data<float>()[0];
            EXPECT_EQ(bits_of(got_amax), bits_of(ref_amax)) << what << ": amax " << got_amax << " vs " << ref_amax;
          }
}

TEST(CudaFp8, QuantizeUnalignedViews) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  for (DType in_dt : {DType::kF32, DType::kBF16})
    for (int64_t n : {int64_t(7), int64_t(1001)}) {
      Tensor inp = random_host({n}, in_dt, 77, -100.0f, 100.0f);
      Tensor out_ref = Tensor::empty({n}, DType::kF8E4M3), amax_ref = host_scalar(0.0f);
      cpu_ref().fp8_quantize(out_ref, inp, host_scalar(2.0f), amax_ref);
      // Unaligned input with an aligned output, then both unaligned.
      for (int both = 0; both < 2; ++both) {
        OffsetView in_v = offset_device(inp);
        OffsetView out_v = offset_device(Tensor::zeros({n}, DType::kF8E4M3));
        Tensor out_aligned = Tensor::empty({n}, DType::kF8E4M3, ctx.device());
        TensorView out = both ? out_v.view : out_aligned.view();
        Tensor d_amax = to_device(host_scalar(0.0f));
        cuda::fp8_quantize(ctx, out, in_v.view, to_device(host_scalar(2.0f)), d_amax);
        const std::string what = std::string("unaligned quantize ") + dtype_name(in_dt) + " n=" + std::to_string(n);
        expect_same_bits(to_host(out), out_ref, what);
        EXPECT_EQ(to_host(d_amax).data<float>()[0], amax_ref.data<float>()[0]) << what;
      }
    }
}

// ---- dequantise ----------------------------------------------------------------------------------------------

TEST(CudaFp8, DequantizeBitIdenticalToCpu) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  for (DType in_dt : {DType::kF8E4M3, DType::kF8E5M2})
    for (DType out_dt : {DType::kF32, DType::kBF16, DType::kF16})
      for (int64_t n : {int64_t(1), int64_t(5), int64_t(256 * 3 + 5)})
        for (float scale_inv : {1.0f, 0.37f, 1e-3f, 3e4f}) {
          Tensor inp = random_fp8_codes(n, in_dt, uint64_t(n));
          Tensor ref = Tensor::empty({n}, out_dt);
          cpu_ref().fp8_dequantize(ref, inp, host_scalar(scale_inv));
          const std::string what = std::string("dequantize ") + dtype_name(in_dt) + " -> " + dtype_name(out_dt) +
                                   " n=" + std::to_string(n) + " scale_inv " + std::to_string(scale_inv);
          Tensor d_out = Tensor::empty({n}, out_dt, ctx.device());
          cuda::fp8_dequantize(ctx, d_out, to_device(inp), to_device(host_scalar(scale_inv)));
          expect_same_bits(to_host(d_out), ref, what);
          // The scalar path: both views one element into their buffers.
          OffsetView in_v = offset_device(inp), out_v = offset_device(Tensor::zeros({n}, out_dt));
          cuda::fp8_dequantize(ctx, out_v.view, in_v.view, to_device(host_scalar(scale_inv)));
          expect_same_bits(to_host(out_v.view), ref, what + " (unaligned)");
        }
}

// ---- delayed-scaling update ----------------------------------------------------------------------------------

TEST(CudaFp8, UpdateScalingIdenticalToCpu) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  uint64_t seed = 900;
  for (int64_t L : {int64_t(1), int64_t(4)})
    for (int64_t n : {int64_t(1), int64_t(6), int64_t(217)})
      for (bool use_max : {false, true})
        for (int margin : {0, 2})
          for (float fp8_max : {448.0f, 57344.0f}) {
            Tensor hist = random_host({L, n}, DType::kF32, seed++, 0.0f, 10.0f);
            Tensor scale = random_host({n}, DType::kF32, seed++, 0.5f, 2.0f);
            Tensor scale_inv = random_host({n}, DType::kF32, seed++, 0.5f, 2.0f);
            float* h = hist.data<float>();
            auto at = [&](int64_t r, int64_t j) -> float& { return h[r * n + j]; };
            // Per-column cases (as far as the width allows): amax 0 everywhere -> keep the scale; +inf and NaN
            // in an older row; a subnormal amax whose scale overflows f32; a zero newest row with older data.
            if (n >= 6) {
              for (int64_t r = 0; r < L; ++r) at(r, 0) = 0.0f;
              at(L - 1, 1) = kInf;
              at(L - 1, 2) = NAN;
              for (int64_t r = 0; r < L; ++r) at(r, 3) = 1e-40f;
              at(0, 4) = 0.0f;
              at(0, 5) = kInf;
            }
            Tensor d_hist = to_device(hist), d_scale = to_device(scale), d_scale_inv = to_device(scale_inv);
            cpu_ref().fp8_update_scaling(hist, scale, scale_inv, fp8_max, margin, use_max);
            cuda::fp8_update_scaling(ctx, d_hist, d_scale, d_scale_inv, fp8_max, margin, use_max);
            const std::string what = "update_scaling L=" + std::to_string(L) + " n=" + std::to_string(n) +
                                     (use_max ? " max" : " most_recent") + " margin=" + std::to_string(margin) +
                                     " fp8_max=" + std::to_string(fp8_max);
            expect_same_bits(to_host(d_hist), hist, what + " history");
            expect_same_bits(to_host(d_scale), scale, what + " scale");
            expect_same_bits(to_host(d_scale_inv), scale_inv, what + " scale_inv");
          }
}

TEST(CudaFp8, UpdateScalingRejectsBadArguments) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  const Device dev = ctx.device();
  Tensor hist = to_device(Tensor::zeros({2, 3}, DType::kF32));
  Tensor s = Tensor::empty({3}, DType::kF32, dev), si = Tensor::empty({3}, DType::kF32, dev);
  EXPECT_ANY_THROW(cuda_ops().fp8_update_scaling(hist, s, si, 448.0f, -1, true));
  EXPECT_ANY_THROW(cuda_ops().fp8_update_scaling(hist, s, si, 0.0f, 0, true));
  EXPECT_ANY_THROW(cuda_ops().fp8_update_scaling(hist, Tensor::empty({2}, DType::kF32, dev), si, 448.0f, 0, true));
  EXPECT_ANY_THROW(cuda_ops().fp8_update_scaling(hist, Tensor::empty({3}, DType::kF32), si, 448.0f, 0, true));
  EXPECT_ANY_THROW(cuda_ops().fp8_update_scaling(Tensor::empty({6}, DType::kF32, dev), s, si, 448.0f, 0, true));
}

// ---- fp8_gemm ------------------------------------------------------------------------------------------------

struct GemmCase {
  int64_t M, N, K;
  bool tensor_core_shape;  // K and N multiples of 16: cuBLASLt's FP8 path on sm_89+, else the fallback
};

TEST(CudaFp8, GemmMatchesCpu) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  const std::vector<GemmCase> cases = {{32, 48, 64, true},  {5, 16, 16, true},  {217, 64, 32, true},
                                       {1, 16, 48, true},   {64, 128, 256, true}, {5, 17, 64, false},
                                       {17, 32, 5, false},  {1, 1, 1, false},   {217, 5, 17, false}};
  const std::pair<DType, DType> formats[] = {{DType::kF8E4M3, DType::kF8E4M3},
                                             {DType::kF8E4M3, DType::kF8E5M2},
                                             {DType::kF8E5M2, DType::kF8E4M3}};
  uint64_t seed = 3000;
  for (const auto& [a_dt, b_dt] : formats)
    for (DType out_dt : {DType::kF32, DType::kBF16, DType::kF16})
      for (int bias_mode = 0; bias_mode < 4; ++bias_mode) {  // none, f32, out's dtype, another 16-bit dtype
        if (bias_mode == 2 && out_dt == DType::kF32) continue;
        const DType other16 = out_dt == DType::kBF16 ? DType::kF16 : DType::kBF16;  // nn::Fp8Gemm: bf16 bias, f32 out
        const DType bias_dt = bias_mode == 3 ? other16 : bias_mode == 2 ? out_dt : DType::kF32;
        for (bool accumulate : {false, true})
          for (const GemmCase& c : cases) {
            // Operands quantised on the CPU from [-1, 1) with power-of-two scales (scale_inv exact).
            const float sa = 64.0f, sb = 16.0f;
            Tensor a = Tensor::empty({c.M, c.K}, a_dt), b = Tensor::empty({c.N, c.K}, b_dt);
            Tensor amax = host_scalar(0.0f);
            cpu_ref().fp8_quantize(a, random_host({c.M, c.K}, DType::kF32, seed++), host_scalar(sa), amax);
            cpu_ref().fp8_quantize(b, random_host({c.N, c.K}, DType::kF32, seed++), host_scalar(sb), amax);
            Tensor bias = bias_mode ? random_host({c.N}, bias_dt, seed++) : Tensor();
            Tensor out0 = random_host({c.M, c.N}, out_dt, seed++);
            Tensor ref = host_clone(out0);
            cpu_ref().fp8_gemm(ref, a, host_scalar(1.0f / sa), b, host_scalar(1.0f / sb), bias, accumulate);
            Tensor d_out = to_device(out0);
            cuda::fp8_gemm(ctx, d_out, to_device(a), to_device(host_scalar(1.0f / sa)), to_device(b),
                           to_device(host_scalar(1.0f / sb)), bias_mode ? TensorView(to_device(bias)) : TensorView(),
                           accumulate);
            // The tensor cores scale the f32 sum once instead of each operand and accumulate FP8 products in
            // their own order and precision: a looser bound there, plus the output rounding for 16-bit outputs
            // (seen on an H200: 4.2e-3 for an f16 output where the sum cancels to 1.4); the fallback is the
            // CPU's own arithmetic.
            const float tol = out_dt == DType::kF32 ? (c.tensor_core_shape ? 4e-3f : 1e-4f)
                                                    : std::max(default_tol(out_dt), c.tensor_core_shape ? 8e-3f : 4e-3f);
            const std::string what = std::string("fp8_gemm ") + dtype_name(a_dt) + " x " + dtype_name(b_dt) +
                                     " -> " + dtype_name(out_dt) +
                                     (bias_mode ? std::string(" bias ") + dtype_name(bias_dt) : std::string()) +
                                     (accumulate ? " accumulate" : "") + " M=" + std::to_string(c.M) +
                                     " N=" + std::to_string(c.N) + " K=" + std::to_string(c.K);
            expect_close(d_out, ref, tol, what);
          }
      }
}

TEST(CudaFp8, GemmFlattensLeadingDimsAndIsDeterministic) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  const int64_t B = 3, T = 11, K = 64, N = 48;
  Tensor a = Tensor::empty({B, T, K}, DType::kF8E4M3), b = Tensor::empty({N, K}, DType::kF8E4M3);
  Tensor amax = host_scalar(0.0f);
  cpu_ref().fp8_quantize(a, random_host({B, T, K}, DType::kF32, 71), host_scalar(32.0f), amax);
  cpu_ref().fp8_quantize(b, random_host({N, K}, DType::kF32, 72), host_scalar(32.0f), amax);
  Tensor bias = random_host({N}, DType::kBF16, 73);
  Tensor ref = Tensor::empty({B, T, N}, DType::kBF16);
  cpu_ref().fp8_gemm(ref, a, host_scalar(1.0f / 32), b, host_scalar(1.0f / 32), bias, false);
  Tensor d_a = to_device(a), d_b = to_device(b), d_si = to_device(host_scalar(1.0f / 32)), d_bias = to_device(bias);
  Tensor runs[2];
  for (auto& r : runs) {
    Tensor d_out = Tensor::empty({B, T, N}, DType::kBF16, ctx.device());
    cuda::fp8_gemm(ctx, d_out, d_a, d_si, d_b, d_si, d_bias, false);
    r = to_host(d_out);
  }
  expect_close(runs[0], ref, default_tol(DType::kBF16), "fp8_gemm (B, T, K)");
  EXPECT_TRUE(same_bytes(runs[0], runs[1])) << "fp8_gemm differs between runs";
}

// The delayed-scaling state keeps a layer's scales side by side, so scale_inv pointers are 4-byte aligned
// views; cuBLASLt's FP8 kernels refuse those at launch, and fp8_gemm copies them to an aligned scratch.
TEST(CudaFp8, GemmScalesAtAnyOffsetOfTheirBuffer) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  const int64_t M = 64, N = 96, K = 128;
  Tensor a = Tensor::empty({M, K}, DType::kF8E4M3), b = Tensor::empty({N, K}, DType::kF8E4M3);
  Tensor amax = host_scalar(0.0f);
  cpu_ref().fp8_quantize(a, random_host({M, K}, DType::kF32, 91), host_scalar(16.0f), amax);
  cpu_ref().fp8_quantize(b, random_host({N, K}, DType::kF32, 92), host_scalar(64.0f), amax);
  Tensor ref = Tensor::empty({M, N}, DType::kBF16);
  cpu_ref().fp8_gemm(ref, a, host_scalar(1.0f / 16), b, host_scalar(1.0f / 64), TensorView(), false);
  Tensor scales = Tensor::empty({4}, DType::kF32);
  scales.data<float>()[0] = 0.0f;
  scales.data<float>()[1] = 1.0f / 16;
  scales.data<float>()[2] = 0.0f;
  scales.data<float>()[3] = 1.0f / 64;
  Tensor d_scales = to_device(scales);
  Tensor d_out = Tensor::empty({M, N}, DType::kBF16, ctx.device());
  testing::internal::CaptureStderr();  // lt_matmul says so when cuBLASLt refuses and the fallback runs
  cuda::fp8_gemm(ctx, d_out, to_device(a), d_scales.slice_flat(1, Shape{1}), to_device(b),
                 d_scales.slice_flat(3, Shape{1}), TensorView(), false);
  ctx.synchronize();
  const std::string said = testing::internal::GetCapturedStderr();
  expect_close(d_out, ref, 8e-3f, "fp8_gemm with scale_inv views at offsets 1 and 3");
  EXPECT_EQ(said.find("refused"), std::string::npos) << "the tensor-core FP8 path was not taken: " << said;
}

TEST(CudaFp8, GemmUnalignedOperandsFallBack) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  const int64_t M = 17, N = 32, K = 32;
  Tensor a = Tensor::empty({M, K}, DType::kF8E4M3), b = Tensor::empty({N, K}, DType::kF8E5M2);
  Tensor amax = host_scalar(0.0f);
  cpu_ref().fp8_quantize(a, random_host({M, K}, DType::kF32, 81), host_scalar(8.0f), amax);
  cpu_ref().fp8_quantize(b, random_host({N, K}, DType::kF32, 82), host_scalar(8.0f), amax);
  Tensor ref = Tensor::empty({M, N}, DType::kF32);
  cpu_ref().fp8_gemm(ref, a, host_scalar(0.125f), b, host_scalar(0.125f), TensorView(), false);
  OffsetView a_v = offset_device(a), b_v = offset_device(b);
  Tensor d_out = Tensor::empty({M, N}, DType::kF32, ctx.device());
  Tensor d_si = to_device(host_scalar(0.125f));
  cuda::fp8_gemm(ctx, d_out, a_v.view, d_si, b_v.view, d_si, TensorView(), false);
  expect_close(d_out, ref, 1e-4f, "fp8_gemm with unaligned operands");
}

TEST(CudaFp8, GemmRejectsBadArguments) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  const Device dev = ctx.device();
  Tensor a4 = Tensor::empty({4, 16}, DType::kF8E4M3, dev), b4 = Tensor::empty({8, 16}, DType::kF8E4M3, dev);
  Tensor a5 = Tensor::empty({4, 16}, DType::kF8E5M2, dev), b5 = Tensor::empty({8, 16}, DType::kF8E5M2, dev);
  Tensor si = to_device(host_scalar(1.0f)), out = Tensor::empty({4, 8}, DType::kF32, dev);
  EXPECT_ANY_THROW(cuda_ops().fp8_gemm(out, a5, si, b5, si, TensorView(), false));  // E5M2 x E5M2
  EXPECT_ANY_THROW(cuda_ops().fp8_gemm(out, Tensor::empty({4, 16}, DType::kBF16, dev), si, b4, si, TensorView(), false));
  EXPECT_ANY_THROW(cuda_ops().fp8_gemm(out, Tensor::empty({4, 15}, DType::kF8E4M3, dev), si, b4, si, TensorView(), false));
  EXPECT_ANY_THROW(cuda_ops().fp8_gemm(Tensor::empty({4, 7}, DType::kF32, dev), a4, si, b4, si, TensorView(), false));
  EXPECT_ANY_THROW(cuda_ops().fp8_gemm(out, a4, si, b4, si, Tensor::empty({7}, DType::kF32, dev), false));
  EXPECT_ANY_THROW(cuda_ops().fp8_gemm(out, a4, si, b4, si, Tensor::empty({8}, DType::kF8E4M3, dev), false));
  EXPECT_ANY_THROW(cuda_ops().fp8_gemm(out, a4, host_scalar(1.0f), b4, si, TensorView(), false));  // host scale
  EXPECT_ANY_THROW(cuda_ops().fp8_gemm(Tensor::empty({4, 8}, DType::kF8E4M3, dev), a4, si, b4, si, TensorView(), false));
}

// ---- transpose ---------------------------------------------------------------------------------------------

TEST(CudaFp8, TransposeAllElementSizes) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1}, {5, 217}, {217, 5}, {64, 33}, {1, 300}, {300, 1}, {1000, 70}};
  uint64_t seed = 500;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kF8E5M2})
    for (const auto& [R, C] : shapes) {
      Tensor inp = random_host({R, C}, dt, seed++, -4.0f, 4.0f);
      Tensor ref = Tensor::empty({C, R}, dt);
      cpu_ref().transpose(ref, inp);
      Tensor d_out = Tensor::empty({C, R}, dt, ctx.device());
      cuda::transpose(ctx, d_out, to_device(inp));
      const std::string what = std::string("transpose ") + dtype_name(dt) + " (" + std::to_string(R) + ", " +
                               std::to_string(C) + ")";
      EXPECT_TRUE(same_bytes(to_host(d_out), ref)) << what;
    }
  // i32 (4-byte, non-float) through an unaligned view.
  Tensor ints = Tensor::empty({37, 19}, DType::kI32);
  for (int64_t i = 0; i < ints.numel(); ++i) ints.data<int32_t>()[i] = int32_t(i * 2654435761u);
  Tensor ref = Tensor::empty({19, 37}, DType::kI32);
  cpu_ref().transpose(ref, ints);
  OffsetView in_v = offset_device(ints);
  Tensor d_out = Tensor::empty({19, 37}, DType::kI32, ctx.device());
  cuda::transpose(ctx, d_out, in_v.view);
  EXPECT_TRUE(same_bytes(to_host(d_out), ref)) << "transpose i32 (unaligned input)";

  EXPECT_ANY_THROW(cuda_ops().transpose(Tensor::empty({5, 4}, DType::kF32, ctx.device()),
                                   Tensor::empty({5, 4}, DType::kF32, ctx.device())));
  EXPECT_ANY_THROW(cuda_ops().transpose(Tensor::empty({4, 5}, DType::kBF16, ctx.device()),
                                   Tensor::empty({5, 4}, DType::kF32, ctx.device())));
  EXPECT_ANY_THROW(cuda_ops().transpose(Tensor::empty({4, 5}, DType::kI64, ctx.device()),
                                   Tensor::empty({5, 4}, DType::kI64, ctx.device())));
}

}  // namespace
}  // namespace loom::test
#endif  // LOOM_HAVE_CUDA

// Matmul (oneDNN) against a double-precision reference: f32 through sgemm and bf16 inputs through the
// matmul primitive (bf16 x bf16 -> f32 accumulate), odd shapes, overwrite vs accumulate semantics.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "loom/backend/device_context.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/matmul_internal.h"
#include "loom/core/rng.h"

using namespace loom;

namespace {

Tensor randn(Shape s, uint64_t stream) {
  Tensor t = Tensor::empty(s, DType::kF32);
  philox_fill_normal(t.data<float>(), t.numel(), 11, stream, 0, 0.0f, 1.0f);
  return t;
}

Tensor to_bf16(const Tensor& x) {
  Tensor y = Tensor::empty(x.shape(), DType::kBF16);
  for (int64_t i = 0; i < x.numel(); ++i) y.data<uint16_t>()[i] = f32_to_bf16(x.data<float>()[i]);
  return y;
}

Tensor bf16_rounded(const Tensor& x) {
  Tensor y = Tensor::empty(x.shape(), DType::kF32);
  for (int64_t i = 0; i < x.numel(); ++i) y.data<float>()[i] = bf16_to_f32(f32_to_bf16(x.data<float>()[i]));
  return y;
}

// Reference out = x W^T + b in double.
std::vector<double> ref_forward(const Tensor& x, const Tensor& w, const Tensor* b) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  std::vector<double> out(size_t(M * N));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = b ? b->data<float>()[n] : 0.0;
      for (int64_t k = 0; k < K; ++k) s += double(x.data<float>()[m * K + k]) * w.data<float>()[n * K + k];
      out[size_t(m * N + n)] = s;
    }
  return out;
}

double max_rel(const float* got, const std::vector<double>& ref) {
  double mr = 1e-30, md = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    mr = std::max(mr, std::fabs(ref[i]));
    md = std::max(md, std::fabs(double(got[i]) - ref[i]));
  }
  return md / mr;
}

}  // namespace

TEST(CpuMatmul, F32OddShapesForwardBackward) {
  auto ctx = make_cpu_context();
  for (int64_t M : {1, 5, 217})
    for (int64_t K : {1, 5, 217})
      for (int64_t N : {1, 5, 217}) {
        Tensor x = randn({M, K}, 1), w = randn({N, K}, 2), b = randn({N}, 3), dout = randn({M, N}, 4);
        Tensor out = Tensor::empty({M, N}, DType::kF32);
        ctx->ops().matmul_forward(out, x, w, b);
        EXPECT_LT(max_rel(out.data<float>(), ref_forward(x, w, &b)), 1e-6) << M << "x" << K << "x" << N;
        // dinp = dout W (overwrite); dW += dout^T x (accumulate on a pre-filled buffer).
        Tensor dinp = randn({M, K}, 5), dw = randn({N, K}, 6), db = randn({N}, 7);
        const Tensor dw0 = randn({N, K}, 6), db0 = randn({N}, 7);
        ctx->ops().matmul_backward(dinp, dw, db, dout, x, w);
        std::vector<double> rdinp(size_t(M * K), 0.0), rdw(size_t(N * K), 0.0), rdb(size_t(N), 0.0);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t k = 0; k < K; ++k)
            for (int64_t n = 0; n < N; ++n)
              rdinp[size_t(m * K + k)] += double(dout.data<float>()[m * N + n]) * w.data<float>()[n * K + k];
        for (int64_t n = 0; n < N; ++n) {
          rdb[size_t(n)] = db0.data<float>()[n];
          for (int64_t m = 0; m < M; ++m) rdb[size_t(n)] += dout.data<float>()[m * N + n];
          for (int64_t k = 0; k < K; ++k) {
            double s = dw0.data<float>()[n * K + k];
            for (int64_t m = 0; m < M; ++m) s += double(dout.data<float>()[m * N + n]) * x.data<float>()[m * K + k];
            rdw[size_t(n * K + k)] = s;
          }
        }
        EXPECT_LT(max_rel(dinp.data<float>(), rdinp), 1e-6);
        EXPECT_LT(max_rel(dw.data<float>(), rdw), 1e-6);
        EXPECT_LT(max_rel(db.data<float>(), rdb), 1e-6);
      }
}

TEST(CpuMatmul, Bf16InputsAccumulateInF32) {
  auto ctx = make_cpu_context();
  for (int64_t M : {1, 5, 217}) {
    const int64_t K = 96, N = 37;
    Tensor x = randn({M, K}, 8), w = randn({N, K}, 9), b = randn({N}, 10);
    Tensor out = Tensor::empty({M, N}, DType::kF32);
    ctx->ops().matmul_forward(out, to_bf16(x), to_bf16(w), b);
    // The products of bf16 values are exact in f32, so against the reference built from the rounded
    // inputs only the f32 accumulation differs: a tight tolerance catches any bf16 rounding of sums.
    const Tensor xr = bf16_rounded(x), wr = bf16_rounded(w);
    EXPECT_LT(max_rel(out.data<float>(), ref_forward(xr, wr, &b)), 1e-6) << M;
    // And it really is bf16 arithmetic: against the unrounded f32 inputs it differs at bf16 precision.
    const double vs_f32 = max_rel(out.data<float>(), ref_forward(x, w, &b));
    EXPECT_GT(vs_f32, 1e-5);
    EXPECT_LT(vs_f32, 2e-2);
  }
}

TEST(CpuMatmul, ShapeErrorsNameTheTensor) {
  auto ctx = make_cpu_context();
  Tensor x = randn({4, 3}, 1), w = randn({5, 2}, 2), out = Tensor::empty({4, 5}, DType::kF32);
  try {
    ctx->ops().matmul_forward(out, x, w, TensorView());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("inp expected (4, 2)"), std::string::npos) << e.what();
  }
}

// f32 products give the same bits whatever the thread count, small ones included: an output smaller than
// one 64-wide piece (LoRA's rank-r products: dA (r, in) over the tokens, h = x A^T) runs on one thread
// rather than letting oneDNN split its reduction between threads.
TEST(CpuMatmul, F32BitsDoNotDependOnTheThreadCount) {
  auto ctx = make_cpu_context();
  struct Case {
    int64_t M, K, N;
  };
  for (const Case c : {Case{512, 64, 8}, Case{512, 8, 64}, Case{4096, 16, 16}, Case{300, 96, 200}}) {
    const Tensor x = randn({c.M, c.K}, 1), w = randn({c.N, c.K}, 2), dout = randn({c.M, c.N}, 3);
    std::vector<std::vector<float>> outs;
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      Tensor y = Tensor::empty({c.M, c.N}, DType::kF32), dx = Tensor::empty({c.M, c.K}, DType::kF32);
      Tensor dw = Tensor::zeros({c.N, c.K}, DType::kF32);
      ctx->ops().matmul_forward(y, x, w, TensorView());
      ctx->ops().matmul_backward(dx, dw, TensorView(), dout, x, w);
      std::vector<float> all;
      for (const Tensor* t : {&y, &dx, &dw}) all.insert(all.end(), t->data<float>(), t->data<float>() + t->numel());
      outs.push_back(std::move(all));
    }
    EXPECT_TRUE(outs[0] == outs[1]) << "M=" << c.M << " K=" << c.K << " N=" << c.N;
  }
  omp_set_num_threads(2);
}

// bf16 input gradients dout · W whose reduction is long against their width (the LM head's, an expert
// fc1's) run in oneDNN's gemm-based kernel through one primitive with a runtime row count: right for any
// row count (against the double reference of the bf16-rounded inputs), one cached primitive for all of
// them, and the same bits for any thread count, also above M/64 + K/64 threads, where that kernel would
// cut the reduction between threads if Loom did not hold it to fewer.
TEST(CpuMatmul, Bf16LongReductionInputGradients) {
  auto ctx = make_cpu_context();
  if (!cpu::matmul_caches_shapes(DType::kBF16)) GTEST_SKIP() << "bf16 runs without cached primitives on this CPU";
  const int64_t N = 2048, K = 64;  // weight (N, K); the product's reduction runs over N, 32x its width K
  const Tensor wf = randn({N, K}, 21), w = to_bf16(wf), wr = bf16_rounded(wf);
  const size_t built_before = cpu::matmul_built_primitives();
  for (int64_t M : {256, 300, 1000}) {
    const Tensor df = randn({M, N}, 22), dout = to_bf16(df), dr = bf16_rounded(df);
    std::vector<double> ref(size_t(M * K), 0.0);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k)
          ref[size_t(m * K + k)] += double(dr.data<float>()[m * N + n]) * wr.data<float>()[n * K + k];
    std::vector<std::vector<float>> outs;
    for (int threads : {1, 2, 8}) {  // 8 > 256/64 + 64/64 = 5
      omp_set_num_threads(threads);
      Tensor dinp = Tensor::empty({M, K}, DType::kF32);
      ctx->ops().matmul_backward(dinp, TensorView(), TensorView(), dout, TensorView(), w);
      EXPECT_LT(max_rel(dinp.data<float>(), ref), 1e-6) << "M=" << M << " threads=" << threads;
      outs.emplace_back(dinp.data<float>(), dinp.data<float>() + dinp.numel());
    }
    omp_set_num_threads(2);
    EXPECT_TRUE(outs[0] == outs[1] && outs[0] == outs[2]) << "M=" << M << ": bits depend on the thread count";
  }
  EXPECT_EQ(cpu::matmul_built_primitives(), built_before + 1) << "one runtime-row primitive for every M";
}

// bf16 weight gradients dW += dout^T · x over more than 512 tokens (GPT-2's and Llama's linears) also run
// in the gemm-based kernel, through one primitive with a runtime token count: they accumulate onto
// the f32 gradient already there, match the double reference of the bf16 inputs, and give the same bits
// for 1, 2 and 40 threads (more than 1024/64 + 1024/64, the count from which oneDNN's gemm may start
// cutting a reduction between threads; at this output size it does not).
// dW (N, K) += dout^T · x over M tokens in bf16 onto a random f32 gradient, on 1, 2 and 40 threads: the same
// bits on all three, and every `row_step`-th row of dW within 1e-6 of the double sum of the bf16-rounded
// inputs. Seeds seed .. seed + 4.
void check_bf16_weight_gradient(DeviceContext& ctx, int64_t N, int64_t K, int64_t M, uint64_t seed,
                                int64_t row_step) {
  const Tensor w = to_bf16(randn({N, K}, seed));  // gives the shape; the weight gradient does not read it
  const Tensor df = randn({M, N}, seed + 1), xf = randn({M, K}, seed + 2), dw0 = randn({N, K}, seed + 3);
  const Tensor dout = to_bf16(df), x = to_bf16(xf), dr = bf16_rounded(df), xr = bf16_rounded(xf);
  std::vector<std::vector<float>> outs;
  for (int threads : {1, 2, 40}) {
    omp_set_num_threads(threads);
    Tensor dw = Tensor::empty({N, K}, DType::kF32);
    std::memcpy(dw.raw(), dw0.raw(), size_t(dw.nbytes()));
    ctx.ops().matmul_backward(TensorView(), dw, TensorView(), dout, x, w);
    outs.emplace_back(dw.data<float>(), dw.data<float>() + dw.numel());
  }
  omp_set_num_threads(2);
  EXPECT_TRUE(outs[0] == outs[1] && outs[0] == outs[2]) << "M=" << M << ": bits depend on the thread count";
  double worst = 0, scale = 1e-30;
  for (int64_t n = 0; n < N; n += row_step)
    for (int64_t k = 0; k < K; ++k) {
      double ref = dw0.data<float>()[n * K + k];
      for (int64_t m = 0; m < M; ++m) ref += double(dr.data<float>()[m * N + n]) * xr.data<float>()[m * K + k];
      worst = std::max(worst, std::fabs(ref - double(outs[0][size_t(n * K + k)])));
      scale = std::max(scale, std::fabs(ref));
    }
  EXPECT_LT(worst / scale, 1e-6) << "M=" << M;
}

TEST(CpuMatmul, Bf16LargeWeightGradients) {
  auto ctx = make_cpu_context();
  if (!cpu::matmul_caches_shapes(DType::kBF16)) GTEST_SKIP() << "bf16 runs without cached primitives on this CPU";
  const size_t built_before = cpu::matmul_built_primitives();
  for (int64_t M : {1024, 1100}) check_bf16_weight_gradient(*ctx, 1024, 1024, M, 30, 37);  // 2^20 outputs
  EXPECT_EQ(cpu::matmul_built_primitives(), built_before + 1) << "one runtime-reduction primitive for every M";
}

// Large weight gradients over a few hundred tokens (MoE expert groups, short steps): on CPUs without AMX they
// go to oneDNN's gemm-based kernel from 128 tokens on (matmul.cpp, runtime_dim), one primitive for every
// token count; on AMX ones they stay on brgemm, one primitive per shape. Either way the checks above hold.
TEST(CpuMatmul, Bf16LargeWeightGradientsOverFewTokens) {
  auto ctx = make_cpu_context();
  if (!cpu::matmul_caches_shapes(DType::kBF16)) GTEST_SKIP() << "bf16 runs without cached primitives on this CPU";
  const size_t built_before = cpu::matmul_built_primitives();
  for (int64_t M : {128, 300, 512}) check_bf16_weight_gradient(*ctx, 3072, 1024, M, 40, 97);  // 3 x 2^20 outputs
  EXPECT_EQ(cpu::matmul_built_primitives(), built_before + (cpu::matmul_uses_amx() ? 3 : 1))
      << (cpu::matmul_uses_amx() ? "one brgemm primitive per token count" : "one runtime-reduction primitive");
}

// The bf16 primitives are cached per product shape, at most matmul_max_cached_primitives() of them: a run
// of ever new row counts (inference's prompt lengths) drops the least recently used, and a shape asked for
// again after its primitive was dropped gets a new one with the same bits.
TEST(CpuMatmul, Bf16PrimitiveCacheIsBounded) {
  auto ctx = make_cpu_context();
  if (!cpu::matmul_caches_shapes(DType::kBF16)) GTEST_SKIP() << "bf16 runs without cached primitives on this CPU";
  const int64_t K = 16, N = 8, max = int64_t(cpu::matmul_max_cached_primitives());
  const Tensor w = to_bf16(randn({N, K}, 1)), x = to_bf16(randn({max + 40, K}, 2));
  auto product = [&](int64_t M) {
    Tensor out = Tensor::empty({M, N}, DType::kF32);
    ctx->ops().matmul_forward(out, x.view().slice_flat(0, {M, K}), w, TensorView());
    return out;
  };
  const Tensor first = product(1);
  for (int64_t M = 2; M <= max + 40; ++M) {
    product(M);
    ASSERT_LE(cpu::matmul_cached_primitives(), size_t(max)) << "after M = " << M;
  }
  EXPECT_EQ(cpu::matmul_cached_primitives(), size_t(max));
  const size_t built = cpu::matmul_built_primitives();
  const Tensor again = product(1);  // M = 1's primitive was the least recently used: dropped, built again
  EXPECT_EQ(cpu::matmul_built_primitives(), built + 1);
  EXPECT_EQ(std::memcmp(first.raw(), again.raw(), size_t(first.nbytes())), 0);
}

// run()'s results on 1, 2 and 3 threads, in that order (the team is 2 again afterwards).
template <class F>
std::vector<std::vector<float>> on_1_2_3_threads(F&& run) {
  std::vector<std::vector<float>> out;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    out.push_back(run());
  }
  omp_set_num_threads(2);
  return out;
}

// sgemm_fixed_split's cut: along the larger dimension on AVX-512; without it, a grid whose every piece stays
// on oneDNN's copy-based AVX2 kernels where the strips would not and the whole product is (GPT-2's and
// Llama's layer shapes; 768 x 768 has no such grid of 2 or more and 256 x 768 is on the no-copy kernels
// whole: both keep the strips), the pieces covering the output exactly.
TEST(CpuMatmul, F32PiecesStayOnCopyKernelsWithoutAvx512) {
  using cpu::matmul_detail::sgemm_copy_based_avx2;
  using cpu::matmul_detail::sgemm_pieces;
  const cpu::matmul_detail::SgemmPieces wide = sgemm_pieces(2048, 3072, true);
  EXPECT_EQ(wide.pm, 1);
  EXPECT_EQ(wide.pn, 16);
  EXPECT_EQ(wide.step_n, 192);
  const cpu::matmul_detail::SgemmPieces tall = sgemm_pieces(2048, 768, true);
  EXPECT_EQ(tall.pm, 16);
  EXPECT_EQ(tall.pn, 1);
  EXPECT_EQ(tall.step_m, 128);
  struct Shape {
    int64_t M, N, count;  // count: the pieces expected without AVX-512
    bool copy_based = true;  // every piece on the copy-based kernels
  };
  for (const Shape s : {Shape{2048, 3072, 16}, Shape{768, 3072, 6}, Shape{3072, 768, 6}, Shape{2048, 2304, 16},
                        Shape{2304, 768, 4}, Shape{2048, 768, 4}, Shape{50304, 768, 16}, Shape{4096, 8192, 16},
                        Shape{2048, 2048, 12}, Shape{768, 768, 12, false}, Shape{256, 768, 12, false}}) {
    const cpu::matmul_detail::SgemmPieces p = sgemm_pieces(s.M, s.N, false);
    EXPECT_EQ(p.pm * p.pn, s.count) << s.M << " x " << s.N;
    std::vector<int> covered(size_t(s.M * s.N), 0);
    for (int64_t i = 0; i < p.pm; ++i)
      for (int64_t j = 0; j < p.pn; ++j) {
        const int64_t m0 = i * p.step_m, n0 = j * p.step_n;
        ASSERT_LT(m0, s.M);
        ASSERT_LT(n0, s.N);
        const int64_t mb = std::min(p.step_m, s.M - m0), nb = std::min(p.step_n, s.N - n0);
        EXPECT_TRUE((p.pm == 1 || p.step_m % 8 == 0) && (p.pn == 1 || p.step_n % 8 == 0));
        if (s.copy_based) {
          EXPECT_TRUE(sgemm_copy_based_avx2(mb, nb)) << s.M << " x " << s.N << ": piece " << mb << " x " << nb;
        }
        for (int64_t r = m0; r < m0 + mb; ++r)
          for (int64_t c = n0; c < n0 + nb; ++c) ++covered[size_t(r * s.N + c)];
      }
    EXPECT_TRUE(std::all_of(covered.begin(), covered.end(), [](int v) { return v == 1; })) << s.M << " x " << s.N;
  }
}

// The products whose pieces the AVX2 grid changes keep their bits for any thread count and match the double
// reference (on an AVX2 CPU, or oneDNN capped at AVX2, they run as grids; elsewhere as strips).
TEST(CpuMatmul, F32GridPiecesAnyThreadCount) {
  auto ctx = make_cpu_context();
  const int64_t M = 40, K = 768, N = 3072;  // dweight (N, K) over M tokens: 3072 x 768, a grid of 6 on AVX2
  const Tensor x = randn({M, K}, 1), w = randn({N, K}, 2), dout = randn({M, N}, 3);
  auto run = [&] {
    Tensor dw = Tensor::zeros({N, K}, DType::kF32);
    ctx->ops().matmul_backward(TensorView(), dw, TensorView(), dout, x, w);
    return std::vector<float>(dw.data<float>(), dw.data<float>() + dw.numel());
  };
  const std::vector<std::vector<float>> got = on_1_2_3_threads(run);
  EXPECT_TRUE(got[0] == got[1] && got[0] == got[2]);
  for (int64_t n = 0; n < N; n += 97)
    for (int64_t k = 0; k < K; k += 31) {
      double want = 0;
      for (int64_t m = 0; m < M; ++m) want += double(dout.data<float>()[m * N + n]) * x.data<float>()[m * K + k];
      EXPECT_NEAR(got[0][size_t(n * K + k)], want, 1e-4) << n << ", " << k;
    }
}

// Sets one of matmul.cpp's switches (on by default) for a scope.
template <void (*Set)(bool)>
class MatmulSwitch {
 public:
  explicit MatmulSwitch(bool on) { Set(on); }
  ~MatmulSwitch() { Set(true); }
  MatmulSwitch(const MatmulSwitch&) = delete;
  MatmulSwitch& operator=(const MatmulSwitch&) = delete;
};
// Whether bf16 products pack their B operand (cpu::set_matmul_packing), and whether bf16 forwards may run
// swapped (cpu::set_matmul_swapping).
using Packing = MatmulSwitch<cpu::set_matmul_packing>;
using Swapping = MatmulSwitch<cpu::set_matmul_swapping>;

// bf16 forward products over at least 256 rows, and input-gradient products over any, take their weight
// packed by Loom into oneDNN's blocked layout on CPUs with AVX512-BF16 and without AMX (matmul.cpp, packs_b): transposed
// (forward, B = W^T) and as stored (input gradient, B = W), over several 32-row and 64-column blocks, a
// last block part past the width zero-filled, with a fused bias and a bf16 output. Each product must match
// the double reference of the bf16-rounded inputs, give the same bits on 1, 2 and 3 threads, and give the
// bits of the same product on the weight as stored (the kernel is the same; only who packs B differs), so
// a misplaced element cannot hide in the rounding. A reduction that is no multiple of 32 is not packed and
// stays right.
TEST(CpuMatmul, Bf16PackedWeights) {
  auto ctx = make_cpu_context();
  if (!cpu::matmul_caches_shapes(DType::kBF16)) GTEST_SKIP() << "bf16 runs without cached primitives on this CPU";
  struct Case {
    int64_t M, N, K;  // forward out (M, N) = x (M, K) W^T; input gradient (M, K) = dout (M, N) W
    bool forward_packs, dinp_packs;  // without AMX
  };
  const bool packs = cpu::matmul_uses_avx512_bf16() && !cpu::matmul_uses_amx();
  for (const Case c : {Case{256, 192, 128, true, true}, Case{300, 128, 256, true, true}, Case{256, 96, 80, false, true},
                       Case{256, 100, 64, true, false}, Case{64, 96, 160, false, true}}) {
    const Tensor xf = randn({c.M, c.K}, 50), wf = randn({c.N, c.K}, 51), bf = randn({c.N}, 52);
    const Tensor df = randn({c.M, c.N}, 53);
    const Tensor x = to_bf16(xf), w = to_bf16(wf), dout = to_bf16(df);
    const Tensor xr = bf16_rounded(xf), wr = bf16_rounded(wf), dr = bf16_rounded(df);
    const std::vector<double> ref_out = ref_forward(xr, wr, &bf);
    std::vector<double> ref_dinp(size_t(c.M * c.K), 0.0);
    for (int64_t m = 0; m < c.M; ++m)
      for (int64_t n = 0; n < c.N; ++n)
        for (int64_t k = 0; k < c.K; ++k)
          ref_dinp[size_t(m * c.K + k)] += double(dr.data<float>()[m * c.N + n]) * wr.data<float>()[n * c.K + k];
    // f32 output with bias, bf16 output with bias, f32 input gradient: all three concatenated.
    auto run = [&]() {
      Tensor out = Tensor::empty({c.M, c.N}, DType::kF32), out16 = Tensor::empty({c.M, c.N}, DType::kBF16);
      Tensor dinp = Tensor::empty({c.M, c.K}, DType::kF32);
      ctx->ops().matmul_forward(out, x, w, bf);
      ctx->ops().matmul_forward(out16, x, w, to_bf16(bf));
      ctx->ops().matmul_backward(dinp, TensorView(), TensorView(), dout, TensorView(), w);
      EXPECT_LT(max_rel(out.data<float>(), ref_out), 1e-6) << "forward, M=" << c.M;
      EXPECT_LT(max_rel(dinp.data<float>(), ref_dinp), 1e-6) << "input gradient, M=" << c.M;
      std::vector<float> all(out.data<float>(), out.data<float>() + out.numel());
      for (int64_t i = 0; i < out16.numel(); ++i) all.push_back(bf16_to_f32(out16.data<uint16_t>()[i]));
      all.insert(all.end(), dinp.data<float>(), dinp.data<float>() + dinp.numel());
      return all;
    };
    const size_t before = cpu::matmul_packed_products();
    const std::vector<std::vector<float>> packed = on_1_2_3_threads(run);
    const size_t ran_packed = cpu::matmul_packed_products() - before;
    const size_t per_run = (c.forward_packs ? 2u : 0u) + (c.dinp_packs ? 1u : 0u);
    EXPECT_EQ(ran_packed, packs ? 3 * per_run : 0u) << "M=" << c.M << " N=" << c.N << " K=" << c.K;
    EXPECT_TRUE(packed[0] == packed[1] && packed[0] == packed[2]) << "M=" << c.M << ": bits depend on the thread count";
    std::vector<float> as_stored;
    {
      const Packing off(false);
      as_stored = run();
    }
    EXPECT_EQ(cpu::matmul_packed_products(), before + ran_packed);
    EXPECT_TRUE(as_stored == packed[0]) << "M=" << c.M << ": packed and stored B give other bits";
  }
}

// bf16 forwards without a bias, over 32 rows or more, whose weight is the larger side (M (N + K) <= N K) run
// swapped on CPUs without AMX (matmul.cpp, swaps_forward): out^T = W · x^T, then transposed into out by
// 16 x 16 register transposes with element-wise edges. Row counts and widths that are no multiple of 16 or
// 32 put elements in both, in f32 and in bf16 outputs. Each must match the double reference of the
// bf16-rounded inputs, give the same bits on 1, 2 and 3 threads (the bf16 output the f32 one rounded once),
// and agree with the product run unswapped (these reductions give the same sums either way); a product with
// a bias, over fewer rows, past the line, or with an output over 64 MB runs as before.
TEST(CpuMatmul, Bf16SwappedForward) {
  auto ctx = make_cpu_context();
  if (!cpu::matmul_caches_shapes(DType::kBF16)) GTEST_SKIP() << "bf16 runs without cached primitives on this CPU";
  struct Case {
    int64_t M, N, K;
    bool bias, swaps;  // swaps: without AMX
  };
  const bool amx = cpu::matmul_uses_amx();
  for (const Case c : {Case{45, 203, 160, false, true}, Case{64, 256, 512, false, true},
                       Case{33, 517, 96, false, true}, Case{130, 1031, 64, false, false},
                       Case{80, 1536, 1280, false, true}, Case{16, 517, 96, false, false},
                       Case{45, 203, 160, true, false}, Case{200, 96, 96, false, false}}) {
    const Tensor xf = randn({c.M, c.K}, 60), wf = randn({c.N, c.K}, 61), bf = randn({c.N}, 62);
    const Tensor x = to_bf16(xf), w = to_bf16(wf), b16 = to_bf16(bf), bias_r = bf16_rounded(bf);
    const std::vector<double> ref = ref_forward(bf16_rounded(xf), bf16_rounded(wf), c.bias ? &bias_r : nullptr);
    // The f32 output, then the bf16 one widened.
    auto run = [&]() {
      Tensor out = Tensor::empty({c.M, c.N}, DType::kF32), out16 = Tensor::empty({c.M, c.N}, DType::kBF16);
      ctx->ops().matmul_forward(out, x, w, c.bias ? TensorView(b16) : TensorView());
      ctx->ops().matmul_forward(out16, x, w, c.bias ? TensorView(b16) : TensorView());
      std::vector<float> all(out.data<float>(), out.data<float>() + out.numel());
      for (int64_t i = 0; i < out16.numel(); ++i) all.push_back(bf16_to_f32(out16.data<uint16_t>()[i]));
      return all;
    };
    const std::string at = std::to_string(c.M) + "x" + std::to_string(c.N) + "x" + std::to_string(c.K);
    const size_t n = ref.size();
    const size_t before = cpu::matmul_swapped_products();
    const std::vector<std::vector<float>> got = on_1_2_3_threads(run);
    EXPECT_EQ(cpu::matmul_swapped_products() - before, c.swaps && !amx ? 6u : 0u) << at;
    EXPECT_TRUE(got[0] == got[1] && got[0] == got[2]) << at << ": bits depend on the thread count";
    EXPECT_LT(max_rel(got[0].data(), ref), 1e-6) << at << ", f32 output";
    for (size_t i = 0; i < n; ++i)
      ASSERT_EQ(got[0][n + i], bf16_to_f32(f32_to_bf16(got[0][i]))) << at << ", bf16 output element " << i;
    std::vector<float> unswapped;
    {
      const Swapping off(false);
      unswapped = run();
    }
    EXPECT_LT(max_rel(unswapped.data(), ref), 1e-6) << at << ", unswapped";
    EXPECT_TRUE(unswapped == got[0]) << at << ": swapped and unswapped give other bits";
  }
  // An output over 64 MB is not swapped (its scratch would be kept): 32 x 532,480 in f32 is 68 MB; in bf16
  // (34 MB) it is. Small integers make every sum exact: out[m][n] = sum_k (m % 3 + 1) ((n + k) % 5 - 2).
  const int64_t M = 32, N = 532480, K = 64;
  Tensor x = Tensor::empty({M, K}, DType::kBF16), w = Tensor::empty({N, K}, DType::kBF16);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) x.data<uint16_t>()[m * K + k] = f32_to_bf16(float(m % 3 + 1));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) w.data<uint16_t>()[n * K + k] = f32_to_bf16(float((n + k) % 5 - 2));
  Tensor out = Tensor::empty({M, N}, DType::kF32), out16 = Tensor::empty({M, N}, DType::kBF16);
  const size_t before = cpu::matmul_swapped_products();
  ctx->ops().matmul_forward(out, x, w, TensorView());
  EXPECT_EQ(cpu::matmul_swapped_products(), before) << "a 68 MB output ran swapped";
  ctx->ops().matmul_forward(out16, x, w, TensorView());
  EXPECT_EQ(cpu::matmul_swapped_products(), before + (amx ? 0u : 1u)) << "a 34 MB output";
  for (int64_t m : {int64_t(0), int64_t(1), int64_t(17), M - 1})
    for (int64_t n : {int64_t(0), int64_t(3), int64_t(4097), N - 1}) {
      double ref = 0;
      for (int64_t k = 0; k < K; ++k) ref += double(m % 3 + 1) * double((n + k) % 5 - 2);
      ASSERT_EQ(out.data<float>()[m * N + n], ref) << m << ", " << n;
      ASSERT_EQ(bf16_to_f32(out16.data<uint16_t>()[m * N + n]), float(ref)) << m << ", " << n;
    }
}

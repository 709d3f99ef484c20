// RMSNorm CPU ops (rmsnorm_forward / rmsnorm_backward / residual_rmsnorm_forward). The forward is compared with
// an f64 loop written here, the backward with central finite differences of that loop for L = sum(out * R)
// (R random), with gradient buffers pre-filled with non-zero values: dinp (residual stream) and dweight must
// ACCUMULATE. bf16/f16 calls must give exactly the RNE rounding of the f32 op on the widened inputs (f32
// outputs: the same bits), and every reduction must be bit-identical with 1, 2 and 3 OpenMP threads.
// Shapes are odd (1, 5, 217; 300 rows span several reduction blocks).
#include <string>

#include "cpu_test_util.h"

namespace loom::test {
namespace {

constexpr float kEps = 1e-5f;
const int64_t kOdd[] = {1, 5, 217};

std::string tag(int64_t N, int64_t C) { return " N" + std::to_string(N) + " C" + std::to_string(C); }

// out = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps), in f64.
std::vector<double> rmsnorm_ref(const std::vector<double>& x, const std::vector<double>& w, int64_t N, int64_t C,
                                std::vector<double>* rstd = nullptr) {
  std::vector<double> out(size_t(N * C));
  for (int64_t n = 0; n < N; ++n) {
    double ms = 0;
    for (int64_t c = 0; c < C; ++c) ms += x[n * C + c] * x[n * C + c];
    const double s = 1.0 / std::sqrt(ms / double(C) + double(kEps));
    for (int64_t c = 0; c < C; ++c) out[n * C + c] = x[n * C + c] * s * w[c];
    if (rstd) rstd->push_back(s);
  }
  return out;
}

TEST(CpuRmsNorm, ForwardMatchesReference) {
  for (int64_t N : kOdd)
    for (int64_t C : kOdd) {
      Tensor x = uniform_tensor({N, C}, 1, -2.0f, 3.0f), w = uniform_tensor({C}, 2, 0.5f, 1.5f);
      Tensor out = filled({N, C}, 7), rstd = filled({N}, 7);
      ops().rmsnorm_forward(out, rstd, x, w, kEps);
      std::vector<double> want_rstd;
      const std::vector<double> want = rmsnorm_ref(to_f64(x), to_f64(w), N, C, &want_rstd);
      // f32 mean of <= 217 squares: a few ulps, relative.
      expect_close(rstd, want_rstd, 0, 2e-6, "rstd" + tag(N, C));
      expect_close(out, want, 1e-6, 2e-6, "out" + tag(N, C));
    }
}

TEST(CpuRmsNorm, ZeroRowGivesZeroAndRstdOfEps) {
  // mean(x^2) = 0: rstd = 1/sqrt(eps), out = 0 (no NaN from 0/0).
  Tensor x = filled({2, 7}, 0), w = uniform_tensor({7}, 3), out = filled({2, 7}, 7), rstd = filled({2}, 7);
  ops().rmsnorm_forward(out, rstd, x, w, kEps);
  expect_close(out, std::vector<double>(14, 0.0), 0, 0, "out");
  expect_close(rstd, std::vector<double>(2, 1.0 / std::sqrt(double(kEps))), 0, 1e-6, "rstd");
}

TEST(CpuRmsNorm, BackwardMatchesFiniteDifferencesAndAccumulates) {
  for (int64_t N : kOdd)
    for (int64_t C : {int64_t(5), int64_t(217)}) {  // C = 1: dinp is a pure cancellation (see gen_llama_ops.py)
      Tensor x = uniform_tensor({N, C}, 10, -1.0f, 2.0f), w = uniform_tensor({C}, 11, 0.5f, 1.5f);
      Tensor R = uniform_tensor({N, C}, 12);
      Tensor out = filled({N, C}, 0), rstd = filled({N}, 0);
      ops().rmsnorm_forward(out, rstd, x, w, kEps);
      Tensor dx = uniform_tensor({N, C}, 13), dw = uniform_tensor({C}, 14);
      std::vector<double> want_dx = to_f64(dx), want_dw = to_f64(dw);
      ops().rmsnorm_backward(dx, dw, R, x, w, rstd);

      std::vector<double> xd = to_f64(x), wd = to_f64(w);
      const std::vector<double> r = to_f64(R);
      int64_t row = 0;
      auto row_objective = [&]() {  // perturbing x[row, :] changes only that row
        std::vector<double> xr(xd.begin() + row * C, xd.begin() + (row + 1) * C);
        const std::vector<double> o = rmsnorm_ref(xr, wd, 1, C);
        double L = 0;
        for (int64_t c = 0; c < C; ++c) L += o[size_t(c)] * r[size_t(row * C + c)];
        return L;
      };
      auto objective = [&]() {
        const std::vector<double> o = rmsnorm_ref(xd, wd, N, C);
        double L = 0;
        for (size_t i = 0; i < o.size(); ++i) L += o[i] * r[i];
        return L;
      };
      for (row = 0; row < N; ++row)
        for (int64_t c = 0; c < C; ++c) want_dx[size_t(row * C + c)] += central_diff(xd[size_t(row * C + c)], row_objective);
      for (int64_t c = 0; c < C; ++c) want_dw[size_t(c)] += central_diff(wd[size_t(c)], objective);
      // dinp: f32 row reduction over <= 217 terms, magnitudes ~rstd ~1: 2e-5 abs + 1e-4 rel (as layernorm).
      expect_close(dx, want_dx, 2e-5, 1e-4, "dinp" + tag(N, C));
      // dweight: sums over <= 217 rows of O(1) terms.
      expect_close(dw, want_dw, 1e-4, 1e-5, "dweight" + tag(N, C));
    }
}

TEST(CpuRmsNorm, BackwardOptionalOutputsGiveTheSameBits) {
  const int64_t N = 70, C = 33;
  Tensor x = uniform_tensor({N, C}, 20), w = uniform_tensor({C}, 21), R = uniform_tensor({N, C}, 22);
  Tensor out = filled({N, C}, 0), rstd = filled({N}, 0);
  ops().rmsnorm_forward(out, rstd, x, w, kEps);
  Tensor dx = filled({N, C}, 0.25f), dw = filled({C}, -0.5f), dx2 = clone(dx), dw2 = clone(dw);
  ops().rmsnorm_backward(dx, dw, R, x, w, rstd);
  ops().rmsnorm_backward(dx2, TensorView(), R, x, w, rstd);
  ops().rmsnorm_backward(TensorView(), dw2, R, x, w, rstd);
  EXPECT_TRUE(same_bits(dx, dx2));
  EXPECT_TRUE(same_bits(dw, dw2));
  // Forward without rstd (inference) writes the same out.
  Tensor out2 = filled({N, C}, 0);
  ops().rmsnorm_forward(out2, TensorView(), x, w, kEps);
  EXPECT_TRUE(same_bits(out, out2));
}

TEST(CpuRmsNorm, ForwardAndBackwardAreThreadCountIndependent) {
  const int64_t N = 300, C = 217;
  Tensor x = uniform_tensor({N, C}, 30, -2, 2), w = uniform_tensor({C}, 31), R = uniform_tensor({N, C}, 32);
  const Tensor dx0 = uniform_tensor({N, C}, 33), dw0 = uniform_tensor({C}, 34);
  std::vector<Tensor> outs, rstds, dxs, dws;
  for (int threads : {1, 2, 3})
    with_threads(threads, [&] {
      outs.push_back(filled({N, C}, 0));
      rstds.push_back(filled({N}, 0));
      dxs.push_back(clone(dx0));
      dws.push_back(clone(dw0));
      ops().rmsnorm_forward(outs.back(), rstds.back(), x, w, kEps);
      ops().rmsnorm_backward(dxs.back(), dws.back(), R, x, w, rstds.back());
    });
  for (size_t i : {1u, 2u}) {
    EXPECT_TRUE(same_bits(outs[0], outs[i])) << "out, threads run " << i;
    EXPECT_TRUE(same_bits(rstds[0], rstds[i])) << "rstd, threads run " << i;
    EXPECT_TRUE(same_bits(dxs[0], dxs[i])) << "dinp, threads run " << i;
    EXPECT_TRUE(same_bits(dws[0], dws[i])) << "dweight, threads run " << i;
  }
}

TEST(CpuRmsNorm, FusedResidualEqualsResidualThenRmsNormBitwise) {
  for (int64_t N : kOdd)
    for (int64_t C : kOdd) {
      Tensor a = uniform_tensor({N, C}, 40), b = uniform_tensor({N, C}, 41, -3, 3), w = uniform_tensor({C}, 42);
      Tensor res = filled({N, C}, 7), out = filled({N, C}, 7), rstd = filled({N}, 7);
      ops().residual_rmsnorm_forward(res, out, rstd, a, b, w, kEps);
      Tensor res2 = filled({N, C}, 0), out2 = filled({N, C}, 0), rstd2 = filled({N}, 0);
      ops().residual_forward(res2, a, b);
      ops().rmsnorm_forward(out2, rstd2, res2, w, kEps);
      EXPECT_TRUE(same_bits(res, res2)) << tag(N, C);
      EXPECT_TRUE(same_bits(out, out2)) << tag(N, C);
      EXPECT_TRUE(same_bits(rstd, rstd2)) << tag(N, C);
    }
}

// ---- bf16 / f16 --------------------------------------------------------------------------------------

const DType kLowp[] = {DType::kBF16, DType::kF16};

TEST(LowpRmsNorm, ForwardAndFusedAreTheRoundedF32Results) {
  struct Case {
    int64_t N, C;
  };
  for (DType dt : kLowp)
    for (Case k : {Case{1, 5}, Case{5, 217}, Case{217, 5}, Case{3, 1500}}) {
      const std::string t = std::string(dtype_name(dt)) + tag(k.N, k.C);
      Tensor x = lowp_uniform({k.N, k.C}, dt, 50, -3, 3), w = lowp_uniform({k.C}, dt, 51);
      Tensor out = Tensor::empty({k.N, k.C}, dt), rstd = filled({k.N}, 0);
      Tensor want = filled({k.N, k.C}, 0), want_rstd = filled({k.N}, 0);
      ops().rmsnorm_forward(out, rstd, x, w, kEps);
      ops().rmsnorm_forward(want, want_rstd, widened(x), widened(w), kEps);
      expect_rounded(out, want, t + " out");
      EXPECT_TRUE(same_bits(rstd, want_rstd)) << t << " rstd";

      Tensor a = lowp_uniform({k.N, k.C}, dt, 52), b = lowp_uniform({k.N, k.C}, dt, 53);
      Tensor res = Tensor::empty({k.N, k.C}, dt), res2 = Tensor::empty({k.N, k.C}, dt);
      Tensor out2 = Tensor::empty({k.N, k.C}, dt), rstd2 = filled({k.N}, 0);
      ops().residual_rmsnorm_forward(res, out, rstd, a, b, w, kEps);
      ops().residual_forward(res2, a, b);
      ops().rmsnorm_forward(out2, rstd2, res2, w, kEps);
      EXPECT_TRUE(same_bits(res, res2)) << t << " fused residual";
      EXPECT_TRUE(same_bits(out, out2)) << t << " fused out";
      EXPECT_TRUE(same_bits(rstd, rstd2)) << t << " fused rstd";
    }
}

TEST(LowpRmsNorm, BackwardAccumulatesDinpAndDweightInF32OrLowp) {
  for (DType dt : kLowp)
    for (int64_t N : {int64_t(5), int64_t(217)}) {
      const int64_t C = 37;
      const std::string t = std::string(dtype_name(dt)) + tag(N, C);
      Tensor x = lowp_uniform({N, C}, dt, 60, -3, 3), w = lowp_uniform({C}, dt, 61), dy = lowp_uniform({N, C}, dt, 62);
      Tensor out = Tensor::empty({N, C}, dt), rstd = filled({N}, 0);
      ops().rmsnorm_forward(out, rstd, x, w, kEps);
      Tensor dx = lowp_uniform({N, C}, dt, 63), dw = uniform_tensor({C}, 64);
      Tensor want_dx = widened(dx), want_dw = clone(dw);
      ops().rmsnorm_backward(dx, dw, dy, x, w, rstd);
      ops().rmsnorm_backward(want_dx, want_dw, widened(dy), widened(x), widened(w), rstd);
      expect_rounded(dx, want_dx, t + " dinp");
      EXPECT_TRUE(same_bits(dw, want_dw)) << t << " f32 dweight";

      Tensor dw16 = lowp_uniform({C}, dt, 65), want_dw16 = widened(dw16);
      ops().rmsnorm_backward(TensorView(), dw16, dy, x, w, rstd);
      ops().rmsnorm_backward(TensorView(), want_dw16, widened(dy), widened(x), widened(w), rstd);
      expect_rounded(dw16, want_dw16, t + " lowp dweight");
    }
}

TEST(CpuRmsNorm, RejectsMismatchedTensors) {
  Tensor x = uniform_tensor({4, 6}, 70), w = uniform_tensor({6}, 71), out = filled({4, 6}, 0), rstd = filled({4}, 0);
  EXPECT_THROW(ops().rmsnorm_forward(out, rstd, x, filled({5}, 1), kEps), Error);        // weight length
  EXPECT_THROW(ops().rmsnorm_forward(out, filled({3}, 0), x, w, kEps), Error);           // rstd length
  EXPECT_THROW(ops().rmsnorm_forward(filled({4, 5}, 0), rstd, x, w, kEps), Error);       // out shape
  EXPECT_THROW(ops().rmsnorm_forward(out, rstd, x, lowp_uniform({6}, DType::kBF16, 72), kEps), Error);  // dtypes
  EXPECT_THROW(ops().rmsnorm_backward(filled({4, 6}, 0), filled({6}, 0), out, x, w, TensorView()), Error);  // no rstd
  EXPECT_THROW(ops().residual_rmsnorm_forward(filled({4, 6}, 0), out, rstd, x, filled({4, 5}, 0), w, kEps), Error);
}

}  // namespace
}  // namespace loom::test

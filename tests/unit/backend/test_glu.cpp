// Gated MLP activation CPU ops (glu_forward / glu_backward; SwiGLU, GeGLU, ReGLU) on rows [gate (F) | up (F)].
// The forward is compared with f64 formulas written here (std::exp / std::tanh), the backward with central
// finite differences of them for L = sum(out * R); dinp starts as NaN, so a missed write or an accumulation
// fails (it OVERWRITES). GeGLU must reproduce gelu_forward / gelu_backward bit for bit (one GeLU formula in
// Loom); dinp may alias inp; saturated tails stay finite; bf16/f16 give exactly the rounded f32 results.
// Shapes are odd (F = 1, 5, 217; 1037 > one 1024-column task).
#include <limits>
#include <string>

#include "cpu_test_util.h"

namespace loom::test {
namespace {

const GluKind kKinds[] = {GluKind::kSwiGLU, GluKind::kGeGLU, GluKind::kReGLU};

std::string kind_name(GluKind k) {
  return k == GluKind::kSwiGLU ? "swiglu" : k == GluKind::kGeGLU ? "geglu" : "reglu";
}

double act_ref(GluKind k, double g) {
  switch (k) {
    case GluKind::kSwiGLU: return g / (1.0 + std::exp(-g));
    case GluKind::kGeGLU: return 0.5 * g * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g)));
    case GluKind::kReGLU: return g > 0 ? g : 0.0;
  }
  return 0;
}

// out (N, F) from inp (N, 2F) in f64.
std::vector<double> glu_ref(GluKind k, const std::vector<double>& x, int64_t N, int64_t F) {
  std::vector<double> out(size_t(N * F));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < F; ++c)
      out[size_t(n * F + c)] = act_ref(k, x[size_t(n * 2 * F + c)]) * x[size_t(n * 2 * F + F + c)];
  return out;
}

std::string tag(GluKind k, int64_t N, int64_t F) {
  return kind_name(k) + " N" + std::to_string(N) + " F" + std::to_string(F);
}

TEST(CpuGlu, ForwardMatchesReference) {
  for (GluKind k : kKinds)
    for (int64_t N : {1, 5, 217})
      for (int64_t F : {1, 5, 217}) {
        Tensor x = uniform_tensor({N, 2 * F}, 1, -4, 4), out = filled({N, F}, 7);
        ops().glu_forward(out, x, k);
        // fast_exp: < 1 ulp; a few roundings around it.
        expect_close(out, glu_ref(k, to_f64(x), N, F), 1e-6, 2e-6, "out " + tag(k, N, F));
      }
}

TEST(CpuGlu, BackwardMatchesFiniteDifferencesAndOverwrites) {
  for (GluKind k : kKinds)
    for (int64_t N : {1, 5, 37})
      for (int64_t F : {1, 5, 217}) {
        Tensor x = uniform_tensor({N, 2 * F}, 10, -4, 4), R = uniform_tensor({N, F}, 11);
        float* xp = x.data<float>();
        for (int64_t i = 0; i < x.numel(); ++i)  // keep ReLU's kink out of reach of the difference step
          if (std::fabs(xp[i]) < 1e-3f) xp[i] = 0.5f;
        Tensor dx = filled({N, 2 * F}, std::numeric_limits<float>::quiet_NaN());
        ops().glu_backward(dx, x, R, k);
        std::vector<double> xd = to_f64(x), want(size_t(N * 2 * F));
        const std::vector<double> r = to_f64(R);
        for (int64_t n = 0; n < N; ++n)
          for (int64_t c = 0; c < 2 * F; ++c) {
            const int64_t f = c % F;  // the output element this input feeds
            auto L = [&]() { return act_ref(k, xd[size_t(n * 2 * F + f)]) * xd[size_t(n * 2 * F + F + f)] * r[size_t(n * F + f)]; };
            want[size_t(n * 2 * F + c)] = central_diff(xd[size_t(n * 2 * F + c)], L);
          }
        expect_close(dx, want, 2e-6, 1e-5, "dinp " + tag(k, N, F));
      }
}

TEST(CpuGlu, GegluIsGeluTimesUpBitForBit) {
  const int64_t N = 7, F = 301;
  Tensor x = uniform_tensor({N, 2 * F}, 20, -8, 8), dy = uniform_tensor({N, F}, 21);
  Tensor gate = Tensor::empty({N, F}, DType::kF32);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < F; ++c) {
      gate.data<float>()[n * F + c] = x.data<float>()[n * 2 * F + c];
      x.data<float>()[n * 2 * F + F + c] = 1.0f;  // up = 1
    }
  Tensor out = filled({N, F}, 0), gelu = filled({N, F}, 0);
  ops().glu_forward(out, x, GluKind::kGeGLU);
  ops().gelu_forward(gelu, gate);
  EXPECT_TRUE(same_bits(out, gelu));
  Tensor dx = filled({N, 2 * F}, 0), dgelu = filled({N, F}, 0);
  ops().glu_backward(dx, x, dy, GluKind::kGeGLU);
  ops().gelu_backward(dgelu, gate, dy);
  int64_t bad_gate = 0, bad_up = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < F; ++c) {
      bad_gate += dx.data<float>()[n * 2 * F + c] != dgelu.data<float>()[n * F + c];
      bad_up += dx.data<float>()[n * 2 * F + F + c] != dy.data<float>()[n * F + c] * gelu.data<float>()[n * F + c];
    }
  EXPECT_EQ(bad_gate, 0) << "dgate != gelu_backward";
  EXPECT_EQ(bad_up, 0) << "dup != dout * gelu";
}

TEST(CpuGlu, SaturatedTailsStayFiniteAndExact) {
  const float gates[] = {-1e4f, -200.0f, -88.0f, -20.0f, 0.0f, 20.0f, 88.0f, 200.0f, 1e4f};
  const int64_t F = 9;
  Tensor x = Tensor::empty({1, 2 * F}, DType::kF32), dy = filled({1, F}, 1.0f);
  for (int64_t c = 0; c < F; ++c) {
    x.data<float>()[c] = gates[c];
    x.data<float>()[F + c] = 1.0f;
  }
  for (GluKind k : {GluKind::kSwiGLU, GluKind::kGeGLU}) {
    Tensor out = filled({1, F}, 0), dx = filled({1, 2 * F}, 0);
    ops().glu_forward(out, x, k);
    ops().glu_backward(dx, x, dy, k);
    for (int64_t c = 0; c < F; ++c) {
      const float g = gates[c], o = out.data<float>()[c], dg = dx.data<float>()[c];
      ASSERT_TRUE(std::isfinite(o) && std::isfinite(dg)) << kind_name(k) << " gate " << g;
      if (std::fabs(g) >= 200.0f) {  // act(g) = max(g, 0) and act'(g) = [g > 0] exactly in f32
        EXPECT_EQ(o, g > 0 ? g : 0.0f) << kind_name(k) << " gate " << g;
        EXPECT_EQ(dg, g > 0 ? 1.0f : 0.0f) << kind_name(k) << " gate " << g;
      }
    }
  }
  // ReLU: NaN propagates (as torch.relu), relu'(0) = 0 (as torch's threshold_backward).
  Tensor y = Tensor::empty({1, 4}, DType::kF32), o = filled({1, 2}, 0), d = filled({1, 4}, 7);
  const float v[] = {std::numeric_limits<float>::quiet_NaN(), 0.0f, 2.0f, 3.0f};
  std::copy(v, v + 4, y.data<float>());
  ops().glu_forward(o, y, GluKind::kReGLU);
  EXPECT_TRUE(std::isnan(o.data<float>()[0]));
  EXPECT_EQ(o.data<float>()[1], 0.0f);
  ops().glu_backward(d, y, filled({1, 2}, 1.0f), GluKind::kReGLU);
  EXPECT_EQ(d.data<float>()[1], 0.0f);
  EXPECT_EQ(d.data<float>()[3], 0.0f);  // dup = dout * relu(0)
}

TEST(CpuGlu, DinpMayAliasInpAndThreadCountDoesNotMatter) {
  for (GluKind k : kKinds) {
    const int64_t N = 9, F = 1037;  // two column tasks per row, the second a ragged one
    Tensor x = uniform_tensor({N, 2 * F}, 30, -5, 5), dy = uniform_tensor({N, F}, 31);
    Tensor dx = filled({N, 2 * F}, 0), out = filled({N, F}, 0);
    ops().glu_forward(out, x, k);
    ops().glu_backward(dx, x, dy, k);
    Tensor alias = clone(x);
    ops().glu_backward(alias, alias, dy, k);
    EXPECT_TRUE(same_bits(alias, dx)) << kind_name(k);
    for (int threads : {1, 3})
      with_threads(threads, [&] {
        Tensor o = filled({N, F}, 0), d = filled({N, 2 * F}, 0);
        ops().glu_forward(o, x, k);
        ops().glu_backward(d, x, dy, k);
        EXPECT_TRUE(same_bits(o, out)) << kind_name(k) << " threads " << threads;
        EXPECT_TRUE(same_bits(d, dx)) << kind_name(k) << " threads " << threads;
      });
  }
}

// glu_backward's `out`: the recomputed activation from the backward's pass is glu_forward's output bit for
// bit, and dinp is unchanged by asking for it (also in place over inp), in every dtype, kind and thread count.
TEST(CpuGlu, BackwardWithOutWritesTheForwardsBits) {
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16})
    for (GluKind k : kKinds) {
      const int64_t N = 7, F = 1037;
      const std::string t = std::string(dtype_name(dt)) + " " + kind_name(k);
      Tensor x = uniform_of({N, 2 * F}, dt, 60, -7, 7), dy = uniform_of({N, F}, dt, 61);
      Tensor want_out = Tensor::empty({N, F}, dt), want_dx = Tensor::empty({N, 2 * F}, dt);
      ops().glu_forward(want_out, x, k);
      ops().glu_backward(want_dx, x, dy, k);
      for (int threads : {1, 2, 3})
        with_threads(threads, [&] {
          Tensor out = Tensor::empty({N, F}, dt), dx = Tensor::empty({N, 2 * F}, dt);
          ops().glu_backward(dx, x, dy, k, out);
          EXPECT_TRUE(same_bits(out, want_out)) << t << " out, threads " << threads;
          EXPECT_TRUE(same_bits(dx, want_dx)) << t << " dinp, threads " << threads;
          Tensor alias = clone(x), out2 = Tensor::empty({N, F}, dt);
          ops().glu_backward(alias, alias, dy, k, out2);
          EXPECT_TRUE(same_bits(out2, want_out)) << t << " out (dinp = inp), threads " << threads;
          EXPECT_TRUE(same_bits(alias, want_dx)) << t << " dinp = inp, threads " << threads;
        });
    }
}

// ---- bf16 / f16 ---------------------------------------------------------------------------------------

TEST(LowpGlu, ForwardAndBackwardAreTheRoundedF32Results) {
  for (DType dt : {DType::kBF16, DType::kF16})
    for (GluKind k : kKinds)
      for (int64_t F : {1, 217, 1037}) {
        const int64_t N = 5;
        const std::string t = std::string(dtype_name(dt)) + " " + tag(k, N, F);
        Tensor x = lowp_uniform({N, 2 * F}, dt, 40, -6, 6), dy = lowp_uniform({N, F}, dt, 41);
        Tensor out = Tensor::empty({N, F}, dt), want = filled({N, F}, 0);
        ops().glu_forward(out, x, k);
        ops().glu_forward(want, widened(x), k);
        expect_rounded(out, want, t + " out");
        Tensor dx = Tensor::empty({N, 2 * F}, dt), want_dx = filled({N, 2 * F}, 0);
        ops().glu_backward(dx, x, dy, k);
        ops().glu_backward(want_dx, widened(x), widened(dy), k);
        expect_rounded(dx, want_dx, t + " dinp");
      }
}

TEST(CpuGlu, RejectsMismatchedTensors) {
  Tensor x = uniform_tensor({4, 6}, 50), out = filled({4, 3}, 0);
  EXPECT_THROW(ops().glu_forward(out, uniform_tensor({4, 5}, 51), GluKind::kSwiGLU), Error);  // odd 2F
  EXPECT_THROW(ops().glu_forward(filled({4, 6}, 0), x, GluKind::kSwiGLU), Error);             // out (N, 2F)
  EXPECT_THROW(ops().glu_forward(filled({3, 3}, 0), x, GluKind::kSwiGLU), Error);             // rows
  EXPECT_THROW(ops().glu_forward(lowp_uniform({4, 3}, DType::kBF16, 52), x, GluKind::kSwiGLU), Error);
  EXPECT_THROW(ops().glu_backward(filled({4, 3}, 0), x, out, GluKind::kGeGLU), Error);  // dinp (N, F)
  EXPECT_THROW(ops().glu_backward(TensorView(), x, out, GluKind::kGeGLU), Error);
  // out: (N, F) in inp's dtype, and a buffer of its own (it is written while the others are read).
  Tensor dx = filled({4, 6}, 0);
  EXPECT_THROW(ops().glu_backward(dx, x, out, GluKind::kSwiGLU, filled({4, 6}, 0)), Error);
  EXPECT_THROW(ops().glu_backward(dx, x, out, GluKind::kSwiGLU, lowp_uniform({4, 3}, DType::kBF16, 53)), Error);
  EXPECT_THROW(ops().glu_backward(dx, x, out, GluKind::kSwiGLU, out), Error);                   // out = dout
  EXPECT_THROW(ops().glu_backward(dx, x, out, GluKind::kSwiGLU, x.slice_flat(0, {4, 3})), Error);  // in inp
  EXPECT_THROW(ops().glu_backward(dx, x, out, GluKind::kSwiGLU, dx.slice_flat(12, {4, 3})), Error);  // in dinp
  Tensor ok = filled({4, 3}, 0);
  EXPECT_NO_THROW(ops().glu_backward(dx, x, out, GluKind::kSwiGLU, ok));
}

}  // namespace
}  // namespace loom::test

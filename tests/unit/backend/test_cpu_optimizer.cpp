// CPU AdamW update and sum of squares: AdamW against an f64 reference of torch.optim.AdamW over several
// steps (decoupled decay, bias corrections, grad_scale, zero_grad) and bit for bit against values
// produced by PyTorch itself; sum_squares against an exact sum; bitwise thread-count independence.
#include <bit>
#include <limits>
#include <string>

#include "cpu_test_util.h"

namespace loom::test {
namespace {

struct AdamRef {
  std::vector<double> p, m, v;
};

// torch.optim.AdamW, single-tensor path, in f64.
void adamw_ref_step(AdamRef& s, const std::vector<double>& grad, const AdamWParams& a) {
  const double lr = a.lr, wd = a.weight_decay, b1 = a.beta1, b2 = a.beta2, eps = a.eps;
  const double bc1 = 1 - std::pow(b1, double(a.step)), bc2 = 1 - std::pow(b2, double(a.step));
  for (size_t i = 0; i < s.p.size(); ++i) {
    const double g = grad[i] * a.grad_scale;
    s.p[i] *= 1 - lr * wd;
    s.m[i] = b1 * s.m[i] + (1 - b1) * g;
    s.v[i] = b2 * s.v[i] + (1 - b2) * g * g;
    s.p[i] -= lr / bc1 * s.m[i] / (std::sqrt(s.v[i]) / std::sqrt(bc2) + eps);
  }
}

TEST(CpuAdamW, MatchesTorchAdamWReferenceOverSteps) {
  for (int64_t n : {int64_t(1), int64_t(5), int64_t(217), int64_t(100003)}) {
    Tensor p = uniform_tensor({n}, 1), m = filled({n}, 0), v = filled({n}, 0);
    AdamRef ref{to_f64(p), std::vector<double>(size_t(n), 0.0), std::vector<double>(size_t(n), 0.0)};
    AdamWParams a;
    a.lr = 1e-2f;
    a.weight_decay = 0.1f;
    a.beta1 = 0.9f;
    a.beta2 = 0.95f;
    a.eps = 1e-8f;
    for (int64_t step = 1; step <= 5; ++step) {
      Tensor g = uniform_tensor({n}, uint64_t(10 + step), -2.0f, 2.0f);
      a.step = step;
      a.grad_scale = step == 3 ? 0.25f : 1.0f;
      a.zero_grad = step % 2 == 0;
      Tensor g_before = clone(g);
      ops().adamw_update(p, g, m, v, a);
      // The f64 reference uses the f32 hyper-parameters the op received.
      adamw_ref_step(ref, to_f64(g_before), a);
      if (a.zero_grad) {
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(g.data<float>()[i], 0.0f);
      } else {
        EXPECT_TRUE(same_bits(g, g_before)) << "grad must be left alone without zero_grad";
      }
    }
    // 5 steps of lr 1e-2 from |p| <= 1 in f32: per-step rounding ~1e-7 relative, and the Adam ratio
    // m/sqrt(v) is well conditioned here (|g| ~ 1 >> eps): 2e-6 abs + 1e-5 rel.
    expect_close(p, ref.p, 2e-6, 1e-5, "param n=" + std::to_string(n));
    expect_close(m, ref.m, 1e-6, 1e-5, "exp_avg n=" + std::to_string(n));
    expect_close(v, ref.v, 1e-7, 1e-5, "exp_avg_sq n=" + std::to_string(n));
  }
}

TEST(CpuAdamW, DecoupledDecayAndBiasCorrectionOnAKnownCase) {
  // One element, step 1, m = v = 0: mhat = g, vhat = g^2, so p1 = p0 (1 - lr wd) - lr g / (|g| + eps).
  Tensor p = filled({1}, 2.0f), g = filled({1}, -0.5f), m = filled({1}, 0), v = filled({1}, 0);
  AdamWParams a;
  a.lr = 0.1f;
  a.weight_decay = 0.5f;
  a.step = 1;
  ops().adamw_update(p, g, m, v, a);
  EXPECT_NEAR(p.data<float>()[0], 2.0 * (1 - 0.05) + 0.1 * 0.5 / (0.5 + 1e-8), 1e-6);
  EXPECT_NEAR(m.data<float>()[0], -0.05, 1e-8);
  EXPECT_NEAR(v.data<float>()[0], 0.001 * 0.25, 1e-10);
  AdamWParams bad = a;
  bad.step = 0;
  EXPECT_THROW(ops().adamw_update(p, g, m, v, bad), Error);
}

TEST(CpuAdamW, BitIdenticalToPyTorchAdamWKnownAnswer) {
  // Generated with PyTorch 1.13 (Debian python3-torch, CPU): torch.manual_seed(1); p0 = randn(16) * 0.5;
  // three steps of torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
  // foreach=False) with grads randn(16) * 0.1. The op reproduces every rounding of PyTorch's kernels.
  const uint32_t p0[16] = {0xbf4346ba, 0xbec00f31, 0xbea76b4b, 0xbf4e0399, 0xbd4d2473, 0xbe9bf3ce,
                           0xbefad25b, 0xbf4df6de, 0xbeb64f1c, 0x3e1b8173, 0xbec6fe12, 0xbe00bebe,
                           0xbde39ae0, 0x3f57f355, 0x3de9e84a, 0x3e6f6dec};
  const uint32_t grads[3][16] = {
      {0xbd8ebd6e, 0xbdedb955, 0x3d8f442b, 0x3ca31672, 0x3db14b37, 0x3cc83737, 0xbd87c3a6, 0x3da55634, 0x3de19fcb,
       0xbc902077, 0xbe65f1f3, 0xbe141e07, 0x3bc864c5, 0xbd7d0733, 0xbda371d8, 0xbc57a6c7},
      {0x3e4071ec, 0xbbec5c87, 0x3c813ee5, 0xbd9e6750, 0x3ca3112d, 0x3b95c245, 0x3c7a9ac8, 0xbd42d68a, 0xbc35e517,
       0x3cefcf08, 0xbc814e87, 0xbb3ca8cf, 0x3e715e40, 0xbdd4726d, 0x3e214263, 0xbd80fe23},
      {0xbdbdee09, 0x3d5f4a3b, 0x3bd92fea, 0xbd3302fb, 0x3d9c2e3c, 0x3d34d7c7, 0x3dee9ed0, 0x3e4e604a, 0x3c6122f7,
       0x3dc03c04, 0xbc985f42, 0xbd8405ab, 0x3e1d9e68, 0xbdb2176f, 0xbeaa8e19, 0xbd992a0b}};
  const uint32_t want_p[16] = {0xbf41761b, 0xbeb57ab7, 0xbeb3dd46, 0xbf4ccfd0, 0xbd9e17c6, 0xbea90c67,
                               0xbef44829, 0xbf520937, 0xbec0bc1c, 0x3e1b7c6a, 0xbeba5cda, 0xbdce9a23,
                               0xbe0beec7, 0x3f5ee0a8, 0x3dff09a7, 0x3e857da7};
  const uint32_t want_m[16] = {0x3b02b9cc, 0xbb96bb15, 0x3bfdeb97, 0xbc1f3c2a, 0x3c86976b, 0x3bdf05c1,
                               0x3bfaf372, 0x3cb79962, 0x3c1858fc, 0x3c2d9ac6, 0xbcafe117, 0xbc96e94a,
                               0x3d17f813, 0xbcbcb544, 0xbcd1bccc, 0xbc68dfb9};
  const uint32_t want_v[16] = {0x3b187ef6, 0x3a46fbb1, 0x39764054, 0x39d06dde, 0x3a29cfaa, 0x3903813a,
                               0x3a68d561, 0x3b1f6a44, 0x3a1394cf, 0x3a01d044, 0x3b170857, 0x3a9708ad,
                               0x3b7ab3c8, 0x3a8b1f8c, 0x3be5d325, 0x39f98399};
  Tensor p = filled({16}, 0), g = filled({16}, 0), m = filled({16}, 0), v = filled({16}, 0);
  std::memcpy(p.raw(), p0, sizeof(p0));
  AdamWParams a;
  a.lr = 1e-2f;
  a.beta1 = 0.9f;
  a.beta2 = 0.95f;
  a.eps = 1e-8f;
  a.weight_decay = 0.1f;
  for (int s = 0; s < 3; ++s) {
    std::memcpy(g.raw(), grads[s], sizeof(grads[s]));
    a.step = s + 1;
    ops().adamw_update(p, g, m, v, a);
  }
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(std::bit_cast<uint32_t>(p.data<float>()[i]), want_p[i]) << "param " << i;
    EXPECT_EQ(std::bit_cast<uint32_t>(m.data<float>()[i]), want_m[i]) << "exp_avg " << i;
    EXPECT_EQ(std::bit_cast<uint32_t>(v.data<float>()[i]), want_v[i]) << "exp_avg_sq " << i;
  }
}

TEST(CpuAdamW, IsThreadCountIndependent) {
  const int64_t n = 300007;
  Tensor p0 = uniform_tensor({n}, 20), g = uniform_tensor({n}, 21), m0 = uniform_tensor({n}, 22, -0.1f, 0.1f);
  Tensor v0 = uniform_tensor({n}, 23, 0.0f, 0.01f);
  AdamWParams a;
  a.lr = 3e-4f;
  a.weight_decay = 0.1f;
  a.step = 7;
  std::vector<Tensor> ps;
  for (int threads : {1, 2, 3}) {
    Tensor p = clone(p0), m = clone(m0), v = clone(v0);
    with_threads(threads, [&] { ops().adamw_update(p, g, m, v, a); });
    ps.push_back(p);
  }
  EXPECT_TRUE(same_bits(ps[0], ps[1]));
  EXPECT_TRUE(same_bits(ps[0], ps[2]));
}

// With a 16-bit compute copy, the update also writes cast(compute, param) — bit for bit what the cast after
// it would give — and param, m, v are what they are without it; at any thread count and chunk tail.
TEST(CpuAdamW, RefreshesTheComputeCopyInTheSamePass) {
  AdamWParams a;
  a.lr = 3e-4f;
  a.weight_decay = 0.1f;
  a.step = 3;
  a.zero_grad = true;
  for (DType dt : {DType::kBF16, DType::kF16})
    for (int64_t n : {int64_t(1), int64_t(5), int64_t(2049), int64_t(300007)})
      for (int threads : {1, 3}) {
        const std::string what = std::string(dtype_name(dt)) + " n " + std::to_string(n) + " threads " +
                                 std::to_string(threads);
        const Tensor p0 = uniform_tensor({n}, 40), g0 = uniform_tensor({n}, 41);
        const Tensor m0 = uniform_tensor({n}, 42, -0.1f, 0.1f), v0 = uniform_tensor({n}, 43, 0.0f, 0.01f);
        Tensor p = clone(p0), g = clone(g0), m = clone(m0), v = clone(v0);
        Tensor want_p = clone(p0), want_g = clone(g0), want_m = clone(m0), want_v = clone(v0);
        Tensor compute = Tensor::empty({n}, dt), want = Tensor::empty({n}, dt);
        ops().fill_(compute, std::numeric_limits<float>::quiet_NaN());
        with_threads(threads, [&] { ops().adamw_update(p, g, m, v, a, compute); });
        ops().adamw_update(want_p, want_g, want_m, want_v, a);
        ops().cast(want, want_p);
        EXPECT_TRUE(same_bits(compute, want)) << what;
        EXPECT_TRUE(same_bits(p, want_p) && same_bits(m, want_m) && same_bits(v, want_v) && same_bits(g, want_g))
            << what;
      }
}

TEST(CpuSumSquares, MatchesExactSumAndIsThreadCountIndependent) {
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(5), int64_t(217), int64_t(1000003)}) {
    Tensor x = uniform_tensor({std::max<int64_t>(n, 1)}, 30, -3.0f, 3.0f).reshape({std::max<int64_t>(n, 1)});
    TensorView xv = x.view().slice_flat(0, {n});
    long double exact = 0;
    for (int64_t i = 0; i < n; ++i) exact += (long double)(x.data<float>()[i]) * x.data<float>()[i];
    double results[3];
    int k = 0;
    for (int threads : {1, 2, 3}) with_threads(threads, [&] { results[k++] = ops().sum_squares(xv); });
    // f64 accumulation of f32 squares (exact products): relative error ~n * 1e-16.
    EXPECT_NEAR(results[0], double(exact), 1e-12 * double(exact) + 1e-300) << n;
    EXPECT_EQ(results[0], results[1]) << n;
    EXPECT_EQ(results[0], results[2]) << n;
  }
  // bf16 input: squares of the decoded values.
  const int64_t n = 50001;
  Tensor x = uniform_tensor({n}, 31), xb = Tensor::empty({n}, DType::kBF16);
  ops().cast(xb, x);
  double want = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = bf16_to_f32(static_cast<uint16_t*>(xb.raw())[i]);
    want += d * d;
  }
  EXPECT_NEAR(ops().sum_squares(xb), want, 1e-12 * want);
}

}  // namespace
}  // namespace loom::test

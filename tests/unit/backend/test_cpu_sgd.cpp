// CPU SGD update (--optimizer sgd) and the zero count (--log-num-zeros-in-grad): SGD bit for bit
// against values produced by PyTorch itself (momentum, weight decay; 37 elements cover the vectorised body
// and the scalar tail of PyTorch's kernels), against an f64 reference of torch.optim.SGD over several steps
// for every combination of momentum / weight decay / grad_scale / zero_grad, thread-count independence;
// count_zeros on every float dtype (+0 and -0 count, NaN and subnormals do not).
#include <bit>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>

#include "cpu_test_util.h"

namespace loom::test {
namespace {

void expect_error(const std::function<void()>& f, const std::string& detail) {
  try {
    f();
    ADD_FAILURE() << "no error for " << detail;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(msg.find("[sgd_update]") != std::string::npos || msg.find("[abs_stats]") != std::string::npos) << msg;
    EXPECT_NE(msg.find(detail), std::string::npos) << msg;
  }
}

TEST(CpuSgd, BitIdenticalToPyTorchSgdKnownAnswer) {
  // Generated with PyTorch 1.13 (Debian python3-torch, CPU): torch.manual_seed(1); p0 = randn(37) * 0.5;
  // grads = [randn(37) * 0.1 for 3 steps]; torch.optim.SGD([p], lr=0.05, momentum=0.9, weight_decay=0.1,
  // foreach=False).
  const uint32_t p0[37] = {
      0xbf4346ba, 0xbec00f31, 0xbea76b4b, 0xbf4e0399, 0xbd4d2473, 0xbe9bf3ce, 0xbefad25b, 0xbf4df6de,
      0xbeb64f1c, 0x3e1b8173, 0xbec6fe12, 0xbe00bebe, 0xbde39ae0, 0x3f57f355, 0x3de9e84a, 0x3e6f6dec,
      0xbeb26cc9, 0xbf1493d5, 0x3eb31536, 0x3dcbdc0e, 0x3edd9e04, 0x3cbb32d6, 0x3d9ca0bd, 0xbe738c2c,
      0xbf70ea0c, 0xbec6cba8, 0x3f818c87, 0xbd313c83, 0x3d48f4fe, 0xbf04c784, 0x3f4992fc, 0xbea13dab,
      0x3f9a0bee, 0x3e0ea03c, 0x3dfcaccc, 0x3f179804, 0xbeba6c37};
  const uint32_t grads[3][37] = {
      {
       0x3d34d7c7, 0x3dee9ed0, 0x3e4e604a, 0x3cb04708, 0xbd56b5b0, 0xbe38aa1b, 0xbe05f8d9, 0x3d39a730,
       0xbdb2176f, 0xbeaa8e19, 0xbd992a0b, 0x3de4d54d, 0x3cf43b82, 0x3c340957, 0xbd845ec1, 0x3d2f87eb,
       0xba45da9a, 0x3e2b5be4, 0x3a8790c8, 0x3dc976b4, 0x3db413eb, 0xbd0be900, 0xbcf5f8ba, 0x3e05e443,
       0xbdee2425, 0x3c440306, 0xbc85a3f6, 0x3d8776c9, 0x3df3b21b, 0x3e127266, 0x3d2c594a, 0xbd10eb4e,
       0x3d9c73c7, 0xbd713bf5, 0xbd9c627f, 0x3e08b99e, 0x3d7782af},
      {
       0xbe8442b3, 0x3daee328, 0x3dff4c15, 0x3d4f24bb, 0x3dc2aa2a, 0x3e04c6db, 0x3db2f417, 0xbd657b75,
       0xbddb3162, 0xbdb30c92, 0xbe15fed7, 0xbe0152e9, 0x3de5ca1a, 0x3e206483, 0x3e82fa08, 0xbcbf2bf4,
       0x3e07f011, 0xbd4aeb10, 0x3e1eae5f, 0x3d0e6392, 0x3c186265, 0x3e1accda, 0xbe0b993b, 0xbdc95d07,
       0x3e1ac0f3, 0x3d837483, 0x3d41b9da, 0xbd2f8cee, 0x3d61d76a, 0xbc33138a, 0x3d5437ff, 0x3c2e8c2b,
       0x3cdc8fe2, 0x3e07a7ff, 0x3e32cad8, 0x3e3df2e7, 0xbd90aa16},
      {
       0xbd8d3600, 0x3d2b05a5, 0xbcae4253, 0xbdac05fe, 0xbd2c0a11, 0xbd7f9af3, 0xbdc82677, 0x3db32af6,
       0x3d70b658, 0x3cfd9add, 0x3e1bb7fa, 0x3df6d4f8, 0xbe39eaa1, 0xbd254203, 0xbdc46ed5, 0xba08844f,
       0xbe7635c8, 0x3dacc7c8, 0x3deebc52, 0x3d57d4d8, 0x3e25cfc1, 0x3d52e8df, 0xbe3d2e84, 0xbe955654,
       0xbd6860da, 0xbdf5976f, 0xbb9b605e, 0xbe4d1a28, 0xbd49470b, 0xbe1e499f, 0xbc8df79b, 0x3d952515,
       0x3bbafa41, 0xbd913c97, 0xbd578cdf, 0xbde22655, 0xbd8f3f38},
  };
  const uint32_t want_p[37] = {
      0xbf3831cf, 0xbec7eeec, 0xbeb62144, 0xbf49271c, 0xbd46cf6d, 0xbe8fddae, 0xbeec8a4e, 0xbf4988a6,
      0xbea789f0, 0x3e4bf4e3, 0xbeb911c4, 0xbe067623, 0xbde8a4f0, 0x3f4e41f3, 0x3dcd5dca, 0x3e6520e3,
      0xbeadaca0, 0xbf1611ee, 0x3ea38212, 0x3d9eeac8, 0x3eccc607, 0x3c2261ab, 0x3dcde638, 0xbe664987,
      0xbf691ea8, 0xbec21c7c, 0x3f7b562e, 0xbd171604, 0x3cecdc6c, 0xbf03c0d5, 0x3f4175bc, 0xbe9cae61,
      0x3f9410b9, 0x3e0988d1, 0x3dee2ac9, 0x3f0bacb8, 0xbeb42953};
  const uint32_t want_buf[37] = {
      0xbef0c7b8, 0x3de13f94, 0x3e26a34a, 0xbe73e0f8, 0xbc46d51c, 0xbe2fff7c, 0xbe82d0e7, 0xbe1284c8,
      0xbe4ee9bb, 0xbe8b0df7, 0xbe129658, 0x3d803538, 0xbdb2d117, 0x3eabd299, 0x3de609e7, 0x3d9ae267,
      0xbe5d30b2, 0x3c8bb432, 0x3eb34e90, 0x3e416e98, 0x3eb6a462, 0x3e29ba40, 0xbe9ec2ee, 0xbeaddf11,
      0xbe88d90c, 0xbe2135e0, 0x3e980b56, 0xbe4a6390, 0x3ddd73c3, 0xbe42a782, 0x3e8c81a9, 0xbcfa463e,
      0x3ed43625, 0x3d1cabe7, 0x3d9bc5c2, 0x3ea478b5, 0xbe3b7034};
  Tensor p = filled({37}, 0), g = filled({37}, 0), buf = filled({37}, 0);
  std::memcpy(p.raw(), p0, sizeof(p0));
  SgdParams s;
  s.lr = 0.05f;
  s.momentum = 0.9f;
  s.weight_decay = 0.1f;
  for (int k = 0; k < 3; ++k) {
    std::memcpy(g.raw(), grads[k], sizeof(grads[k]));
    ops().sgd_update(p, g, buf, s);
  }
  for (int i = 0; i < 37; ++i) {
    EXPECT_EQ(std::bit_cast<uint32_t>(p.data<float>()[i]), want_p[i]) << "param " << i;
    EXPECT_EQ(std::bit_cast<uint32_t>(buf.data<float>()[i]), want_buf[i]) << "momentum_buffer " << i;
  }
}

// torch.optim.SGD (dampening 0, no Nesterov), single-tensor path, in f64; the buffer starts as clone(d).
void sgd_ref_step(std::vector<double>& p, std::vector<double>& buf, bool& has_buf, const std::vector<double>& grad,
                  const SgdParams& s) {
  for (size_t i = 0; i < p.size(); ++i) {
    double d = grad[i] * s.grad_scale + double(s.weight_decay) * p[i];
    if (s.momentum != 0.0f) {
      buf[i] = has_buf ? buf[i] * s.momentum + d : d;
      d = buf[i];
    }
    p[i] -= double(s.lr) * d;
  }
  has_buf = true;
}

TEST(CpuSgd, MatchesTorchSgdReferenceOverSteps) {
  for (int64_t n : {int64_t(1), int64_t(5), int64_t(217), int64_t(100003)})
    for (float momentum : {0.0f, 0.9f})
      for (float wd : {0.0f, 0.05f}) {
        const std::string what = "n=" + std::to_string(n) + " momentum=" + std::to_string(momentum) +
                                  " wd=" + std::to_string(wd);
        Tensor p = uniform_tensor({n}, 1);
        Tensor buf = momentum != 0.0f ? filled({n}, 0) : Tensor{};
        std::vector<double> ref = to_f64(p), ref_buf(size_t(n), 0.0);
        bool has_buf = false;
        SgdParams s;
        s.momentum = momentum;
        s.weight_decay = wd;
        for (int step = 1; step <= 5; ++step) {
          Tensor g = uniform_tensor({n}, uint64_t(10 + step), -2.0f, 2.0f);
          s.lr = 1e-2f * float(step);
          s.grad_scale = step == 3 ? 0.25f : 1.0f;
          s.zero_grad = step % 2 == 0;
          Tensor g_before = clone(g);
          ops().sgd_update(p, g, buf.defined() ? buf.view() : TensorView{}, s);
          sgd_ref_step(ref, ref_buf, has_buf, to_f64(g_before), s);
          if (s.zero_grad) {
            for (int64_t i = 0; i < n; ++i) ASSERT_EQ(g.data<float>()[i], 0.0f) << what;
          } else {
            EXPECT_TRUE(same_bits(g, g_before)) << "grad must be left alone without zero_grad; " << what;
          }
        }
        // 5 steps of lr <= 5e-2 with |g| <= 2 in f32: a few roundings of values <= ~3 per step.
        expect_close(p, ref, 2e-6, 1e-5, "param " + what);
        if (buf.defined()) expect_close(buf, ref_buf, 2e-6, 1e-5, "momentum_buffer " + what);
      }
}

TEST(CpuSgd, IsThreadCountIndependent) {
  const int64_t n = 300007;
  Tensor p0 = uniform_tensor({n}, 20), g = uniform_tensor({n}, 21), b0 = uniform_tensor({n}, 22, -0.1f, 0.1f);
  SgdParams s;
  s.lr = 3e-2f;
  s.momentum = 0.9f;
  s.weight_decay = 0.1f;
  std::vector<Tensor> ps, bs;
  for (int threads : {1, 2, 3}) {
    Tensor p = clone(p0), b = clone(b0), gg = clone(g);
    with_threads(threads, [&] { ops().sgd_update(p, gg, b, s); });
    ps.push_back(std::move(p));
    bs.push_back(std::move(b));
  }
  EXPECT_TRUE(same_bits(ps[0], ps[1]) && same_bits(ps[0], ps[2]));
  EXPECT_TRUE(same_bits(bs[0], bs[1]) && same_bits(bs[0], bs[2]));
}

// With a 16-bit compute copy the update also writes cast(compute, param), bit for bit, and changes nothing else.
TEST(CpuSgd, RefreshesTheComputeCopyInTheSamePass) {
  SgdParams s;
  s.lr = 3e-2f;
  s.momentum = 0.9f;
  s.weight_decay = 0.1f;
  for (DType dt : {DType::kBF16, DType::kF16})
    for (int64_t n : {int64_t(3), int64_t(4097), int64_t(300007)}) {
      const std::string what = std::string(dtype_name(dt)) + " n " + std::to_string(n);
      const Tensor p0 = uniform_tensor({n}, 50), g = uniform_tensor({n}, 51), b0 = uniform_tensor({n}, 52, -0.1f, 0.1f);
      Tensor p = clone(p0), b = clone(b0), want_p = clone(p0), want_b = clone(b0);
      Tensor compute = Tensor::empty({n}, dt), want = Tensor::empty({n}, dt);
      ops().fill_(compute, std::numeric_limits<float>::quiet_NaN());
      with_threads(2, [&] { ops().sgd_update(p, g, b, s, compute); });
      ops().sgd_update(want_p, g, want_b, s);
      ops().cast(want, want_p);
      EXPECT_TRUE(same_bits(compute, want)) << what;
      EXPECT_TRUE(same_bits(p, want_p) && same_bits(b, want_b)) << what;
    }
}

TEST(CpuSgd, RejectsBadArguments) {
  Tensor p = filled({8}, 1), g = filled({8}, 1), b = filled({8}, 0), b7 = filled({7}, 0);
  SgdParams s;
  s.lr = 0.1f;
  s.momentum = 0.9f;
  expect_error([&] { ops().sgd_update(p, g, TensorView{}, s); }, "momentum_buf");
  expect_error([&] { ops().sgd_update(p, g, b7, s); }, "momentum_buf");
  s.momentum = -0.5f;
  expect_error([&] { ops().sgd_update(p, g, b, s); }, "momentum must be >= 0");
  s.momentum = 0.0f;
  expect_error([&] { ops().sgd_update(p, g, b, s); }, "takes no momentum buffer");
  Tensor gb = Tensor::empty({8}, DType::kBF16);
  expect_error([&] { ops().sgd_update(p, gb, TensorView{}, s); }, "expected f32 grad");
}

TEST(CpuCountZeros, CountsSignedZerosOnlyInEveryFloatDtype) {
  // +0, -0, a NaN, the smallest f32 subnormal, 1, -1, inf: two zeros.
  const float vals[] = {0.0f, -0.0f, std::bit_cast<float>(0x7FC00000u), std::bit_cast<float>(1u), 1.0f, -1.0f,
                        std::bit_cast<float>(0x7F800000u)};
  Tensor x = filled({7}, 0);
  std::memcpy(x.raw(), vals, sizeof(vals));
  EXPECT_EQ(ops().count_zeros(x), 2);
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kF8E5M2}) {
    Tensor y = Tensor::empty({7}, dt);
    ops().cast(y, x);  // the subnormal rounds to +0 in every narrower format: three zeros
    EXPECT_EQ(ops().count_zeros(y), 3) << dtype_name(dt);
  }
  // A large buffer (threaded): every third element zero.
  const int64_t n = 1000003;
  Tensor big = uniform_tensor({n}, 5, 0.5f, 1.5f);
  for (int64_t i = 0; i < n; i += 3) big.data<float>()[i] = (i % 2) ? -0.0f : 0.0f;
  EXPECT_EQ(ops().count_zeros(big), (n + 2) / 3);
  EXPECT_EQ(ops().count_zeros(big.view().slice_flat(1, {0})), 0);
}

TEST(CpuAbsStats, MatchesExactSumsAndIsThreadCountIndependent) {
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(5), int64_t(300007)}) {
    Tensor x = uniform_tensor({std::max<int64_t>(n, 1)}, 40, -3.0f, 3.0f);
    TensorView xv = x.view().slice_flat(0, {n});
    long double sum = 0, sq = 0, mx = 0;
    for (int64_t i = 0; i < n; ++i) {
      const long double a = std::fabs((long double)x.data<float>()[i]);
      sum += a;
      sq += std::sqrt(a);
      mx = std::max(mx, a);
    }
    AbsStats r[3];
    int k = 0;
    for (int threads : {1, 2, 3}) with_threads(threads, [&] { r[k++] = ops().abs_stats(xv); });
    EXPECT_NEAR(r[0].sum_abs, double(sum), 1e-12 * double(sum) + 1e-300) << n;
    EXPECT_NEAR(r[0].sum_sqrt_abs, double(sq), 1e-12 * double(sq) + 1e-300) << n;
    EXPECT_EQ(r[0].max_abs, double(mx)) << n;
    for (int t = 1; t < 3; ++t) {
      EXPECT_EQ(r[0].sum_abs, r[t].sum_abs);
      EXPECT_EQ(r[0].sum_sqrt_abs, r[t].sum_sqrt_abs);
      EXPECT_EQ(r[0].max_abs, r[t].max_abs);
    }
  }
  Tensor nan = filled({4}, 1.0f);
  nan.data<float>()[2] = std::bit_cast<float>(0x7FC00000u);
  EXPECT_TRUE(std::isnan(ops().abs_stats(nan).max_abs));
  expect_error([&] { ops().abs_stats(Tensor::empty({4}, DType::kBF16)); }, "");  // f32 only
}

}  // namespace
}  // namespace loom::test

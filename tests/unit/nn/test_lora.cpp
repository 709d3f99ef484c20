// LoraAdapter (loom/nn/lora.h) against an independently written PyTorch LoRA (/usr/bin/python3 + Debian's
// python3-torch, the PEFT formula y = base + (alpha / r) · B(A(dropout(x))) through autograd): the output,
// the input gradient added to the base layer's, and dA, dB within 1e-5 in FP32, with and without dropout
// (Loom's mask handed to PyTorch), gradients accumulating over two backward calls; PEFT's initialisation
// (A uniform within 1/sqrt(in), B zero: the adapted layer starts equal to the base); the argument checks.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "loom/core/check.h"
#include "loom/nn/lora.h"

using namespace loom;

namespace {

namespace fs = std::filesystem;

void write_f32(const std::string& path, const float* p, int64_t n) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(p), std::streamsize(n * 4));
}
std::vector<float> read_f32(const std::string& path, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(v.data()), std::streamsize(n * 4));
  return v;
}
void fill(float* p, int64_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  for (int64_t i = 0; i < n; ++i) p[i] = u(rng);
}

void expect_near(const float* got, const std::vector<float>& want, double tol, const std::string& what) {
  double worst = 0, scale = 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::fabs(double(got[i]) - double(want[i])));
    scale = std::max(scale, std::fabs(double(want[i])));
  }
  EXPECT_LE(worst / scale, tol) << what << ": max |diff| " << worst << " of max |ref| " << scale;
}

void check_against_torch(float dropout) {
  SCOPED_TRACE("dropout " + std::to_string(dropout));
  const int64_t N = 6, in = 20, out = 12;
  LoraConfig cfg;
  cfg.rank = 4;
  cfg.alpha = 8.0f;
  cfg.dropout = dropout;
  auto ctx = make_cpu_context();
  ParameterSet ps;
  LoraAdapter lora(ps, "layer.linear_qkv", in, out, cfg);
  ps.allocate(*ctx);
  ps.initialize(1);
  fill(lora.b().value.data<float>(), out * cfg.rank, 2);  // B non-zero, or the test checks little
  fill(lora.a().value.data<float>(), cfg.rank * in, 3);
  ps.sync_compute(*ctx);
  std::vector<float> x(size_t(N * in)), base(size_t(N * out)), dout(size_t(N * out)), dbase(size_t(N * in));
  fill(x.data(), N * in, 4);
  fill(base.data(), N * out, 5);
  fill(dout.data(), N * out, 6);
  fill(dbase.data(), N * in, 7);
  Tensor xt = Tensor::empty({N, in}, DType::kF32), yt = Tensor::empty({N, out}, DType::kF32);
  Tensor dy = Tensor::empty({N, out}, DType::kF32), dx = Tensor::empty({N, in}, DType::kF32);
  std::copy(x.begin(), x.end(), xt.data<float>());
  std::copy(base.begin(), base.end(), yt.data<float>());
  std::copy(dout.begin(), dout.end(), dy.data<float>());
  std::copy(dbase.begin(), dbase.end(), dx.data<float>());
  LoraAdapter::Saved s;
  lora.forward(*ctx, yt, s, xt, 11, 3);
  // Two backward passes: the parameter gradients accumulate, the input gradient adds to what it holds.
  lora.backward(*ctx, dx, dy, xt, s, 11, 3);
  lora.backward(*ctx, TensorView(), dy, xt, s, 11, 3);
  // The dropout mask Loom used, handed to PyTorch: dropout of ones.
  Tensor ones = Tensor::empty({N, in}, DType::kF32), mask = Tensor::empty({N, in}, DType::kF32);
  for (int64_t i = 0; i < N * in; ++i) ones.data<float>()[i] = 1.0f;
  ctx->ops().dropout_forward(mask, ones, dropout, 11, 3);

  const std::string dir = (fs::temp_directory_path() / ("loom_lora_" + std::to_string(::getpid()))).string();
  fs::create_directories(dir);
  write_f32(dir + "/x", x.data(), N * in);
  write_f32(dir + "/base", base.data(), N * out);
  write_f32(dir + "/dout", dout.data(), N * out);
  write_f32(dir + "/dbase", dbase.data(), N * in);
  write_f32(dir + "/mask", mask.data<float>(), N * in);
  write_f32(dir + "/A", lora.a().value.data<float>(), cfg.rank * in);
  write_f32(dir + "/B", lora.b().value.data<float>(), out * cfg.rank);
  std::ofstream(dir + "/ref.py") << R"(import sys, numpy as np, torch
d = sys.argv[1]; N, IN, OUT, R, ALPHA = 6, 20, 12, 4, 8.0
t = lambda name, *shape: torch.tensor(np.fromfile(d + '/' + name, dtype=np.float32).reshape(shape), dtype=torch.float64)
x = t('x', N, IN).requires_grad_(True); A = t('A', R, IN).requires_grad_(True); B = t('B', OUT, R).requires_grad_(True)
mask = t('mask', N, IN)
# PEFT: result = base(x) + lora_B(lora_A(dropout(x))) * scaling
y = t('base', N, OUT) + ((x * mask) @ A.T @ B.T) * (ALPHA / R)
y.backward(t('dout', N, OUT))
dx = t('dbase', N, IN) + x.grad
for name, v in (('y', y), ('dx', dx), ('dA', 2 * A.grad), ('dB', 2 * B.grad)):
    v.detach().numpy().astype(np.float32).tofile(d + '/ref_' + name)
)";
  ASSERT_EQ(std::system(("/usr/bin/python3 " + dir + "/ref.py " + dir).c_str()), 0) << "the PyTorch reference must run";
  expect_near(yt.data<float>(), read_f32(dir + "/ref_y", N * out), 1e-5, "output");
  expect_near(dx.data<float>(), read_f32(dir + "/ref_dx", N * in), 1e-5, "input gradient");
  expect_near(lora.a().grad.data<float>(), read_f32(dir + "/ref_dA", cfg.rank * in), 1e-5, "dA (two passes)");
  expect_near(lora.b().grad.data<float>(), read_f32(dir + "/ref_dB", out * cfg.rank), 1e-5, "dB (two passes)");
  fs::remove_all(dir);
}

TEST(Lora, MatchesPyTorchReference) { check_against_torch(0.0f); }
TEST(Lora, MatchesPyTorchReferenceWithDropout) { check_against_torch(0.25f); }

TEST(Lora, PeftInitialisationLeavesTheBaseUnchanged) {
  auto ctx = make_cpu_context();
  ParameterSet ps;
  LoraConfig cfg;
  cfg.rank = 8;
  LoraAdapter lora(ps, "decoder.layers.0.mlp.linear_fc1", 64, 32, cfg);
  ps.allocate(*ctx);
  ps.initialize(7);
  EXPECT_EQ(lora.a().name, "decoder.layers.0.mlp.linear_fc1.lora_A.weight");
  EXPECT_EQ(lora.b().name, "decoder.layers.0.mlp.linear_fc1.lora_B.weight");
  const float bound = 1.0f / 8.0f;  // 1 / sqrt(64)
  double sum = 0, sq = 0;
  const float* a = lora.a().value.data<float>();
  for (int64_t i = 0; i < 8 * 64; ++i) {
    ASSERT_LE(std::fabs(a[i]), bound);
    sum += a[i];
    sq += double(a[i]) * a[i];
  }
  EXPECT_NEAR(sum / 512, 0.0, 0.02);
  EXPECT_NEAR(sq / 512, double(bound) * bound / 3.0, 0.002);  // U(-b, b) has variance b^2 / 3
  for (int64_t i = 0; i < 32 * 8; ++i) ASSERT_EQ(lora.b().value.data<float>()[i], 0.0f);
  // B = 0: the adapter adds nothing.
  ps.sync_compute(*ctx);
  Tensor x = Tensor::empty({3, 64}, DType::kF32), y = Tensor::empty({3, 32}, DType::kF32);
  for (int64_t i = 0; i < 3 * 64; ++i) x.data<float>()[i] = float(i % 7) - 3.0f;
  for (int64_t i = 0; i < 3 * 32; ++i) y.data<float>()[i] = float(i);
  LoraAdapter::Saved s;
  lora.forward(*ctx, y, s, x);
  for (int64_t i = 0; i < 3 * 32; ++i) ASSERT_EQ(y.data<float>()[i], float(i));
}

TEST(Lora, RejectsBadSettings) {
  ParameterSet ps;
  LoraConfig cfg;
  cfg.rank = 0;
  EXPECT_THROW(LoraAdapter(ps, "l", 16, 8, cfg), UserError);
  cfg.rank = 9;  // more than min(in, out)
  EXPECT_THROW(LoraAdapter(ps, "l", 16, 8, cfg), UserError);
  cfg.rank = 4;
  cfg.dropout = 1.0f;
  EXPECT_THROW(LoraAdapter(ps, "l", 16, 8, cfg), UserError);
  cfg.dropout = 0.0f;
  cfg.alpha = 0.0f;
  EXPECT_THROW(LoraAdapter(ps, "l", 16, 8, cfg), UserError);
}

}  // namespace

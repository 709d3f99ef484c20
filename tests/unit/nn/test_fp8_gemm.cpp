// Fp8Gemm (FP8 linear-layer GEMMs, emulated) against its definition computed here in f64 from the core's
// fp8 codecs: forward out = deq(q(x)) · deq(q(W))^T + b, backward dx = deq(q(dout)) · deq(q(W)),
// dW += deq(q(dout))^T · deq(q(x)) (or dout^T · x without fp8 wgrad), db += colsum(dout); the amaxes each
// quantisation records; the weight quantised once per step (cache until begin_step()).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "loom/core/dtype.h"
#include "loom/nn/fp8_gemm.h"

namespace loom {
namespace {

struct Mat {
  int64_t rows, cols;
  std::vector<float> v;  // values as the op sees them (after rounding to the tensor's dtype)
  Tensor t;
};

Mat make(const DeviceContext& ctx, int64_t r, int64_t c, DType dt, uint32_t seed, float spread) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, spread);
  Tensor f = Tensor::empty({r, c}, DType::kF32);
  for (int64_t i = 0; i < r * c; ++i) f.data<float>()[i] = d(gen);
  Mat m{r, c, {}, ctx.empty({r, c}, dt)};
  ctx.ops().cast(m.t, f);
  ctx.ops().cast(f, m.t);
  m.v.assign(f.data<float>(), f.data<float>() + r * c);
  return m;
}

// deq(q(x)) with scale s in the given fp8 format, and max |x|.
std::vector<double> qdq(const std::vector<float>& x, DType fdt, float s, float* amax) {
  std::vector<double> out(x.size());
  *amax = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float y = x[i] * s;
    const float q = fdt == DType::kF8E4M3 ? fp8_e4m3_to_f32(f32_to_fp8_e4m3(y)) : fp8_e5m2_to_f32(f32_to_fp8_e5m2(y));
    out[i] = double(q * (1.0f / s));
    *amax = std::max(*amax, std::fabs(x[i]));
  }
  return out;
}

void set_scale(const Fp8ScalingGroup& g, int slot, float s) {
  g.scale(slot).data<float>()[0] = s;
  g.scale_inv(slot).data<float>()[0] = 1.0f / s;
}

void expect_close(const float* got, const std::vector<double>& want, double rel, const char* what) {
  double scale = 1e-12;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_NEAR(got[i], want[i], rel * scale) << what << " element " << i;
}

TEST(Fp8Gemm, ForwardBackwardMatchTheDefinition) {
  auto ctx = make_cpu_context();
  const int64_t M = 37, K = 24, N = 19;
  for (bool wgrad : {true, false}) {
    SCOPED_TRACE(wgrad ? "fp8 wgrad" : "high-precision wgrad");
    Fp8Recipe r;  // hybrid: E4M3 forward, E5M2 gradients
    Fp8ScalingGroup fwd(*ctx, r.forward_dtype(), 2, r), bwd(*ctx, r.backward_dtype(), 1, r);
    const float sx = 64.0f, sw = 1024.0f, sg = 4096.0f;  // non-trivial scales (the amax is not at fp8_max)
    set_scale(fwd, 0, sx);
    set_scale(fwd, 1, sw);
    set_scale(bwd, 0, sg);
    Fp8Gemm gemm(&fwd, 0, 1, &bwd, 0, wgrad);
    Mat x = make(*ctx, M, K, DType::kBF16, 1, 1.0f), w = make(*ctx, N, K, DType::kBF16, 2, 0.05f),
        b = make(*ctx, 1, N, DType::kBF16, 3, 0.1f), g = make(*ctx, M, N, DType::kBF16, 4, 0.01f);
    Tensor out = ctx->empty({M, N}, DType::kF32);
    gemm.forward(*ctx, out, x.t, w.t, b.t.reshape({N}));
    float ax, aw, ag;
    const std::vector<double> xd = qdq(x.v, DType::kF8E4M3, sx, &ax), wd = qdq(w.v, DType::kF8E4M3, sw, &aw),
                              gd = qdq(g.v, DType::kF8E5M2, sg, &ag);
    std::vector<double> ref(size_t(M * N));
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double acc = b.v[size_t(j)];
        for (int64_t k = 0; k < K; ++k) acc += xd[size_t(i * K + k)] * wd[size_t(j * K + k)];
        ref[size_t(i * N + j)] = acc;
      }
    expect_close(out.data<float>(), ref, 1e-5, "out");
    EXPECT_EQ(fwd.amax(0).data<float>()[0], ax);
    EXPECT_EQ(fwd.amax(1).data<float>()[0], aw);

    Tensor dinp = ctx->empty({M, K}, DType::kF32), dw = ctx->zeros({N, K}, DType::kF32),
           db = ctx->zeros({N}, DType::kF32);
    gemm.backward(*ctx, dinp, dw, db, g.t, x.t, w.t);
    std::vector<double> rdx(size_t(M * K), 0.0), rdw(size_t(N * K), 0.0), rdb(size_t(N), 0.0);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        const double gij = gd[size_t(i * N + j)];
        rdb[size_t(j)] += g.v[size_t(i * N + j)];
        for (int64_t k = 0; k < K; ++k) {
          rdx[size_t(i * K + k)] += gij * wd[size_t(j * K + k)];
          rdw[size_t(j * K + k)] += wgrad ? gij * xd[size_t(i * K + k)] : double(g.v[size_t(i * N + j)]) * x.v[size_t(i * K + k)];
        }
      }
    expect_close(dinp.data<float>(), rdx, 1e-5, "dinp");
    expect_close(dw.data<float>(), rdw, wgrad ? 1e-5 : 1e-2, "dweight");  // bf16 GEMM without fp8 wgrad
    expect_close(db.data<float>(), rdb, 1e-5, "dbias");
    EXPECT_EQ(bwd.amax(0).data<float>()[0], ag);
    // The backward's re-quantisation of x records the same amax (max is idempotent).
    EXPECT_EQ(fwd.amax(0).data<float>()[0], ax);
  }
}

TEST(Fp8Gemm, WeightQuantisedOncePerStep) {
  auto ctx = make_cpu_context();
  Fp8Recipe r;
  Fp8ScalingGroup fwd(*ctx, r.forward_dtype(), 2, r), bwd(*ctx, r.backward_dtype(), 1, r);
  Fp8Gemm gemm(&fwd, 0, 1, &bwd, 0, true);
  Mat x = make(*ctx, 4, 8, DType::kBF16, 5, 1.0f), w = make(*ctx, 3, 8, DType::kBF16, 6, 1.0f);
  Tensor first = ctx->empty({4, 3}, DType::kBF16), again = ctx->empty({4, 3}, DType::kBF16),
         fresh = ctx->empty({4, 3}, DType::kBF16);
  gemm.forward(*ctx, first, x.t, w.t, TensorView());
  ctx->ops().scale_(w.t, 2.0f);  // an optimizer step changes the weights...
  gemm.forward(*ctx, again, x.t, w.t, TensorView());  // ...but this micro-batch is still in the old step
  EXPECT_EQ(std::memcmp(first.raw(), again.raw(), size_t(first.nbytes())), 0);
  gemm.begin_step();
  gemm.forward(*ctx, fresh, x.t, w.t, TensorView());
  EXPECT_NE(std::memcmp(first.raw(), fresh.raw(), size_t(first.nbytes())), 0);
}

}  // namespace
}  // namespace loom

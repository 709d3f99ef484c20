// nn modules of the Llama family: Norm (RMSNorm kind), RotaryEmbedding (frequencies, Llama 3.1 scaling,
// tables, forward/backward through the op table) and QKNorm (per-head norms of a grouped qkv tensor,
// checked element by element and against finite differences).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <numbers>
#include <vector>

#include "loom/nn/modules.h"

using namespace loom;

namespace {

void fill(Tensor& t, uint64_t seed, float scale, float shift = 0.0f) {
  uint64_t s = seed;
  for (int64_t i = 0; i < t.numel(); ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    t.data<float>()[i] = shift + scale * (float((s >> 40) & 0xFFFFFF) / float(1 << 24) - 0.5f) * 2.0f;
  }
}

}  // namespace

TEST(NormModule, RmsNormHasOnlyAWeight) {
  auto ctx = make_cpu_context();
  ParameterSet ps;
  Norm rms(ps, "rms", 6, 1e-5f, NormKind::kRMSNorm);
  Norm ln(ps, "ln", 6, 1e-5f);
  ps.allocate(*ctx);
  ps.initialize(1);
  EXPECT_NE(ps.find("rms.weight"), nullptr);
  EXPECT_EQ(ps.find("rms.bias"), nullptr);
  EXPECT_NE(ps.find("ln.bias"), nullptr);
  EXPECT_EQ(ps.numel(), 6 + 12);
  EXPECT_EQ(Norm::num_parameters(NormKind::kRMSNorm, 6), 6);
  EXPECT_EQ(Norm::num_parameters(NormKind::kLayerNorm, 6), 12);
  // Forward over (B, T, C): x · rstd (weight 1); backward accumulates into dinp.
  Tensor x = Tensor::empty({2, 3, 6}, DType::kF32), y = Tensor::empty({2, 3, 6}, DType::kF32);
  fill(x, 3, 2.0f, 0.3f);
  Norm::Saved s;
  rms.forward(*ctx, y, s, x);
  EXPECT_FALSE(s.mean.defined());
  ASSERT_EQ(s.rstd.numel(), 6);
  for (int64_t r = 0; r < 6; ++r) {
    double ms = 0;
    for (int64_t c = 0; c < 6; ++c) ms += double(x.data<float>()[r * 6 + c]) * x.data<float>()[r * 6 + c];
    const double rstd = 1.0 / std::sqrt(ms / 6 + 1e-5);
    for (int64_t c = 0; c < 6; ++c) EXPECT_NEAR(y.data<float>()[r * 6 + c], x.data<float>()[r * 6 + c] * rstd, 1e-5);
  }
}

TEST(RotaryEmbedding, FrequenciesAndLlama31Scaling) {
  RotaryOptions o;
  o.rotary_dim = 128;
  o.base = 500000.0;
  const std::vector<double> plain = RotaryEmbedding::inverse_frequencies(o);
  ASSERT_EQ(plain.size(), 64u);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_DOUBLE_EQ(plain[i], std::pow(500000.0, -double(2 * i) / 128.0));
  o.scaling = RopeScaling{};  // factor 8, low/high frequency factors 1 and 4, original context 8192
  const std::vector<double> scaled = RotaryEmbedding::inverse_frequencies(o);
  int high = 0, low = 0, mid = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    const double wavelen = 2 * std::numbers::pi / plain[i];
    if (wavelen < 8192.0 / 4) {
      EXPECT_EQ(scaled[i], plain[i]) << i;  // short wavelengths: untouched
      ++high;
    } else if (wavelen > 8192.0) {
      EXPECT_DOUBLE_EQ(scaled[i], plain[i] / 8) << i;  // long ones: interpolated by the factor
      ++low;
    } else {
      // In between: a blend, strictly between the two.
      EXPECT_LT(scaled[i], plain[i]) << i;
      EXPECT_GT(scaled[i], plain[i] / 8) << i;
      const double smooth = (8192.0 / wavelen - 1.0) / 3.0;
      EXPECT_NEAR(scaled[i], (1 - smooth) * plain[i] / 8 + smooth * plain[i], 1e-15) << i;
      ++mid;
    }
    if (i > 0) {
      EXPECT_LT(scaled[i], scaled[i - 1]) << i;  // still strictly decreasing
    }
  }
  EXPECT_GT(high, 0);
  EXPECT_GT(low, 0);
  EXPECT_GT(mid, 0);
}

TEST(RotaryEmbedding, TablesAndForwardBackwardAreInverse) {
  auto ctx = make_cpu_context();
  RotaryOptions o;
  o.rotary_dim = 4;
  o.base = 10000.0;
  const RotaryEmbedding rope(*ctx, o, 7);
  ASSERT_EQ(rope.cos().shape(), Shape({7, 2}));
  for (int64_t p = 0; p < 7; ++p)
    for (int64_t i = 0; i < 2; ++i) {
      const double angle = double(p) * std::pow(10000.0, -double(2 * i) / 4.0);
      EXPECT_EQ(rope.cos().data<float>()[p * 2 + i], float(std::cos(angle)));
      EXPECT_EQ(rope.sin().data<float>()[p * 2 + i], float(std::sin(angle)));
    }
  // GQA: 4 query heads in 2 groups, head size 6 (2 channels pass through).
  AttentionParams p;
  p.num_heads = 4;
  p.num_kv_heads = 2;
  p.head_dim = 6;
  Tensor qkv = Tensor::empty({2, 5, 2 * 4 * 6}, DType::kF32);
  fill(qkv, 11, 1.0f);
  const std::vector<float> before(qkv.data<float>(), qkv.data<float>() + qkv.numel());
  rope.forward(*ctx, qkv, p);
  const float* y = qkv.data<float>();
  // Position 0 is the identity; v heads and the pass-through channels never change.
  for (int64_t c = 0; c < 48; ++c) EXPECT_EQ(y[c], before[size_t(c)]);
  int64_t changed = 0;
  for (int64_t i = 0; i < qkv.numel(); ++i) {
    const int64_t col = i % 48, head = col / 6, ch = col % 6;
    if (head % 4 == 3 || ch >= 4) ASSERT_EQ(y[i], before[size_t(i)]) << i;
    else changed += y[i] != before[size_t(i)];
  }
  EXPECT_GT(changed, 0);
  rope.backward(*ctx, qkv, p);  // the transpose of a rotation is its inverse
  for (int64_t i = 0; i < qkv.numel(); ++i) EXPECT_NEAR(y[i], before[size_t(i)], 1e-6f) << i;
}

namespace {

// qkv (1, T, NKV·(G+2)·HS) for NH = 4, NKV = 2, HS = 5.
constexpr int64_t kT = 3, kNH = 4, kNKV = 2, kG = 2, kHS = 5, kRow = kNKV * (kG + 2) * kHS;

// Column of channel c of query head h (kind 0), key head g (kind 1) or value head g (kind 2).
int64_t column(int kind, int64_t head, int64_t c) {
  if (kind == 0) return ((head / kG) * (kG + 2) + head % kG) * kHS + c;
  return (head * (kG + 2) + kG + (kind == 2 ? 1 : 0)) * kHS + c;
}

}  // namespace

TEST(QKNorm, NormalisesEachQueryAndKeyHeadOnly) {
  auto ctx = make_cpu_context();
  AttentionParams p;
  p.num_heads = kNH;
  p.num_kv_heads = kNKV;
  p.head_dim = kHS;
  ParameterSet ps;
  QKNorm qk(ps, "self_attention", p, 1e-6f, NormKind::kRMSNorm);
  ps.allocate(*ctx);
  ps.initialize(0);
  ASSERT_NE(ps.find("self_attention.q_layernorm.weight"), nullptr);
  ASSERT_NE(ps.find("self_attention.k_layernorm.weight"), nullptr);
  float* qw = ps.find("self_attention.q_layernorm.weight")->value.data<float>();
  float* kw = ps.find("self_attention.k_layernorm.weight")->value.data<float>();
  for (int64_t c = 0; c < kHS; ++c) {
    qw[c] = 1.0f + 0.1f * float(c);
    kw[c] = 2.0f - 0.2f * float(c);
  }
  Tensor qkv = Tensor::empty({1, kT, kRow}, DType::kF32), scratch = Tensor::empty({kT * kNH * kHS}, DType::kF32);
  fill(qkv, 5, 1.5f, 0.2f);
  const std::vector<float> x(qkv.data<float>(), qkv.data<float>() + qkv.numel());
  QKNorm::Saved s;
  qk.forward(*ctx, qkv, s, scratch);
  const float* y = qkv.data<float>();
  for (int64_t t = 0; t < kT; ++t) {
    for (int kind = 0; kind < 3; ++kind) {
      for (int64_t h = 0; h < (kind == 0 ? kNH : kNKV); ++h) {
        double ms = 0;
        for (int64_t c = 0; c < kHS; ++c) ms += std::pow(double(x[size_t(t * kRow + column(kind, h, c))]), 2);
        const double rstd = 1.0 / std::sqrt(ms / kHS + 1e-6);
        for (int64_t c = 0; c < kHS; ++c) {
          const size_t i = size_t(t * kRow + column(kind, h, c));
          if (kind == 2) ASSERT_EQ(y[i], x[i]) << "v head changed";
          else EXPECT_NEAR(y[i], x[i] * rstd * (kind == 0 ? qw[c] : kw[c]), 1e-5) << t << " " << kind << " " << h;
        }
      }
    }
  }
  // The saved inputs are the heads before the norm, query heads in head order.
  EXPECT_EQ(s.q_inp.data<float>()[(1 * kNH + 3) * kHS + 2], x[size_t(1 * kRow + column(0, 3, 2))]);
  EXPECT_EQ(s.k_inp.data<float>()[(2 * kNKV + 1) * kHS + 4], x[size_t(2 * kRow + column(1, 1, 4))]);
}

// Backward against central differences of L = sum(w · qknorm(x)), for the LayerNorm kind (weights and
// biases) and RMSNorm: d x (v heads pass the gradient through unchanged) and the weight gradients.
TEST(QKNorm, BackwardMatchesFiniteDifferences) {
  for (const NormKind kind : {NormKind::kRMSNorm, NormKind::kLayerNorm}) {
    SCOPED_TRACE(norm_kind_name(kind));
    auto ctx = make_cpu_context();
    AttentionParams p;
    p.num_heads = kNH;
    p.num_kv_heads = kNKV;
    p.head_dim = kHS;
    ParameterSet ps;
    QKNorm qk(ps, "attn", p, 1e-5f, kind);
    ps.allocate(*ctx);
    ps.initialize(0);
    for (Parameter& par : ps.all()) {
      Tensor v = par.value;
      fill(v, std::hash<std::string>()(par.name), 0.3f, par.name.ends_with(".weight") ? 1.0f : 0.0f);
    }
    Tensor x = Tensor::empty({1, kT, kRow}, DType::kF32), w = Tensor::empty({1, kT, kRow}, DType::kF32);
    fill(x, 21, 1.0f, 0.1f);
    fill(w, 22, 1.0f);
    Tensor a = Tensor::empty({kT * kNH * kHS}, DType::kF32), b = Tensor::empty({kT * kNH * kHS}, DType::kF32);
    auto loss = [&] {
      Tensor y = Tensor::empty({1, kT, kRow}, DType::kF32);
      std::memcpy(y.raw(), x.raw(), size_t(x.nbytes()));
      QKNorm::Saved s;
      qk.forward(*ctx, y, s, a);
      double l = 0;
      for (int64_t i = 0; i < y.numel(); ++i) l += double(y.data<float>()[i]) * w.data<float>()[i];
      return l;
    };
    // Analytic: forward, then backward with dqkv = w.
    Tensor y = Tensor::empty({1, kT, kRow}, DType::kF32);
    std::memcpy(y.raw(), x.raw(), size_t(x.nbytes()));
    QKNorm::Saved s;
    qk.forward(*ctx, y, s, a);
    Tensor d = Tensor::empty({1, kT, kRow}, DType::kF32);
    std::memcpy(d.raw(), w.raw(), size_t(w.nbytes()));
    ps.zero_grads(*ctx);
    qk.backward(*ctx, d, s, a, b);
    const double eps = 1e-3;
    for (int64_t i = 0; i < x.numel(); ++i) {
      const float x0 = x.data<float>()[i];
      x.data<float>()[i] = x0 + float(eps);
      const double lp = loss();
      x.data<float>()[i] = x0 - float(eps);
      const double lm = loss();
      x.data<float>()[i] = x0;
      EXPECT_NEAR(d.data<float>()[i], (lp - lm) / (2 * eps), 2e-3) << "dx " << i;
    }
    for (Parameter& par : ps.all()) {
      for (int64_t i = 0; i < par.shape.numel(); ++i) {
        float* v = par.value.data<float>();
        const float v0 = v[i];
        v[i] = v0 + float(eps);
        const double lp = loss();
        v[i] = v0 - float(eps);
        const double lm = loss();
        v[i] = v0;
        EXPECT_NEAR(par.grad.data<float>()[i], (lp - lm) / (2 * eps), 2e-3) << par.name << " " << i;
      }
    }
  }
}

// Shared helpers of the CPU attention tests: the test case geometry, the op runner (outputs start as
// NaN so unwritten elements show up), a naive f64 reference written from the definitions (full score
// rows, two-pass softmax, visibility = causal AND window AND same segment, and attention dropout with the
// explicit mask Z[b, h, i, j] = dropout_keep(seed, stream, ((b * NH + h) * T + i) * T + j)), and the
// checks every variant repeats: against that reference, by finite differences, bit-identity across
// OpenMP thread counts, and buffers for argument checks.
#pragma once
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "loom/core/rng.h"

namespace loom::cpu::attn_test {

struct Case {
  int64_t B, T, NH, NKV, HS, window;
  bool causal = true;
  float dropout_p = 0;  // attention dropout (0: none)
  uint64_t seed = 0, stream = 0;
  int64_t qkv_cols() const { return NKV * (NH / NKV + 2) * HS; }
  float scale() const { return 1.0f / std::sqrt(float(HS)); }
  AttentionParams params() const {
    AttentionParams p;
    p.num_heads = NH;
    p.num_kv_heads = NKV;
    p.head_dim = HS;
    p.softmax_scale = scale();
    p.causal = causal;
    p.window = window;
    p.dropout_p = dropout_p;
    p.dropout_seed = seed;
    p.dropout_stream = stream;
    return p;
  }
  std::string name() const {
    return "B" + std::to_string(B) + "_T" + std::to_string(T) + "_NH" + std::to_string(NH) + "_NKV" +
           std::to_string(NKV) + "_HS" + std::to_string(HS) + "_W" + (window < 0 ? "inf" : std::to_string(window)) +
           (causal ? "" : "_noncausal") + (dropout_p > 0 ? "_drop" + std::to_string(int(dropout_p * 100)) : "");
  }
};

inline std::vector<float> randn(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(gen);
  return v;
}

struct Outputs {
  std::vector<float> out, lse, dqkv;
};

// Runs forward and backward with the given segment ids (none when empty); outputs start as NaN so any
// element the op fails to write shows up.
inline Outputs run_op(const Case& c, std::vector<float>& qkv, std::vector<float>& dout, std::vector<int32_t> seg = {}) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Outputs r;
  r.out.assign(size_t(c.B * c.T * c.NH * c.HS), nan);
  r.lse.assign(size_t(c.B * c.NH * c.T), nan);
  r.dqkv.assign(qkv.size(), nan);
  const Shape qkv_s{c.B, c.T, c.qkv_cols()}, out_s{c.B, c.T, c.NH * c.HS}, lse_s{c.B, c.NH, c.T};
  TensorView tqkv(qkv.data(), DType::kF32, qkv_s), tout(r.out.data(), DType::kF32, out_s);
  TensorView tlse(r.lse.data(), DType::kF32, lse_s), tdqkv(r.dqkv.data(), DType::kF32, qkv_s);
  TensorView tdout(dout.data(), DType::kF32, out_s);
  TensorView tseg = seg.empty() ? TensorView() : TensorView(seg.data(), DType::kI32, Shape{c.B, c.T});
  CpuOps ops;
  ops.attention_forward(tout, tlse, tqkv, c.params(), tseg);
  ops.attention_backward(tdqkv, tdout, tqkv, tout, tlse, c.params(), tseg);
  return r;
}

struct Reference {
  std::vector<double> out, lse, dqkv;
};

// Naive f64 attention from the definitions: full score rows, two-pass softmax, and the visibility rule
// written out as causal AND window AND same segment id (no segment ids: one segment). With dropout, the
// softmax P is that of the undropped scores, out = (P * Z / (1 - p)) V, and the gradients are those of
// that function with the mask held fixed.
inline Reference reference(const Case& c, const std::vector<float>& qkv, const std::vector<float>& dout,
                           const std::vector<int32_t>& seg = {}) {
  const int64_t G = c.NH / c.NKV, C3 = c.qkv_cols(), CO = c.NH * c.HS, T = c.T, HS = c.HS;
  const double scale = c.scale();
  Reference r;
  r.out.assign(size_t(c.B * T * CO), 0.0);
  r.lse.assign(size_t(c.B * c.NH * T), 0.0);
  r.dqkv.assign(qkv.size(), 0.0);
  auto at = [&](int64_t b, int64_t t, int64_t col) { return double(qkv[size_t((b * T + t) * C3 + col)]); };
  std::vector<double> p(static_cast<size_t>(T)), dp(static_cast<size_t>(T)), z(static_cast<size_t>(T), 1.0);
  const uint32_t threshold = c.dropout_p > 0 ? dropout_threshold(c.dropout_p) : 0;
  const double keep_scale = 1.0 / (1.0 - double(c.dropout_p));
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t h = 0; h < c.NH; ++h) {
      const int64_t grp = h / G;
      const int64_t qc = (grp * (G + 2) + h % G) * HS, kc = (grp * (G + 2) + G) * HS, vc = kc + HS;
      for (int64_t i = 0; i < T; ++i) {
        auto vis = [&](int64_t j) {
          return (!c.causal || j <= i) && (c.window < 0 || j > i - c.window) &&
                 (seg.empty() || seg[size_t(b * T + j)] == seg[size_t(b * T + i)]);
        };
        double m = -INFINITY;
        for (int64_t j = 0; j < T; ++j) {
          if (!vis(j)) continue;
          double s = 0;
          for (int64_t d = 0; d < HS; ++d) s += at(b, i, qc + d) * at(b, j, kc + d);
          p[size_t(j)] = s * scale;
          m = std::max(m, p[size_t(j)]);
        }
        double l = 0;
        for (int64_t j = 0; j < T; ++j) {
          p[size_t(j)] = vis(j) ? std::exp(p[size_t(j)] - m) : 0.0;
          l += p[size_t(j)];
        }
        r.lse[size_t((b * c.NH + h) * T + i)] = m + std::log(l);
        if (c.dropout_p > 0) {
          for (int64_t j = 0; j < T; ++j) {
            const uint64_t index = (uint64_t(b * c.NH + h) * uint64_t(T) + uint64_t(i)) * uint64_t(T) + uint64_t(j);
            z[size_t(j)] = dropout_keep(c.seed, c.stream, index, threshold) ? keep_scale : 0.0;
          }
        }
        const float* dy = dout.data() + (b * T + i) * CO + h * HS;
        double dsum = 0;  // D_i = dy . out_i = sum_j P Z dP
        for (int64_t j = 0; j < T; ++j) {
          p[size_t(j)] /= l;
          double s = 0;
          for (int64_t d = 0; d < HS; ++d) s += double(dy[d]) * at(b, j, vc + d);
          dp[size_t(j)] = s;
          dsum += p[size_t(j)] * z[size_t(j)] * s;
        }
        for (int64_t j = 0; j < T; ++j) {
          const double pj = p[size_t(j)], zj = z[size_t(j)];
          if (pj == 0) continue;
          const double ds = pj * (dp[size_t(j)] * zj - dsum) * scale;
          for (int64_t d = 0; d < HS; ++d) {
            r.out[size_t((b * T + i) * CO + h * HS + d)] += pj * zj * at(b, j, vc + d);
            r.dqkv[size_t((b * T + i) * C3 + qc + d)] += ds * at(b, j, kc + d);
            r.dqkv[size_t((b * T + j) * C3 + kc + d)] += ds * at(b, i, qc + d);
            r.dqkv[size_t((b * T + j) * C3 + vc + d)] += pj * zj * double(dy[d]);
          }
        }
      }
    }
  }
  return r;
}

// max |got - want| / max |want|; NaN in got (an element never written) gives +inf.
inline double rel_error(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0, mag = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double e = std::abs(double(got[i]) - want[i]);
    err = std::isnan(e) ? INFINITY : std::max(err, e);
    mag = std::max(mag, std::abs(want[i]));
  }
  return err / std::max(mag, 1e-30);
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// out, lse and dqkv of `a` and `b` are bit-identical.
inline void expect_same_bits(const Outputs& a, const Outputs& b, const std::string& what = "") {
  EXPECT_TRUE(same_bits(a.out, b.out)) << what;
  EXPECT_TRUE(same_bits(a.lse, b.lse)) << what;
  EXPECT_TRUE(same_bits(a.dqkv, b.dqkv)) << what;
}

// The op on random qkv and dout (seeds `seed`, `seed + 1`) against the f64 reference: rel_error of out,
// lse and dqkv each <= tol.
inline void expect_matches_reference(const Case& c, uint32_t seed, const std::vector<int32_t>& seg = {},
                                     double tol = 1e-5) {
  SCOPED_TRACE(c.name() + (seg.empty() ? "" : "_segments"));
  auto qkv = randn(c.B * c.T * c.qkv_cols(), seed);
  auto dout = randn(c.B * c.T * c.NH * c.HS, seed + 1);
  const Outputs got = run_op(c, qkv, dout, seg);
  const Reference want = reference(c, qkv, dout, seg);
  EXPECT_LE(rel_error(got.out, want.out), tol);
  EXPECT_LE(rel_error(got.lse, want.lse), tol);
  EXPECT_LE(rel_error(got.dqkv, want.dqkv), tol);
}

// Same inputs with 1 OpenMP thread, then 2, 3 and 2 again: every output bit-identical to the first run.
inline void expect_bit_identical_across_threads(const Case& c, std::vector<float>& qkv, std::vector<float>& dout,
                                                const std::vector<int32_t>& seg = {}) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const Outputs one = run_op(c, qkv, dout, seg);
  for (int threads : {2, 3, 2}) {
    omp_set_num_threads(threads);
    expect_same_bits(one, run_op(c, qkv, dout, seg), "threads " + std::to_string(threads));
  }
  omp_set_num_threads(saved);
}

// A qkv element: batch row b, position t, column col.
struct Probe {
  int64_t b, t, col;
};

// d/dx sum(out * r) by central differences (step 1e-2) of the f32 op itself, with the same segments and
// (for dropout) the same mask, against `dqkv` = attention_backward with dout = r, at each probe: within
// 2e-3 + 1e-2 |fd|. Returns how many probes actually carry gradient (|fd| > 1e-2), for the caller to
// require enough of them.
inline int expect_gradient_matches_finite_differences(const Case& c, const std::vector<float>& qkv,
                                                      std::vector<float> r, const std::vector<int32_t>& seg,
                                                      const std::vector<float>& dqkv,
                                                      const std::vector<Probe>& probes) {
  auto objective = [&](std::vector<float>& x) {
    const Outputs o = run_op(c, x, r, seg);
    double f = 0;
    for (size_t i = 0; i < o.out.size(); ++i) f += double(o.out[i]) * double(r[i]);
    return f;
  };
  int carrying = 0;
  for (const Probe& pr : probes) {
    const size_t idx = size_t((pr.b * c.T + pr.t) * c.qkv_cols() + pr.col);
    std::vector<float> xp = qkv, xm = qkv;
    xp[idx] += 1e-2f;
    xm[idx] -= 1e-2f;
    const double fd = (objective(xp) - objective(xm)) / (double(xp[idx]) - double(xm[idx]));
    EXPECT_NEAR(dqkv[idx], fd, 2e-3 + 1e-2 * std::abs(fd)) << "qkv[" << pr.b << ", " << pr.t << ", " << pr.col << "]";
    carrying += std::abs(fd) > 1e-2;
  }
  return carrying;
}

// f32 buffers of one case (qkv random, the rest zero) and views of them, for argument checks.
struct OpBuffers {
  explicit OpBuffers(const Case& c, uint32_t seed = 1)
      : qkv_data(randn(c.B * c.T * c.qkv_cols(), seed)),
        out_data(size_t(c.B * c.T * c.NH * c.HS)),
        lse_data(size_t(c.B * c.NH * c.T)),
        dqkv_data(qkv_data.size()),
        qkv(qkv_data.data(), DType::kF32, Shape{c.B, c.T, c.qkv_cols()}),
        out(out_data.data(), DType::kF32, Shape{c.B, c.T, c.NH * c.HS}),
        lse(lse_data.data(), DType::kF32, Shape{c.B, c.NH, c.T}),
        dqkv(dqkv_data.data(), DType::kF32, Shape{c.B, c.T, c.qkv_cols()}) {}
  OpBuffers(const OpBuffers&) = delete;
  OpBuffers& operator=(const OpBuffers&) = delete;

  std::vector<float> qkv_data, out_data, lse_data, dqkv_data;
  TensorView qkv, out, lse, dqkv;
};

}  // namespace loom::cpu::attn_test

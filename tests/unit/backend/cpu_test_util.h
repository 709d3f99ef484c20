// Helpers for the CPU op tests: seeded random tensors, f64 copies, thread-count control, a bitwise
// comparison of buffers (determinism checks compare bits, not values), tolerance checks, central finite
// differences, and bf16/f16 tensors built and checked with the core scalar conversions of
// loom/core/dtype.h (never the code under test).
#pragma once
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "loom/core/dtype.h"
#include "loom/core/tensor.h"

namespace loom::test {

inline const cpu::CpuOps& ops() {
  static const cpu::CpuOps o;
  return o;
}

inline Tensor uniform_tensor(Shape s, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  Tensor t = Tensor::empty(s, DType::kF32);
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = d(g);
  return t;
}

inline Tensor filled(Shape s, float v) {
  Tensor t = Tensor::empty(s, DType::kF32);
  std::fill(t.data<float>(), t.data<float>() + t.numel(), v);
  return t;
}

inline Tensor clone(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype());
  if (t.nbytes()) std::memcpy(c.raw(), t.raw(), size_t(t.nbytes()));
  return c;
}

inline std::vector<double> to_f64(const Tensor& t) {
  const float* p = t.data<float>();
  return std::vector<double>(p, p + t.numel());
}

inline bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), size_t(a.nbytes())) == 0;
}

// Runs f with exactly n OpenMP threads, restoring the previous setting.
template <typename F>
void with_threads(int n, F&& f) {
  const int prev = omp_get_max_threads();
  omp_set_num_threads(n);
  f();
  omp_set_num_threads(prev);
}

// |got - want| <= atol + rtol * |want| for every element; reports the worst index.
inline void expect_close(const float* got, const std::vector<double>& want, double atol, double rtol,
                         const std::string& what) {
  int64_t worst = -1;
  double worst_excess = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double err = std::fabs(double(got[i]) - want[i]);
    const double excess = err - (atol + rtol * std::fabs(want[i]));
    if (!(excess <= 0) && (worst < 0 || excess > worst_excess || std::isnan(err))) {
      worst = int64_t(i);
      worst_excess = excess;
    }
  }
  EXPECT_LT(worst, 0) << what << ": element " << worst << " got " << (worst >= 0 ? got[worst] : 0.0f)
                      << " want " << (worst >= 0 ? want[size_t(worst)] : 0.0);
}

inline void expect_close(const Tensor& got, const std::vector<double>& want, double atol, double rtol,
                         const std::string& what) {
  ASSERT_EQ(got.numel(), int64_t(want.size())) << what;
  expect_close(got.data<float>(), want, atol, rtol, what);
}

// Central difference of a scalar f64 function of one coordinate: (f(x+h) - f(x-h)) / 2h with the
// coordinate restored afterwards. h = 1e-5 in f64: truncation ~h^2 and rounding ~1e-16/h, both < 1e-9.
inline double central_diff(double& coord, const std::function<double()>& f) {
  constexpr double h = 1e-5;
  const double x0 = coord;
  coord = x0 + h;
  const double fp = f();
  coord = x0 - h;
  const double fm = f();
  coord = x0;
  return (fp - fm) / (2 * h);
}

// ---- bf16 / f16 ---------------------------------------------------------------------------------------

inline uint16_t encode(DType dt, float x) { return dt == DType::kBF16 ? f32_to_bf16(x) : f32_to_f16(x); }
inline float decode(DType dt, uint16_t b) { return dt == DType::kBF16 ? bf16_to_f32(b) : f16_to_f32(b); }

// The 16-bit payload of a bf16/f16 tensor.
inline uint16_t* bits(const Tensor& t) { return static_cast<uint16_t*>(t.raw()); }

// x (f32) rounded to dt.
inline Tensor to_lowp(const Tensor& x, DType dt) {
  Tensor y = Tensor::empty(x.shape(), dt);
  for (int64_t i = 0; i < x.numel(); ++i) bits(y)[i] = encode(dt, x.data<float>()[i]);
  return y;
}

// A random low-precision tensor (uniform in [lo, hi) before rounding).
inline Tensor lowp_uniform(Shape s, DType dt, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  return to_lowp(uniform_tensor(s, seed, lo, hi), dt);
}

// A random tensor of any compute dtype: uniform_tensor for f32, lowp_uniform for bf16/f16.
inline Tensor uniform_of(Shape s, DType dt, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  return dt == DType::kF32 ? uniform_tensor(s, seed, lo, hi) : lowp_uniform(s, dt, seed, lo, hi);
}

// Exact f32 copy of a bf16/f16 tensor.
inline Tensor widened(const Tensor& y) {
  Tensor x = Tensor::empty(y.shape(), DType::kF32);
  for (int64_t i = 0; i < y.numel(); ++i) x.data<float>()[i] = decode(y.dtype(), bits(y)[i]);
  return x;
}

// got (bf16/f16) must be exactly the rounding of want (f32); the first few mismatches are reported.
inline void expect_rounded(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  int64_t bad = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const uint16_t w = encode(got.dtype(), want.data<float>()[i]);
    if (bits(got)[i] != w && bad++ < 3)
      ADD_FAILURE() << what << ": element " << i << " got 0x" << std::hex << bits(got)[i] << " want 0x" << w
                    << std::dec << " (f32 " << want.data<float>()[i] << ")";
  }
  EXPECT_EQ(bad, 0) << what;
}

}  // namespace loom::test

// Helpers for the CPU op tests: seeded random tensors, f64 copies, thread-count control, and a bitwise
// comparison of buffers (determinism checks compare bits, not values).
#pragma once
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/cpu_ops.h"
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

}  // namespace loom::test

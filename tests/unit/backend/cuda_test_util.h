// Helpers for the CUDA op tests: one CudaContext (and its op table) per test process (the allocator is a
// process singleton bound to device 0), host <-> device copies, seeded random host tensors in any float
// dtype, and an element-wise comparison with per-dtype tolerances that reports the worst element. Every
// CUDA op test runs the CPU reference (cpu::CpuOps) on the same inputs and compares; GPU tests skip when no
// GPU is visible (REQUIRE_GPU), so the suite passes on the CPU-only CI machine.
#pragma once
#if defined(LOOM_HAVE_CUDA)
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <string>

#include "backend/cpu/cpu_ops.h"
#include "backend/cuda/cuda_context.cuh"
#include "backend/cuda/cuda_ops.cuh"
#include "loom/core/dtype.h"
#include "loom/core/tensor.h"

namespace loom::test {

inline bool gpu_visible() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();
  return ok;
}

#define REQUIRE_GPU() \
  if (!::loom::test::gpu_visible()) GTEST_SKIP() << "no CUDA GPU visible"

inline cuda::CudaContext& cuda_ctx() {
  static cuda::CudaContext* c = new cuda::CudaContext(0);
  return *c;
}

// The CUDA op table on the test context. Arguments are checked at the OpTable entry points, not by the
// launchers (cuda::matmul_forward etc. trust their caller), so tests of rejected arguments call through it.
inline const cuda::CudaOps& cuda_ops() {
  static const cuda::CudaOps* o = new cuda::CudaOps(cuda_ctx());
  return *o;
}

inline const cpu::CpuOps& cpu_ref() {
  static const cpu::CpuOps o;
  return o;
}

// A device copy of a host tensor (same dtype and shape).
inline Tensor to_device(const Tensor& host) {
  Tensor d = Tensor::empty(host.shape(), host.dtype(), cuda_ctx().device());
  cuda_ctx().copy(d, host);
  return d;
}
// A host copy of a device tensor (waits for the compute stream).
inline Tensor to_host(TensorView dev) {
  Tensor h = Tensor::empty(dev.shape(), dev.dtype());
  cuda_ctx().copy(h, dev);
  return h;
}

// A device copy of `host` that starts `offset` elements into a larger buffer (offset 1 breaks every 16-byte
// alignment, so the kernels' scalar paths run); offset 0 is a plain to_device.
inline Tensor to_device_at(const Tensor& host, int64_t offset) {
  if (offset == 0) return to_device(host);
  Tensor big = Tensor::empty(Shape{host.numel() + offset}, host.dtype(), cuda_ctx().device());
  Tensor view = big.slice_flat(offset, host.shape());
  cuda_ctx().copy(view, host);
  return view;
}
// An uninitialised device tensor placed likewise `offset` elements into a larger buffer.
inline Tensor device_empty_at(Shape s, DType dt, int64_t offset) {
  if (offset == 0) return Tensor::empty(s, dt, cuda_ctx().device());
  Tensor big = Tensor::empty(Shape{s.numel() + offset}, dt, cuda_ctx().device());
  return big.slice_flat(offset, s);
}

// The message of the exception f throws, or "no exception".
inline std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no exception";
}

inline float host_get(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::kF32: return t.data<float>()[i];
    case DType::kBF16: return bf16_to_f32(t.data<uint16_t>()[i]);
    case DType::kF16: return f16_to_f32(t.data<uint16_t>()[i]);
    case DType::kF8E4M3: return fp8_e4m3_to_f32(t.data<uint8_t>()[i]);
    case DType::kF8E5M2: return fp8_e5m2_to_f32(t.data<uint8_t>()[i]);
    case DType::kI32: return float(t.data<int32_t>()[i]);
    default: ADD_FAILURE() << "host_get: unsupported dtype " << dtype_name(t.dtype()); return 0;
  }
}
inline void host_set(const Tensor& t, int64_t i, float v) {
  switch (t.dtype()) {
    case DType::kF32: t.data<float>()[i] = v; return;
    case DType::kBF16: t.data<uint16_t>()[i] = f32_to_bf16(v); return;
    case DType::kF16: t.data<uint16_t>()[i] = f32_to_f16(v); return;
    case DType::kF8E4M3: t.data<uint8_t>()[i] = f32_to_fp8_e4m3(v); return;
    case DType::kF8E5M2: t.data<uint8_t>()[i] = f32_to_fp8_e5m2(v); return;
    default: ADD_FAILURE() << "host_set: unsupported dtype " << dtype_name(t.dtype());
  }
}

// Uniform values in [lo, hi), rounded to dt (so the CPU and GPU see identical inputs).
inline Tensor random_host(Shape s, DType dt, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  Tensor t = Tensor::empty(s, dt);
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  for (int64_t i = 0; i < t.numel(); ++i) host_set(t, i, d(g));
  return t;
}

inline Tensor host_clone(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype());
  if (t.nbytes()) std::memcpy(c.raw(), t.raw(), size_t(t.nbytes()));
  return c;
}

// Default tolerances (relative to max(1, |ref|)) by the dtype of the compared output.
inline float default_tol(DType dt) {
  switch (dt) {
    case DType::kF32: return 2e-5f;
    case DType::kBF16: return 1.6e-2f;
    case DType::kF16: return 2e-3f;
    default: return 0.13f;  // fp8
  }
}

// Expects |got - ref| <= tol * max(1, |ref|) element-wise (NaN must match NaN); reports the worst element.
// Both arguments may live on the host or the device (device ones are copied to the host first): a device
// tensor passed where a host one was expected must never be read through a host pointer.
inline void expect_close_host(const Tensor& got_host, const Tensor& ref_host, float tol, const std::string& what) {
  ASSERT_EQ(got_host.numel(), ref_host.numel()) << what;
  double worst = 0;
  int64_t at = -1;
  for (int64_t i = 0; i < got_host.numel(); ++i) {
    const float g = host_get(got_host, i), r = host_get(ref_host, i);
    if (std::isnan(r) || std::isnan(g)) {
      if (std::isnan(r) != std::isnan(g)) {
        ADD_FAILURE() << what << ": NaN mismatch at " << i << " (got " << g << ", ref " << r << ")";
        return;
      }
      continue;
    }
    if (std::isinf(r) || std::isinf(g)) {
      if (g != r) {
        ADD_FAILURE() << what << ": inf mismatch at " << i << " (got " << g << ", ref " << r << ")";
        return;
      }
      continue;
    }
    const double err = std::fabs(double(g) - double(r)) / std::max(1.0, std::fabs(double(r)));
    if (err > worst) {
      worst = err;
      at = i;
    }
  }
  EXPECT_LE(worst, tol) << what << ": worst relative error " << worst << " at element " << at << " (got "
                        << host_get(got_host, at) << ", ref " << host_get(ref_host, at) << ")";
}
inline void expect_close(TensorView got, TensorView ref, float tol, const std::string& what) {
  expect_close_host(to_host(got), to_host(ref), tol, what);
}

inline bool same_bytes(TensorView a, TensorView b) {
  if (a.nbytes() != b.nbytes()) return false;
  const Tensor ha = to_host(a), hb = to_host(b);
  return std::memcmp(ha.raw(), hb.raw(), size_t(ha.nbytes())) == 0;
}

}  // namespace loom::test
#endif  // LOOM_HAVE_CUDA

// Tests for the CUDA backend's device pieces: error-check macros, the caching allocator, the context
// (streams, cuBLASLt handle, workspace, copies) and the f32 <-> bf16 cast kernels, checked bit for bit
// against the CPU reference conversions. GPU tests skip when no GPU is visible; the checks that need
// no GPU (error macros, "no GPU" answers, the stub of a CUDA-less build) always run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "loom/backend/device_context.h"
#include "loom/core/check.h"
#include "loom/core/dtype.h"
#include "loom/core/tensor.h"

#if defined(LOOM_HAVE_CUDA)
#include <cuda_runtime_api.h>

#include "backend/cuda/cast.cuh"
#include "backend/cuda/cuda_allocator.cuh"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/cuda_context.cuh"
#endif

namespace loom {
namespace {

#if !defined(LOOM_HAVE_CUDA)

TEST(CudaSkeleton, BuildWithoutCudaSaysSo) {
  EXPECT_FALSE(cuda_available());
  try {
    make_cuda_context(0);
    FAIL() << "make_cuda_context must throw in a build without CUDA";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("no CUDA backend"), std::string::npos) << e.what();
  }
}

#else

bool gpu_visible() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();
  return ok;
}

#define REQUIRE_GPU() \
  if (!gpu_visible()) GTEST_SKIP() << "no CUDA GPU visible"

// One context per test process: the allocator is a process singleton bound to device 0.
cuda::CudaContext& ctx() {
  static cuda::CudaContext* c = new cuda::CudaContext(0);
  return *c;
}

std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return std::string("Error: ") + e.what();
  } catch (const UserError& e) {
    return std::string("UserError: ") + e.what();
  }
  return "no exception";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// ---- no GPU needed ------------------------------------------------------------------------------

TEST(CudaSkeleton, CudaCheckNamesCallAndError) {
  const std::string msg = what_of([] { LOOM_CUDA_CHECK(cudaSetDevice(-1)); });
  ASSERT_TRUE(contains(msg, "Error: ")) << msg;
  EXPECT_TRUE(contains(msg, "cudaSetDevice(-1)")) << msg;
  // Whatever the reason here (no driver, no device, bad ordinal), the runtime's own words appear.
  const cudaError_t err = cudaSetDevice(-1);
  cudaGetLastError();
  ASSERT_NE(err, cudaSuccess);
  EXPECT_TRUE(contains(msg, cudaGetErrorString(err))) << msg;
  EXPECT_TRUE(contains(msg, cudaGetErrorName(err))) << msg;
  EXPECT_TRUE(contains(msg, "test_cuda_skeleton.cpp")) << msg;
}

TEST(CudaSkeleton, CublasCheckNamesStatus) {
  const std::string msg = what_of([] { LOOM_CUBLAS_CHECK(CUBLAS_STATUS_NOT_INITIALIZED); });
  EXPECT_TRUE(contains(msg, "Error: ")) << msg;
  EXPECT_TRUE(contains(msg, "CUBLAS_STATUS_NOT_INITIALIZED")) << msg;
  EXPECT_EQ(what_of([] { LOOM_CUBLAS_CHECK(CUBLAS_STATUS_SUCCESS); }), "no exception");
  EXPECT_EQ(what_of([] { LOOM_CUDA_CHECK(cudaSuccess); }), "no exception");
}

TEST(CudaSkeleton, SizeClasses) {
  using A = cuda::CudaAllocator;
  EXPECT_EQ(A::size_class(0), 512u);
  EXPECT_EQ(A::size_class(1), 512u);
  EXPECT_EQ(A::size_class(512), 512u);
  EXPECT_EQ(A::size_class(513), 1024u);
  EXPECT_EQ(A::size_class(size_t(1) << 20), size_t(1) << 20);
  EXPECT_EQ(A::size_class((size_t(1) << 20) + 1), size_t(2) << 20);
  EXPECT_EQ(A::size_class((size_t(3) << 20) + 5), size_t(4) << 20);
  EXPECT_EQ(A::size_class(size_t(4) << 20), size_t(4) << 20);
}

TEST(CudaSkeleton, PublicEntryPoints) {
  // With a GPU: a context with the CUDA op table; without one: a one-line UserError.
  if (gpu_visible()) {
    EXPECT_TRUE(cuda_available());
    EXPECT_GT(cuda_device_count(), 0);
    const std::unique_ptr<DeviceContext> c = make_cuda_context(0);
    EXPECT_EQ(c->device().type, DeviceType::kCUDA);
    EXPECT_EQ(what_of([&] { (void)c->ops(); }), "no exception");
    EXPECT_TRUE(contains(what_of([] { make_cuda_context(1 << 20); }), "does not exist"));
    // A bare context (tests of the device pieces) has no op table and says so.
    EXPECT_TRUE(contains(what_of([] { (void)ctx().ops(); }), "op table"));
  } else {
    EXPECT_FALSE(cuda_available());
    EXPECT_EQ(cuda_device_count(), 0);
    const std::string msg = what_of([] { make_cuda_context(0); });
    EXPECT_TRUE(contains(msg, "UserError: no CUDA GPU is visible")) << msg;
  }
}

// ---- GPU ----------------------------------------------------------------------------------------

TEST(CudaSkeleton, ContextPieces) {
  REQUIRE_GPU();
  cuda::CudaContext& c = ctx();
  EXPECT_EQ(c.device(), (Device{DeviceType::kCUDA, 0}));
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  const std::string desc = c.description();
  EXPECT_TRUE(contains(desc, "cuda:0 (")) << desc;
  EXPECT_TRUE(contains(desc, prop.name)) << desc;
  EXPECT_TRUE(contains(desc, std::to_string(prop.multiProcessorCount) + " SMs")) << desc;
  EXPECT_TRUE(contains(desc, "sm_" + std::to_string(prop.major) + std::to_string(prop.minor))) << desc;
  EXPECT_EQ(c.sm_count(), prop.multiProcessorCount);
  EXPECT_NE(c.compute_stream(), nullptr);
  EXPECT_NE(c.comm_stream(), nullptr);
  EXPECT_NE(c.compute_stream(), c.comm_stream());
  int pc = 0, pm = 0;
  ASSERT_EQ(cudaStreamGetPriority(c.compute_stream(), &pc), cudaSuccess);
  ASSERT_EQ(cudaStreamGetPriority(c.comm_stream(), &pm), cudaSuccess);
  EXPECT_LE(pm, pc);  // lower number = higher priority: communication is not starved
  EXPECT_NE(c.cublaslt(), nullptr);
  ASSERT_NE(c.workspace(), nullptr);
  EXPECT_EQ(c.workspace_bytes(), size_t(32) << 20);
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, c.workspace()), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeDevice);
  EXPECT_EQ(attr.device, 0);
  // The workspace is counted by the allocator that tensors of this device use.
  EXPECT_EQ(&allocator_for(c.device()), static_cast<Allocator*>(&c.allocator()));
  EXPECT_GE(c.memory_stats().current_bytes, int64_t(32) << 20);
  EXPECT_TRUE(contains(what_of([&] { c.ops(); }), "UserError: "));
  c.synchronize();
}

TEST(CudaSkeleton, AllocatorStatsAndReuse) {
  REQUIRE_GPU();
  cuda::CudaAllocator& a = ctx().allocator();
  a.empty_cache();
  a.reset_peak();
  const AllocStats s0 = a.stats();
  EXPECT_EQ(a.cached_bytes(), 0);
  EXPECT_EQ(s0.peak_bytes, s0.current_bytes);

  void* p = a.allocate(1000);  // class 1024
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 256, 0u);
  AllocStats s = a.stats();
  EXPECT_EQ(s.current_bytes, s0.current_bytes + 1000);
  EXPECT_EQ(s.reserved_bytes, s0.reserved_bytes + 1024);
  EXPECT_EQ(s.num_allocs, s0.num_allocs + 1);

  void* q = a.allocate((size_t(3) << 20) + 7);  // class 4 MiB
  s = a.stats();
  EXPECT_EQ(s.current_bytes, s0.current_bytes + 1000 + (int64_t(3) << 20) + 7);
  EXPECT_EQ(s.reserved_bytes, s0.reserved_bytes + 1024 + (int64_t(4) << 20));
  EXPECT_EQ(s.peak_bytes, s.current_bytes);

  a.deallocate(p, 1000);
  s = a.stats();
  EXPECT_EQ(s.current_bytes, s0.current_bytes + (int64_t(3) << 20) + 7);
  EXPECT_EQ(s.reserved_bytes, s0.reserved_bytes + 1024 + (int64_t(4) << 20));  // cached, not freed
  EXPECT_EQ(s.peak_bytes, s0.current_bytes + 1000 + (int64_t(3) << 20) + 7);
  EXPECT_EQ(a.cached_bytes(), 1024);

  // Same class comes back from the cache: same block, no new reservation.
  void* p2 = a.allocate(900);
  EXPECT_EQ(p2, p);
  EXPECT_EQ(a.stats().reserved_bytes, s0.reserved_bytes + 1024 + (int64_t(4) << 20));
  EXPECT_EQ(a.cached_bytes(), 0);
  // A different class does not.
  void* r = a.allocate(100);
  EXPECT_NE(r, p);
  EXPECT_EQ(a.stats().reserved_bytes, s0.reserved_bytes + 1024 + 512 + (int64_t(4) << 20));

  // Freeing with the wrong size or twice is a bug the allocator catches.
  EXPECT_TRUE(contains(what_of([&] { a.deallocate(p2, 1000); }), "Error: "));
  a.deallocate(p2, 900);
  EXPECT_TRUE(contains(what_of([&] { a.deallocate(p2, 900); }), "double free"));
  a.deallocate(q, (size_t(3) << 20) + 7);
  a.deallocate(r, 100);
  s = a.stats();
  EXPECT_EQ(s.current_bytes, s0.current_bytes);
  EXPECT_EQ(a.cached_bytes(), 1024 + 512 + (int64_t(4) << 20));

  a.reset_peak();
  EXPECT_EQ(a.stats().peak_bytes, s0.current_bytes);
  a.empty_cache();
  EXPECT_EQ(a.cached_bytes(), 0);
  EXPECT_EQ(a.stats().reserved_bytes, s0.reserved_bytes);

  // Tensors on the device go through the same allocator (allocate(0) still gives a real block).
  {
    Tensor t = Tensor::empty({0}, DType::kF32, ctx().device());
    EXPECT_NE(t.raw(), nullptr);
    Tensor u = Tensor::empty({3, 5}, DType::kBF16, ctx().device());
    EXPECT_EQ(ctx().memory_stats().current_bytes, s0.current_bytes + 30);
  }
  EXPECT_EQ(ctx().memory_stats().current_bytes, s0.current_bytes);
}

TEST(CudaSkeleton, CopyRoundTrip) {
  REQUIRE_GPU();
  cuda::CudaContext& c = ctx();
  for (int64_t n : {1, 5, 217, 100003}) {
    Tensor h = Tensor::empty({n}, DType::kF32);
    float* hp = h.data<float>();
    for (int64_t i = 0; i < n; ++i) hp[i] = float(i) * 0.5f - 3.25f;
    Tensor d1 = c.empty({n}, DType::kF32), d2 = c.empty({n}, DType::kF32);
    c.copy(d1, h);   // H2D
    c.copy(d2, d1);  // D2D
    Tensor back = Tensor::empty({n}, DType::kF32);
    c.copy(back, d2);  // D2H
    EXPECT_EQ(std::memcmp(back.raw(), h.raw(), size_t(h.nbytes())), 0) << "n=" << n;
    // The data really lives on the device: a raw read agrees.
    float last = 0;
    ASSERT_EQ(cudaMemcpy(&last, d1.data<float>() + (n - 1), 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(last, hp[n - 1]);
  }
  // Sub-ranges (views into a larger buffer) copy only their bytes.
  Tensor h = Tensor::empty({8}, DType::kF32);
  for (int i = 0; i < 8; ++i) h.data<float>()[i] = float(i);
  Tensor d = c.empty({8}, DType::kF32);
  c.copy(d, h);
  Tensor out = Tensor::empty({3}, DType::kF32);
  c.copy(out, d.slice_flat(4, {3}));
  EXPECT_EQ(out.data<float>()[0], 4.0f);
  EXPECT_EQ(out.data<float>()[2], 6.0f);
  EXPECT_TRUE(contains(what_of([&] { c.copy(out, d); }), "size mismatch"));
}

// bf16 bits of x via the GPU kernel, for every x in `in`; `offset` shifts the views off alignment.
std::vector<uint16_t> gpu_to_bf16(const std::vector<float>& in, int64_t offset) {
  cuda::CudaContext& c = ctx();
  const int64_t n = int64_t(in.size());
  Tensor hsrc = Tensor::empty({n + offset}, DType::kF32);
  std::memcpy(hsrc.data<float>() + offset, in.data(), in.size() * 4);
  Tensor src = c.empty({n + offset}, DType::kF32), dst = c.empty({n + offset}, DType::kBF16);
  c.copy(src, hsrc);
  cuda::cast(dst.slice_flat(offset, {n}), src.slice_flat(offset, {n}), c.compute_stream());
  Tensor hdst = Tensor::empty({n + offset}, DType::kBF16);
  c.copy(hdst, dst);  // same stream: ordered after the cast
  const uint16_t* b = hdst.data<uint16_t>() + offset;
  return std::vector<uint16_t>(b, b + n);
}

TEST(CudaSkeleton, CastF32ToBf16MatchesCpuBitForBit) {
  REQUIRE_GPU();
  std::vector<float> special = {0.0f,
                                -0.0f,
                                1.0f,
                                -2.5f,
                                float_of(0x3F808000u),  // 1 + 2^-8: tie, rounds down to even 0x3F80
                                float_of(0x3F818000u),  // tie, rounds up to even 0x3F82
                                float_of(0x3F808001u),  // just above the tie: up
                                float_of(0x3F807FFFu),  // just below: down
                                std::numeric_limits<float>::max(),      // rounds to +inf
                                -std::numeric_limits<float>::max(),
                                std::numeric_limits<float>::infinity(),
                                -std::numeric_limits<float>::infinity(),
                                std::numeric_limits<float>::denorm_min(),
                                float_of(0x00018000u),  // subnormal tie
                                std::numeric_limits<float>::min(),
                                std::numeric_limits<float>::quiet_NaN(),
                                float_of(0x7F800001u),  // signalling NaN with low payload only: stays NaN
                                float_of(0xFFC12345u)};
  std::mt19937 rng(17);
  std::uniform_int_distribution<uint32_t> any_bits;
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int64_t n : {int64_t(1), int64_t(5), int64_t(217), int64_t(100003)}) {
    std::vector<float> x(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      x[size_t(i)] = i < int64_t(special.size()) ? special[size_t(i)]
                     : (i % 2 ? normal(rng) : float_of(any_bits(rng)));
    for (int64_t offset : {0, 1}) {  // 0: vectorized path; 1: unaligned scalar path
      const std::vector<uint16_t> got = gpu_to_bf16(x, offset);
      int mismatches = 0;
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t want = f32_to_bf16(x[size_t(i)]);
        if (got[size_t(i)] != want && ++mismatches <= 5)
          ADD_FAILURE() << "n=" << n << " offset=" << offset << " i=" << i << " x bits=0x" << std::hex
                        << bits_of(x[size_t(i)]) << " got 0x" << got[size_t(i)] << " want 0x" << want;
      }
      EXPECT_EQ(mismatches, 0) << "n=" << n << " offset=" << offset;
    }
  }
  // Spot-check the reference itself on the ties, so a wrong reference cannot hide a wrong kernel.
  EXPECT_EQ(f32_to_bf16(float_of(0x3F808000u)), 0x3F80);
  EXPECT_EQ(f32_to_bf16(float_of(0x3F818000u)), 0x3F82);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7F80);
}

TEST(CudaSkeleton, CastBf16ToF32IsExactForAllPatterns) {
  REQUIRE_GPU();
  cuda::CudaContext& c = ctx();
  const int64_t n = 65536;
  for (int64_t offset : {0, 3}) {
    Tensor h = Tensor::empty({n + offset}, DType::kBF16);
    for (int64_t i = 0; i < n; ++i) h.data<uint16_t>()[offset + i] = uint16_t(i);
    Tensor src = c.empty({n + offset}, DType::kBF16), dst = c.empty({n + offset}, DType::kF32);
    c.copy(src, h);
    cuda::cast(dst.slice_flat(offset, {n}), src.slice_flat(offset, {n}), c.compute_stream());
    Tensor back = Tensor::empty({n + offset}, DType::kF32);
    c.copy(back, dst);
    int mismatches = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t got = bits_of(back.data<float>()[offset + i]);
      const uint32_t want = bits_of(bf16_to_f32(uint16_t(i)));
      if (got != want) ++mismatches;
    }
    EXPECT_EQ(mismatches, 0) << "offset=" << offset;
  }
  // f32 -> bf16 -> f32 on bf16-representable values is the identity, through both kernels.
  std::vector<float> x = {1.0f, -0.5f, 3.0f, 1024.0f, -7.0f};
  const std::vector<uint16_t> b = gpu_to_bf16(x, 0);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(bf16_to_f32(b[i]), x[i]);
  // Wrong dtype pairs are refused.
  Tensor a = c.empty({4}, DType::kF32), i32 = c.empty({4}, DType::kI32);
  EXPECT_TRUE(contains(what_of([&] { cuda::cast(i32, a, c.compute_stream()); }), "f32 <-> bf16"));
}

#endif  // LOOM_HAVE_CUDA

}  // namespace
}  // namespace loom

// Core layer: dtype conversions (checked against an independent brute-force round-to-nearest-even over
// the sorted values of each format), Shape, Tensor views/slices/ownership, allocator accounting, and the
// Philox4x32-10 generator (Random123 known-answer vectors, distribution statistics, sub-range equality).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "loom/core/allocator.h"
#include "loom/core/check.h"
#include "loom/core/dtype.h"
#include "loom/core/rng.h"
#include "loom/core/shape.h"
#include "loom/core/tensor.h"

namespace loom {
namespace {

// ---- dtype conversions -------------------------------------------------------------------------------

struct Format {
  const char* name;
  int bits;              // 8 or 16
  uint32_t max_bits;     // largest finite positive pattern
  bool overflow_to_inf;  // IEEE rounding to inf (bf16, f16); FP8 saturates to max_bits
  uint32_t inf_bits;     // only with overflow_to_inf
  std::function<float(uint32_t)> decode;
  std::function<uint32_t(float)> encode;
};

std::vector<Format> formats() {
  return {
      {"bf16", 16, 0x7F7F, true, 0x7F80, [](uint32_t b) { return bf16_to_f32(uint16_t(b)); },
       [](float x) { return uint32_t(f32_to_bf16(x)); }},
      {"f16", 16, 0x7BFF, true, 0x7C00, [](uint32_t b) { return f16_to_f32(uint16_t(b)); },
       [](float x) { return uint32_t(f32_to_f16(x)); }},
      {"fp8e4m3", 8, 0x7E, false, 0, [](uint32_t b) { return fp8_e4m3_to_f32(uint8_t(b)); },
       [](float x) { return uint32_t(f32_to_fp8_e4m3(x)); }},
      {"fp8e5m2", 8, 0x7B, false, 0, [](uint32_t b) { return fp8_e5m2_to_f32(uint8_t(b)); },
       [](float x) { return uint32_t(f32_to_fp8_e5m2(x)); }},
  };
}

// Brute-force reference: positive finite patterns 0..max_bits are increasing in value, so the nearest
// representable is found by binary search in f64; ties go to the even pattern (mantissa LSB 0).
// Above the largest finite value: IEEE formats go to inf from the midpoint towards the next binade on
// (round-to-nearest with unbounded exponent), FP8 saturates.
uint32_t reference_encode(const Format& f, float x) {
  const uint32_t sign = std::signbit(x) ? 1u << (f.bits - 1) : 0;
  const double a = std::fabs(double(x));
  const double max = f.decode(f.max_bits);
  if (a > max) {
    const double next_binade = max + (max - double(f.decode(f.max_bits - 1)));
    if (f.overflow_to_inf && a >= (max + next_binade) / 2) return sign | f.inf_bits;
    return sign | f.max_bits;
  }
  uint32_t lo = 0, hi = f.max_bits;  // largest p with decode(p) <= a
  while (lo < hi) {
    const uint32_t mid = (lo + hi + 1) / 2;
    if (double(f.decode(mid)) <= a)
      lo = mid;
    else
      hi = mid - 1;
  }
  if (double(f.decode(lo)) == a || lo == f.max_bits) return sign | lo;
  const double dlo = a - f.decode(lo), dhi = double(f.decode(lo + 1)) - a;
  if (dlo < dhi) return sign | lo;
  if (dhi < dlo) return sign | (lo + 1);
  return sign | ((lo & 1u) ? lo + 1 : lo);
}

std::vector<float> rounding_inputs(const Format& f) {
  std::vector<float> v;
  for (uint32_t b = 0; b < f.max_bits; ++b) {
    const double lo = f.decode(b), hi = f.decode(b + 1);
    const float mid = float((lo + hi) / 2);  // exact: one more bit than the format, fewer than f32
    for (float s : {1.0f, -1.0f}) {
      v.push_back(s * float(lo));
      v.push_back(s * mid);
      v.push_back(s * std::nextafter(mid, INFINITY));
      v.push_back(s * std::nextafter(mid, 0.0f));
    }
  }
  const double max = f.decode(f.max_bits);
  const double next_binade = max + (max - double(f.decode(f.max_bits - 1)));
  const float overflow_mid = float((max + next_binade) / 2);
  for (float s : {1.0f, -1.0f})
    for (float x :
         {float(max), overflow_mid, std::nextafter(overflow_mid, 0.0f), std::nextafter(overflow_mid, INFINITY),
          float(next_binade), 1e30f, 3.4e38f, INFINITY, 1e-30f, 1e-45f, 0.0f})
      v.push_back(s * x);
  std::mt19937 g(7);
  for (int i = 0; i < 200000; ++i) {
    const float x = std::bit_cast<float>(uint32_t(g()));
    if (!std::isnan(x)) v.push_back(x);
  }
  return v;
}

TEST(CoreDType, SizesNamesAndMaxima) {
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF8E5M2), 1u);
  EXPECT_EQ(dtype_size(DType::kI64), 8u);
  EXPECT_STREQ(dtype_name(DType::kF8E4M3), "fp8e4m3");
  EXPECT_TRUE(dtype_is_float(DType::kF16));
  EXPECT_FALSE(dtype_is_float(DType::kI32));
  EXPECT_EQ(dtype_max(DType::kF16), 65504.0);
  EXPECT_EQ(dtype_max(DType::kF8E4M3), 448.0);
  EXPECT_EQ(dtype_max(DType::kF8E5M2), 57344.0);
  EXPECT_EQ(dtype_max(DType::kBF16), double(bf16_to_f32(0x7F7F)));
  EXPECT_THROW(dtype_max(DType::kI32), Error);
}

TEST(CoreDType, EncodeMatchesBruteForceRoundToNearestEven) {
  for (const Format& f : formats()) {
    int64_t bad = 0;
    for (float x : rounding_inputs(f)) {
      const uint32_t got = f.encode(x), want = reference_encode(f, x);
      if (got != want && bad++ < 5)
        ADD_FAILURE() << f.name << " encode(" << x << " = 0x" << std::hex << std::bit_cast<uint32_t>(x) << ") = 0x"
                      << got << ", want 0x" << want;
    }
    EXPECT_EQ(bad, 0) << f.name;
  }
}

TEST(CoreDType, ExhaustiveDecodeEncodeRoundTrip) {
  for (const Format& f : formats()) {
    for (uint32_t b = 0; b < (1u << f.bits); ++b) {
      const float x = f.decode(b);
      if (std::isnan(x)) {
        ASSERT_TRUE(std::isnan(f.decode(f.encode(x)))) << f.name << " NaN pattern 0x" << std::hex << b;
        continue;
      }
      if (std::isinf(x) && !f.overflow_to_inf) {  // E5M2 has infinities, but the cast saturates them
        ASSERT_EQ(f.encode(x), (b & ~0x7Fu) | f.max_bits) << f.name;
        continue;
      }
      ASSERT_EQ(f.encode(x), b) << f.name << " pattern 0x" << std::hex << b << " value " << x;
    }
  }
}

TEST(CoreDType, KnownValuesSpecialsAndSubnormals) {
  // Ties to even.
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3F808000u)), 0x3F80);  // tie, even below
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3F818000u)), 0x3F82);  // tie, odd below: up
  EXPECT_EQ(f32_to_f16(1.0f + 0x1p-11f), 0x3C00);                     // tie between 1 and 1+2^-10
  EXPECT_EQ(f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3C02);
  // Subnormals: f16 smallest 2^-24; half of it ties to 0; just above half rounds up.
  EXPECT_EQ(f32_to_f16(0x1p-24f), 0x0001);
  EXPECT_EQ(f32_to_f16(0x1p-25f), 0x0000);
  EXPECT_EQ(f32_to_f16(std::nextafter(0x1p-25f, 1.0f)), 0x0001);
  EXPECT_EQ(f32_to_f16(-0x1p-24f * 3), 0x8003);
  EXPECT_EQ(f16_to_f32(0x03FF), 0x1p-14f - 0x1p-24f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), 0x1p-9f);
  EXPECT_EQ(fp8_e5m2_to_f32(0x01), 0x1p-16f);
  EXPECT_EQ(f32_to_fp8_e4m3(0x1p-10f), 0x00);  // tie with 0: even
  EXPECT_EQ(f32_to_fp8_e4m3(0x1p-10f * 3), 0x02);
  // Overflow: f16 -> inf from 65520 on, FP8 saturates, bf16 -> inf.
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7BFF);
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7BFF);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7C00);
  EXPECT_EQ(f32_to_f16(-1e9f), 0xFC00);
  EXPECT_EQ(f32_to_fp8_e4m3(1e9f), 0x7E);
  EXPECT_EQ(f32_to_fp8_e4m3(-INFINITY), 0xFE);
  EXPECT_EQ(fp8_e4m3_to_f32(0x7E), 448.0f);
  EXPECT_EQ(f32_to_fp8_e5m2(1e9f), 0x7B);
  EXPECT_EQ(f32_to_fp8_e5m2(INFINITY), 0x7B);
  EXPECT_EQ(fp8_e5m2_to_f32(0x7B), 57344.0f);
  EXPECT_EQ(f32_to_bf16(3.4e38f), 0x7F80);
  EXPECT_EQ(f32_to_bf16(-INFINITY), 0xFF80);
  // NaN stays NaN (quiet), sign kept where the format can.
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::bit_cast<float>(0x7F800001u)))));  // signalling NaN
  EXPECT_EQ(f32_to_bf16(-NAN) & 0x8000, 0x8000);
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(NAN))));
  EXPECT_EQ(f32_to_fp8_e4m3(NAN) & 0x7F, 0x7F);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0xFF)));
  EXPECT_TRUE(std::isnan(fp8_e5m2_to_f32(f32_to_fp8_e5m2(NAN))));
  EXPECT_EQ(fp8_e5m2_to_f32(0x7C), INFINITY);
  // Signed zero.
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_fp8_e4m3(-0.0f), 0x80);
  EXPECT_TRUE(std::signbit(fp8_e5m2_to_f32(0x80)));
}

// ---- Shape -------------------------------------------------------------------------------------------

TEST(CoreShape, ExtentsRowsColsAndErrors) {
  Shape s{2, 3, 5};
  EXPECT_EQ(s.ndim(), 3);
  EXPECT_EQ(s.numel(), 30);
  EXPECT_EQ(s.rows(), 6);
  EXPECT_EQ(s.cols(), 5);
  EXPECT_EQ(s[-1], 5);
  EXPECT_EQ(s[0], 2);
  EXPECT_EQ(s.str(), "(2, 3, 5)");
  EXPECT_EQ(s, (Shape{2, 3, 5}));
  EXPECT_NE(s, (Shape{2, 15}));
  EXPECT_THROW(s[3], Error);
  EXPECT_THROW(s[-4], Error);
  EXPECT_THROW((Shape{1, 2, 3, 4, 5, 6, 7}), Error);
  EXPECT_THROW((Shape{2, -1}), Error);
  Shape scalar;
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar.rows(), 1);
  EXPECT_EQ(scalar.cols(), 1);
  EXPECT_EQ((Shape{4, 0, 3}).numel(), 0);
  const int64_t dims[] = {7, 11};
  EXPECT_EQ(Shape(std::span<const int64_t>(dims)), (Shape{7, 11}));
}

// ---- Tensor and allocator ----------------------------------------------------------------------------

TEST(CoreTensor, ViewsSlicesAndTypedAccess) {
  Tensor t = Tensor::zeros({4, 6}, DType::kF32);
  for (int64_t i = 0; i < 24; ++i) EXPECT_EQ(t.data<float>()[i], 0.0f);
  for (int64_t i = 0; i < 24; ++i) t.data<float>()[i] = float(i);
  EXPECT_EQ(t.nbytes(), 96);
  EXPECT_EQ(t.desc(), "f32(4, 6)@cpu");
  Tensor r = t.reshape({2, 12});
  EXPECT_EQ(r.raw(), t.raw());
  EXPECT_EQ(r.size(1), 12);
  EXPECT_THROW(t.reshape({5, 5}), Error);
  Tensor s = t.slice_flat(7, {2, 3});
  EXPECT_EQ(s.data<float>()[0], 7.0f);
  EXPECT_EQ(s.data<float>()[5], 12.0f);
  s.data<float>()[0] = -1;  // shares storage
  EXPECT_EQ(t.data<float>()[7], -1.0f);
  EXPECT_THROW(t.slice_flat(20, {5}), Error);
  EXPECT_THROW(t.slice_flat(-1, {1}), Error);
  TensorView v = t;
  EXPECT_TRUE(v.defined());
  EXPECT_FALSE(TensorView().defined());
  EXPECT_EQ(v.slice_flat(3, {3}).data<float>()[0], 3.0f);
  EXPECT_THROW(v.data<int32_t>(), Error);  // dtype mismatch
  EXPECT_THROW(v.data<uint16_t>(), Error);
  Tensor h = Tensor::empty({3}, DType::kBF16);
  EXPECT_NO_THROW(h.data<uint16_t>());
  EXPECT_THROW(h.data<float>(), Error);
  Tensor q = Tensor::empty({3}, DType::kF8E4M3);
  EXPECT_NO_THROW(q.data<uint8_t>());
}

TEST(CoreTensor, SliceKeepsStorageAliveAndWrapDoesNotOwn) {
  Allocator& a = allocator_for(cpu_device());
  const int64_t before = a.stats().current_bytes;
  Tensor s;
  {
    Tensor t = Tensor::empty({1000}, DType::kF32);
    EXPECT_EQ(a.stats().current_bytes, before + 4000);
    for (int i = 0; i < 1000; ++i) t.data<float>()[i] = float(i);
    s = t.slice_flat(990, {10});
    Tensor copy = t;  // refcount 3, one storage
    EXPECT_EQ(a.stats().current_bytes, before + 4000);
  }
  // The original handle is gone; the slice still holds the storage.
  EXPECT_EQ(a.stats().current_bytes, before + 4000);
  EXPECT_EQ(s.data<float>()[9], 999.0f);
  s = Tensor();
  EXPECT_EQ(a.stats().current_bytes, before);

  std::vector<float> mine(8, 2.0f);
  {
    Tensor w = Tensor::wrap(mine.data(), {8}, DType::kF32);
    EXPECT_EQ(w.data<float>()[3], 2.0f);
    EXPECT_EQ(a.stats().current_bytes, before);  // not counted, not freed
  }
  EXPECT_EQ(mine[3], 2.0f);
}

TEST(CoreAllocator, CurrentPeakAndCountAccounting) {
  Allocator& a = allocator_for(cpu_device());
  a.reset_peak();
  const AllocStats s0 = a.stats();
  EXPECT_EQ(s0.peak_bytes, s0.current_bytes);
  void* p1 = a.allocate(1000);
  void* p2 = a.allocate(3);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p1) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p2) % 64, 0u);
  AllocStats s1 = a.stats();
  EXPECT_EQ(s1.current_bytes, s0.current_bytes + 1003);
  EXPECT_EQ(s1.peak_bytes, s0.current_bytes + 1003);
  EXPECT_EQ(s1.num_allocs, s0.num_allocs + 2);
  a.deallocate(p1, 1000);
  AllocStats s2 = a.stats();
  EXPECT_EQ(s2.current_bytes, s0.current_bytes + 3);
  EXPECT_EQ(s2.peak_bytes, s1.peak_bytes);  // the high-water mark stays
  a.reset_peak();
  EXPECT_EQ(a.stats().peak_bytes, s2.current_bytes);
  a.deallocate(p2, 3);
  EXPECT_EQ(a.stats().current_bytes, s0.current_bytes);
  void* z = a.allocate(0);  // a valid pointer for empty tensors
  EXPECT_NE(z, nullptr);
  a.deallocate(z, 0);
  EXPECT_THROW(allocator_for(Device{DeviceType::kCUDA, 0}), Error);  // nothing registered in this test
}

// Large blocks (>= kCacheMin) are cached per 2 MiB class and handed out again for a request of the same
// class, or of a class at most a quarter (and 2 MiB) smaller (no fresh pages to fault in and zero every
// step); a miss gives back the cached blocks of smaller classes; reserved counts the cache; a block past
// the limit is freed; empty_cache gives everything back; small blocks are not cached; a large block freed
// with another size, or twice, fails a check.
TEST(CoreAllocator, CpuCachesLargeBlocksPerSizeClass) {
  CpuAllocator a;
  a.set_cache_limit(int64_t(64) << 20);
  a.set_poison(false);
  const size_t mb = size_t(1) << 20;
  void* p = a.allocate(3 * mb + 100);  // class 4 MiB
  std::memset(p, 0x5A, 3 * mb + 100);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  a.deallocate(p, 3 * mb + 100);
  EXPECT_EQ(a.cached_bytes(), int64_t(4 * mb));
  EXPECT_EQ(a.stats().current_bytes, 0);
  EXPECT_EQ(a.stats().reserved_bytes, int64_t(4 * mb));
  void* q = a.allocate(4 * mb);  // same class: the same block, old contents and all
  EXPECT_EQ(q, p);
  EXPECT_EQ(static_cast<unsigned char*>(q)[12345], 0x5A);
  EXPECT_EQ(a.cached_bytes(), 0);
  EXPECT_EQ(a.stats().current_bytes, int64_t(4 * mb));
  void* r = a.allocate(9 * mb);  // class 10 MiB: a new block
  EXPECT_NE(r, q);
  a.deallocate(q, 4 * mb);
  a.deallocate(r, 9 * mb);
  EXPECT_EQ(a.cached_bytes(), int64_t(14 * mb));
  EXPECT_EQ(a.stats().reserved_bytes, int64_t(14 * mb));

  void* r2 = a.allocate(8 * mb);  // class 8: the 10 MiB block fits with 2 MiB to spare
  EXPECT_EQ(r2, r);
  EXPECT_EQ(a.cached_bytes(), int64_t(4 * mb));
  a.deallocate(r2, 8 * mb);  // filed under its own class again
  EXPECT_EQ(a.cached_bytes(), int64_t(14 * mb));
  void* r3 = a.allocate(10 * mb);
  EXPECT_EQ(r3, r);
  a.deallocate(r3, 10 * mb);

  void* small = a.allocate(mb - 64);  // under kCacheMin: straight to and from malloc
  a.deallocate(small, mb - 64);
  EXPECT_EQ(a.cached_bytes(), int64_t(14 * mb));

  void* s6 = a.allocate(6 * mb);  // a miss (10 MiB would waste 4): the 4 MiB block, smaller, goes back
  EXPECT_NE(s6, r);
  EXPECT_EQ(a.cached_bytes(), int64_t(10 * mb));
  a.deallocate(s6, 6 * mb);
  EXPECT_EQ(a.cached_bytes(), int64_t(16 * mb));

  void* big = a.allocate(50 * mb);  // a miss: both smaller classes go back; 50 MiB then fits the limit
  EXPECT_EQ(a.cached_bytes(), 0);
  a.deallocate(big, 50 * mb);
  EXPECT_EQ(a.cached_bytes(), int64_t(50 * mb));
  void* over = a.allocate(20 * mb);  // a miss below the cached class: 50 MiB stays; 20 + 50 > 64: freed
  a.deallocate(over, 20 * mb);
  EXPECT_EQ(a.cached_bytes(), int64_t(50 * mb));
  a.empty_cache();
  EXPECT_EQ(a.cached_bytes(), 0);
  EXPECT_EQ(a.stats().reserved_bytes, 0);

  a.set_cache_limit(0);  // off: every block goes back
  void* s = a.allocate(8 * mb);
  a.deallocate(s, 8 * mb);
  EXPECT_EQ(a.cached_bytes(), 0);
  EXPECT_EQ(a.stats().num_allocs, 10);

  void* t = a.allocate(2 * mb);
  EXPECT_THROW(a.deallocate(t, 3 * mb), Error);
  a.deallocate(t, 2 * mb);
  EXPECT_THROW(a.deallocate(t, 2 * mb), Error);
}

// With poisoning on (LOOM_CPU_ALLOC_POISON=1, or set_poison), every large block is handed out filled with
// 0xFF, fresh or reused: code that reads memory it did not write sees NaNs instead of zeros or old data.
TEST(CoreAllocator, CpuPoisonFillsLargeBlocks) {
  CpuAllocator a;
  a.set_cache_limit(int64_t(64) << 20);
  a.set_poison(true);
  const size_t n = (size_t(2) << 20) / sizeof(float);
  auto* f = static_cast<float*>(a.allocate(n * sizeof(float)));
  EXPECT_TRUE(std::isnan(f[0]) && std::isnan(f[n / 2]) && std::isnan(f[n - 1]));
  std::fill(f, f + n, 1.0f);
  a.deallocate(f, n * sizeof(float));
  auto* g = static_cast<float*>(a.allocate(n * sizeof(float)));
  EXPECT_EQ(static_cast<void*>(g), static_cast<void*>(f));  // the cached block, poisoned again
  EXPECT_TRUE(std::isnan(g[0]) && std::isnan(g[n - 1]));
  a.deallocate(g, n * sizeof(float));
}

// The process's CPU allocator is shared by every thread: concurrent large allocations and frees keep the
// accounting exact and never hand one block to two owners.
TEST(CoreAllocator, CpuCacheIsThreadSafe) {
  CpuAllocator a;
  a.set_cache_limit(int64_t(256) << 20);
  a.set_poison(false);
  std::vector<std::thread> threads;
  std::atomic<int> clashes{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        const size_t bytes = (size_t(1 + (i + t) % 3) << 20) + 64;
        auto* p = static_cast<int*>(a.allocate(bytes));
        p[0] = t * 1000 + i;
        std::this_thread::yield();
        if (p[0] != t * 1000 + i) clashes.fetch_add(1);
        a.deallocate(p, bytes);
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(clashes.load(), 0);
  EXPECT_EQ(a.stats().current_bytes, 0);
  EXPECT_EQ(a.stats().num_allocs, 800);
  EXPECT_EQ(a.stats().reserved_bytes, a.cached_bytes());
  EXPECT_LE(a.cached_bytes(), int64_t(4 * 6) << 20);  // at most 4 blocks of each of the 3 classes (2, 4, 4 MiB)
}

// The VmFlags line of /proc/self/smaps for the mapping that holds p ("" when there is none or no smaps).
std::string vm_flags_of(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  const auto addr = reinterpret_cast<uintptr_t>(p);
  while (std::getline(smaps, line)) {
    unsigned long lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-' && line.find(':') > line.find(' ')) {
      inside = addr >= lo && addr < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

// Large blocks start on a 2 MiB boundary and their pages are advised as transparent huge pages (the "hg"
// VmFlag), unless switched off (LOOM_CPU_ALLOC_HUGEPAGES=0, set_hugepages); small blocks are plain. A value
// of LOOM_CPU_ALLOC_HUGEPAGES other than 0 or 1 is an error that names it.
TEST(CoreAllocator, CpuLargeBlocksAskForHugePages) {
  CpuAllocator a;
  a.set_hugepages(true);
  const size_t big = (size_t(5) << 20) + 64, other = (size_t(9) << 20) + 64, small = size_t(256) << 10;
  auto* p = static_cast<char*>(a.allocate(big));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % (size_t(2) << 20), 0u);
  std::memset(p, 1, big);
  const std::string flags = vm_flags_of(p);
  if (flags.empty()) {
    a.deallocate(p, big);
    GTEST_SKIP() << "no /proc/self/smaps";
  }
  EXPECT_NE((flags + " ").find(" hg "), std::string::npos) << flags;
  a.set_hugepages(false);
  auto* q = static_cast<char*>(a.allocate(other));  // another size class: not the cached block
  std::memset(q, 1, other);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(q) % (size_t(2) << 20), 0u);
  EXPECT_EQ((vm_flags_of(q) + " ").find(" hg "), std::string::npos) << vm_flags_of(q);
  auto* r = static_cast<char*>(a.allocate(small));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(r) % 64, 0u);
  a.deallocate(r, small);
  a.deallocate(q, other);
  a.deallocate(p, big);
  setenv("LOOM_CPU_ALLOC_HUGEPAGES", "yes", 1);
  try {
    CpuAllocator bad;
    ADD_FAILURE() << "LOOM_CPU_ALLOC_HUGEPAGES=yes was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("LOOM_CPU_ALLOC_HUGEPAGES='yes'"), std::string::npos) << e.what();
  }
  setenv("LOOM_CPU_ALLOC_HUGEPAGES", "0", 1);
  {
    CpuAllocator off;
    auto* b = static_cast<char*>(off.allocate(big));
    std::memset(b, 1, big);
    EXPECT_EQ((vm_flags_of(b) + " ").find(" hg "), std::string::npos) << vm_flags_of(b);
    off.deallocate(b, big);
  }
  unsetenv("LOOM_CPU_ALLOC_HUGEPAGES");
}

// ---- Philox ------------------------------------------------------------------------------------------

TEST(CorePhilox, Random123KnownAnswers) {
  // Philox4x32-10 KAT vectors from Random123 (counter c0..c3, key k0 k1). Our mapping: counter =
  // (block lo, block hi, stream lo, stream hi), key = (seed lo, seed hi).
  using W = std::array<uint32_t, 4>;
  EXPECT_EQ(philox4x32(0, 0, 0), (W{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_EQ(philox4x32(~0ull, ~0ull, ~0ull), (W{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  // Counter (243f6a88 85a308d3 13198a2e 03707344), key (a4093822 299f31d0): digits of pi.
  EXPECT_EQ(philox4x32(0x299f31d0a4093822ull, 0x0370734413198a2eull, 0x85a308d3243f6a88ull),
            (W{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

TEST(CorePhilox, UniformIsStrictlyInsideTheUnitInterval) {
  // Find a counter whose word is within 2^7 of 2^32 - 1, where (w + 0.5) / 2^32 rounds to 1.0f in f32.
  const uint64_t seed = 1, stream = 0;
  int64_t index = -1;
  for (uint64_t b = 0; b < (uint64_t(1) << 26) && index < 0; ++b) {
    const auto w = philox4x32(seed, stream, b);
    for (int l = 0; l < 4; ++l)
      if (w[l] >= 0xFFFFFF80u) index = int64_t(b * 4 + uint64_t(l));
  }
  ASSERT_GE(index, 0);
  const float u = philox_uniform(seed, stream, uint64_t(index));
  EXPECT_LT(u, 1.0f);
  EXPECT_GT(u, 0.0f);
  float buf[1];
  philox_fill_uniform(buf, 1, seed, stream, uint64_t(index));
  EXPECT_LT(buf[0], 1.0f);
}

TEST(CorePhilox, NormalAndUniformFillStatistics) {
  const int64_t n = 1000000;
  std::vector<float> x(n), u(n);
  philox_fill_normal(x.data(), n, 1234, hash_stream("layers.0.weight"), 0, 3.0f, 2.0f);
  philox_fill_uniform(u.data(), n, 1234, 7, 0);
  double s = 0, s2 = 0, us = 0, umin = 1, umax = 0;
  for (int64_t i = 0; i < n; ++i) {
    s += x[i];
    s2 += double(x[i]) * x[i];
    us += u[i];
    umin = std::min(umin, double(u[i]));
    umax = std::max(umax, double(u[i]));
  }
  const double mean = s / n, sd = std::sqrt(s2 / n - mean * mean);
  // Standard errors: mean 2/1000 = 0.002, std 2/sqrt(2e6) = 0.0014; allow 5 sigma.
  EXPECT_NEAR(mean, 3.0, 0.01);
  EXPECT_NEAR(sd, 2.0, 0.007);
  EXPECT_NEAR(us / n, 0.5, 0.0015);  // uniform: sd 0.289/1000
  EXPECT_GT(umin, 0.0);
  EXPECT_LT(umax, 1.0);
}

TEST(CorePhilox, SubRangesEqualSlicesOfTheFullRangeForAnyThreadCount) {
  const int64_t n = 1003;
  std::vector<float> full(n), full1(n);
  philox_fill_normal(full.data(), n, 42, 9, 0, 0.0f, 1.0f);
  const int prev = omp_get_max_threads();
  omp_set_num_threads(1);
  philox_fill_normal(full1.data(), n, 42, 9, 0, 0.0f, 1.0f);
  omp_set_num_threads(prev);
  EXPECT_EQ(std::memcmp(full.data(), full1.data(), n * sizeof(float)), 0);
  for (int64_t off : {0, 1, 2, 3, 5, 123, 998})
    for (int64_t len : {1, 2, 5, 37}) {
      if (off + len > n) continue;
      std::vector<float> part(static_cast<size_t>(len));
      philox_fill_normal(part.data(), len, 42, 9, uint64_t(off), 0.0f, 1.0f);
      EXPECT_EQ(std::memcmp(part.data(), full.data() + off, size_t(len) * sizeof(float)), 0) << off << "+" << len;
      philox_fill_uniform(part.data(), len, 42, 9, uint64_t(off));
      for (int64_t i = 0; i < len; ++i) EXPECT_EQ(part[i], philox_uniform(42, 9, uint64_t(off + i)));
    }
  // Different streams and seeds give different numbers.
  std::vector<float> other(n);
  philox_fill_normal(other.data(), n, 42, 10, 0, 0.0f, 1.0f);
  EXPECT_NE(std::memcmp(other.data(), full.data(), n * sizeof(float)), 0);
  philox_fill_normal(other.data(), n, 43, 9, 0, 0.0f, 1.0f);
  EXPECT_NE(std::memcmp(other.data(), full.data(), n * sizeof(float)), 0);
  EXPECT_NE(hash_stream("a"), hash_stream("b"));
  EXPECT_EQ(hash_stream(""), 1469598103934665603ull);  // FNV-1a offset basis
}

}  // namespace
}  // namespace loom

#include "loom/core/allocator.h"

#include <cstdlib>
#include <new>

#include "loom/core/check.h"

namespace loom {

void* CpuAllocator::allocate(size_t bytes) {
  const size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
  if (!p) throw std::bad_alloc();
  const int64_t cur = current_.fetch_add(int64_t(bytes)) + int64_t(bytes);
  int64_t peak = peak_.load();
  while (cur > peak && !peak_.compare_exchange_weak(peak, cur)) {
  }
  count_.fetch_add(1);
  return p;
}

void CpuAllocator::deallocate(void* p, size_t bytes) {
  if (!p) return;
  std::free(p);
  current_.fetch_sub(int64_t(bytes));
}

AllocStats CpuAllocator::stats() const {
  AllocStats s;
  s.current_bytes = current_.load();
  s.peak_bytes = peak_.load();
  s.reserved_bytes = s.current_bytes;
  s.num_allocs = count_.load();
  return s;
}

void CpuAllocator::reset_peak() { peak_.store(current_.load()); }

namespace {
Allocator* g_cuda_allocator = nullptr;
}

Allocator& allocator_for(Device d) {
  static CpuAllocator cpu;
  if (d.type == DeviceType::kCPU) return cpu;
  LOOM_CHECK(g_cuda_allocator != nullptr, "[allocator] no allocator registered for ", d.str(),
             " (create its DeviceContext first)");
  return *g_cuda_allocator;
}

void register_allocator(DeviceType type, Allocator* alloc) {
  LOOM_CHECK(type == DeviceType::kCUDA, "[allocator] only CUDA allocators can be registered");
  g_cuda_allocator = alloc;
}

}  // namespace loom

#include "loom/core/allocator.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "loom/core/check.h"
#include "loom/core/env.h"

namespace loom {

namespace {

void* aligned_block(size_t bytes) { return std::aligned_alloc(64, bytes == 0 ? 64 : bytes); }

// Whether large blocks ask for transparent huge pages (LOOM_CPU_ALLOC_HUGEPAGES, on unless "0").
bool hugepages_default() {
  const char* e = std::getenv("LOOM_CPU_ALLOC_HUGEPAGES");
  if (e == nullptr || *e == '\0') return true;
  LOOM_CHECK(std::strcmp(e, "0") == 0 || std::strcmp(e, "1") == 0, "[allocator] LOOM_CPU_ALLOC_HUGEPAGES='", e,
             "': expected 1 (large blocks on transparent huge pages, the default) or 0 (the system's default pages)");
  return e[0] == '1';
}

// A large block of `cls` bytes (a multiple of kLargeGranule, the x86-64 huge page size), aligned to it, its
// pages advised as transparent huge pages when `huge` (see the header). Null when the system has no memory.
void* large_block(size_t cls, bool huge) {
  void* p = std::aligned_alloc(CpuAllocator::kLargeGranule, cls);
  if (p != nullptr && huge) madvise(p, cls, MADV_HUGEPAGE);  // advice only: its failure changes nothing
  return p;
}

size_t large_class(size_t bytes) {
  return (bytes + CpuAllocator::kLargeGranule - 1) / CpuAllocator::kLargeGranule * CpuAllocator::kLargeGranule;
}

int64_t default_cache_limit() {
  if (const char* e = std::getenv("LOOM_CPU_ALLOC_CACHE_MB")) {
    char* end = nullptr;
    const long long mb = std::strtoll(e, &end, 10);
    LOOM_CHECK(end != e && *end == '\0' && mb >= 0, "[allocator] LOOM_CPU_ALLOC_CACHE_MB='", e,
               "': expected a number of MiB >= 0 (0 turns the CPU allocator's cache off)");
    return int64_t(mb) << 20;
  }
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  const int64_t eighth = pages > 0 && page > 0 ? int64_t(pages) * int64_t(page) / 8 : int64_t(1) << 30;
  return std::min<int64_t>(int64_t(4) << 30, eighth);
}

}  // namespace

struct CpuAllocator::Cache {
  mutable std::mutex mu;
  std::map<size_t, std::vector<void*>> free;  // class size -> cached blocks
  struct Live {
    size_t bytes, cls;  // requested bytes; the class of the block (>= the request's)
  };
  std::unordered_map<void*, Live> live;  // large blocks handed out
  int64_t cached = 0;
  int64_t limit = default_cache_limit();
  std::atomic<bool> poison{env_flag("LOOM_CPU_ALLOC_POISON")};
  std::atomic<bool> hugepages{hugepages_default()};
};

CpuAllocator::CpuAllocator() : cache_(new Cache) {}

CpuAllocator::~CpuAllocator() {
  release_cached_locked();
  delete cache_;
}

void* CpuAllocator::allocate(size_t bytes) {
  const size_t rounded = (bytes + 63) / 64 * 64;
  void* p = nullptr;
  const bool large = rounded >= kCacheMin;
  if (large) {
    const size_t want = large_class(rounded);
    size_t cls = want;
    std::vector<void*> stale;
    {
      std::lock_guard<std::mutex> lock(cache_->mu);
      // The smallest cached class that fits with at most a quarter (and 2 MiB) to spare.
      for (auto it = cache_->free.lower_bound(want); it != cache_->free.end(); ++it) {
        if (it->first > want + std::max(want / 4, kLargeGranule)) break;
        if (it->second.empty()) continue;
        p = it->second.back();
        it->second.pop_back();
        cls = it->first;
        cache_->cached -= int64_t(cls);
        break;
      }
      if (!p) {  // a miss: what is cached in smaller classes is left from a smaller workload; give it back
        for (auto it = cache_->free.begin(); it != cache_->free.end() && it->first < want; ++it) {
          cache_->cached -= int64_t(it->first) * int64_t(it->second.size());
          stale.insert(stale.end(), it->second.begin(), it->second.end());
          it->second.clear();
        }
      }
    }
    for (void* b : stale) std::free(b);
    const bool huge = cache_->hugepages.load(std::memory_order_relaxed);
    if (!p) p = large_block(cls, huge);
    if (!p) {  // out of memory: give the cache back to the system and try once more
      empty_cache();
      p = large_block(cls, huge);
    }
    if (!p) throw std::bad_alloc();
    if (cache_->poison.load(std::memory_order_relaxed)) std::memset(p, 0xFF, rounded);
    std::lock_guard<std::mutex> lock(cache_->mu);
    cache_->live.emplace(p, Cache::Live{bytes, cls});
  } else {
    p = aligned_block(rounded);
    if (!p) throw std::bad_alloc();
  }
  const int64_t cur = current_.fetch_add(int64_t(bytes)) + int64_t(bytes);
  int64_t peak = peak_.load();
  while (cur > peak && !peak_.compare_exchange_weak(peak, cur)) {
  }
  count_.fetch_add(1);
  return p;
}

void CpuAllocator::deallocate(void* p, size_t bytes) {
  if (!p) return;
  const size_t rounded = (bytes + 63) / 64 * 64;
  if (rounded < kCacheMin) {
    current_.fetch_sub(int64_t(bytes));
    std::free(p);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(cache_->mu);
    auto it = cache_->live.find(p);
    LOOM_CHECK(it != cache_->live.end(), "[allocator] free of ", p, ", which is not a live block (double free?)");
    LOOM_CHECK(it->second.bytes == bytes, "[allocator] block ", p, " allocated with ", it->second.bytes,
               " bytes, freed with ", bytes);
    const size_t cls = it->second.cls;
    cache_->live.erase(it);
    current_.fetch_sub(int64_t(bytes));
    if (cache_->cached + int64_t(cls) <= cache_->limit) {
      cache_->free[cls].push_back(p);
      cache_->cached += int64_t(cls);
      return;
    }
  }
  std::free(p);
}

AllocStats CpuAllocator::stats() const {
  AllocStats s;
  s.current_bytes = current_.load();
  s.peak_bytes = peak_.load();
  s.reserved_bytes = s.current_bytes + cached_bytes();
  s.num_allocs = count_.load();
  return s;
}

void CpuAllocator::reset_peak() { peak_.store(current_.load()); }

void CpuAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(cache_->mu);
  release_cached_locked();
}

void CpuAllocator::release_cached_locked() {
  for (auto& [cls, blocks] : cache_->free) {
    for (void* b : blocks) std::free(b);
    cache_->cached -= int64_t(cls) * int64_t(blocks.size());
    blocks.clear();
  }
}

int64_t CpuAllocator::cached_bytes() const {
  std::lock_guard<std::mutex> lock(cache_->mu);
  return cache_->cached;
}

void CpuAllocator::set_cache_limit(int64_t bytes) {
  std::lock_guard<std::mutex> lock(cache_->mu);
  cache_->limit = std::max<int64_t>(0, bytes);
  if (cache_->cached > cache_->limit) release_cached_locked();
}

void CpuAllocator::set_poison(bool on) { cache_->poison.store(on); }

void CpuAllocator::set_hugepages(bool on) { cache_->hugepages.store(on); }

namespace {
Allocator* g_cuda_allocator = nullptr;
}

CpuAllocator& cpu_allocator() {
  // Never destroyed: tensors in other static objects may be freed after it would be.
  static CpuAllocator* const instance = new CpuAllocator;
  return *instance;
}

Allocator& allocator_for(Device d) {
  if (d.type == DeviceType::kCPU) return cpu_allocator();
  LOOM_CHECK(g_cuda_allocator != nullptr, "[allocator] no allocator registered for ", d.str(),
             " (create its DeviceContext first)");
  return *g_cuda_allocator;
}

void register_allocator(DeviceType type, Allocator* alloc) {
  LOOM_CHECK(type == DeviceType::kCUDA, "[allocator] only CUDA allocators can be registered");
  g_cuda_allocator = alloc;
}

}  // namespace loom

// Allocators with byte accounting. Every tensor's storage comes from the allocator of its device, so
// current/peak figures cover all tensors (the memory line of the logs and the benchmarks read them).
// The CPU allocator is built in; device backends register theirs when their context is created.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "loom/core/device.h"

namespace loom {

struct AllocStats {
  int64_t current_bytes = 0;  // bytes in live allocations
  int64_t peak_bytes = 0;     // high-water mark of current_bytes since start or reset_peak()
  int64_t reserved_bytes = 0; // bytes held from the system (>= current for caching allocators)
  int64_t num_allocs = 0;     // allocations made so far
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p, size_t bytes) = 0;
  virtual AllocStats stats() const = 0;
  virtual void reset_peak() = 0;
};

// 64-byte aligned host memory, counted. Blocks of at least kCacheMin bytes are cached: glibc's malloc
// serves blocks over 32 MiB (and, after heap trimming, smaller ones too) with fresh mmap'd pages and gives
// them back on free, so a step that allocates the same large temporaries every time (a mixture-of-experts
// layer's permuted rows and expert activations) page-faults and zeroes all of them again each step:
// 8-25k faults and 3-7% of an MoE layer's forward + backward on a 2-core VM (bench/RESULTS.md). A freed
// large block is kept in a free list of its size class (a multiple of kLargeGranule) and handed out again
// for a request of that class or of one at most a quarter (and 2 MiB) smaller. A request that finds none
// (a miss) gives the cached blocks of smaller classes back to the system first: a workload that grows
// (generation without a KV cache, a longer sequence) would otherwise leave them cached for nothing, while a
// training step, which asks for the same sizes every time, has no misses after its first steps. At most
// LOOM_CPU_ALLOC_CACHE_MB of idle blocks are kept (a block that would go past it is freed), and the whole
// cache is released and the allocation retried when the system has no memory left. Handed-out memory is
// uninitialised either way (fresh mmap'd pages happen to read as zeros, reused blocks hold old data); with
// LOOM_CPU_ALLOC_POISON=1 every large block is filled with 0xFF bytes (NaN as f32/bf16/f16) when handed
// out, to catch code that reads memory it did not write. Large blocks start on a 2 MiB boundary and are
// advised as transparent huge pages (docs/performance.md: streaming weights and gradients through 4 KiB
// pages cost an MoE layer 7-20%), unless LOOM_CPU_ALLOC_HUGEPAGES=0. A large block must be freed with the
// size it was allocated with (checked). Thread-safe.
class CpuAllocator final : public Allocator {
 public:
  static constexpr size_t kCacheMin = size_t(1) << 20;
  static constexpr size_t kLargeGranule = size_t(2) << 20;

  CpuAllocator();
  CpuAllocator(const CpuAllocator&) = delete;
  CpuAllocator& operator=(const CpuAllocator&) = delete;
  ~CpuAllocator() override;

  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) override;
  // current/peak count requested bytes of live blocks; reserved adds the cached blocks (at class size).
  AllocStats stats() const override;
  void reset_peak() override;

  // Frees every cached block. Live blocks are untouched.
  void empty_cache();
  int64_t cached_bytes() const;
  // The most bytes the cache keeps is LOOM_CPU_ALLOC_CACHE_MB (0 turns caching off), by default the smaller
  // of 4 GiB and an eighth of the machine's memory; this changes it (tests; a cache holding more than the new
  // limit is emptied).
  void set_cache_limit(int64_t bytes);
  // Whether large blocks are filled with 0xFF when handed out (LOOM_CPU_ALLOC_POISON, loom/core/env.h's
  // rule; tests may switch it).
  void set_poison(bool on);
  // Whether large blocks allocated from now on ask for transparent huge pages (LOOM_CPU_ALLOC_HUGEPAGES;
  // tests and benchmarks may switch it). Cached blocks keep the pages they have.
  void set_hugepages(bool on);

 private:
  void release_cached_locked();

  std::atomic<int64_t> current_{0}, peak_{0}, count_{0};
  struct Cache;
  Cache* cache_;  // the free lists (allocator.cpp)
};

Allocator& allocator_for(Device d);
// The process's CPU allocator (what allocator_for(cpu) returns).
CpuAllocator& cpu_allocator();
// Called once by a device backend when it starts; the allocator must outlive all its tensors.
void register_allocator(DeviceType type, Allocator* alloc);

}  // namespace loom

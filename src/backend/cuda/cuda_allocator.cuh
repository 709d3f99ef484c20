// Caching allocator for device memory. cudaMalloc/cudaFree are slow and synchronize the device, so
// freed blocks are kept in per-size-class free lists and handed out again; cudaFree happens only in
// empty_cache() (also tried once when cudaMalloc runs out of memory).
//
// Size classes: requests up to 1 MiB round up to a multiple of 512 B, larger ones to a multiple of
// 2 MiB; a block is reused only for a request of exactly its class, so a block never changes size
// and no splitting or coalescing is needed (waste is < 512 B or < 2 MiB per live block).
//
// Stream invariant: a freed block may be handed out again at once. That is safe while all work runs
// on the context's compute stream (stream order keeps the old and new users apart); code that uses a
// block on another stream (the communication stream) must synchronize that stream before the block
// is freed.
//
// One allocator per process (one process per device); it lives until the process exits, so tensors
// never outlive it. Thread-safe.
#pragma once
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "loom/core/allocator.h"

namespace loom::cuda {

class CudaAllocator final : public Allocator {
 public:
  explicit CudaAllocator(int device) : device_(device) {}
  CudaAllocator(const CudaAllocator&) = delete;
  CudaAllocator& operator=(const CudaAllocator&) = delete;

  // At least 256-byte aligned (cudaMalloc's alignment). allocate(0) returns a valid block so that
  // an empty tensor still has a non-null pointer.
  void* allocate(size_t bytes) override;
  // `bytes` must be the size passed to allocate(); unknown pointers and double frees fail a check.
  void deallocate(void* p, size_t bytes) override;
  // current/peak count requested bytes of live blocks; reserved counts every block obtained from
  // cudaMalloc (live + cached), at class size.
  AllocStats stats() const override;
  void reset_peak() override;

  // Returns every cached (free) block to the driver. Live blocks are untouched.
  void empty_cache();
  int device() const { return device_; }
  int64_t cached_bytes() const;  // reserved - (class size of live blocks)

  // The size class a request of `bytes` is served from.
  static size_t size_class(size_t bytes);
  static constexpr size_t kSmallGranule = 512;
  static constexpr size_t kSmallMax = size_t(1) << 20;
  static constexpr size_t kLargeGranule = size_t(2) << 20;

 private:
  void release_cached_locked();

  const int device_;
  mutable std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;  // size class -> cached blocks
  std::unordered_map<void*, size_t> live_;               // block -> requested bytes
  int64_t current_ = 0, peak_ = 0, reserved_ = 0, num_allocs_ = 0, cached_ = 0;
};

// The process's device allocator for GPU `device`: created on first use and registered with
// register_allocator(DeviceType::kCUDA, ...). Asking for a second, different device fails a check
// (Loom runs one process per GPU).
CudaAllocator& cuda_allocator(int device);

}  // namespace loom::cuda

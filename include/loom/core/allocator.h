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

// 64-byte aligned host memory, counted.
class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) override;
  AllocStats stats() const override;
  void reset_peak() override;

 private:
  std::atomic<int64_t> current_{0}, peak_{0}, count_{0};
};

Allocator& allocator_for(Device d);
// Called once by a device backend when it starts; the allocator must outlive all its tensors.
void register_allocator(DeviceType type, Allocator* alloc);

}  // namespace loom

// Caching device allocator (see cuda_allocator.cuh for the size classes and the stream invariant).
#include "backend/cuda/cuda_allocator.cuh"

#include <cuda_runtime_api.h>

#include "backend/cuda/cuda_check.cuh"

namespace loom::cuda {

size_t CudaAllocator::size_class(size_t bytes) {
  if (bytes == 0) return kSmallGranule;
  if (bytes <= kSmallMax) return (bytes + kSmallGranule - 1) / kSmallGranule * kSmallGranule;
  return (bytes + kLargeGranule - 1) / kLargeGranule * kLargeGranule;
}

void* CudaAllocator::allocate(size_t bytes) {
  const size_t cls = size_class(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  void* p = nullptr;
  auto it = free_.find(cls);
  if (it != free_.end() && !it->second.empty()) {
    p = it->second.back();
    it->second.pop_back();
    cached_ -= int64_t(cls);
  } else {
    // The calling thread's current device may differ (e.g. a helper thread that never set one).
    LOOM_CUDA_CHECK(cudaSetDevice(device_));
    cudaError_t err = cudaMalloc(&p, cls);
    if (err == cudaErrorMemoryAllocation && cached_ > 0) {
      cudaGetLastError();
      release_cached_locked();
      err = cudaMalloc(&p, cls);
    }
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      const double gib = double(1 << 30);
      user_error("[cuda allocator] out of memory on cuda:", device_, ": tried to allocate ",
                 double(bytes) / gib, " GiB with ", double(current_) / gib, " GiB in use by tensors (",
                 double(reserved_) / gib, " GiB reserved), ", double(free_b) / gib, " GiB free of ",
                 double(total_b) / gib, " GiB; reduce --micro-batch-size or --seq-length, or use "
                 "--recompute-granularity / more parallelism");
    }
    LOOM_CUDA_CHECK(err);
    reserved_ += int64_t(cls);
  }
  live_.emplace(p, bytes);
  current_ += int64_t(bytes);
  if (current_ > peak_) peak_ = current_;
  ++num_allocs_;
  return p;
}

void CudaAllocator::deallocate(void* p, size_t bytes) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(p);
  LOOM_CHECK(it != live_.end(), "[cuda allocator] free of ", p, ", which is not a live block (double free?)");
  LOOM_CHECK(it->second == bytes, "[cuda allocator] block ", p, " allocated with ", it->second,
             " bytes, freed with ", bytes);
  live_.erase(it);
  const size_t cls = size_class(bytes);
  free_[cls].push_back(p);
  cached_ += int64_t(cls);
  current_ -= int64_t(bytes);
}

AllocStats CudaAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  AllocStats s;
  s.current_bytes = current_;
  s.peak_bytes = peak_;
  s.reserved_bytes = reserved_;
  s.num_allocs = num_allocs_;
  return s;
}

void CudaAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_ = current_;
}

int64_t CudaAllocator::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_;
}

void CudaAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  release_cached_locked();
}

void CudaAllocator::release_cached_locked() {
  LOOM_CUDA_CHECK(cudaSetDevice(device_));
  for (auto& [cls, blocks] : free_) {
    for (void* p : blocks) {
      LOOM_CUDA_CHECK(cudaFree(p));  // cudaFree waits for pending work on the block
      reserved_ -= int64_t(cls);
      cached_ -= int64_t(cls);
    }
    blocks.clear();
  }
}

CudaAllocator& cuda_allocator(int device) {
  // Never destroyed: freeing device memory during static destruction races the CUDA runtime's own
  // teardown, and tensors in other static objects may still point into it.
  static CudaAllocator* const instance = [device] {
    auto* a = new CudaAllocator(device);
    register_allocator(DeviceType::kCUDA, a);
    return a;
  }();
  LOOM_CHECK(instance->device() == device, "[cuda allocator] this process already uses cuda:",
             instance->device(), "; Loom runs one process per GPU, asked for cuda:", device);
  return *instance;
}

}  // namespace loom::cuda

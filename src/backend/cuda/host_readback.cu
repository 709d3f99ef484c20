// Pinned-slot readback (declared in host_readback.cuh). Host code only.
#include "backend/cuda/host_readback.cuh"

#include <cuda_runtime.h>

#include "backend/cuda/cuda_check.cuh"

namespace loom::cuda {

namespace {

constexpr size_t kSlotBytes = 64;

// The pinned host slot a reducing launcher copies its result into. One per host thread, allocated on first
// use and kept for the process (a few bytes; freeing it at thread exit could run after the CUDA runtime is
// torn down).
void* pinned_slot() {
  thread_local void* slot = [] {
    void* p = nullptr;
    LOOM_CUDA_CHECK(cudaMallocHost(&p, kSlotBytes));
    return p;
  }();
  return slot;
}

}  // namespace

const void* read_back(const CudaContext& ctx, const void* dev, size_t bytes) {
  void* host = pinned_slot();
  LOOM_CUDA_CHECK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, ctx.compute_stream()));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(ctx.compute_stream()));
  return host;
}

}  // namespace loom::cuda

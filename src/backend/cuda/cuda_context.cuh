// CudaContext: the device pieces a CUDA op table runs on — the device index and its properties, a
// compute stream and a communication stream, a cuBLASLt handle with a 32 MiB workspace, and the
// process's caching allocator. The op table itself arrives with the CUDA backend issue: it is built
// on these pieces and installed with set_ops(); until then ops() throws a UserError, and the public
// make_cuda_context() refuses to hand out a context that cannot run ops.
//
// Invariants: all ops of a context run on compute_stream(); collectives run on comm_stream(), which
// has the higher priority so communication overlapping compute is not starved. copy() and
// synchronize() block the host. The workspace is owned by the context and used only on the compute
// stream. Host-only header (no device code), usable from .cpp files.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <string>

#include "backend/cuda/cuda_allocator.cuh"
#include "loom/backend/device_context.h"

namespace loom::cuda {

class CudaContext final : public DeviceContext {
 public:
  static constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // cuBLASLt's recommendation for Hopper

  // Makes `index` the calling thread's current device and creates streams, handle and workspace.
  explicit CudaContext(int index);
  ~CudaContext() override;
  CudaContext(const CudaContext&) = delete;
  CudaContext& operator=(const CudaContext&) = delete;

  Device device() const override { return Device{DeviceType::kCUDA, index_}; }
  const OpTable& ops() const override;
  void synchronize() const override;  // waits for both streams
  // "cuda:0 (NVIDIA H100 80GB HBM3, 132 SMs, 79.1 GiB, sm_90, CUDA runtime 13.0, driver 13.0)"
  std::string description() const override;
  int64_t memory_capacity() const override { return int64_t(props_.totalGlobalMem); }
  // Host<->device and device<->device copies of equal byte size: cudaMemcpyAsync on the compute
  // stream, then waits for it. Host<->host copies are a plain memcpy.
  void copy(TensorView dst, TensorView src) const override;
  void range_push(const char* name) const override;  // nvtxRangePushA
  void range_pop() const override;
  void profiler_start() const override;  // waits for the device, then cudaProfilerStart
  void profiler_stop() const override;
  // The embedding kernels' out-of-range id flag (embedding_take_error), as a message.
  std::string take_input_errors() const override;

  // Installs the op table (the CUDA backend issue's CudaOps, built on this context's pieces).
  void set_ops(std::unique_ptr<OpTable> ops) { ops_ = std::move(ops); }

  int index() const { return index_; }
  const cudaDeviceProp& props() const { return props_; }
  int sm_count() const { return props_.multiProcessorCount; }
  cudaStream_t compute_stream() const { return compute_; }
  cudaStream_t comm_stream() const { return comm_; }
  cublasLtHandle_t cublaslt() const { return cublaslt_; }
  void* workspace() const { return workspace_; }
  size_t workspace_bytes() const { return kWorkspaceBytes; }
  CudaAllocator& allocator() const { return *allocator_; }

 private:
  void release() noexcept;

  int index_ = 0;
  cudaDeviceProp props_{};
  CudaAllocator* allocator_ = nullptr;
  cudaStream_t compute_ = nullptr;
  cudaStream_t comm_ = nullptr;
  cublasLtHandle_t cublaslt_ = nullptr;
  void* workspace_ = nullptr;
  std::unique_ptr<OpTable> ops_;
};

// Number of visible GPUs; 0 when there is no driver or no device (never throws).
int cuda_device_count();

}  // namespace loom::cuda

// DeviceContext: what a process needs to run ops on one device — the op table, and for CUDA the
// stream and library handles. One per process (one process per device). The CPU context is always
// available; the CUDA context exists when the CUDA backend was compiled in (see cuda_available()).
#pragma once
#include <memory>

#include "loom/backend/ops.h"
#include "loom/core/allocator.h"
#include "loom/core/tensor.h"

namespace loom {

class DeviceContext {
 public:
  virtual ~DeviceContext() = default;
  virtual Device device() const = 0;
  virtual const OpTable& ops() const = 0;
  virtual void synchronize() const = 0;
  virtual std::string description() const = 0;  // e.g. "cpu (2 OpenMP threads, oneDNN 2.6.3, avx512_core_amx)"
  // Bytes this device holds in all: the GPU's memory; for the CPU the machine's physical memory, or the
  // process's cgroup memory limit or address-space rlimit when smaller. Processes sharing the device
  // share it. Used to refuse a model that cannot fit before anything is allocated.
  virtual int64_t memory_capacity() const = 0;

  Tensor empty(Shape s, DType dt) const { return Tensor::empty(s, dt, device()); }
  Tensor zeros(Shape s, DType dt) const;
  AllocStats memory_stats() const { return allocator_for(device()).stats(); }
  // Restarts the high-water mark at the bytes allocated now (the allocator is per device, process-wide).
  void reset_peak_memory() const { allocator_for(device()).reset_peak(); }
  // Copies between host and this device (plain memcpy on the CPU).
  virtual void copy(TensorView dst, TensorView src) const = 0;

  // Profiling (Nsight Systems): a named range on the timeline (NVTX) and the profiler's capture window
  // (cudaProfilerStart/Stop, for `nsys profile --capture-range=cudaProfilerApi`). No-ops on the CPU.
  virtual void range_push(const char* /*name*/) const {}
  virtual void range_pop() const {}
  virtual void profiler_start() const {}
  virtual void profiler_stop() const {}

  // Errors the device's kernels found in their inputs since the last call, as one message ("" when none);
  // clears them. A GPU cannot throw from a kernel, and reading a flag back every step would stall the
  // stream, so kernels raise sticky flags (an embedding's out-of-range token or position id) that the
  // trainer polls at each log interval. Waits for the device. The CPU ops throw at once: always "".
  virtual std::string take_input_errors() const { return {}; }
};

std::unique_ptr<DeviceContext> make_cpu_context();
// True when the CUDA backend was compiled in and a GPU is visible.
bool cuda_available();
// Number of visible GPUs (0 without the CUDA backend, a driver or a device; never throws).
int cuda_device_count();
// Creates the CUDA context for device `index`; throws a UserError naming the reason when unavailable.
std::unique_ptr<DeviceContext> make_cuda_context(int index);

}  // namespace loom

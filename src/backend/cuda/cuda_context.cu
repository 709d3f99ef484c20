// The CUDA DeviceContext (see cuda_context.cuh) and the public entry points cuda_available(),
// cuda_device_count() and make_cuda_context(), which returns a context with the CUDA op table (CudaOps)
// installed. Tests may construct a bare CudaContext directly (its ops() then refuses).
#include "backend/cuda/cuda_context.cuh"

#include "backend/cuda/cuda_ops.cuh"

#include <cuda_profiler_api.h>
#include <nvtx3/nvToolsExt.h>

#include <cstdio>
#include <cstring>

#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/embedding.cuh"

namespace loom {

namespace cuda {

namespace {

constexpr const char* kNoOpTable =
    "this CudaContext has no op table installed (make_cuda_context() installs CudaOps; a bare context is for "
    "tests of the device pieces)";

std::string version_str(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }

}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error for a query
    return 0;
  }
  return n;
}

CudaContext::CudaContext(int index) : index_(index) {
  const int count = cuda_device_count();
  if (index < 0 || index >= count)
    user_error("cuda:", index, " does not exist: ", count, " GPU(s) visible",
               count ? " (check CUDA_VISIBLE_DEVICES and the local rank)" : "");
  try {
    LOOM_CUDA_CHECK(cudaSetDevice(index));
    LOOM_CUDA_CHECK(cudaGetDeviceProperties(&props_, index));
    allocator_ = &cuda_allocator(index);
    int least = 0, greatest = 0;  // numerically: greatest priority is the lowest number
    LOOM_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    LOOM_CUDA_CHECK(cudaStreamCreateWithPriority(&compute_, cudaStreamNonBlocking, least));
    LOOM_CUDA_CHECK(cudaStreamCreateWithPriority(&comm_, cudaStreamNonBlocking, greatest));
    LOOM_CUBLAS_CHECK(cublasLtCreate(&cublaslt_));
    workspace_ = allocator_->allocate(kWorkspaceBytes);
  } catch (...) {
    release();
    throw;
  }
}

CudaContext::~CudaContext() { release(); }

void CudaContext::release() noexcept {
  // Destructors must not throw: report failures instead (a sticky error from an earlier fault would
  // otherwise abort the unwinding that is reporting that fault).
  auto report = [](const char* what, const char* err) { std::fprintf(stderr, "loom: %s failed: %s\n", what, err); };
  if (compute_ || comm_) {
    if (compute_) {
      const cudaError_t e = cudaStreamSynchronize(compute_);
      if (e != cudaSuccess) report("cudaStreamSynchronize(compute)", cudaGetErrorString(e));
    }
    if (comm_) {
      const cudaError_t e = cudaStreamSynchronize(comm_);
      if (e != cudaSuccess) report("cudaStreamSynchronize(comm)", cudaGetErrorString(e));
    }
  }
  ops_.reset();  // ops may hold pieces of this context; drop them first
  if (workspace_) {
    try {
      allocator_->deallocate(workspace_, kWorkspaceBytes);
    } catch (const std::exception& e) {
      report("workspace free", e.what());
    }
    workspace_ = nullptr;
  }
  if (cublaslt_) {
    const cublasStatus_t s = cublasLtDestroy(cublaslt_);
    if (s != CUBLAS_STATUS_SUCCESS) report("cublasLtDestroy", cublasLtGetStatusString(s));
    cublaslt_ = nullptr;
  }
  for (cudaStream_t* s : {&compute_, &comm_}) {
    if (*s) {
      const cudaError_t e = cudaStreamDestroy(*s);
      if (e != cudaSuccess) report("cudaStreamDestroy", cudaGetErrorString(e));
      *s = nullptr;
    }
  }
}

const OpTable& CudaContext::ops() const {
  if (!ops_) user_error(kNoOpTable);
  return *ops_;
}

void CudaContext::synchronize() const {
  LOOM_CUDA_CHECK(cudaStreamSynchronize(compute_));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(comm_));
}

std::string CudaContext::description() const {
  int runtime = 0, driver = 0;
  LOOM_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  LOOM_CUDA_CHECK(cudaDriverGetVersion(&driver));
  char mem[32];
  std::snprintf(mem, sizeof mem, "%.1f GiB", double(props_.totalGlobalMem) / double(1 << 30));
  return device().str() + " (" + props_.name + ", " + std::to_string(props_.multiProcessorCount) + " SMs, " + mem +
         ", sm_" + std::to_string(props_.major) + std::to_string(props_.minor) + ", CUDA runtime " +
         version_str(runtime) + ", driver " + version_str(driver) + ")";
}

void CudaContext::copy(TensorView dst, TensorView src) const {
  LOOM_CHECK(dst.nbytes() == src.nbytes(), "[copy] ", dst.desc(), " <- ", src.desc(), " size mismatch");
  for (const TensorView* t : {&dst, &src})
    LOOM_CHECK(t->device().is_cpu() || t->device() == device(), "[copy] context ", device().str(),
               " cannot copy ", t->desc());
  if (dst.nbytes() == 0) return;
  const bool d_dev = !dst.device().is_cpu(), s_dev = !src.device().is_cpu();
  if (!d_dev && !s_dev) {
    std::memcpy(dst.raw(), src.raw(), size_t(src.nbytes()));
    return;
  }
  const cudaMemcpyKind kind = d_dev ? (s_dev ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                                    : cudaMemcpyDeviceToHost;
  LOOM_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), size_t(src.nbytes()), kind, compute_));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(compute_));
}

void CudaContext::range_push(const char* name) const { nvtxRangePushA(name); }
void CudaContext::range_pop() const { nvtxRangePop(); }

void CudaContext::profiler_start() const {
  synchronize();
  LOOM_CUDA_CHECK(cudaProfilerStart());
}

void CudaContext::profiler_stop() const {
  synchronize();
  LOOM_CUDA_CHECK(cudaProfilerStop());
}

std::string CudaContext::take_input_errors() const {
  if (!embedding_take_error(*this)) return {};
  return "an embedding kernel on " + device().str() +
         " met a token id outside the vocabulary or a position id outside the position table (those rows "
         "were set to NaN)";
}

}  // namespace cuda

bool cuda_available() { return cuda::cuda_device_count() > 0; }
int cuda_device_count() { return cuda::cuda_device_count(); }

std::unique_ptr<DeviceContext> make_cuda_context(int index) {
  const int count = cuda::cuda_device_count();
  if (count == 0)
    user_error("no CUDA GPU is visible (no driver, or CUDA_VISIBLE_DEVICES hides them all); run on the CPU");
  if (index < 0 || index >= count)
    user_error("cuda:", index, " does not exist: ", count, " GPU(s) visible");
  auto ctx = std::make_unique<cuda::CudaContext>(index);
  ctx->set_ops(std::make_unique<cuda::CudaOps>(*ctx));
  return ctx;
}

}  // namespace loom

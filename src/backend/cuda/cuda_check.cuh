// Error checks for CUDA runtime and cuBLAS(Lt) calls. Every such call in Loom is wrapped, so a failure
// surfaces as a loom::Error (never an ignored status or a later unrelated crash) carrying the
// library's error name and message, the call text and file:line, e.g.
//   [cuda] cudaErrorInvalidDevice: invalid device ordinal
//          (check failed: cudaSetDevice(7) == cudaSuccess at x.cu:12 in f)
// Host-only header (usable from .cpp files compiled without nvcc).
#pragma once
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "loom/core/check.h"

namespace loom::cuda {

[[noreturn]] inline void cuda_fail(cudaError_t err, const char* call, const char* file, int line,
                                   const char* func) {
  cudaGetLastError();  // clear the non-sticky error so it does not resurface at the next check
  ::loom::detail::check_fail(call, file, line, func,
                             ::loom::detail::concat("[cuda] ", cudaGetErrorName(err), ": ",
                                                    cudaGetErrorString(err)));
}

[[noreturn]] inline void cublas_fail(cublasStatus_t status, const char* call, const char* file, int line,
                                     const char* func) {
  ::loom::detail::check_fail(call, file, line, func,
                             ::loom::detail::concat("[cublas] ", cublasLtGetStatusName(status), ": ",
                                                    cublasLtGetStatusString(status)));
}

}  // namespace loom::cuda

#define LOOM_CUDA_CHECK(call)                                                             \
  do {                                                                                    \
    const cudaError_t loom_err_ = (call);                                                 \
    if (loom_err_ != cudaSuccess) [[unlikely]]                                            \
      ::loom::cuda::cuda_fail(loom_err_, #call " == cudaSuccess", __FILE__, __LINE__, __func__); \
  } while (0)

#define LOOM_CUBLAS_CHECK(call)                                                                 \
  do {                                                                                          \
    const cublasStatus_t loom_status_ = (call);                                                 \
    if (loom_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                     \
      ::loom::cuda::cublas_fail(loom_status_, #call " == CUBLAS_STATUS_SUCCESS", __FILE__, __LINE__, \
                                __func__);                                                      \
  } while (0)

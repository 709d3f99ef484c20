// Chosen by CMake when nvcc is not found: the build has no CUDA backend.
#include "loom/backend/device_context.h"

namespace loom {

bool cuda_available() { return false; }
int cuda_device_count() { return 0; }

std::unique_ptr<DeviceContext> make_cuda_context(int index) {
  user_error("this Loom build has no CUDA backend (nvcc was not found at configure time); "
             "rebuild on a machine with the CUDA toolkit, or run on the CPU");
}

}  // namespace loom

// Chosen by CMake when the CUDA backend is off or NCCL (nccl.h, libnccl) was not found.
#include "loom/dist/communicator.h"

namespace loom {

bool nccl_compiled_in() { return false; }

std::unique_ptr<Communicator> make_nccl_communicator(const Communicator& group, void*) {
  user_error("this Loom build has no NCCL (it needs the CUDA backend and nccl.h / libnccl at configure time), so ",
             "group ", group.name(), " cannot communicate between GPUs; install NCCL and rebuild, or train on the CPU");
}

std::unique_ptr<Communicator> make_nccl_communicator(const Communicator& group) {
  return make_nccl_communicator(group, nullptr);
}

}  // namespace loom

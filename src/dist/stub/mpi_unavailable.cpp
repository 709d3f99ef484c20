// Chosen by CMake when MPI is not found: only the single-process world exists, and a multi-rank launch
// is refused (each process would otherwise train alone while believing it is the whole job).
#include <cstdio>
#include <cstdlib>

#include "dist/dist_util.h"
#include "loom/dist/communicator.h"

namespace loom {

bool mpi_compiled_in() { return false; }

// No MPI messages exist in this build, so there is nothing to chunk.
void set_mpi_max_message_elements(int64_t n) {
  LOOM_CHECK(n >= 0, "[set_mpi_max_message_elements] n must be >= 0, got ", n);
}

std::unique_ptr<Communicator> init_world(std::chrono::milliseconds timeout) {
  LOOM_CHECK(timeout.count() > 0, "[init_world] timeout must be positive, got ", timeout.count(), " ms");
  dist::set_operation_timeout(timeout);
  const int launched = dist::launcher_world_size();
  if (launched > 1 || launched < 0)
    user_error("this Loom build has no MPI (libopenmpi-dev was not found at configure time) but was started by a "
               "launcher with ", launched > 0 ? std::to_string(launched) : std::string("several"),
               " processes; install libopenmpi-dev and rebuild, or run a single process without mpirun/srun");
  return make_self_communicator("world");
}

// Without MPI the job is this one process (init_world refuses a multi-rank launch): there are no other
// ranks to end, so main prints the error and returns the code, as communicator.h says.
int end_after_error(const std::string& message, int exit_code) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  return exit_code;
}

void abort_job(const std::string& message, int exit_code) {
  std::fprintf(stderr, "[loom] rank %d: %s\n", dist::launcher_world_rank(), message.c_str());
  std::fflush(stderr);
  std::exit(exit_code);
}

}  // namespace loom

// A small MPI program for test_fault.cpp, run under mpirun with a mode argument:
//   ok        a few all_reduces, then a normal exit (the harness itself works; exit status 0)
//   mismatch  rank 0 calls barrier, rank 1 all_reduce, on a group named "fault-test", 2 s timeout:
//             the job must abort with a message naming the operation and the group
//   die       rank 1 calls std::_Exit(3) between collectives (60 s timeout): the launcher must end the
//             job long before the timeout, and no survivor may hang
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "loom/dist/communicator.h"

using namespace loom;

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "ok";
  const bool mismatch = std::strcmp(mode, "mismatch") == 0;
  auto world = init_world(std::chrono::milliseconds(mismatch ? 2000 : 60000));
  auto group = world->split(0, world->rank(), "fault-test");
  std::vector<float> buf(1024, 1.0f);
  TensorView x(buf.data(), DType::kF32, Shape{1024});
  if (mismatch) {
    if (group->rank() == 1)
      group->all_reduce(x);
    else
      group->barrier();
    std::fprintf(stderr, "rank %d: mismatched collective returned\n", world->rank());
    return 0;
  }
  const bool die = std::strcmp(mode, "die") == 0;
  for (int step = 0; step < 5; ++step) {
    if (die && step == 2 && group->rank() == 1) std::_Exit(3);
    group->all_reduce(x);
  }
  float expect = 1.0f;  // each all_reduce multiplies the ones by the group size
  for (int step = 0; step < 5; ++step) expect *= float(group->size());
  if (buf[0] != expect) {
    std::fprintf(stderr, "rank %d: all_reduce gave %g, expected %g\n", world->rank(), buf[0], expect);
    return 1;
  }
  return 0;
}

// Private to the dist layer's MPI build (included only by the files CMake compiles when MPI is found):
// what the MPI communicator (communicator_mpi.cpp) and the MPI process runtime (communicator_mpi_runtime.cpp)
// share: the MPI error check, a group and its per-kind communicators (see Kind), and MpiWork, the posted
// operation whose completion (the polling wait bounded by the timeout) the runtime file defines.
#pragma once
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dist/dist_util.h"
#include "loom/dist/communicator.h"

namespace loom::mpi_detail {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

// Whether MPI is initialised and not yet finalised (destructors running after MPI_Finalize do nothing).
bool mpi_active();

[[noreturn]] void mpi_fail(int err, const char* call, const char* file, int line, const char* func);

#define LOOM_MPI_CHECK(call)                                                                              \
  do {                                                                                                    \
    const int loom_mpi_err_ = (call);                                                                     \
    if (loom_mpi_err_ != MPI_SUCCESS) [[unlikely]]                                                        \
      ::loom::mpi_detail::mpi_fail(loom_mpi_err_, #call " == MPI_SUCCESS", __FILE__, __LINE__, __func__); \
  } while (0)

// ---- group and posted operations -----------------------------------------------------------------

// What a communicator and its in-flight operations share; works hold it so the MPI_Comm outlives them.
// Each kind of operation runs on its own duplicate of the group's communicator. MPI matches
// collectives only by order within a communicator, so a rank calling barrier while another calls
// all_reduce on one communicator can "complete" both with garbage (OpenMPI does); on separate
// communicators they never match, and the mismatch surfaces as the timeout with its message.
enum Kind { kAllReduce, kBroadcast, kAllGather, kReduceScatter, kBarrier, kP2p, kAllToAll, kKinds };

struct Group {
  MPI_Comm comm = MPI_COMM_NULL;  // split and the rendezvous before it
  MPI_Comm kind_comm[kKinds] = {};
  bool owned = false;  // `comm` is freed with the group (split results; not MPI_COMM_WORLD)
  std::string name;
  std::string text;  // "data-parallel (global ranks 0,2)"
  std::vector<int> global_ranks;
  int rank = 0, size = 1;
  Millis timeout{600000};
  dist::CommRecorder stats;

  ~Group() {
    // A group that outlives MPI (a static destroyed after the exit handler) has nothing left to free.
    if (!mpi_active()) return;
    for (MPI_Comm& c : kind_comm)
      if (c != MPI_COMM_NULL) MPI_Comm_free(&c);
    if (owned && comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
};

std::shared_ptr<Group> make_group(MPI_Comm comm, bool owned, std::string name, Millis timeout);

// One posted operation: its requests, the staging buffers it owns, and what to do once it completed
// (convert a staged result back, move a result out of a temporary, check received counts). `stat`: the
// statistics entry the operation counts under (its call is counted here, at posting; none for internal
// operations such as split's rendezvous).
class MpiWork final : public Work {
 public:
  MpiWork(const char* op, std::shared_ptr<const Group> group, std::string what, std::optional<dist::CommOp> stat,
          int64_t bytes);
  ~MpiWork() override;

  void wait() override { wait_from(Clock::now()); }

  // wait(), recording the time from t0 (a blocking call's entry) instead of from now.
  void wait_from(Clock::time_point t0);

  bool done() override;

  // An async post's own duration (from t0 to now), counted as time the caller was blocked.
  void record_post(Clock::time_point t0) const { record_wait(t0); }

  std::vector<MPI_Request> reqs;
  // Receives: the element count each request must have delivered, checked on completion.
  std::vector<int> expected_counts;
  // Receives from several peers (all-to-all): the peer of each expected count; empty: `peer` for all.
  std::vector<int> expected_peers;
  std::vector<MPI_Status> statuses;
  MPI_Datatype recv_type = MPI_BYTE;
  int peer = -1;
  std::vector<float> stage, stage_out;
  std::vector<char> tmp;
  std::function<void()> finish;

 private:
  void complete();
  void record_wait(Clock::time_point t0) const;

  const char* op_;
  std::shared_ptr<const Group> group_;
  std::string what_;
  std::optional<dist::CommOp> stat_;
  bool finished_ = false;
};

// The communicator over group g (communicator_mpi.cpp).
std::unique_ptr<Communicator> make_mpi_communicator(std::shared_ptr<Group> g);

}  // namespace loom::mpi_detail

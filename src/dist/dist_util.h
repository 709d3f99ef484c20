// Pieces shared by the MPI, NCCL and stub communicators: launcher detection from the environment, the
// text of timeout messages (one wording for every backend), the recorder behind comm_stats() and the
// argument checks of all-to-all (AllToAllPlan: every backend validates the same way).
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/core/tensor.h"

namespace loom::dist {

// The world size announced by a launcher (mpirun, srun, a PMI/PMIx launcher): 0 when the process was
// not started by one, -1 when it was but the size is not in the environment (PMIX_RANK alone).
int launcher_world_size();
// This process's rank as the launcher announced it (0 when unknown); for messages before MPI is up.
int launcher_world_rank();

// The process-wide operation timeout (--distributed-timeout-minutes), set by init_world; communicators
// created later from other communicators (NCCL) read it. 10 minutes until init_world ran.
std::chrono::milliseconds operation_timeout();
void set_operation_timeout(std::chrono::milliseconds timeout);

// "data-parallel (global ranks 0,2)"; long rank lists are shortened ("0,1,2,...,127 (128 ranks)").
std::string describe_group(const std::string& name, const std::vector<int>& global_ranks);
// "1.0 min" from one minute up, "2.0 s" below.
std::string format_timeout(std::chrono::milliseconds timeout);
// "<op> on group <group> of <what> did not complete within <timeout> (--distributed-timeout-minutes):
//  a rank died or ranks called different collectives"
std::string timeout_message(const std::string& op, const std::string& group, const std::string& what,
                            std::chrono::milliseconds timeout);

// ---- communication statistics (comm_stats() in loom/dist/communicator.h) ----------------------------

enum class CommOp {
  kAllReduce, kAllGather, kReduceScatter, kBroadcast, kSend, kRecv, kAllReduceScalar, kBarrier, kAllToAll
};
inline constexpr int kCommOps = 9;
// "all_reduce", "all_gather", ... (the names comm_stats() reports).
const char* comm_op_name(CommOp op);

// Seconds since `t0` on the steady clock (the clock every recorded wait uses).
inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// One group's entries in the process registry, one per operation. Entries are created on construction
// and live until the process ends (reset_comm_stats zeroes them, never frees them), so a communicator
// looks its group up once and every call after that costs one uncontended mutex. A default-constructed
// recorder records nothing (the self communicator, internal operations such as split).
class CommRecorder {
 public:
  CommRecorder() = default;
  explicit CommRecorder(const std::string& group);
  bool active() const { return entries_[0] != nullptr; }
  // One posted operation with its payload bytes (the convention in communicator.h).
  void call(CommOp op, int64_t bytes) const;
  // Time the caller spent blocked in an operation (added to what earlier waits of it recorded).
  void wait(CommOp op, double seconds) const;

  struct Entry;

 private:
  std::array<Entry*, kCommOps> entries_{};
};

// ---- all-to-all ----------------------------------------------------------------------------------------

// A checked all_to_all_v call (Communicator::all_to_all_v's contract), in elements: peer p's rows of inp
// start at send_off[p] and number send_count[p] elements; what p sends lands at recv_off[p] in out,
// recv_count[p] elements. Throws (LOOM_CHECK) naming the group `text` and the tensor or count at fault.
struct AllToAllPlan {
  std::vector<int64_t> send_off, send_count, recv_off, recv_count;  // elements, one per group rank
  int64_t row_elements = 1;                                         // elements per row (trailing shape)
};
AllToAllPlan plan_all_to_all(const std::string& text, int size, TensorView out,
                             const std::vector<int64_t>& out_counts, TensorView inp,
                             const std::vector<int64_t>& in_counts);
// The rows per rank of an equal-split all_to_all (out and inp the same shape, dim 0 divisible by size).
std::vector<int64_t> equal_all_to_all_counts(const std::string& text, int size, TensorView out, TensorView inp);

}  // namespace loom::dist

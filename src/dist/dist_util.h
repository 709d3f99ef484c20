// Pieces shared by the MPI, NCCL and stub communicators: launcher detection from the environment and
// the text of timeout messages (one wording for every backend).
#pragma once
#include <chrono>
#include <string>
#include <vector>

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

}  // namespace loom::dist

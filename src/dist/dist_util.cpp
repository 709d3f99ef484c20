// Launcher detection, timeout message text and the communication statistics registry, shared by every
// communicator backend (compiled with and without MPI, so comm_stats() always exists).
#include "dist/dist_util.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <utility>

#include "loom/dist/communicator.h"

namespace loom::dist {

namespace {

// A positive integer from the environment, or 0 when unset or not a number.
int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return 0;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return (*end == '\0' && x > 0 && x < (1L << 30)) ? int(x) : 0;
}

}  // namespace

int launcher_world_size() {
  // OpenMPI's mpirun, then MPICH/Intel (PMI), then srun. PMIX_RANK alone (srun --mpi=pmix without the
  // SLURM variables) says "launched" without a size.
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"})
    if (int n = env_int(var)) return n;
  if (std::getenv("SLURM_PROCID")) {
    // Inside an sbatch script SLURM_PROCID is set for the batch step too; only a multi-task step
    // (srun -n N, N > 1) is a launch of several ranks.
    if (int n = env_int("SLURM_NTASKS"); n > 1) return n;
  }
  if (std::getenv("PMIX_RANK")) return -1;
  return 0;
}

int launcher_world_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"})
    if (const char* v = std::getenv(var); v && *v) return std::atoi(v);
  return 0;
}

namespace {
std::atomic<int64_t> g_timeout_ms{600000};
}  // namespace

std::chrono::milliseconds operation_timeout() { return std::chrono::milliseconds(g_timeout_ms.load()); }
void set_operation_timeout(std::chrono::milliseconds timeout) { g_timeout_ms.store(timeout.count()); }

std::string describe_group(const std::string& name, const std::vector<int>& global_ranks) {
  std::ostringstream os;
  os << name << " (global ranks ";
  const size_t n = global_ranks.size();
  constexpr size_t kShown = 16;
  for (size_t i = 0; i < n; ++i) {
    if (n > kShown && i == kShown - 1) {
      os << "...," << global_ranks.back() << " (" << n << " ranks)";
      break;
    }
    os << (i ? "," : "") << global_ranks[i];
  }
  os << ")";
  return os.str();
}

std::string format_timeout(std::chrono::milliseconds timeout) {
  const double s = double(timeout.count()) / 1000.0;
  char buf[64];
  if (s >= 60.0)
    std::snprintf(buf, sizeof buf, "%.1f min", s / 60.0);
  else
    std::snprintf(buf, sizeof buf, "%.1f s", s);
  return buf;
}

std::string timeout_message(const std::string& op, const std::string& group, const std::string& what,
                            std::chrono::milliseconds timeout) {
  std::ostringstream os;
  os << op << " on group " << group;
  if (!what.empty()) os << " of " << what;
  os << " did not complete within " << format_timeout(timeout)
     << " (--distributed-timeout-minutes): a rank died or ranks called different collectives";
  return os.str();
}

// ---- communication statistics ------------------------------------------------------------------------

struct CommRecorder::Entry {
  int64_t calls = 0;
  int64_t bytes = 0;
  double wait_seconds = 0;
};

namespace {

// The process registry. std::map keeps entry addresses stable while others are inserted, and it is
// never destroyed (leaked on purpose): a Work finishing during static destruction may still record.
struct CommRegistry {
  std::mutex mu;
  std::map<std::pair<std::string, std::string>, CommRecorder::Entry> entries;
};
CommRegistry& comm_registry() {
  static auto* r = new CommRegistry;
  return *r;
}

}  // namespace

const char* comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::kAllReduce: return "all_reduce";
    case CommOp::kAllGather: return "all_gather";
    case CommOp::kReduceScatter: return "reduce_scatter";
    case CommOp::kBroadcast: return "broadcast";
    case CommOp::kSend: return "send";
    case CommOp::kRecv: return "recv";
    case CommOp::kAllReduceScalar: return "all_reduce_scalar";
    case CommOp::kBarrier: return "barrier";
    case CommOp::kAllToAll: return "all_to_all";
  }
  return "unknown";
}

CommRecorder::CommRecorder(const std::string& group) {
  CommRegistry& r = comm_registry();
  std::lock_guard<std::mutex> lk(r.mu);
  for (int i = 0; i < kCommOps; ++i) entries_[size_t(i)] = &r.entries[{group, comm_op_name(CommOp(i))}];
}

void CommRecorder::call(CommOp op, int64_t bytes) const {
  Entry* e = entries_[size_t(op)];
  if (!e) return;
  std::lock_guard<std::mutex> lk(comm_registry().mu);
  e->calls += 1;
  e->bytes += bytes;
}

void CommRecorder::wait(CommOp op, double seconds) const {
  Entry* e = entries_[size_t(op)];
  if (!e) return;
  std::lock_guard<std::mutex> lk(comm_registry().mu);
  e->wait_seconds += std::max(0.0, seconds);
}

}  // namespace loom::dist

namespace loom {

std::vector<CommStat> comm_stats() {
  dist::CommRegistry& r = dist::comm_registry();
  std::lock_guard<std::mutex> lk(r.mu);
  std::vector<CommStat> out;
  // The map's order is (group, op); entries created for a group but never used are left out.
  for (const auto& [key, e] : r.entries)
    if (e.calls != 0 || e.bytes != 0 || e.wait_seconds != 0)
      out.push_back(CommStat{key.first, key.second, e.calls, e.bytes, e.wait_seconds});
  return out;
}

void reset_comm_stats() {
  dist::CommRegistry& r = dist::comm_registry();
  std::lock_guard<std::mutex> lk(r.mu);
  for (auto& [key, e] : r.entries) e = dist::CommRecorder::Entry{};
}

}  // namespace loom

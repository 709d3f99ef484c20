// The MPI process runtime (init_world, abort_job, MPI_Finalize at exit) and what every MPI operation rests
// on: creating a group (its per-kind communicators), and completing a posted operation (MpiWork) by one
// polling wait that aborts the job once the timeout has passed, so a dead peer or mismatched collectives
// end the job with a message instead of a silent hang. Statistics: the time is taken around the polling
// wait (and each done() test), so it is the time the caller was held up. The communicator itself is
// communicator_mpi.cpp's; both share communicator_mpi_impl.h.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <thread>

#include "dist/communicator_mpi_impl.h"

namespace loom {

namespace mpi_detail {

namespace {

// The runtime state of this process: whether init_world started MPI (and so owns MPI_Finalize) and the
// latest timeout, which bounds the barrier before MPI_Finalize at exit.
struct Runtime {
  bool we_initialized = false;
  Millis timeout{600000};
};
Runtime& runtime() {
  static Runtime r;
  return r;
}

// One MPI_Testall over `reqs`; an MPI error aborts the job naming the operation and the group.
bool test_requests(std::vector<MPI_Request>& reqs, std::vector<MPI_Status>& statuses, const char* op,
                   const std::string& group, const std::string& what) {
  statuses.resize(reqs.size());
  int flag = 0;
  const int err = MPI_Testall(int(reqs.size()), reqs.data(), &flag, statuses.data());
  if (err == MPI_SUCCESS) return flag != 0;
  int code = err;
  if (err == MPI_ERR_IN_STATUS)
    for (const MPI_Status& st : statuses)
      if (st.MPI_ERROR != MPI_SUCCESS && st.MPI_ERROR != MPI_ERR_PENDING) code = st.MPI_ERROR;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = std::snprintf(text, sizeof text, "error %d", code);
  abort_job(detail::concat(op, " on group ", group, what.empty() ? "" : " of ", what, " failed in MPI (",
                           std::string(text, size_t(len)),
                           "): ranks called different collectives or with different sizes, or a rank died"));
}

// Polls `reqs` until all completed. Spins for the first 50 us (most small collectives finish within
// that), then sleeps with a doubling backoff capped at 500 us so waiting ranks leave the cores to ranks
// still computing. Past the timeout, or when MPI reports an error for the operation (OpenMPI does when
// ranks call the same collective with different sizes), the job is aborted with a message naming the
// operation and the group.
void wait_requests(std::vector<MPI_Request>& reqs, std::vector<MPI_Status>& statuses, const char* op,
                   const std::string& group, const std::string& what, Millis timeout) {
  auto test = [&] { return test_requests(reqs, statuses, op, group, what); };
  if (test()) return;
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  int64_t sleep_us = 0;
  for (;;) {
    if (test()) return;
    const auto now = Clock::now();
    if (now > deadline) abort_job(dist::timeout_message(op, group, what, timeout));
    if (now - start < std::chrono::microseconds(50)) continue;
    sleep_us = std::min<int64_t>(std::max<int64_t>(1, sleep_us * 2), 500);
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
  }
}

// Registered with atexit by init_world: a timed barrier (a rank still inside a collective, or one that
// exits early while others wait, ends in abort_job instead of a hang inside MPI_Finalize), then
// MPI_Finalize.
void finalize_at_exit() {
  if (!runtime().we_initialized || !mpi_active()) return;
  MPI_Request req;
  if (MPI_Ibarrier(MPI_COMM_WORLD, &req) == MPI_SUCCESS) {
    std::vector<MPI_Request> reqs{req};
    std::vector<MPI_Status> statuses;
    wait_requests(reqs, statuses, "the barrier before MPI_Finalize (process exit)", "world", "", runtime().timeout);
  }
  MPI_Finalize();
}

}  // namespace

bool mpi_active() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return false;
  MPI_Finalized(&finalized);
  return !finalized;
}

[[noreturn]] void mpi_fail(int err, const char* call, const char* file, int line, const char* func) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(err, text, &len) != MPI_SUCCESS) len = std::snprintf(text, sizeof text, "error %d", err);
  detail::check_fail(call, file, line, func, detail::concat("[mpi] ", std::string(text, size_t(len))));
}

std::shared_ptr<Group> make_group(MPI_Comm comm, bool owned, std::string name, Millis timeout) {
  auto g = std::make_shared<Group>();
  g->comm = comm;
  g->owned = owned;
  g->name = std::move(name);
  g->timeout = timeout;
  LOOM_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
  LOOM_MPI_CHECK(MPI_Comm_rank(comm, &g->rank));
  LOOM_MPI_CHECK(MPI_Comm_size(comm, &g->size));
  MPI_Group group, world_group;
  LOOM_MPI_CHECK(MPI_Comm_group(comm, &group));
  LOOM_MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
  std::vector<int> local(size_t(g->size));
  std::iota(local.begin(), local.end(), 0);
  g->global_ranks.resize(size_t(g->size));
  LOOM_MPI_CHECK(MPI_Group_translate_ranks(group, g->size, local.data(), world_group, g->global_ranks.data()));
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  g->text = dist::describe_group(g->name, g->global_ranks);
  g->stats = dist::CommRecorder(g->name);
  std::vector<MPI_Request> reqs(kKinds);
  std::vector<MPI_Status> statuses;
  for (int k = 0; k < kKinds; ++k) LOOM_MPI_CHECK(MPI_Comm_idup(comm, &g->kind_comm[k], &reqs[size_t(k)]));
  wait_requests(reqs, statuses, "creating communicators", g->text, "", timeout);
  for (MPI_Comm c : g->kind_comm) LOOM_MPI_CHECK(MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN));
  return g;
}

// ---- MpiWork ---------------------------------------------------------------------------------------

MpiWork::MpiWork(const char* op, std::shared_ptr<const Group> group, std::string what, std::optional<dist::CommOp> stat,
                 int64_t bytes)
    : op_(op), group_(std::move(group)), what_(std::move(what)), stat_(stat) {
  if (stat_) group_->stats.call(*stat_, bytes);
}

MpiWork::~MpiWork() {
  if (finished_ || !mpi_active()) return;
  try {
    wait();
  } catch (const std::exception& e) {
    abort_job(detail::concat(op_, " on group ", group_->text, " failed while its Work was destroyed: ", e.what()));
  }
}

// wait(), recording the time from t0 (a blocking call's entry) instead of from now.
void MpiWork::wait_from(Clock::time_point t0) {
  if (finished_) return;
  wait_requests(reqs, statuses, op_, group_->text, what_, group_->timeout);
  complete();
  record_wait(t0);
}

bool MpiWork::done() {
  if (finished_) return true;
  const auto t0 = Clock::now();
  const bool ok = test_requests(reqs, statuses, op_, group_->text, what_);
  if (ok) complete();
  record_wait(t0);
  return ok;
}

void MpiWork::complete() {
  finished_ = true;
  for (size_t i = 0; i < expected_counts.size(); ++i) {
    int got = 0;
    LOOM_MPI_CHECK(MPI_Get_count(&statuses[i], recv_type, &got));
    const bool many = !expected_peers.empty();
    LOOM_CHECK(got == expected_counts[i], "[", op_, "] on group ", group_->text, " from rank ",
               many ? expected_peers[i] : peer, " into ", what_, ": the message had ", got, " elements where ",
               expected_counts[i], " were expected (",
               many ? "out_counts[peer] must equal the rows that peer passes as in_counts for this rank"
                    : "sender and receiver tensors must have the same numel and dtype",
               ")");
  }
  if (finish) finish();
}

void MpiWork::record_wait(Clock::time_point t0) const {
  if (stat_) group_->stats.wait(*stat_, dist::seconds_since(t0));
}

}  // namespace mpi_detail

using namespace mpi_detail;

bool mpi_compiled_in() { return true; }

std::unique_ptr<Communicator> init_world(std::chrono::milliseconds timeout) {
  LOOM_CHECK(timeout.count() > 0, "[init_world] timeout must be positive, got ", timeout.count(), " ms");
  dist::set_operation_timeout(timeout);
  if (dist::launcher_world_size() == 0) return make_self_communicator("world");
  int initialized = 0, finalized = 0;
  LOOM_MPI_CHECK(MPI_Initialized(&initialized));
  LOOM_MPI_CHECK(MPI_Finalized(&finalized));
  LOOM_CHECK(!finalized, "[init_world] MPI was already finalised in this process");
  Runtime& rt = runtime();
  if (!initialized) {
    // Only the main thread calls MPI, but SERIALIZED leaves room for a communication thread.
    int provided = MPI_THREAD_SINGLE;
    const int err = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    if (err != MPI_SUCCESS) user_error("MPI_Init_thread failed (error ", err, "); check the mpirun/srun launch");
    rt.we_initialized = true;
    std::atexit(finalize_at_exit);
    if (provided < MPI_THREAD_FUNNELED)
      abort_job(detail::concat("this MPI library provides thread level ", provided,
                               " but Loom needs MPI_THREAD_FUNNELED (OpenMP threads run beside MPI)"));
  }
  rt.timeout = timeout;
  return make_mpi_communicator(make_group(MPI_COMM_WORLD, false, "world", timeout));
}

int end_after_error(const std::string& message, int exit_code) {
  int size = 1;
  if (mpi_active()) MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size > 1) abort_job(message, exit_code);
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  return exit_code;
}

void abort_job(const std::string& message, int exit_code) {
  const bool active = mpi_active();
  int rank = dist::launcher_world_rank();
  if (active) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "[loom] rank %d: %s\n", rank, message.c_str());
  std::fflush(stderr);
  if (active) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::exit(exit_code);
}

}  // namespace loom

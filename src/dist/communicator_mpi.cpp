// MPI communicator (host tensors) and the process runtime (init_world, abort_job, MPI_Finalize at exit).
// Every operation is posted non-blocking (MPI_I*) and completed by one polling wait that aborts the job
// once the timeout has passed, so a dead peer or mismatched collectives end the job with a message
// instead of a silent hang. 16- and 8-bit float reductions are staged through f32 buffers: the sum is
// accumulated in f32 by MPI's built-in ops and rounded once on the way back (a user-defined MPI_Op on
// the 16-bit data would round at every step of MPI's reduction tree, and the result would depend on the
// algorithm MPI picks).
//
// Statistics (comm_stats()): each operation counts its call and payload bytes when posted; the time is
// taken around the polling wait (and each done() test), or from entry for the blocking calls, so it is
// the time the caller was held up, not the time the operation took in the background.
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <thread>

#include "dist/dist_util.h"
#include "loom/dist/communicator.h"

namespace loom {

namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

constexpr int kP2pTag = 7;

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

std::atomic<int64_t> g_max_message_elements{0};

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

#define LOOM_MPI_CHECK(call)                                                               \
  do {                                                                                     \
    const int loom_mpi_err_ = (call);                                                      \
    if (loom_mpi_err_ != MPI_SUCCESS) [[unlikely]]                                         \
      mpi_fail(loom_mpi_err_, #call " == MPI_SUCCESS", __FILE__, __LINE__, __func__);      \
  } while (0)

// ---- dtypes --------------------------------------------------------------------------------------

// The MPI type that carries a dtype's bytes; 16/8-bit floats travel as unsigned integers (they are
// only moved, never reduced, in that form).
MPI_Datatype mpi_type(DType dt) {
  switch (dt) {
    case DType::kF32: return MPI_FLOAT;
    case DType::kI32: return MPI_INT32_T;
    case DType::kI64: return MPI_INT64_T;
    case DType::kU16:
    case DType::kBF16:
    case DType::kF16: return MPI_UINT16_T;
    case DType::kF8E4M3:
    case DType::kF8E5M2: return MPI_UINT8_T;
  }
  LOOM_FAIL("[mpi] unknown dtype ", int(dt));
}

// Float formats MPI cannot reduce: reductions go through f32.
bool staged(DType dt) {
  return dt == DType::kBF16 || dt == DType::kF16 || dt == DType::kF8E4M3 || dt == DType::kF8E5M2;
}

void to_f32(const void* src, DType dt, float* dst, int64_t n) {
  const auto* s16 = static_cast<const uint16_t*>(src);
  const auto* s8 = static_cast<const uint8_t*>(src);
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    switch (dt) {
      case DType::kBF16: dst[i] = bf16_to_f32(s16[i]); break;
      case DType::kF16: dst[i] = f16_to_f32(s16[i]); break;
      case DType::kF8E4M3: dst[i] = fp8_e4m3_to_f32(s8[i]); break;
      default: dst[i] = fp8_e5m2_to_f32(s8[i]); break;
    }
  }
}

void from_f32(const float* src, DType dt, void* dst, int64_t n) {
  auto* d16 = static_cast<uint16_t*>(dst);
  auto* d8 = static_cast<uint8_t*>(dst);
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    switch (dt) {
      case DType::kBF16: d16[i] = f32_to_bf16(src[i]); break;
      case DType::kF16: d16[i] = f32_to_f16(src[i]); break;
      case DType::kF8E4M3: d8[i] = f32_to_fp8_e4m3(src[i]); break;
      default: d8[i] = f32_to_fp8_e5m2(src[i]); break;
    }
  }
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return MPI_SUM;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kMin: return MPI_MIN;
  }
  LOOM_FAIL("[mpi] unknown reduce op ", int(op));
}

// Elements per MPI call: below INT_MAX (MPI 3 counts are int) and at most 1 GiB per message, which
// keeps clear of the 2 GiB byte-offset limits some MPI collectives still have.
int64_t max_message_elements(size_t elem_bytes) {
  if (const int64_t v = g_max_message_elements.load(std::memory_order_relaxed); v > 0) return v;
  return std::min<int64_t>(INT_MAX, (int64_t(1) << 30) / int64_t(elem_bytes));
}

template <typename F>
void for_chunks(int64_t n, int64_t max_chunk, F&& f) {
  for (int64_t off = 0; off < n; off += max_chunk) f(off, int(std::min(max_chunk, n - off)));
}

bool overlaps(TensorView a, TensorView b) {
  const auto* pa = static_cast<const char*>(a.raw());
  const auto* pb = static_cast<const char*>(b.raw());
  return a.nbytes() > 0 && b.nbytes() > 0 && pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

// "f32(1024)" (the tensor's description without the device).
std::string tensor_text(TensorView t) {
  std::string d = t.desc();
  if (auto at = d.find('@'); at != std::string::npos) d.resize(at);
  return d;
}

void wait_requests(std::vector<MPI_Request>& reqs, std::vector<MPI_Status>& statuses, const char* op,
                   const std::string& group, const std::string& what, Millis timeout);

// ---- group and waiting ----------------------------------------------------------------------------

// What a communicator and its in-flight operations share; works hold it so the MPI_Comm outlives them.
// Each kind of operation runs on its own duplicate of the group's communicator. MPI matches
// collectives only by order within a communicator, so a rank calling barrier while another calls
// all_reduce on one communicator can "complete" both with garbage (OpenMPI does); on separate
// communicators they never match, and the mismatch surfaces as the timeout with its message.
enum Kind { kAllReduce, kBroadcast, kAllGather, kReduceScatter, kBarrier, kP2p, kKinds };

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

// One posted operation: its requests, the staging buffers it owns, and what to do once it completed
// (convert a staged result back, move a result out of a temporary, check received counts). `stat`: the
// statistics entry the operation counts under (its call is counted here, at posting; none for internal
// operations such as split's rendezvous).
class MpiWork final : public Work {
 public:
  MpiWork(const char* op, std::shared_ptr<const Group> group, std::string what, std::optional<dist::CommOp> stat,
          int64_t bytes)
      : op_(op), group_(std::move(group)), what_(std::move(what)), stat_(stat) {
    if (stat_) group_->stats.call(*stat_, bytes);
  }
  ~MpiWork() override {
    if (finished_ || !mpi_active()) return;
    try {
      wait();
    } catch (const std::exception& e) {
      abort_job(detail::concat(op_, " on group ", group_->text, " failed while its Work was destroyed: ", e.what()));
    }
  }

  void wait() override { wait_from(Clock::now()); }

  // wait(), recording the time from t0 (a blocking call's entry) instead of from now.
  void wait_from(Clock::time_point t0) {
    if (finished_) return;
    wait_requests(reqs, statuses, op_, group_->text, what_, group_->timeout);
    complete();
    record_wait(t0);
  }

  bool done() override {
    if (finished_) return true;
    const auto t0 = Clock::now();
    const bool ok = test_requests(reqs, statuses, op_, group_->text, what_);
    if (ok) complete();
    record_wait(t0);
    return ok;
  }

  // An async post's own duration (from t0 to now), counted as time the caller was blocked.
  void record_post(Clock::time_point t0) const { record_wait(t0); }

  std::vector<MPI_Request> reqs;
  // Receives: the element count each request must have delivered, checked on completion.
  std::vector<int> expected_counts;
  std::vector<MPI_Status> statuses;
  MPI_Datatype recv_type = MPI_BYTE;
  int peer = -1;
  std::vector<float> stage, stage_out;
  std::vector<char> tmp;
  std::function<void()> finish;

 private:
  void complete() {
    finished_ = true;
    for (size_t i = 0; i < expected_counts.size(); ++i) {
      int got = 0;
      LOOM_MPI_CHECK(MPI_Get_count(&statuses[i], recv_type, &got));
      LOOM_CHECK(got == expected_counts[i], "[recv] on group ", group_->text, " from rank ", peer, " into ", what_,
                 ": the message had ", got, " elements where ", expected_counts[i],
                 " were expected (sender and receiver tensors must have the same numel and dtype)");
    }
    if (finish) finish();
  }

  void record_wait(Clock::time_point t0) const {
    if (stat_) group_->stats.wait(*stat_, dist::seconds_since(t0));
  }

  const char* op_;
  std::shared_ptr<const Group> group_;
  std::string what_;
  std::optional<dist::CommOp> stat_;
  bool finished_ = false;
};

// ---- the communicator -----------------------------------------------------------------------------

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(std::shared_ptr<Group> g) : g_(std::move(g)) {}

  int rank() const override { return g_->rank; }
  int size() const override { return g_->size; }
  std::string name() const override { return g_->name; }
  std::vector<int> global_ranks() const override { return g_->global_ranks; }

  // Blocking calls are the async posts completed at once; their recorded time runs from entry (the
  // staging conversions and the posting block the caller too).
  template <typename Post>
  static void blocking(Post post) {
    const auto t0 = Clock::now();
    post()->wait_from(t0);
  }
  void all_reduce(TensorView x, ReduceOp op) const override {
    blocking([&] { return post_all_reduce(x, op); });
  }
  void all_gather(TensorView out, TensorView inp) const override {
    blocking([&] { return post_all_gather(out, inp); });
  }
  void reduce_scatter(TensorView out, TensorView inp) const override {
    blocking([&] { return post_reduce_scatter(out, inp); });
  }
  void send(TensorView x, int peer) const override {
    blocking([&] { return post_send(x, peer); });
  }
  void recv(TensorView x, int peer) const override {
    blocking([&] { return post_recv(x, peer); });
  }

  // Async posts: the time spent posting (staging conversions, MPI's first round) blocks the caller too
  // and counts as waiting; the rest is what Work::wait()/done() spend.
  template <typename Post>
  static std::unique_ptr<Work> timed_post(Post post) {
    const auto t0 = Clock::now();
    std::unique_ptr<MpiWork> w = post();
    w->record_post(t0);
    return w;
  }
  std::unique_ptr<Work> all_reduce_async(TensorView x, ReduceOp op) const override {
    return timed_post([&] { return post_all_reduce(x, op); });
  }
  std::unique_ptr<Work> all_gather_async(TensorView out, TensorView inp) const override {
    return timed_post([&] { return post_all_gather(out, inp); });
  }
  std::unique_ptr<Work> reduce_scatter_async(TensorView out, TensorView inp) const override {
    return timed_post([&] { return post_reduce_scatter(out, inp); });
  }
  std::unique_ptr<Work> send_async(TensorView x, int peer) const override {
    return timed_post([&] { return post_send(x, peer); });
  }
  std::unique_ptr<Work> recv_async(TensorView x, int peer) const override {
    return timed_post([&] { return post_recv(x, peer); });
  }

  double all_reduce_scalar(double v, ReduceOp op) const override {
    const auto t0 = Clock::now();
    MpiWork w("all_reduce_scalar", g_, "f64 scalar", dist::CommOp::kAllReduceScalar, int64_t(sizeof v));
    w.reqs.emplace_back();
    LOOM_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, mpi_op(op), g_->kind_comm[kAllReduce], &w.reqs.back()));
    w.wait_from(t0);
    return v;
  }

  void broadcast(TensorView x, int root) const override {
    const auto t0 = Clock::now();
    check_host(x, "broadcast");
    LOOM_CHECK(root >= 0 && root < g_->size, "[broadcast] root ", root, " out of range for group ", g_->text);
    MpiWork w("broadcast", g_, tensor_text(x), dist::CommOp::kBroadcast, x.nbytes());
    const size_t esz = dtype_size(x.dtype());
    const MPI_Datatype type = mpi_type(x.dtype());
    for_chunks(x.numel(), max_message_elements(esz), [&](int64_t off, int len) {
      w.reqs.emplace_back();
      LOOM_MPI_CHECK(MPI_Ibcast(static_cast<char*>(x.raw()) + off * int64_t(esz), len, type, root, g_->kind_comm[kBroadcast],
                                &w.reqs.back()));
    });
    w.wait_from(t0);
  }

  void barrier() const override {
    const auto t0 = Clock::now();
    MpiWork w("barrier", g_, "", dist::CommOp::kBarrier, 0);
    w.reqs.emplace_back();
    LOOM_MPI_CHECK(MPI_Ibarrier(g_->kind_comm[kBarrier], &w.reqs.back()));
    w.wait_from(t0);
  }

  std::unique_ptr<Communicator> split(int color, int key, std::string name) const override {
    // MPI_Comm_split blocks until every rank arrives; a timed all-gather first makes sure they all did
    // (a rank that never calls split aborts the job here instead of hanging the others).
    {
      int mine[2] = {color, key};
      std::vector<int> all(size_t(2 * g_->size));
      MpiWork w("split", g_, "group \"" + name + "\"", std::nullopt, 0);
      w.reqs.emplace_back();
      LOOM_MPI_CHECK(MPI_Iallgather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, g_->comm, &w.reqs.back()));
      w.wait();
    }
    MPI_Comm sub = MPI_COMM_NULL;
    LOOM_MPI_CHECK(MPI_Comm_split(g_->comm, color < 0 ? MPI_UNDEFINED : color, key, &sub));
    if (sub == MPI_COMM_NULL) return nullptr;
    return std::make_unique<MpiCommunicator>(make_group(sub, true, std::move(name), g_->timeout));
  }

 private:
  std::unique_ptr<MpiWork> post_all_reduce(TensorView x, ReduceOp op) const {
    check_host(x, "all_reduce");
    auto w = std::make_unique<MpiWork>("all_reduce", g_, tensor_text(x), dist::CommOp::kAllReduce, x.nbytes());
    const int64_t n = x.numel();
    void* buf = x.raw();
    MPI_Datatype type = mpi_type(x.dtype());
    size_t esz = dtype_size(x.dtype());
    if (staged(x.dtype())) {
      w->stage.resize(size_t(n));
      to_f32(x.raw(), x.dtype(), w->stage.data(), n);
      buf = w->stage.data();
      type = MPI_FLOAT;
      esz = sizeof(float);
      w->finish = [w = w.get(), x] { from_f32(w->stage.data(), x.dtype(), x.raw(), x.numel()); };
    }
    for_chunks(n, max_message_elements(esz), [&](int64_t off, int len) {
      w->reqs.emplace_back();
      LOOM_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, static_cast<char*>(buf) + off * int64_t(esz), len, type,
                                    mpi_op(op), g_->kind_comm[kAllReduce], &w->reqs.back()));
    });
    return w;
  }

  std::unique_ptr<MpiWork> post_all_gather(TensorView out, TensorView inp) const {
    check_host(out, "all_gather");
    check_host(inp, "all_gather");
    LOOM_CHECK(out.dtype() == inp.dtype(), "[all_gather] on group ", g_->text, ": out ", out.desc(), " and inp ",
               inp.desc(), " differ in dtype");
    LOOM_CHECK(out.numel() == inp.numel() * g_->size, "[all_gather] on group ", g_->text, ": out ", out.desc(),
               " must hold group size ", g_->size, " x inp ", inp.desc(), " = ", inp.numel() * g_->size,
               " elements");
    auto w = std::make_unique<MpiWork>("all_gather", g_, tensor_text(inp) + " per rank", dist::CommOp::kAllGather,
                                       out.nbytes());
    const int64_t m = inp.numel();
    const size_t esz = dtype_size(inp.dtype());
    const MPI_Datatype type = mpi_type(inp.dtype());
    char* dst = static_cast<char*>(out.raw());
    char* mine = dst + int64_t(g_->rank) * m * int64_t(esz);
    // In place when inp is this rank's slice of out (MPI_IN_PLACE); another overlap goes via a copy.
    const bool in_place = inp.raw() == mine;
    const void* src = inp.raw();
    if (!in_place && overlaps(out, inp)) {
      w->tmp.assign(static_cast<const char*>(inp.raw()), static_cast<const char*>(inp.raw()) + inp.nbytes());
      src = w->tmp.data();
    }
    if (m == 0) return w;
    const int64_t max_chunk = max_message_elements(esz);
    if (m <= max_chunk) {
      w->reqs.emplace_back();
      LOOM_MPI_CHECK(MPI_Iallgather(in_place ? MPI_IN_PLACE : src, int(m), type, dst, int(m), type, g_->kind_comm[kAllGather],
                                    &w->reqs.back()));
      return w;
    }
    // Slices too large for one call: every rank broadcasts its slice in chunks.
    if (!in_place) std::memcpy(mine, src, size_t(m) * esz);
    for (int r = 0; r < g_->size; ++r)
      for_chunks(m, max_chunk, [&](int64_t off, int len) {
        w->reqs.emplace_back();
        LOOM_MPI_CHECK(MPI_Ibcast(dst + (int64_t(r) * m + off) * int64_t(esz), len, type, r, g_->kind_comm[kAllGather],
                                  &w->reqs.back()));
      });
    return w;
  }

  std::unique_ptr<MpiWork> post_reduce_scatter(TensorView out, TensorView inp) const {
    check_host(out, "reduce_scatter");
    check_host(inp, "reduce_scatter");
    LOOM_CHECK(out.dtype() == inp.dtype(), "[reduce_scatter] on group ", g_->text, ": out ", out.desc(),
               " and inp ", inp.desc(), " differ in dtype");
    LOOM_CHECK(inp.numel() % g_->size == 0 && out.numel() == inp.numel() / g_->size, "[reduce_scatter] on group ",
               g_->text, ": inp ", inp.desc(), " must split into group size ", g_->size, " slices of out ",
               out.desc());
    auto w = std::make_unique<MpiWork>("reduce_scatter", g_, tensor_text(inp), dist::CommOp::kReduceScatter,
                                       inp.nbytes());
    const int64_t n = inp.numel(), m = out.numel();
    size_t esz = dtype_size(inp.dtype());
    MPI_Datatype type = mpi_type(inp.dtype());
    const void* src = inp.raw();
    void* dst = out.raw();
    if (staged(inp.dtype())) {
      w->stage.resize(size_t(n));
      w->stage_out.resize(size_t(m));
      to_f32(inp.raw(), inp.dtype(), w->stage.data(), n);
      src = w->stage.data();
      dst = w->stage_out.data();
      type = MPI_FLOAT;
      esz = sizeof(float);
      w->finish = [w = w.get(), out] { from_f32(w->stage_out.data(), out.dtype(), out.raw(), out.numel()); };
    } else if (overlaps(out, inp)) {
      // MPI forbids aliasing send and receive buffers: receive into a temporary, copy out at the end.
      w->tmp.resize(size_t(out.nbytes()));
      dst = w->tmp.data();
      w->finish = [w = w.get(), out] { std::memcpy(out.raw(), w->tmp.data(), w->tmp.size()); };
    }
    if (m == 0) return w;
    const int64_t max_chunk = max_message_elements(esz);
    if (m <= max_chunk) {
      w->reqs.emplace_back();
      LOOM_MPI_CHECK(MPI_Ireduce_scatter_block(src, dst, int(m), type, MPI_SUM, g_->kind_comm[kReduceScatter], &w->reqs.back()));
      return w;
    }
    // Slices too large for one call: one chunked reduce to each slice's owner.
    for (int r = 0; r < g_->size; ++r)
      for_chunks(m, max_chunk, [&](int64_t off, int len) {
        w->reqs.emplace_back();
        void* recv = r == g_->rank ? static_cast<char*>(dst) + off * int64_t(esz) : nullptr;
        LOOM_MPI_CHECK(MPI_Ireduce(static_cast<const char*>(src) + (int64_t(r) * m + off) * int64_t(esz), recv,
                                   len, type, MPI_SUM, r, g_->kind_comm[kReduceScatter], &w->reqs.back()));
      });
    return w;
  }

  std::unique_ptr<MpiWork> post_send(TensorView x, int peer) const {
    check_host(x, "send");
    check_peer(peer, "send");
    auto w = std::make_unique<MpiWork>("send", g_, tensor_text(x) + " to rank " + std::to_string(peer),
                                       dist::CommOp::kSend, x.nbytes());
    const size_t esz = dtype_size(x.dtype());
    const MPI_Datatype type = mpi_type(x.dtype());
    for_chunks(x.numel(), max_message_elements(esz), [&](int64_t off, int len) {
      w->reqs.emplace_back();
      LOOM_MPI_CHECK(MPI_Isend(static_cast<char*>(x.raw()) + off * int64_t(esz), len, type, peer, kP2pTag,
                               g_->kind_comm[kP2p], &w->reqs.back()));
    });
    return w;
  }

  std::unique_ptr<MpiWork> post_recv(TensorView x, int peer) const {
    check_host(x, "recv");
    check_peer(peer, "recv");
    auto w = std::make_unique<MpiWork>("recv", g_, tensor_text(x) + " from rank " + std::to_string(peer),
                                       dist::CommOp::kRecv, x.nbytes());
    const size_t esz = dtype_size(x.dtype());
    const MPI_Datatype type = mpi_type(x.dtype());
    w->recv_type = type;
    w->peer = peer;
    for_chunks(x.numel(), max_message_elements(esz), [&](int64_t off, int len) {
      w->reqs.emplace_back();
      w->expected_counts.push_back(len);
      LOOM_MPI_CHECK(MPI_Irecv(static_cast<char*>(x.raw()) + off * int64_t(esz), len, type, peer, kP2pTag,
                               g_->kind_comm[kP2p], &w->reqs.back()));
    });
    return w;
  }

  void check_host(TensorView x, const char* op) const {
    LOOM_CHECK(x.numel() == 0 || x.defined(), "[", op, "] on group ", g_->text, ": undefined tensor");
    LOOM_CHECK(x.device().is_cpu(), "[", op, "] on group ", g_->text, ": the MPI communicator takes host tensors, got ",
               x.desc(), " (use the NCCL communicator for device tensors)");
  }
  void check_peer(int peer, const char* op) const {
    LOOM_CHECK(peer >= 0 && peer < g_->size && peer != g_->rank, "[", op, "] on group ", g_->text, ": peer ", peer,
               " is not another rank of this group of ", g_->size);
  }

  std::shared_ptr<Group> g_;
};

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

bool mpi_compiled_in() { return true; }

void set_mpi_max_message_elements(int64_t n) {
  LOOM_CHECK(n >= 0, "[set_mpi_max_message_elements] n must be >= 0, got ", n);
  g_max_message_elements.store(n, std::memory_order_relaxed);
}

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
  return std::make_unique<MpiCommunicator>(make_group(MPI_COMM_WORLD, false, "world", timeout));
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

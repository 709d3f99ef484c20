// NCCL communicator: collectives and point-to-point on device tensors, bootstrapped through a host
// communicator over the same ranks (rank 0 creates the unique id, the group broadcasts it).
//
// Stream semantics (the GPU analogue of "blocking"): a blocking operation is enqueued on the
// communicator's stream and returns; later work on that stream sees its result. An async operation
// runs on the communicator's own high-priority stream after the work already queued on the main
// stream, and Work::wait() makes the main stream wait for it (no host block); done() asks the event.
//
// Timeouts: every enqueued operation is handed to a watchdog thread with its completion event and
// deadline. Past the deadline, or when NCCL reports an asynchronous error (a peer died), the watchdog
// aborts the NCCL communicator (so no kernel spins forever) and ends the job through abort_job with
// the same message text as the MPI communicator. Host-level operations (all_reduce_scalar, barrier,
// split) go through a duplicate of the bootstrap host group, which has its own timed waits.
//
// All-to-all is one NCCL group of ncclSend/ncclRecv per peer (zero counts skipped) plus a device copy of
// this rank's own rows; NCCL cannot check that the peers' counts agree, so a mismatch is undefined.
//
// 16-bit float reductions use NCCL's native bf16/f16 arithmetic (as Megatron's NCCL reductions do);
// the f32-accumulate-and-round-once guarantee holds for the host (MPI) communicator.
//
// Statistics (comm_stats()): calls and bytes are counted at enqueue. The recorded time is the host's:
// a blocking operation's enqueue, Work::wait()/done(), and barrier's wait for the stream; the time a
// collective spends on the GPU stream is invisible here (it shows up where the host later synchronises).
// Host-level operations are counted by the host group, which has the same name.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "dist/dist_util.h"
#include "loom/dist/communicator.h"

namespace loom {

namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

#define LOOM_NCCL_CUDA_CHECK(call)                                                                        \
  do {                                                                                                    \
    const cudaError_t loom_err_ = (call);                                                                 \
    LOOM_CHECK(loom_err_ == cudaSuccess, "[cuda] ", cudaGetErrorName(loom_err_), ": ",                    \
               cudaGetErrorString(loom_err_));                                                            \
  } while (0)

// Movement operations carry bytes; reductions need NCCL's element type.
ncclDataType_t nccl_reduce_type(DType dt, const std::string& group) {
  switch (dt) {
    case DType::kF32: return ncclFloat32;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF16: return ncclFloat16;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 24, 0)
    case DType::kF8E4M3: return ncclFloat8e4m3;
    case DType::kF8E5M2: return ncclFloat8e5m2;
#endif
    default: break;
  }
  LOOM_FAIL("[nccl] group ", group, ": NCCL cannot reduce ", dtype_name(dt), " tensors");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  LOOM_FAIL("[nccl] unknown reduce op ", int(op));
}

std::string tensor_text(TensorView t) {
  std::string d = t.desc();
  if (auto at = d.find('@'); at != std::string::npos) d.resize(at);
  return d;
}

// A CUDA event that marks the end of one operation; shared by the watchdog and a Work.
struct Event {
  cudaEvent_t e = nullptr;
  Event() { LOOM_NCCL_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); }
  ~Event() {
    if (e) cudaEventDestroy(e);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

// The NCCL communicator's shared state: the comm, the streams and the watchdog.
class NcclState {
 public:
  NcclState(ncclComm_t comm, cudaStream_t stream, int device, const std::string& name, std::string text,
            Millis timeout)
      : comm_(comm), stream_(stream), device_(device), text_(std::move(text)), timeout_(timeout), stats_(name) {
    int lo = 0, hi = 0;
    LOOM_NCCL_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    LOOM_NCCL_CUDA_CHECK(cudaStreamCreateWithPriority(&side_, cudaStreamNonBlocking, hi));
    watchdog_ = std::thread([this] { watch(); });
  }
  ~NcclState() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    watchdog_.join();  // drains: returns once every operation completed (or aborts the job)
    ncclCommDestroy(comm_);
    cudaStreamDestroy(side_);
  }

  ncclComm_t comm() const { return comm_; }
  cudaStream_t stream() const { return stream_; }
  cudaStream_t side() const { return side_; }
  int device() const { return device_; }
  const std::string& text() const { return text_; }
  const dist::CommRecorder& stats() const { return stats_; }

  // After an NCCL call: a non-blocking communicator may still be enqueueing (ncclInProgress).
  void check(ncclResult_t r, const char* op, const std::string& what) {
    const auto deadline = Clock::now() + timeout_;
    while (r == ncclInProgress) {
      if (Clock::now() > deadline) fail(op, what, "");
      std::this_thread::yield();
      ncclCommGetAsyncError(comm_, &r);
    }
    if (r != ncclSuccess) fail(op, what, ncclGetErrorString(r));
  }

  // Records the end of an operation on `s` and hands it to the watchdog.
  std::shared_ptr<Event> track(cudaStream_t s, const char* op, std::string what) {
    auto ev = std::make_shared<Event>();
    LOOM_NCCL_CUDA_CHECK(cudaEventRecord(ev->e, s));
    {
      std::lock_guard<std::mutex> lk(mu_);
      pending_.push_back({ev, op, std::move(what), Clock::now() + timeout_});
    }
    cv_.notify_all();
    return ev;
  }

  // Blocks the host until `ev` completed, with the same timeout and error checks as the watchdog.
  void host_wait(const Event& ev, const char* op, const std::string& what) {
    const auto deadline = Clock::now() + timeout_;
    for (int i = 0;; ++i) {
      const cudaError_t q = cudaEventQuery(ev.e);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) fail(op, what, cudaGetErrorString(q));
      poll_errors(op, what, deadline);
      if (i > 100) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

 private:
  struct Pending {
    std::shared_ptr<Event> ev;
    const char* op;
    std::string what;
    Clock::time_point deadline;
  };

  void poll_errors(const char* op, const std::string& what, Clock::time_point deadline) {
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess && async != ncclInProgress) fail(op, what, ncclGetErrorString(async));
    if (Clock::now() > deadline) fail(op, what, "");
  }

  // Aborts the communicator (so its kernels stop spinning) and ends the job. `error` empty: timeout.
  [[noreturn]] void fail(const char* op, const std::string& what, const std::string& error) {
    ncclCommAbort(comm_);
    if (error.empty()) abort_job(dist::timeout_message(op, text_, what, timeout_));
    abort_job(detail::concat(op, " on group ", text_, what.empty() ? "" : " of ", what, " failed in NCCL (", error,
                             "): ranks called different collectives or with different sizes, or a rank died"));
  }

  void watch() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return stop_ || !pending_.empty(); });
      if (pending_.empty()) return;  // stop_ and drained
      Pending p = pending_.front();
      lk.unlock();
      bool finished = false;
      while (!finished) {
        const cudaError_t q = cudaEventQuery(p.ev->e);
        if (q == cudaSuccess) {
          finished = true;
        } else if (q != cudaErrorNotReady) {
          fail(p.op, p.what, cudaGetErrorString(q));
        } else {
          poll_errors(p.op, p.what, p.deadline);
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      }
      lk.lock();
      pending_.pop_front();
    }
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  cudaStream_t side_ = nullptr;
  int device_;
  std::string text_;
  Millis timeout_;
  dist::CommRecorder stats_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  bool stop_ = false;
  std::thread watchdog_;
};

// `stat`: the operation whose wait_seconds the host time in wait()/done() is added to.
class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclState> s, std::shared_ptr<Event> ev, dist::CommOp stat)
      : s_(std::move(s)), ev_(std::move(ev)), stat_(stat) {}
  ~NcclWork() override { wait(); }
  // Later work on the communicator's stream runs after the operation; the watchdog bounds the time.
  void wait() override {
    if (waited_) return;
    const auto t0 = Clock::now();
    waited_ = true;
    cudaStreamWaitEvent(s_->stream(), ev_->e, 0);
    s_->stats().wait(stat_, dist::seconds_since(t0));
  }
  bool done() override {
    const auto t0 = Clock::now();
    const bool ok = cudaEventQuery(ev_->e) == cudaSuccess;
    s_->stats().wait(stat_, dist::seconds_since(t0));
    return ok;
  }

 private:
  std::shared_ptr<NcclState> s_;
  std::shared_ptr<Event> ev_;
  dist::CommOp stat_;
  bool waited_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::unique_ptr<Communicator> host, std::shared_ptr<NcclState> s)
      : host_(std::move(host)), s_(std::move(s)) {}

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::string name() const override { return host_->name(); }
  std::vector<int> global_ranks() const override { return host_->global_ranks(); }

  // Blocking operations record their whole host duration (the enqueue).
  void all_reduce(TensorView x, ReduceOp op) const override {
    const auto t0 = Clock::now();
    all_reduce_on(s_->stream(), x, op);
    s_->stats().wait(dist::CommOp::kAllReduce, dist::seconds_since(t0));
  }
  void all_gather(TensorView out, TensorView inp) const override {
    const auto t0 = Clock::now();
    all_gather_on(s_->stream(), out, inp);
    s_->stats().wait(dist::CommOp::kAllGather, dist::seconds_since(t0));
  }
  void reduce_scatter(TensorView out, TensorView inp) const override {
    const auto t0 = Clock::now();
    reduce_scatter_on(s_->stream(), out, inp);
    s_->stats().wait(dist::CommOp::kReduceScatter, dist::seconds_since(t0));
  }
  void all_to_all_v(TensorView out, const std::vector<int64_t>& out_counts, TensorView inp,
                    const std::vector<int64_t>& in_counts) const override {
    const auto t0 = Clock::now();
    all_to_all_v_on(s_->stream(), out, out_counts, inp, in_counts);
    s_->stats().wait(dist::CommOp::kAllToAll, dist::seconds_since(t0));
  }
  void send(TensorView x, int peer) const override {
    const auto t0 = Clock::now();
    p2p_on(s_->stream(), x, peer, true);
    s_->stats().wait(dist::CommOp::kSend, dist::seconds_since(t0));
  }
  void recv(TensorView x, int peer) const override {
    const auto t0 = Clock::now();
    p2p_on(s_->stream(), x, peer, false);
    s_->stats().wait(dist::CommOp::kRecv, dist::seconds_since(t0));
  }

  void broadcast(TensorView x, int root) const override {
    const auto t0 = Clock::now();
    check_device(x, "broadcast");
    LOOM_CHECK(root >= 0 && root < size(), "[broadcast] root ", root, " out of range for group ", s_->text());
    const std::string what = tensor_text(x);
    s_->check(ncclBroadcast(x.raw(), x.raw(), size_t(x.nbytes()), ncclUint8, root, s_->comm(), s_->stream()),
              "broadcast", what);
    s_->track(s_->stream(), "broadcast", what);
    s_->stats().call(dist::CommOp::kBroadcast, x.nbytes());
    s_->stats().wait(dist::CommOp::kBroadcast, dist::seconds_since(t0));
  }

  // Host values and host synchronisation go through the host group.
  double all_reduce_scalar(double v, ReduceOp op) const override { return host_->all_reduce_scalar(v, op); }
  void barrier() const override {
    // Every rank's queued NCCL work first, so the barrier means "everything before it finished". The
    // host barrier counts the call; the stream wait adds to its time.
    const auto t0 = Clock::now();
    auto ev = s_->track(s_->stream(), "barrier", "");
    s_->host_wait(*ev, "barrier", "");
    s_->stats().wait(dist::CommOp::kBarrier, dist::seconds_since(t0));
    host_->barrier();
  }

  std::unique_ptr<Work> all_reduce_async(TensorView x, ReduceOp op) const override {
    return side([&](cudaStream_t s) { all_reduce_on(s, x, op); }, "all_reduce", tensor_text(x),
                dist::CommOp::kAllReduce);
  }
  std::unique_ptr<Work> all_gather_async(TensorView out, TensorView inp) const override {
    return side([&](cudaStream_t s) { all_gather_on(s, out, inp); }, "all_gather", tensor_text(inp),
                dist::CommOp::kAllGather);
  }
  std::unique_ptr<Work> reduce_scatter_async(TensorView out, TensorView inp) const override {
    return side([&](cudaStream_t s) { reduce_scatter_on(s, out, inp); }, "reduce_scatter", tensor_text(inp),
                dist::CommOp::kReduceScatter);
  }
  std::unique_ptr<Work> all_to_all_v_async(TensorView out, const std::vector<int64_t>& out_counts, TensorView inp,
                                           const std::vector<int64_t>& in_counts) const override {
    return side([&](cudaStream_t s) { all_to_all_v_on(s, out, out_counts, inp, in_counts); }, "all_to_all",
                tensor_text(inp), dist::CommOp::kAllToAll);
  }
  std::unique_ptr<Work> send_async(TensorView x, int peer) const override {
    return side([&](cudaStream_t s) { p2p_on(s, x, peer, true); }, "send", tensor_text(x), dist::CommOp::kSend);
  }
  std::unique_ptr<Work> recv_async(TensorView x, int peer) const override {
    return side([&](cudaStream_t s) { p2p_on(s, x, peer, false); }, "recv", tensor_text(x), dist::CommOp::kRecv);
  }

  std::unique_ptr<Work> send_recv_async(TensorView send, int send_peer, TensorView recv,
                                        int recv_peer) const override {
    const std::string what = (send ? tensor_text(send) + " to rank " + std::to_string(send_peer) : std::string()) +
                             (send && recv ? ", " : "") +
                             (recv ? tensor_text(recv) + " from rank " + std::to_string(recv_peer) : std::string());
    return side(
        [&](cudaStream_t s) {
          s_->check(ncclGroupStart(), "send_recv", what);
          if (send) enqueue_p2p(s, send, send_peer, true, what);
          if (recv) enqueue_p2p(s, recv, recv_peer, false, what);
          s_->check(ncclGroupEnd(), "send_recv", what);
        },
        // Waiting on the pair is waiting for the message to arrive: the time goes to the recv.
        "send_recv", what, recv ? dist::CommOp::kRecv : dist::CommOp::kSend);
  }

  std::unique_ptr<Communicator> split(int color, int key, std::string name) const override {
    auto sub = host_->split(color, key, std::move(name));
    if (!sub) return nullptr;
    return make_nccl_communicator(*sub, s_->stream());
  }

 private:
  // Runs `enqueue` on the side stream after the work already queued on the main stream.
  template <typename F>
  std::unique_ptr<Work> side(F&& enqueue, const char* op, const std::string& what, dist::CommOp stat) const {
    Event ready;
    LOOM_NCCL_CUDA_CHECK(cudaEventRecord(ready.e, s_->stream()));
    LOOM_NCCL_CUDA_CHECK(cudaStreamWaitEvent(s_->side(), ready.e, 0));
    enqueue(s_->side());
    auto done = s_->track(s_->side(), op, what);
    return std::make_unique<NcclWork>(s_, std::move(done), stat);
  }

  void all_reduce_on(cudaStream_t s, TensorView x, ReduceOp op) const {
    check_device(x, "all_reduce");
    const std::string what = tensor_text(x);
    s_->check(ncclAllReduce(x.raw(), x.raw(), size_t(x.numel()), nccl_reduce_type(x.dtype(), s_->text()), nccl_op(op),
                            s_->comm(), s),
              "all_reduce", what);
    s_->stats().call(dist::CommOp::kAllReduce, x.nbytes());
    if (s == s_->stream()) s_->track(s, "all_reduce", what);
  }

  void all_gather_on(cudaStream_t s, TensorView out, TensorView inp) const {
    check_device(out, "all_gather");
    check_device(inp, "all_gather");
    LOOM_CHECK(out.dtype() == inp.dtype() && out.numel() == inp.numel() * size(), "[all_gather] on group ",
               s_->text(), ": out ", out.desc(), " must hold group size ", size(), " x inp ", inp.desc());
    const char* mine = static_cast<const char*>(out.raw()) + int64_t(rank()) * inp.nbytes();
    LOOM_CHECK(inp.raw() == mine || !overlaps(out, inp), "[all_gather] on group ", s_->text(),
               ": inp overlaps out other than as this rank's slice");
    const std::string what = tensor_text(inp);
    s_->check(ncclAllGather(inp.raw(), out.raw(), size_t(inp.nbytes()), ncclUint8, s_->comm(), s), "all_gather", what);
    s_->stats().call(dist::CommOp::kAllGather, out.nbytes());
    if (s == s_->stream()) s_->track(s, "all_gather", what);
  }

  void reduce_scatter_on(cudaStream_t s, TensorView out, TensorView inp) const {
    check_device(out, "reduce_scatter");
    check_device(inp, "reduce_scatter");
    LOOM_CHECK(out.dtype() == inp.dtype() && inp.numel() % size() == 0 && out.numel() == inp.numel() / size(),
               "[reduce_scatter] on group ", s_->text(), ": inp ", inp.desc(), " must split into group size ", size(),
               " slices of out ", out.desc());
    const char* mine = static_cast<const char*>(inp.raw()) + int64_t(rank()) * out.nbytes();
    LOOM_CHECK(out.raw() == mine || !overlaps(out, inp), "[reduce_scatter] on group ", s_->text(),
               ": out overlaps inp other than as this rank's slice");
    const std::string what = tensor_text(inp);
    s_->check(ncclReduceScatter(inp.raw(), out.raw(), size_t(out.numel()), nccl_reduce_type(inp.dtype(), s_->text()),
                                ncclSum, s_->comm(), s),
              "reduce_scatter", what);
    s_->stats().call(dist::CommOp::kReduceScatter, inp.nbytes());
    if (s == s_->stream()) s_->track(s, "reduce_scatter", what);
  }

  // One NCCL group of a send and a receive per peer (zero counts skipped); this rank's own rows are a
  // device-to-device copy on the same stream. NCCL counts are size_t, so no size limit applies.
  void all_to_all_v_on(cudaStream_t s, TensorView out, const std::vector<int64_t>& out_counts, TensorView inp,
                       const std::vector<int64_t>& in_counts) const {
    check_device(out, "all_to_all_v");
    check_device(inp, "all_to_all_v");
    const dist::AllToAllPlan plan = dist::plan_all_to_all(s_->text(), size(), out, out_counts, inp, in_counts);
    const int me = rank();
    LOOM_CHECK(plan.send_count[size_t(me)] == plan.recv_count[size_t(me)], "[all_to_all_v] on group ", s_->text(),
               ": this rank (", me, ") sends itself ", in_counts[size_t(me)], " rows (in_counts) but expects ",
               out_counts[size_t(me)], " (out_counts)");
    const std::string what = tensor_text(inp) + " -> " + tensor_text(out);
    const int64_t esz = int64_t(dtype_size(inp.dtype()));
    char* dst = static_cast<char*>(out.raw());
    const char* src = static_cast<const char*>(inp.raw());
    if (plan.send_count[size_t(me)] > 0)
      LOOM_NCCL_CUDA_CHECK(cudaMemcpyAsync(dst + plan.recv_off[size_t(me)] * esz, src + plan.send_off[size_t(me)] * esz,
                                           size_t(plan.send_count[size_t(me)] * esz), cudaMemcpyDeviceToDevice, s));
    s_->check(ncclGroupStart(), "all_to_all", what);
    for (int k = 1; k < size(); ++k) {
      const auto p = size_t((me + k) % size());
      if (plan.recv_count[p] > 0)
        s_->check(ncclRecv(dst + plan.recv_off[p] * esz, size_t(plan.recv_count[p] * esz), ncclUint8, int(p),
                           s_->comm(), s),
                  "all_to_all", what);
      if (plan.send_count[p] > 0)
        s_->check(ncclSend(src + plan.send_off[p] * esz, size_t(plan.send_count[p] * esz), ncclUint8, int(p),
                           s_->comm(), s),
                  "all_to_all", what);
    }
    s_->check(ncclGroupEnd(), "all_to_all", what);
    s_->stats().call(dist::CommOp::kAllToAll, inp.nbytes());
    if (s == s_->stream()) s_->track(s, "all_to_all", what);
  }

  void p2p_on(cudaStream_t s, TensorView x, int peer, bool is_send) const {
    const char* op = is_send ? "send" : "recv";
    const std::string what = tensor_text(x) + (is_send ? " to rank " : " from rank ") + std::to_string(peer);
    s_->check(ncclGroupStart(), op, what);
    enqueue_p2p(s, x, peer, is_send, what);
    s_->check(ncclGroupEnd(), op, what);
    if (s == s_->stream()) s_->track(s, op, what);
  }

  // One ncclSend/ncclRecv inside the caller's ncclGroupStart/End.
  void enqueue_p2p(cudaStream_t s, TensorView x, int peer, bool is_send, const std::string& what) const {
    const char* op = is_send ? "send" : "recv";
    check_device(x, op);
    LOOM_CHECK(peer >= 0 && peer < size() && peer != rank(), "[", op, "] on group ", s_->text(), ": peer ", peer,
               " is not another rank of this group of ", size());
    const ncclResult_t r = is_send ? ncclSend(x.raw(), size_t(x.nbytes()), ncclUint8, peer, s_->comm(), s)
                                   : ncclRecv(x.raw(), size_t(x.nbytes()), ncclUint8, peer, s_->comm(), s);
    s_->check(r, op, what);
    s_->stats().call(is_send ? dist::CommOp::kSend : dist::CommOp::kRecv, x.nbytes());
  }

  void check_device(TensorView x, const char* op) const {
    LOOM_CHECK(x.device().type == DeviceType::kCUDA && x.device().index == s_->device(), "[", op, "] on group ",
               s_->text(), ": the NCCL communicator takes tensors on cuda:", s_->device(), ", got ", x.desc());
  }

  std::unique_ptr<Communicator> host_;
  std::shared_ptr<NcclState> s_;
};

}  // namespace

bool nccl_compiled_in() { return true; }

std::unique_ptr<Communicator> make_nccl_communicator(const Communicator& group, void* cuda_stream) {
  const Millis timeout = dist::operation_timeout();
  // A private duplicate of the host group: host-level operations and later splits go through it.
  auto host = group.split(0, group.rank(), group.name());
  const std::string text = dist::describe_group(host->name(), host->global_ranks());
  int device = 0;
  LOOM_NCCL_CUDA_CHECK(cudaGetDevice(&device));

  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (host->rank() == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    LOOM_CHECK(r == ncclSuccess, "[nccl] ncclGetUniqueId for group ", text, ": ", ncclGetErrorString(r));
  }
  static_assert(sizeof(ncclUniqueId) % 2 == 0);
  host->broadcast(TensorView(&id, DType::kU16, Shape{int64_t(sizeof id / 2)}), 0);

  // Non-blocking initialisation, polled with the timeout: a rank that never joins aborts the job.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, host->size(), id, host->rank(), &config);
  const auto deadline = Clock::now() + timeout;
  while (r == ncclInProgress) {
    if (Clock::now() > deadline) {
      if (comm) ncclCommAbort(comm);
      abort_job(dist::timeout_message("ncclCommInitRank", text, "", timeout));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    ncclCommGetAsyncError(comm, &r);
  }
  if (r != ncclSuccess) {
    if (comm) ncclCommAbort(comm);
    LOOM_FAIL("[nccl] ncclCommInitRank for group ", text, " on cuda:", device, ": ", ncclGetErrorString(r));
  }
  auto state = std::make_shared<NcclState>(comm, static_cast<cudaStream_t>(cuda_stream), device, host->name(), text,
                                           timeout);
  return std::make_unique<NcclCommunicator>(std::move(host), std::move(state));
}

std::unique_ptr<Communicator> make_nccl_communicator(const Communicator& group) {
  return make_nccl_communicator(group, nullptr);
}

}  // namespace loom

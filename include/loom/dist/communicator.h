// Communicator: collectives and point-to-point messages over one process group. Implementations: self
// (one process), MPI (CPU tensors; OpenMPI from Debian) and NCCL (GPU tensors, bootstrapped through MPI:
// rank 0 of the group creates the unique id and broadcasts it). Collectives take tensors and work out
// counts themselves; in-place where the signature has a single tensor. Every rank of the group must call
// the same collectives in the same order with the same shapes and dtypes.
//
// Timeouts (--distributed-timeout-minutes): an MPI or NCCL operation that has not completed within the
// timeout (a dead peer, or ranks that called different collectives) aborts the whole job with a message
// naming the operation, the group and its global ranks; no rank hangs silently.
//
// Reductions of bf16/f16 tensors accumulate in f32 and round once (MPI has no 16-bit float types).
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "loom/core/tensor.h"

namespace loom {

enum class ReduceOp { kSum, kMax, kMin };

// An operation started asynchronously (for overlapping communication with compute). wait() blocks until
// it completed (or aborts the job on timeout); destroying an unfinished Work waits for it first.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual bool done() = 0;  // non-blocking test
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // the group's name in error messages, e.g. "data-parallel"
  // Global (world) ranks of the members in group-rank order (for messages and for building layouts).
  virtual std::vector<int> global_ranks() const = 0;

  virtual void all_reduce(TensorView x, ReduceOp op = ReduceOp::kSum) const = 0;
  // Reduces a host scalar (used for loss sums, norms and overflow flags).
  virtual double all_reduce_scalar(double v, ReduceOp op = ReduceOp::kSum) const = 0;
  virtual void broadcast(TensorView x, int root) const = 0;
  // out (n) = concatenation over ranks of inp (n / size).
  virtual void all_gather(TensorView out, TensorView inp) const = 0;
  // out (n / size) = this rank's slice of the sum over ranks of inp (n).
  virtual void reduce_scatter(TensorView out, TensorView inp) const = 0;
  virtual void barrier() const = 0;

  // Point-to-point within the group (peer is a group rank). Blocking send/recv of a whole tensor; the
  // receiver's tensor must have the sender's numel and dtype. Messages between a pair arrive in order.
  virtual void send(TensorView x, int peer) const = 0;
  virtual void recv(TensorView x, int peer) const = 0;

  // Asynchronous twins. The tensors must stay alive and untouched until wait() returns.
  virtual std::unique_ptr<Work> all_reduce_async(TensorView x, ReduceOp op = ReduceOp::kSum) const = 0;
  virtual std::unique_ptr<Work> all_gather_async(TensorView out, TensorView inp) const = 0;
  virtual std::unique_ptr<Work> reduce_scatter_async(TensorView out, TensorView inp) const = 0;
  virtual std::unique_ptr<Work> send_async(TensorView x, int peer) const = 0;
  virtual std::unique_ptr<Work> recv_async(TensorView x, int peer) const = 0;
  // Sends `send` to `send_peer` and receives `recv` from `recv_peer` as one operation; either tensor
  // may be undefined to skip that half. Two ranks exchanging with each other cannot deadlock (NCCL
  // groups the pair; a send and a recv queued one after the other on a GPU stream would wait for each
  // other forever). The default posts recv_async, then send_async (non-blocking posts in MPI).
  virtual std::unique_ptr<Work> send_recv_async(TensorView send, int send_peer, TensorView recv,
                                                int recv_peer) const;

  // All-to-all along dim 0 (expert-parallel token dispatch). A row is one index of dim 0 (the trailing
  // shape's elements); out and inp have the same dtype and trailing shape and must not overlap.
  // all_to_all_v: inp is size() consecutive runs of rows, in_counts[p] rows for group rank p (in rank
  // order); out receives out_counts[p] rows from rank p, in rank order. sum(in_counts) = inp rows,
  // sum(out_counts) = out rows; counts may be 0. out_counts[p] must equal what rank p passes as
  // in_counts[rank()] (Megatron's alltoall dispatcher exchanges the per-expert counts first, with an
  // equal-split all_to_all of an i64 tensor). MPI checks every received count, so a mismatch there is an
  // error naming the peer (or the timeout); NCCL cannot tell, and a mismatch is undefined.
  virtual void all_to_all_v(TensorView out, const std::vector<int64_t>& out_counts, TensorView inp,
                            const std::vector<int64_t>& in_counts) const = 0;
  virtual std::unique_ptr<Work> all_to_all_v_async(TensorView out, const std::vector<int64_t>& out_counts,
                                                   TensorView inp, const std::vector<int64_t>& in_counts) const = 0;
  // Equal splits: out and inp have the same shape, dim 0 divisible by size(); chunk p of inp goes to
  // rank p, chunk p of out came from rank p. The defaults call the _v twins with equal counts.
  virtual void all_to_all(TensorView out, TensorView inp) const;
  virtual std::unique_ptr<Work> all_to_all_async(TensorView out, TensorView inp) const;

  // A sub-group of the ranks that pass the same color (MPI_Comm_split semantics; ranks ordered by key).
  // Collective over this group. color < 0: this rank joins no group and gets null.
  virtual std::unique_ptr<Communicator> split(int color, int key, std::string name) const = 0;
};

inline std::unique_ptr<Work> Communicator::send_recv_async(TensorView send, int send_peer, TensorView recv,
                                                          int recv_peer) const {
  struct Both final : Work {
    std::unique_ptr<Work> recv, send;
    void wait() override {
      if (recv) recv->wait();
      if (send) send->wait();
    }
    bool done() override { return (!recv || recv->done()) && (!send || send->done()); }
  };
  auto w = std::make_unique<Both>();
  if (recv) w->recv = recv_async(recv, recv_peer);
  if (send) w->send = send_async(send, send_peer);
  return w;
}

// The single-process group: every collective is the identity (a copy where out and inp differ);
// send/recv to itself are an error.
// global_rank: what global_ranks() reports (this process's rank in the world; 0 for a one-process run).
std::unique_ptr<Communicator> make_self_communicator(std::string name, int global_rank = 0);

// ---- process-level runtime (communicator_mpi_runtime.cpp, or the stub without MPI) -------------------

// True when this build has MPI. Without it only world size 1 exists.
bool mpi_compiled_in();
// Initialises MPI once per process (MPI_THREAD_FUNNELED or better) when the process was started by
// mpirun/srun (OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_RANK set) and returns the world communicator
// (named "world"); without a launcher (or without MPI) returns the self communicator. Finalises at exit.
// timeout: how long any operation may take before the job is aborted (--distributed-timeout-minutes).
std::unique_ptr<Communicator> init_world(std::chrono::milliseconds timeout);
// Ends every rank of the job with `exit_code` after printing `message` on this rank (MPI_Abort); a plain
// exit without MPI.
[[noreturn]] void abort_job(const std::string& message, int exit_code = 1);
// The last step of a process whose command failed with an error (main's catch): in a job of several ranks
// with MPI running, ends every rank at once through abort_job(message, exit_code), because the other ranks
// would otherwise wait in their next collective until --distributed-timeout-minutes passed (an error that
// only one rank sees: a damaged shard of its own, a bad token id in its own samples); otherwise prints
// `message` on stderr and returns exit_code for main to return.
int end_after_error(const std::string& message, int exit_code);

// The NCCL communicator over the same ranks as `group` (device tensors; bootstrapped through `group`).
// Throws UserError naming the reason when NCCL or CUDA is not compiled in.
std::unique_ptr<Communicator> make_nccl_communicator(const Communicator& group);

}  // namespace loom

namespace loom {

// ---- additions: NCCL stream choice, availability and an MPI testing hook ---------------------------

// True when this build has NCCL (CUDA backend on and nccl.h / libnccl found at configure time).
bool nccl_compiled_in();
// The NCCL communicator whose operations run on `cuda_stream` (a cudaStream_t; nullptr = the legacy
// default stream, which the one-argument make_nccl_communicator uses). Blocking operations enqueue on
// the stream and wait until the stream reached them (with the timeout); async ones return a Work that
// waits on a CUDA event.
std::unique_ptr<Communicator> make_nccl_communicator(const Communicator& group, void* cuda_stream);
// The largest element count a single MPI call carries (default: 1 GiB of elements, well below the
// INT_MAX count limit of MPI 3); larger tensors go as several calls. Tests lower it to exercise the
// chunked paths on small tensors. n >= 1; 0 restores the default.
void set_mpi_max_message_elements(int64_t n);

}  // namespace loom

namespace loom {

// ---- communication statistics ----------------------------------------------------------------------

// Communication statistics of this process, for per-step volume per parallel mode and "exposed"
// communication time: every operation an MPI or NCCL communicator posts is counted under (group name,
// operation name): calls, payload bytes, and the wall time the calling thread spent blocked in it (a
// blocking call: its whole duration; an async one: posting it (MPI) plus the time inside Work::wait() and
// Work::done(), so an operation that completed in the background while the caller computed costs only
// the post and the polls). Payload
// convention (as nccl-tests' "size"): all_reduce, broadcast, send, recv: the tensor's bytes; all_gather:
// the output's bytes; reduce_scatter and all_to_all (equal or variable counts): the input's bytes (all
// this rank sends, its own rows included); all_reduce_scalar: 8; barrier: 0. Staged
// 16-bit reductions count the 16-bit tensor's bytes (what the model moves), not the f32 staging.
// Async twins count under the blocking names ("all_reduce" for all_reduce_async, "all_to_all" for
// all_to_all_v and both async twins); send_recv_async counts
// as its send and its recv. The self (one-process) communicator records nothing. NCCL: calls and bytes
// at enqueue; the time is the host's (enqueueing, Work::wait/done, the stream wait of barrier), not the
// GPU stream's. Thread-safe (one mutex; operations are counted per call, never per element).
struct CommStat {
  std::string group;  // Communicator::name(), e.g. "tensor-model-parallel"
  std::string op;     // "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send",
                      // "recv", "all_reduce_scalar", "barrier"
  int64_t calls = 0;
  int64_t bytes = 0;
  double wait_seconds = 0;
};
// Every (group, op) with something recorded since the last reset, sorted by (group, op).
std::vector<CommStat> comm_stats();
void reset_comm_stats();

}  // namespace loom

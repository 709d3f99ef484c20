// MPI communicator (host tensors): MpiCommunicator's collectives, point-to-point operations and split. The
// process runtime (init_world, abort_job, MPI_Finalize at exit), group creation and the completion of
// posted operations (MpiWork, the polling wait) are in communicator_mpi_runtime.cpp; both share
// communicator_mpi_impl.h.
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
#include "dist/communicator_mpi_impl.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <optional>

namespace loom {

namespace mpi_detail {

namespace {

constexpr int kP2pTag = 7;
constexpr int kAllToAllTag = 8;

std::atomic<int64_t> g_max_message_elements{0};

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

// "f32(1024)" (the tensor's description without the device).
std::string tensor_text(TensorView t) {
  std::string d = t.desc();
  if (auto at = d.find('@'); at != std::string::npos) d.resize(at);
  return d;
}

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
  void all_to_all(TensorView out, TensorView inp) const override {
    blocking([&] { return post_all_to_all(out, inp); });
  }
  void all_to_all_v(TensorView out, const std::vector<int64_t>& out_counts, TensorView inp,
                    const std::vector<int64_t>& in_counts) const override {
    blocking([&] { return post_all_to_all_v(out, out_counts, inp, in_counts); });
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
  std::unique_ptr<Work> all_to_all_async(TensorView out, TensorView inp) const override {
    return timed_post([&] { return post_all_to_all(out, inp); });
  }
  std::unique_ptr<Work> all_to_all_v_async(TensorView out, const std::vector<int64_t>& out_counts, TensorView inp,
                                           const std::vector<int64_t>& in_counts) const override {
    return timed_post([&] { return post_all_to_all_v(out, out_counts, inp, in_counts); });
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

  // Equal splits: one MPI_Ialltoall (every rank has the same sizes, so every rank takes the same path);
  // a tensor too large for one call goes pairwise like all_to_all_v.
  std::unique_ptr<MpiWork> post_all_to_all(TensorView out, TensorView inp) const {
    check_host(out, "all_to_all");
    check_host(inp, "all_to_all");
    const std::vector<int64_t> counts = dist::equal_all_to_all_counts(g_->text, g_->size, out, inp);
    const dist::AllToAllPlan plan = dist::plan_all_to_all(g_->text, g_->size, out, counts, inp, counts);
    const size_t esz = dtype_size(inp.dtype());
    if (inp.numel() > max_message_elements(esz)) return post_pairwise(out, inp, plan, "all_to_all");
    auto w = std::make_unique<MpiWork>("all_to_all", g_, tensor_text(inp), dist::CommOp::kAllToAll, inp.nbytes());
    const int m = int(plan.send_count[0]);
    if (m == 0) return w;
    const MPI_Datatype type = mpi_type(inp.dtype());
    w->reqs.emplace_back();
    LOOM_MPI_CHECK(MPI_Ialltoall(inp.raw(), m, type, out.raw(), m, type, g_->kind_comm[kAllToAll], &w->reqs.back()));
    return w;
  }

  // Variable counts go pairwise (MPI_Irecv/MPI_Isend per peer, chunked): a pair's count is known to both
  // of its ranks, so both chunk it the same way, and every received count is checked, whereas
  // MPI_Alltoallv's int displacements would make "does it fit in one call" a question about every rank.
  std::unique_ptr<MpiWork> post_all_to_all_v(TensorView out, const std::vector<int64_t>& out_counts, TensorView inp,
                                             const std::vector<int64_t>& in_counts) const {
    check_host(out, "all_to_all_v");
    check_host(inp, "all_to_all_v");
    return post_pairwise(out, inp, dist::plan_all_to_all(g_->text, g_->size, out, out_counts, inp, in_counts),
                         "all_to_all_v");
  }

  // This rank's own rows are copied at posting; receives are posted before sends, peers in the order
  // rank+1, rank+2, ... so that not every rank sends to rank 0 first.
  std::unique_ptr<MpiWork> post_pairwise(TensorView out, TensorView inp, const dist::AllToAllPlan& plan,
                                         const char* op) const {
    const int me = g_->rank, n = g_->size;
    LOOM_CHECK(plan.send_count[size_t(me)] == plan.recv_count[size_t(me)], "[", op, "] on group ", g_->text,
               ": this rank (", me, ") sends itself ", plan.send_count[size_t(me)] / plan.row_elements,
               " rows (in_counts) but expects ", plan.recv_count[size_t(me)] / plan.row_elements, " (out_counts)");
    auto w = std::make_unique<MpiWork>(op, g_, tensor_text(inp) + " -> " + tensor_text(out), dist::CommOp::kAllToAll,
                                       inp.nbytes());
    const size_t esz = dtype_size(inp.dtype());
    const MPI_Datatype type = mpi_type(inp.dtype());
    const int64_t max_chunk = max_message_elements(esz);
    char* dst = static_cast<char*>(out.raw());
    const char* src = static_cast<const char*>(inp.raw());
    if (plan.send_count[size_t(me)] > 0)
      std::memcpy(dst + plan.recv_off[size_t(me)] * int64_t(esz), src + plan.send_off[size_t(me)] * int64_t(esz),
                  size_t(plan.send_count[size_t(me)]) * esz);
    w->recv_type = type;
    for (int k = 1; k < n; ++k) {
      const int p = (me + k) % n;
      for_chunks(plan.recv_count[size_t(p)], max_chunk, [&](int64_t off, int len) {
        w->reqs.emplace_back();
        w->expected_counts.push_back(len);
        w->expected_peers.push_back(p);
        LOOM_MPI_CHECK(MPI_Irecv(dst + (plan.recv_off[size_t(p)] + off) * int64_t(esz), len, type, p, kAllToAllTag,
                                 g_->kind_comm[kAllToAll], &w->reqs.back()));
      });
    }
    for (int k = 1; k < n; ++k) {
      const int p = (me + k) % n;
      for_chunks(plan.send_count[size_t(p)], max_chunk, [&](int64_t off, int len) {
        w->reqs.emplace_back();
        LOOM_MPI_CHECK(MPI_Isend(src + (plan.send_off[size_t(p)] + off) * int64_t(esz), len, type, p, kAllToAllTag,
                                 g_->kind_comm[kAllToAll], &w->reqs.back()));
      });
    }
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

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(std::shared_ptr<Group> g) {
  return std::make_unique<MpiCommunicator>(std::move(g));
}

}  // namespace mpi_detail

using namespace mpi_detail;

void set_mpi_max_message_elements(int64_t n) {
  LOOM_CHECK(n >= 0, "[set_mpi_max_message_elements] n must be >= 0, got ", n);
  g_max_message_elements.store(n, std::memory_order_relaxed);
}

}  // namespace loom

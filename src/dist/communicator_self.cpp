// The single-process communicator: reductions over one rank are the identity; gathers, scatters and
// all-to-alls are a copy (host tensors). It moves no data between processes, so it records nothing in
// comm_stats().
#include <cstring>

#include "dist/dist_util.h"
#include "loom/dist/communicator.h"

namespace loom {

namespace {

class DoneWork final : public Work {
 public:
  void wait() override {}
  bool done() override { return true; }
};

class SelfCommunicator final : public Communicator {
 public:
  SelfCommunicator(std::string name, int global_rank) : name_(std::move(name)), global_rank_(global_rank) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return name_; }
  std::vector<int> global_ranks() const override { return {global_rank_}; }
  void all_reduce(TensorView, ReduceOp) const override {}
  double all_reduce_scalar(double v, ReduceOp) const override { return v; }
  void broadcast(TensorView, int root) const override {
    LOOM_CHECK(root == 0, "[broadcast] root ", root, " out of range for the single-rank group ", name_);
  }
  void all_gather(TensorView out, TensorView inp) const override { copy(out, inp, "all_gather"); }
  void reduce_scatter(TensorView out, TensorView inp) const override { copy(out, inp, "reduce_scatter"); }
  void barrier() const override {}
  // Checked like every backend's (counts, shapes, no overlap); the one run of rows is this rank's own.
  void all_to_all_v(TensorView out, const std::vector<int64_t>& out_counts, TensorView inp,
                    const std::vector<int64_t>& in_counts) const override {
    dist::plan_all_to_all(name_, 1, out, out_counts, inp, in_counts);
    LOOM_CHECK(out_counts[0] == in_counts[0], "[all_to_all_v] on the single-rank group ", name_, ": out_counts[0] = ",
               out_counts[0], " must equal in_counts[0] = ", in_counts[0], " (this rank receives what it sends)");
    copy(out, inp, "all_to_all_v");
  }
  std::unique_ptr<Work> all_to_all_v_async(TensorView out, const std::vector<int64_t>& out_counts, TensorView inp,
                                           const std::vector<int64_t>& in_counts) const override {
    all_to_all_v(out, out_counts, inp, in_counts);
    return std::make_unique<DoneWork>();
  }
  void send(TensorView, int peer) const override { no_peer("send", peer); }
  void recv(TensorView, int peer) const override { no_peer("recv", peer); }
  std::unique_ptr<Work> all_reduce_async(TensorView, ReduceOp) const override { return std::make_unique<DoneWork>(); }
  std::unique_ptr<Work> all_gather_async(TensorView out, TensorView inp) const override {
    all_gather(out, inp);
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<Work> reduce_scatter_async(TensorView out, TensorView inp) const override {
    reduce_scatter(out, inp);
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<Work> send_async(TensorView, int peer) const override { no_peer("send", peer); }
  std::unique_ptr<Work> recv_async(TensorView, int peer) const override { no_peer("recv", peer); }
  std::unique_ptr<Communicator> split(int color, int, std::string name) const override {
    if (color < 0) return nullptr;
    return std::make_unique<SelfCommunicator>(std::move(name), global_rank_);
  }

 private:
  [[noreturn]] void no_peer(const char* what, int peer) const {
    LOOM_CHECK(false, "[", what, "] peer ", peer, " does not exist in the single-rank group ", name_);
    throw;  // unreachable
  }
  void copy(TensorView out, TensorView inp, const char* what) const {
    LOOM_CHECK(out.numel() == inp.numel() && out.dtype() == inp.dtype(), "[", what, "] on group ", name_,
               ": out ", out.desc(), " vs inp ", inp.desc());
    LOOM_CHECK(out.device().is_cpu(), "[", what, "] self communicator copies host tensors only");
    if (out.raw() != inp.raw() && out.nbytes()) std::memcpy(out.raw(), inp.raw(), size_t(out.nbytes()));
  }
  std::string name_;
  int global_rank_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator(std::string name, int global_rank) {
  return std::make_unique<SelfCommunicator>(std::move(name), global_rank);
}

}  // namespace loom

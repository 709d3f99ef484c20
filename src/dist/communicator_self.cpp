// The single-process communicator: reductions over one rank are the identity.
#include <cstring>

#include "loom/dist/communicator.h"

namespace loom {

namespace {

class SelfCommunicator final : public Communicator {
 public:
  explicit SelfCommunicator(std::string name) : name_(std::move(name)) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return name_; }
  void all_reduce(TensorView, ReduceOp) const override {}
  double all_reduce_scalar(double v, ReduceOp) const override { return v; }
  void broadcast(TensorView, int root) const override {
    LOOM_CHECK(root == 0, "[broadcast] root ", root, " out of range for the single-rank group ", name_);
  }
  void all_gather(TensorView out, TensorView inp) const override { copy(out, inp, "all_gather"); }
  void reduce_scatter(TensorView out, TensorView inp) const override { copy(out, inp, "reduce_scatter"); }
  void barrier() const override {}

 private:
  void copy(TensorView out, TensorView inp, const char* what) const {
    LOOM_CHECK(out.numel() == inp.numel() && out.dtype() == inp.dtype(), "[", what, "] on group ", name_,
               ": out ", out.desc(), " vs inp ", inp.desc());
    LOOM_CHECK(out.device().is_cpu(), "[", what, "] self communicator copies host tensors only");
    if (out.raw() != inp.raw() && out.nbytes()) std::memcpy(out.raw(), inp.raw(), size_t(out.nbytes()));
  }
  std::string name_;
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator(std::string name) {
  return std::make_unique<SelfCommunicator>(std::move(name));
}

}  // namespace loom

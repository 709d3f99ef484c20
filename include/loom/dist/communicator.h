// Communicator: collectives over one process group. Implementations: self (one process, the only one
// in this build stage), MPI and NCCL (the distributed-training issue). Collectives take tensors and work
// out counts themselves; in-place where the signature has a single tensor.
#pragma once
#include <memory>
#include <string>

#include "loom/core/tensor.h"

namespace loom {

enum class ReduceOp { kSum, kMax, kMin };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // the group's name in error messages, e.g. "data-parallel"

  virtual void all_reduce(TensorView x, ReduceOp op = ReduceOp::kSum) const = 0;
  // Reduces a host scalar (used for loss sums, norms and overflow flags).
  virtual double all_reduce_scalar(double v, ReduceOp op = ReduceOp::kSum) const = 0;
  virtual void broadcast(TensorView x, int root) const = 0;
  // out (n) = concatenation over ranks of inp (n / size).
  virtual void all_gather(TensorView out, TensorView inp) const = 0;
  // out (n / size) = this rank's slice of the sum over ranks of inp (n).
  virtual void reduce_scatter(TensorView out, TensorView inp) const = 0;
  virtual void barrier() const = 0;
};

// The single-process group: every collective is the identity (a copy where out and inp differ).
std::unique_ptr<Communicator> make_self_communicator(std::string name);

}  // namespace loom

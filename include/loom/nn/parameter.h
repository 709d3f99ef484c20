// Parameters and the contiguous buffers that hold them.
// Modules declare their parameters (name, shape, init, weight-decay flag, TP partition dim) into a
// ParameterSet while they are built; allocate() then places every value in one contiguous buffer and every
// gradient in a second one with the same offsets, so the optimizer, the gradient norm and (later) the
// data-parallel buckets work on flat buffers and never see modules.
#pragma once
#include <deque>
#include <string>
#include <vector>

#include "loom/backend/device_context.h"
#include "loom/core/tensor.h"

namespace loom {

enum class InitKind { kNormal, kZeros, kOnes };

struct Parameter {
  std::string name;            // Megatron-style, e.g. decoder.layers.3.self_attention.linear_qkv.weight
  Shape shape;
  InitKind init = InitKind::kNormal;
  float init_std = 0.02f;      // for kNormal
  bool no_weight_decay = false;  // biases and norm parameters
  int partition_dim = -1;      // dim split across tensor-parallel ranks (-1: replicated)
  int64_t offset = 0;          // element offset in the contiguous buffers (set by allocate)
  Tensor value;                // view into ParameterSet::values()
  Tensor grad;                 // view into ParameterSet::grads()
};

class ParameterSet {
 public:
  Parameter& add(std::string name, Shape shape, InitKind init, float init_std, bool no_weight_decay,
                 int partition_dim = -1);
  // Lays out values and gradients contiguously in declaration order (gradients zeroed).
  void allocate(const DeviceContext& ctx);
  // Fills every value from its init rule. Normal values come from Philox with the stream keyed by the
  // parameter's name and the index of the element, so a value never depends on declaration order,
  // thread count or (later) how the tensor is sharded.
  void initialize(uint64_t seed);

  Parameter* find(const std::string& name);
  const std::deque<Parameter>& all() const { return params_; }
  std::deque<Parameter>& all() { return params_; }
  int64_t numel() const { return numel_; }
  const Tensor& values() const { return values_; }
  const Tensor& grads() const { return grads_; }
  void zero_grads(const DeviceContext& ctx) const;

 private:
  std::deque<Parameter> params_;  // deque: references stay valid while modules add parameters
  int64_t numel_ = 0;
  Tensor values_, grads_;
};

}  // namespace loom

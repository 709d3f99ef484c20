// Parameters and the contiguous buffers that hold them.
// Modules declare their parameters (name, shape, init, weight-decay flag, TP partition dim) into a
// ParameterSet while they are built; allocate() then places every parameter in contiguous buffers with
// the same element offsets, so the optimizer, the gradient norm and (later) the data-parallel buckets work
// on flat buffers and never see modules:
//   values()         f32 master weights (what the optimizer updates and checkpoints hold);
//   compute_values() the copy the forward/backward ops read, in the compute dtype (--bf16/--fp16). For f32
//                    it IS values() (same storage, no copy); otherwise sync_compute() refreshes it from the
//                    master weights (round to nearest even), which the owner calls after every write to
//                    values() — optimizer step, checkpoint load, golden fixture load;
//   grads()          gradients in the grad dtype: f32 main grads (Megatron's default, also for --bf16) or
//                    f16 (--fp16 without --accumulate-allreduce-grads-in-fp32). Backward accumulates.
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
  Tensor value;                // f32 master, view into ParameterSet::values()
  Tensor compute;              // view into ParameterSet::compute_values(); modules read this one
  Tensor grad;                 // view into ParameterSet::grads(), grad dtype
};

class ParameterSet {
 public:
  Parameter& add(std::string name, Shape shape, InitKind init, float init_std, bool no_weight_decay,
                 int partition_dim = -1);
  // Lays out master values, the compute copy and gradients contiguously in declaration order (gradients
  // zeroed). compute_dtype: f32, bf16 or f16; grad_dtype: f32 or compute_dtype. with_grads = false
  // (inference) allocates no gradient buffer: grads() and every Parameter::grad stay undefined.
  void allocate(const DeviceContext& ctx, DType compute_dtype = DType::kF32, DType grad_dtype = DType::kF32,
                bool with_grads = true);
  // Fills every master value from its init rule and syncs the compute copy. Normal values come from
  // Philox with the stream keyed by the parameter's name and the index of the element, so a value never
  // depends on declaration order, thread count or (later) how the tensor is sharded.
  void initialize(uint64_t seed);
  // compute_values() = cast(values()) with round to nearest even; nothing to do when the compute dtype is f32.
  void sync_compute(const DeviceContext& ctx) const;

  Parameter* find(const std::string& name);  // null when there is no such parameter
  const Parameter* find(const std::string& name) const;
  const std::deque<Parameter>& all() const { return params_; }
  std::deque<Parameter>& all() { return params_; }
  int64_t numel() const { return numel_; }
  DType compute_dtype() const { return compute_.dtype(); }
  DType grad_dtype() const { return grads_.dtype(); }
  const Tensor& values() const { return values_; }
  const Tensor& compute_values() const { return compute_; }
  const Tensor& grads() const { return grads_; }
  void zero_grads(const DeviceContext& ctx) const;

 private:
  std::deque<Parameter> params_;  // deque: references stay valid while modules add parameters
  int64_t numel_ = 0;
  const DeviceContext* ctx_ = nullptr;  // the context of allocate(), for initialize()'s sync
  Tensor values_, compute_, grads_;
};

}  // namespace loom

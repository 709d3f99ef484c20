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
//                    f16 (--fp16 without --accumulate-allreduce-grads-in-fp32). Backward accumulates,
//                    except that a matmul may store the step's first write of a weight gradient whose
//                    buffer is known to hold zeros (Parameter::grad_zero, take_grad_write) instead of
//                    adding it, which saves reading the buffer.
#pragma once
#include <deque>
#include <unordered_map>
#include <functional>
#include <string>
#include <vector>

#include "loom/backend/device_context.h"
#include "loom/backend/ops.h"
#include "loom/core/tensor.h"

namespace loom {

// kNormal: N(0, init_std²); kUniform: U(-init_std, init_std) (init_std is the bound: PyTorch's
// kaiming_uniform_(a=sqrt(5)) of LoRA's A is U(-1/sqrt(fan_in), 1/sqrt(fan_in))).
enum class InitKind { kNormal, kZeros, kOnes, kUniform };

// A run of indices [start, start + size) of the global tensor along its partition dim.
struct ShardRange {
  int64_t start = 0;
  int64_t size = 0;
};

struct Parameter {
  std::string name;            // Megatron-style, e.g. decoder.layers.3.self_attention.linear_qkv.weight
  Shape shape;
  InitKind init = InitKind::kNormal;
  float init_std = 0.02f;      // kNormal: the std; kUniform: the bound
  bool no_weight_decay = false;  // biases and norm parameters
  int partition_dim = -1;      // dim split across tensor-parallel ranks (-1: replicated)
  // The full (unsharded) tensor's shape; equals `shape` when this rank holds all of it.
  Shape global_shape;
  // With partition_dim >= 0: the global indices along partition_dim this rank holds, concatenated in
  // order (one range for a column/row-parallel weight; two for a gated fc1, its gate and its up rows).
  // Empty: the whole tensor. Initialisation and checkpoints use it to address global elements.
  std::vector<ShardRange> shard;
  // --sequence-parallel: a replicated parameter used on this rank's sequence shard only (norms, the
  // row-parallel biases), so its gradient is partial and is summed over the TP group before the optimizer.
  bool sequence_parallel = false;
  // The last pipeline stage's copy of the tied word embedding (PP > 1): initialised like the first
  // stage's, its gradient summed with it over the embedding group; the first stage's copy is the one that
  // checkpoints save and gradient norms count.
  bool tied_embedding_copy = false;
  // The word embedding shared with the output layer (a tied model, the default): set on the first
  // stage's embedding and on the last stage's copy alike, so the optimizer finds the pair whose gradients
  // it sums over the embedding group by this flag, never by name.
  bool tied_embedding = false;
  // A mixture-of-experts expert's weight (decoder.layers.N.mlp.experts.linear_fc1.weight<e>, e the GLOBAL
  // expert index): split over the expert-parallel (EP) group (each EP rank holds its own experts), its
  // partition_dim / shard over the expert-tensor-parallel (ETP) group instead of TP, and replicated over
  // expert_dp only. The optimizer reduces its gradient over expert_dp (never dp_cp, no TP/SP sums); the
  // checkpoint is saved by expert_dp rank 0 (and etp rank 0 when unsharded). See ParallelState's grid.
  bool expert = false;
  int64_t offset = 0;          // element offset in the contiguous buffers (set by allocate)
  Tensor value;                // f32 master, view into ParameterSet::values()
  Tensor compute;              // view into ParameterSet::compute_values(); modules read this one
  Tensor grad;                 // view into ParameterSet::grads(), grad dtype
  // The gradient buffer is known to hold zeros, so its first writer may store instead of add
  // (GradWrite::kOverwrite: the buffer is not read, and over few rows that read is much of a weight
  // gradient's cost). Set for every parameter the optimizer trains at the start of each step
  // (DistributedOptimizer::start_step, where every gradient the model will write has been zeroed);
  // cleared by the first write: take_grad_write for the matmuls, clear_grad_zero for any other writer
  // that may come before a matmul on the same gradient (the embedding of a tied output layer). Stays false
  // outside the trainer's steps (every op then accumulates, as it always may).
  bool grad_zero = false;
};

// How the next write of p's gradient goes: kOverwrite when p.grad_zero is set, which it clears, else
// kAccumulate (also when p has no gradient bound: nothing is written, the mark stays). With
// LOOM_CHECK_GRAD_OVERWRITE=1 in the environment (loom/core/env.h's rule) a kOverwrite first checks that the
// buffer holds zeros and fails otherwise (reads the buffer: a debugging aid that tests turn on to catch a
// writer that added to the gradient before a matmul and did not clear the flag).
GradWrite take_grad_write(const DeviceContext& ctx, Parameter& p);
// The same for parameters one op writes together (a grouped GEMM's experts): kOverwrite only when every
// one of them holds zeros; every flag is cleared.
GradWrite take_grad_write(const DeviceContext& ctx, const std::vector<Parameter*>& ps);
// Marks p's gradient as written (for writers that always accumulate).
inline void clear_grad_zero(Parameter& p) { p.grad_zero = false; }
// Whether LOOM_CHECK_GRAD_OVERWRITE checks run (read once from the environment; tests may switch them).
bool grad_overwrite_checks();
void set_grad_overwrite_checks(bool on);

// Called by the model around its units of work so that data-parallel / ZeRO code can overlap
// communication with compute and gather sharded parameters just in time. Unit u is a contiguous range of
// the flat parameter buffer: the model's units() lists them (embedding, each layer, the head) in forward
// order; backward visits them in reverse.
class ParamHooks {
 public:
  virtual ~ParamHooks() = default;
  virtual void before_forward(int unit) {}
  virtual void after_forward(int unit) {}
  virtual void before_backward(int unit) {}
  // The unit's parameter gradients for this micro-batch are complete.
  virtual void after_backward(int unit) {}
};

// A unit's parameters: elements [offset, offset + numel) of the flat buffers.
struct ParamUnit {
  std::string name;  // "embedding", "decoder.layers.3", "head" (final norm + output layer)
  int64_t offset = 0, numel = 0;
  // Other units (indices) whose parameters this unit's forward and backward also read and whose
  // gradients its backward also writes: the head of a model with a tied word embedding reads the
  // embedding unit's weight. The hooks of this unit then cover them too.
  std::vector<int> reads;
  // Every parameter of the unit is an expert's (Parameter::expert): an MoE layer's experts,
  // "decoder.layers.N.mlp.experts", listed in the reads of their layer unit "decoder.layers.N" so that the
  // layer's hooks cover them. Data-parallel buckets never mix expert and dense units (different groups).
  bool expert = false;
};

// How allocate() backs the parameters (the data-parallel sharding strategy decides; see
// loom/optim/distributed_optimizer.h):
//   kFull               contiguous master values, compute copy and gradients (one process, DDP);
//   kShardedMaster      ZeRO-1: compute copy and gradients only. With f32 compute the compute copy IS the
//                       f32 values (values() is defined; the optimizer updates its range of it); with
//                       bf16/f16 there are no full f32 values (values(), Parameter::value undefined): the
//                       optimizer keeps the master shard and writes the compute copy;
//   kShardedMasterGrads ZeRO-2: as kShardedMaster without a gradient buffer: the optimizer binds
//                       Parameter::grad to a bucket buffer while the bucket's backward runs;
//   kExternal           ZeRO-3: only the layout (offsets) exists; Parameter::value/compute/grad stay
//                       undefined until their owner binds them to gathered buffers around each use.
//   kFrozen             a frozen set (the base model of a LoRA run): the compute copy only, no gradients.
//                       With f32 compute it IS the f32 values; with bf16/f16 there are no f32 values at all
//                       (2 bytes per parameter): initialize() and write_value() round into the compute copy.
enum class ParamStorage { kFull, kShardedMaster, kShardedMasterGrads, kExternal, kFrozen };

class ParameterSet {
 public:
  Parameter& add(std::string name, Shape shape, InitKind init, float init_std, bool no_weight_decay,
                 int partition_dim = -1);
  // A tensor-parallel shard: this rank holds the `shard` ranges of `global_shape` along partition_dim
  // (local shape = global shape with that dim = sum of the range sizes).
  Parameter& add_sharded(std::string name, Shape global_shape, int partition_dim, std::vector<ShardRange> shard,
                         InitKind init, float init_std, bool no_weight_decay);
  // Lays out master values, the compute copy and gradients contiguously in declaration order (gradients
  // zeroed). compute_dtype: f32, bf16 or f16; grad_dtype: f32 or compute_dtype. with_grads = false
  // (inference) allocates no gradient buffer: grads() and every Parameter::grad stay undefined.
  void allocate(const DeviceContext& ctx, DType compute_dtype = DType::kF32, DType grad_dtype = DType::kF32,
                bool with_grads = true, ParamStorage storage = ParamStorage::kFull);
  ParamStorage storage() const { return storage_; }
  // Fills every master value from its init rule and syncs the compute copy. Normal values come from
  // Philox with the stream keyed by the parameter's name and the element's index in the GLOBAL tensor,
  // so a value never depends on declaration order, thread count or how the tensor is sharded (TP = 1 and
  // TP = 4 build the same full model).
  void initialize(uint64_t seed);
  // The values initialize() gives to flat elements [begin, end) of the layout, written to out[0, end -
  // begin) (host f32). Needs only the layout, so ZeRO-3 (kExternal) initialises its master shard with it.
  void initialize_range(uint64_t seed, int64_t begin, int64_t end, float* out) const;
  // compute_values() = cast(values()) with round to nearest even; nothing to do when the compute dtype is f32
  // or the set has no f32 values (kFrozen in 16 bits).
  void sync_compute(const DeviceContext& ctx) const;
  // Sets p's value from `src` (f32 (p.shape), host or this set's device): its master value, or without one
  // (kFrozen in 16 bits) its compute copy, rounded to nearest even. Masters need sync_compute() after.
  void write_value(Parameter& p, TensorView src) const;

  Parameter* find(const std::string& name);  // null when there is no such parameter
  const Parameter* find(const std::string& name) const;
  const std::deque<Parameter>& all() const { return params_; }
  std::deque<Parameter>& all() { return params_; }
  int64_t numel() const { return numel_; }
  // The dtypes allocate() was given (also with kExternal storage, where the buffers do not exist);
  // grad_dtype() is f32 for a set without gradients.
  DType compute_dtype() const { return compute_dtype_; }
  DType grad_dtype() const { return grad_dtype_; }
  const Tensor& values() const { return values_; }
  const Tensor& compute_values() const { return compute_; }
  const Tensor& grads() const { return grads_; }
  void zero_grads(const DeviceContext& ctx) const;
  // Sets every parameter's grad_zero: the caller has made sure that every gradient buffer holds zeros
  // (or will be bound to zeros before it is written) until the next write.
  void mark_grads_zero();

 private:
  std::deque<Parameter> params_;  // deque: references stay valid while modules add parameters
  // name -> index in params_, so declaring a model is O(parameters), not O(parameters^2).
  std::unordered_map<std::string, size_t> index_;
  int64_t numel_ = 0;
  const DeviceContext* ctx_ = nullptr;  // the context of allocate(), for initialize()'s sync
  ParamStorage storage_ = ParamStorage::kFull;
  DType compute_dtype_ = DType::kF32, grad_dtype_ = DType::kF32;
  bool allocated_ = false;
  Tensor values_, compute_, grads_;
};

}  // namespace loom

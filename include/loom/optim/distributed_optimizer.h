// Data parallelism and ZeRO over the flat parameter buffers of this rank's model chunks (Megatron's
// DistributedDataParallel + DistributedOptimizer, Megatron-FSDP's sharding strategies):
//   kNone              plain DDP: gradients all-reduced (averaged) over the dp_cp group in buckets;
//                      every rank keeps full FP32 masters and Adam state
//   kOptim             ZeRO-1 (--use-distributed-optimizer): the padded flat buffer is split in DP equal
//                      ranges; a rank keeps FP32 masters and Adam state for its range only; gradients are
//                      reduce-scattered, the updated range all-gathered into every rank's parameters
//   kOptimGrads        ZeRO-2: as ZeRO-1, and only the gradient shard outlives a bucket's reduction
//   kOptimGradsParams  ZeRO-3 / FSDP: parameters too are sharded; a unit's parameters are all-gathered
//                      just before its forward/backward (ParamHooks) and released after
// Buckets (--ddp-bucket-size elements) are runs of whole units in backward order; with
// --overlap-grad-reduce a bucket's reduction starts as soon as its last unit's backward is done
// (asynchronously) and finish_grad_sync() waits for all of them. ZeRO-2/3 reduce every micro-batch's
// gradients as soon as the bucket is complete (that is what lets the full-size buffer go), keeping at most
// two bucket buffers alive (one being written, one in flight).
// --overlap-param-gather: ZeRO-1/2 launch the all-gathers of updated parameters bucket by bucket at the
// end of step() and each unit's forward waits for its own bucket only; ZeRO-3 prefetches the next unit's
// parameters (forward order in forward, reverse in backward) while the current one computes.
// Sequence-parallel parameters' gradients are summed over TP, the tied word embedding's over the
// embedding group, before the data-parallel reduction. The embedding-group sum (PP > 1 with a tied
// embedding, detected from Parameter::tied_embedding_copy on the last stage) runs in finish_grad_sync,
// never inside a backward hook: the first and last stage reach their embedding backward at different
// times of a pipeline schedule, so a blocking sum inside the hook would deadlock them. A tied output
// layer in the same chunk as the embedding (ParamUnit::reads) keeps the embedding's gathered parameters
// (ZeRO-3) and gradient bucket (ZeRO-2/3) bound while the head runs.
//
// Mixture-of-experts (Parameter::expert, ParamUnit::expert; Megatron-Core's expert-parallel buffers):
// expert units get buckets of their own, never shared with dense units. An expert bucket skips the TP/SP
// sums, is reduced (DDP), reduce-scattered and all-gathered (ZeRO-1/2/3) over expert_dp instead of dp_cp,
// with the same 1/(DP·CP) pre-scale as dense ones (an expert's gradient already sums the tokens that every
// EP peer routed to it). Norms, zero counts and state statistics count each element once in the world:
// expert pieces are replicated over expert_dp (and over ETP when unsharded along a partition dim). An
// expert unit listed in another unit's reads (a MoE layer's "decoder.layers.N.mlp.experts" in the reads of
// "decoder.layers.N") has no hooks of its own: its reader's hooks gather, bind and complete it.
//
// Sharding is per bucket (as Megatron's DistributedOptimizer): a bucket of L elements is padded to a
// multiple of DP and rank r owns its r-th 1/DP slice, so each bucket is one reduce-scatter/all-gather
// with contiguous pieces (DP, r: the bucket's group, dp_cp or expert_dp). ZeRO-3 uses one bucket per unit (what is gathered together is reduced
// together). Optimizer-owned state is laid out as the concatenation of this rank's bucket slices
// ("shard space", padding included): exp_avg, exp_avg_sq, the f32 gradient shard (ZeRO-2/3) and the f32
// master shard (ZeRO-3, and ZeRO-1/2 with bf16/f16 compute).
//
// Memory per rank, bytes per local parameter (Ψ = local parameters, d = DP·CP (expert parameters:
// expert_dp's size), c = 2 for bf16/f16;
// memory() reports what is allocated, nothing estimated; `loom calc` prints the same formulas):
//   kNone              f32: 4 values + 4 grads + 8 Adam = 16; bf16: 4 + 2 + 4 + 8 = 18
//   kOptim             f32: 4 values (the rank updates its range of them) + 4 grads + 8/d;
//                      bf16: 2 compute copy + 4 grads + (4 master + 8 Adam)/d = 6 + 12/d (Megatron's figure)
//   kOptimGrads        f32: 4 + 12/d; bf16: 2 + 16/d; plus at most two gradient buckets while reducing
//   kOptimGradsParams  f32: 16/d; bf16: 18/d (f32 master, compute copy, f32 grad, Adam: all shards); plus
//                      the gathered parameters and gradients of one or two units at a time
// Memory::buffers_peak measures those transient bucket buffers (and padded communication copies).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/dist/parallel_state.h"
#include "loom/param/parameter.h"
#include "loom/optim/optimizer.h"

namespace loom {

enum class ShardingStrategy { kNone, kOptim, kOptimGrads, kOptimGradsParams };
// --data-parallel-sharding-strategy values: no_shard | optim | optim_grads | optim_grads_params.
ShardingStrategy parse_sharding_strategy(const std::string& s);
const char* sharding_strategy_name(ShardingStrategy s);
const char* zero_stage_name(ShardingStrategy s);  // "no ZeRO", "ZeRO-1", "ZeRO-2", "ZeRO-3"
// The strategy of --use-distributed-optimizer (optim) and --data-parallel-sharding-strategy (wins when
// given); UserError for an unknown strategy or --use-distributed-optimizer with no_shard.
ShardingStrategy resolve_sharding(bool use_distributed_optimizer, const std::string& strategy);

struct DDPConfig {
  ShardingStrategy sharding = ShardingStrategy::kNone;
  int64_t bucket_size = 0;          // --ddp-bucket-size (elements); 0: Megatron's max(40M, 1M · DP)
  bool overlap_grad_reduce = false;   // --overlap-grad-reduce
  bool overlap_param_gather = false;  // --overlap-param-gather (a sharded strategy only)
};

// The ParameterSet storage a strategy needs (GPTModel's ModelOptions::param_storage).
ParamStorage param_storage_for(ShardingStrategy s);

// One parameter's piece of optimizer-owned state on this rank: elements [begin, end) of the parameter's
// (local, TP-sharded) row-major flattening (all of it without ZeRO).
struct StateShard {
  const Parameter* param = nullptr;
  int chunk = 0;
  int64_t begin = 0, end = 0;
  TensorView master;                 // (end - begin) f32
  TensorView exp_avg, exp_avg_sq;    // Adam's moments; undefined for SGD
  TensorView momentum_buffer;        // SGD with momentum; undefined otherwise
  // The optimizer state of this piece under its checkpoint names (PyTorch's state keys): exp_avg and
  // exp_avg_sq (Adam), momentum_buffer (SGD with momentum), nothing for SGD without momentum.
  std::vector<std::pair<const char*, TensorView>> optimizer_state() const {
    std::vector<std::pair<const char*, TensorView>> out;
    if (exp_avg.defined()) out.emplace_back("exp_avg", exp_avg);
    if (exp_avg_sq.defined()) out.emplace_back("exp_avg_sq", exp_avg_sq);
    if (momentum_buffer.defined()) out.emplace_back("momentum_buffer", momentum_buffer);
    return out;
  }
};

// Megatron-DeepSpeed's --log-optimizer-states-to-tensorboard figures over the whole model (every rank gets
// the same values; replicas counted once): L2 and L1 norms and max |x| of the second moment ("variance",
// exp_avg_sq), of its square root, of the first moment ("momentum": exp_avg, or SGD's momentum buffer) and
// of the f32 master weights. has_variance / has_momentum: whether the optimizer keeps that state.
struct OptimizerStateStats {
  bool has_variance = false, has_momentum = false;
  double variance_l2 = 0, variance_sqrt_l2 = 0, momentum_l2 = 0, weight_l2 = 0;
  double variance_l1 = 0, variance_sqrt_l1 = 0, momentum_l1 = 0, weight_l1 = 0;
  double variance_abs_max = 0, variance_sqrt_abs_max = 0, momentum_abs_max = 0, weight_abs_max = 0;
};

class DistributedOptimizer {
 public:
  // chunks: the ParameterSets of this rank's model chunks; units: each chunk's units (forward order),
  // which must tile the chunk's flat buffer (empty: the whole buffer is one unit). kOptimGradsParams needs
  // sets allocated with param_storage_for(ddp.sharding). Collective over the world
  // (it agrees on the tied-embedding layout over the embedding group).
  DistributedOptimizer(const DeviceContext& ctx, std::vector<ParameterSet*> chunks,
                       std::vector<std::vector<ParamUnit>> units, const ParallelState& ps, DDPConfig ddp,
                       OptimizerConfig optim);
  OptimizerKind kind() const;
  ~DistributedOptimizer();

  // Initial parameter values (ParameterSet::initialize's rule): the full f32 values where the sets have
  // them, else this rank's f32 master shard (then gathered into the compute copy).
  void initialize(uint64_t seed);
  ShardingStrategy sharding() const;
  int num_buckets(int chunk) const;
  // Chunk c's buckets in backward (reduction) order.
  struct BucketInfo {
    int64_t begin = 0, end = 0;  // flat range of whole units
    bool expert = false;         // expert units only (else dense units only)
    int group_size = 1;          // the group it is reduced and sharded over: expert_dp or dp_cp
    int64_t padded = 0;          // its length padded to a multiple of group_size (sharded strategies)
  };
  std::vector<BucketInfo> bucket_info(int chunk) const;

  // Before the first micro-batch of a step.
  void start_step();
  // The schedule tells which micro-batch's backward comes next (grads of the last one are final).
  void set_last_microbatch(int chunk, bool last);
  // Completes every gradient reduction of this step; afterwards the gradients this rank owns are the
  // dp_cp-averaged full-batch gradients (expert ones: summed over expert_dp, scaled by 1/(DP·CP)).
  void finish_grad_sync();
  // L2 norm over the whole model (every rank computes the same value), replicas counted once.
  double grad_norm();
  // The same for the master weights (--log-params-norm). Collective over the world.
  double param_norm();
  // --log-optimizer-states-to-tensorboard. Collective over the world.
  OptimizerStateStats state_stats();
  // Zeros in the gradients (Megatron's --log-num-zeros-in-grad), replicas counted once; every rank gets
  // the same count. Collective over the world.
  int64_t num_zeros_in_grad();
  // True when any rank's gradients hold an inf or NaN (fp16 loss scaling).
  bool found_inf();
  // Scales the owned gradients by grad_scale (clip coefficient / loss scale), runs the optimizer (AdamW
  // or SGD) on the owned range, and makes every rank's parameters (values and compute copy) the updated
  // ones.
  void step(float lr, float weight_decay, float grad_scale);
  int64_t num_steps() const;
  void set_num_steps(int64_t n);

  // The optimizer state this rank owns (checkpoints), one entry per (chunk, parameter) piece.
  std::vector<StateShard> state_shards();
  // After the masters in state_shards() were written (checkpoint load): refresh every rank's parameters.
  void sync_params_from_masters();
  // Waits for the parameter all-gathers step() left in flight (--overlap-param-gather); forward hooks
  // wait for their own bucket, so only code that reads parameters outside a forward needs this.
  void finish_param_sync();
  // Bytes this rank holds persistently: parameters (values, compute copy, master shard), gradients
  // (buffer and/or f32 shard), Adam state — loom calc's ZeRO figures; and the peak of the transient
  // bucket buffers (gathered parameters, bucket gradients, padded communication copies) seen so far.
  struct Memory {
    int64_t params = 0, grads = 0, optimizer = 0;
    int64_t buffers_peak = 0;
    int64_t states() const { return params + grads + optimizer; }
  };
  Memory memory() const;

  // The hooks chunk c's model calls (GPTModel::set_hooks): bucket reductions (overlap) and ZeRO-3's
  // just-in-time parameter gathers. Owned by the optimizer.
  ParamHooks* hooks(int chunk);

 private:
  // sync_params_from_masters(); with unsharded_compute_written, the unsharded sets' compute copies are
  // already the masters rounded (step() wrote them during the update) and are not cast again.
  void sync_params(bool unsharded_compute_written);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom

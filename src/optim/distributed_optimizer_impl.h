// Private to the optim layer: DistributedOptimizer's state (chunks, their buckets and the owned pieces
// Adam steps) and the Impl that holds it. Impl's members are defined in three files by concern:
// distributed_optimizer.cpp (bucket/shard layout, lifecycle, memory), distributed_optimizer_reduce.cpp
// (gradient reduction, norms, the Adam step) and distributed_optimizer_gather.cpp (parameter all-gathers,
// ZeRO-3 binding and the per-unit hooks). The invariants are listed at the top of distributed_optimizer.cpp.
#pragma once
#include <cstdint>
#include <deque>
#include <memory>
#include <utility>
#include <vector>

#include "loom/optim/distributed_optimizer.h"

namespace loom {

namespace dist_optim_detail {

inline int64_t bytes(const Tensor& t) { return t.defined() ? t.nbytes() : 0; }

// The piece of one parameter inside one bucket's owned range: Adam, the norm and checkpoints work on it.
struct Piece {
  const Parameter* param = nullptr;
  int64_t flat_begin = 0, flat_end = 0;  // in the chunk's flat buffer
  int64_t shard_off = 0;                 // where flat_begin lives in shard space
  bool weight_decay = true;
  // false for duplicates: dense replicated parameters on tp_rank > 0, the tied embedding's copy, expert
  // replicated parameters on etp_rank > 0.
  bool count_in_norm = true;
  bool expert = false;  // an expert's (Parameter::expert): its norm partials are summed over the expert grid
};

struct Range {
  int64_t begin = 0, numel = 0;  // relative to the bucket's begin
};

struct Bucket {
  int64_t begin = 0, end = 0;     // flat range (whole units)
  int first_unit = 0, last_unit = 0;  // forward-order unit indices, inclusive
  // Expert units only (ParamUnit::expert): reduced, sharded and gathered over expert_dp; otherwise dense
  // units only, over dp_cp. `group` is that communicator ("DP" below means its size).
  bool expert = false;
  const Communicator* group = nullptr;
  int64_t padded = 0;             // end - begin rounded up to a multiple of DP
  int64_t shard = 0;              // padded / DP: each rank's slice
  int64_t own_begin = 0, own_end = 0;  // this rank's slice clipped to the bucket (flat)
  int64_t shard_off = 0;          // offset of this rank's slice in shard space
  std::vector<Range> sp;          // sequence-parallel parameters: summed over TP first
  std::vector<Range> emb;         // tied word embedding: summed over the embedding group first
  bool deferred = false;          // has emb: reduced in finish_grad_sync only
  // Per step.
  int units_done = 0;             // units whose backward finished (launching micro-batches)
  bool reduced = false;           // reduction launched after its last backward write
  std::unique_ptr<Work> work;
  Tensor comm;                    // reduction input kept alive: padded copy or the bucket's gradients
  Tensor out;                     // reduce-scatter output (shard elements, grad dtype)
  Tensor grad_buf;                // ZeRO-2/3: the bucket's gradients while its backward runs (padded)
  // Parameter all-gather in flight (--overlap-param-gather; ZeRO-3 prefetch).
  std::unique_ptr<Work> gather_work;
  Tensor gather_send, gather_recv;
  // ZeRO-3.
  Tensor params_buf;              // gathered compute values (padded elements)
  int param_refs = 0;             // nested uses (forward inside backward for recomputation, tied head)
  bool prefetched = false;        // params_buf gathered ahead of use; holds one reference

  int64_t numel() const { return end - begin; }
  int64_t transient_bytes() const {
    return bytes(comm) + bytes(out) + bytes(grad_buf) + bytes(gather_send) + bytes(gather_recv) + bytes(params_buf);
  }
};

struct Chunk {
  ParameterSet* set = nullptr;
  std::vector<ParamUnit> units;
  std::vector<int> unit_bucket;  // unit -> bucket index
  // An expert unit listed in another unit's reads has no hooks of its own: the reader's hooks gather,
  // bind and complete it (its gradients are final when the reader's backward is). -1: hooked itself.
  std::vector<int> covered_by;
  std::vector<Bucket> buckets;   // backward order
  int64_t shard_numel = 0;       // size of shard space
  Tensor exp_avg, exp_avg_sq;    // (shard_numel) f32: Adam's moments
  Tensor momentum;               // (shard_numel) f32: SGD's momentum buffer (--sgd-momentum > 0)
  Tensor grad_shard;             // (shard_numel) f32; undefined when Adam reads ParameterSet grads
  Tensor master_shard;           // (shard_numel) f32; undefined when the masters are ParameterSet values
  Tensor compute_shard;          // ZeRO-3 with bf16/f16 compute: (shard_numel) compute dtype
  std::vector<Piece> pieces;
  bool last_microbatch = true;
};

}  // namespace dist_optim_detail

struct DistributedOptimizer::Impl {
  using Piece = dist_optim_detail::Piece;
  using Range = dist_optim_detail::Range;
  using Bucket = dist_optim_detail::Bucket;
  using Chunk = dist_optim_detail::Chunk;

  const DeviceContext& ctx;
  const ParallelState& ps;
  DDPConfig ddp;
  OptimizerConfig optim;
  std::vector<Chunk> chunks;
  std::vector<std::unique_ptr<ParamHooks>> hooks;
  int64_t steps = 0;
  bool grads_dirty = false;  // reduced gradients not yet consumed (and zeroed) by step()
  bool tied_embedding = false;
  std::deque<std::pair<int, int>> inflight;  // ZeRO-2/3 overlapped reductions (chunk, bucket), oldest first
  int64_t buffers_peak = 0;

  Impl(const DeviceContext& c, const ParallelState& p, DDPConfig d, OptimizerConfig o)
      : ctx(c), ps(p), ddp(d), optim(o) {}

  bool sharded() const { return ddp.sharding != ShardingStrategy::kNone; }
  bool zero3() const { return ddp.sharding == ShardingStrategy::kOptimGradsParams; }
  // ZeRO-2/3: gradients live in per-bucket buffers and are reduced after every micro-batch.
  bool bucket_grads_only() const {
    return ddp.sharding == ShardingStrategy::kOptimGrads || ddp.sharding == ShardingStrategy::kOptimGradsParams;
  }
  int dp() const { return ps.dp_cp().size(); }
  // The world-wide sum (kSum) or maximum (kMax) of per-rank partials over the pieces counted in norms:
  // `dense` over dense pieces, `expert` over expert pieces (see model_sum).
  double reduce_partials(double dense, double expert, ReduceOp op) const;

  // ---- distributed_optimizer.cpp ----
  void note_buffers();

  // ---- distributed_optimizer_reduce.cpp: small buffer helpers, reductions ----
  void add_into(TensorView dst_f32, TensorView src) const;
  TensorView bucket_grads(Chunk& ch, Bucket& b) const;
  TensorView piece_grad(Chunk& ch, const Piece& p) const;
  TensorView piece_master(Chunk& ch, const Piece& p) const;
  // Without sharding, the piece's slice of its set's 16-bit compute copy, which the optimizer update then
  // refreshes in the same pass (no cast after it); undefined where the compute copy is the f32 values or
  // comes from a gather or the shard.
  TensorView piece_compute(Chunk& ch, const Piece& p) const;
  // Sum over the model of f(view(chunk, piece)) for the pieces counted in norms, replicas once, summed
  // over the ranks that hold distinct pieces. Defined (and only used) in distributed_optimizer_reduce.cpp.
  template <typename View, typename F>
  double model_sum(View view, F f);
  void sum_over(const Communicator& g, TensorView grads, const std::vector<Range>& ranges) const;
  void launch(Chunk& ch, Bucket& b);
  void complete(Chunk& ch, Bucket& b);
  void track_inflight(int c, int bucket);

  // ---- distributed_optimizer_gather.cpp: parameter binding (ZeRO-3), all-gathers, hooks ----
  template <typename F>
  void for_params(Chunk& ch, const Bucket& b, F f);  // defined (and only used) in distributed_optimizer_gather.cpp
  TensorView gather_target(Chunk& ch, const Bucket& b) const;
  void start_param_gather(Chunk& ch, Bucket& b);
  void finish_param_gather(Chunk& ch, Bucket& b);
  void start_unit_gather(Chunk& ch, Bucket& b);
  void bind_params(Chunk& ch, Bucket& b);
  void gather(Chunk& ch, Bucket& b);
  void prefetch(Chunk& ch, Bucket& b);
  void release(Chunk& ch, Bucket& b);
  void drop_prefetches();
  void bind_grads(Chunk& ch, Bucket& b);
  void unbind_grads(Chunk& ch, Bucket& b);
  Bucket& bucket_of(int c, int unit);
  std::vector<Bucket*> buckets_used(int c, int unit);
  // The unit whose hooks run next after `unit` in direction step (+1 forward, -1 backward), skipping
  // covered expert units; -1 when none.
  int next_hooked_unit(int c, int unit, int step) const;
  bool launches_now(const Chunk& ch, const Bucket& b) const;
  void before_forward(int c, int unit);
  void after_forward(int c, int unit);
  void before_backward(int c, int unit);
  void after_backward(int c, int unit);

  // What chunk c's model calls.
  class ChunkHooks : public ParamHooks {
   public:
    ChunkHooks(Impl* impl, int chunk) : impl_(impl), chunk_(chunk) {}
    void before_forward(int unit) override { impl_->before_forward(chunk_, unit); }
    void after_forward(int unit) override { impl_->after_forward(chunk_, unit); }
    void before_backward(int unit) override { impl_->before_backward(chunk_, unit); }
    void after_backward(int unit) override { impl_->after_backward(chunk_, unit); }

   private:
    Impl* impl_;
    int chunk_;
  };
};

}  // namespace loom

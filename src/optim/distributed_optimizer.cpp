// DistributedOptimizer: data-parallel gradient reduction in buckets and ZeRO-1/2/3 sharding over the
// flat parameter buffers (see the header for the strategies, the per-bucket sharding and memory).
// Invariants:
//   - after step() every gradient buffer this class reads (ParameterSet grads, the f32 gradient shard) is
//     zero, so the next step's micro-batches accumulate from zero; start_step() re-zeroes them only when
//     the previous step was skipped (fp16 overflow) after its gradients were reduced;
//   - a bucket's reduction is in flight between launch() and complete(); its input buffers (ParameterSet
//     grads or a padded copy, ZeRO-3's unit gradient buffer) and its output are untouched meanwhile; the
//     hooks complete it before the next micro-batch's backward writes into the same bucket;
//   - gradients are pre-scaled by 1/DP before the sum (Megatron's gradient_scaling_factor), which keeps
//     fp16 gradients in range.
#include "loom/optim/distributed_optimizer.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <utility>

namespace loom {

ShardingStrategy parse_sharding_strategy(const std::string& s) {
  if (s == "no_shard") return ShardingStrategy::kNone;
  if (s == "optim") return ShardingStrategy::kOptim;
  if (s == "optim_grads") return ShardingStrategy::kOptimGrads;
  if (s == "optim_grads_params") return ShardingStrategy::kOptimGradsParams;
  user_error("--data-parallel-sharding-strategy must be no_shard, optim, optim_grads or optim_grads_params, got '", s,
             "'");
}

const char* sharding_strategy_name(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kNone: return "no_shard";
    case ShardingStrategy::kOptim: return "optim";
    case ShardingStrategy::kOptimGrads: return "optim_grads";
    case ShardingStrategy::kOptimGradsParams: return "optim_grads_params";
  }
  return "?";
}

const char* zero_stage_name(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kNone: return "no ZeRO";
    case ShardingStrategy::kOptim: return "ZeRO-1";
    case ShardingStrategy::kOptimGrads: return "ZeRO-2";
    case ShardingStrategy::kOptimGradsParams: return "ZeRO-3";
  }
  return "?";
}

ShardingStrategy resolve_sharding(bool use_distributed_optimizer, const std::string& strategy) {
  if (strategy.empty()) return use_distributed_optimizer ? ShardingStrategy::kOptim : ShardingStrategy::kNone;
  const ShardingStrategy s = parse_sharding_strategy(strategy);
  if (use_distributed_optimizer && s == ShardingStrategy::kNone)
    user_error("--use-distributed-optimizer contradicts --data-parallel-sharding-strategy no_shard");
  return s;
}

ParamStorage param_storage_for(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kNone: return ParamStorage::kFull;
    case ShardingStrategy::kOptim: return ParamStorage::kShardedMaster;
    case ShardingStrategy::kOptimGrads: return ParamStorage::kShardedMasterGrads;
    case ShardingStrategy::kOptimGradsParams: return ParamStorage::kExternal;
  }
  return ParamStorage::kFull;
}

namespace {


int64_t bytes(const Tensor& t) { return t.defined() ? t.nbytes() : 0; }

// The piece of one parameter inside one bucket's owned range: Adam, the norm and checkpoints work on it.
struct Piece {
  const Parameter* param = nullptr;
  int64_t flat_begin = 0, flat_end = 0;  // in the chunk's flat buffer
  int64_t shard_off = 0;                 // where flat_begin lives in shard space
  bool weight_decay = true;
  bool count_in_norm = true;  // false for TP duplicates (tp_rank > 0) and the tied embedding's copy
};

struct Range {
  int64_t begin = 0, numel = 0;  // relative to the bucket's begin
};

struct Bucket {
  int64_t begin = 0, end = 0;     // flat range (whole units)
  int first_unit = 0, last_unit = 0;  // forward-order unit indices, inclusive
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
  std::vector<Bucket> buckets;   // backward order
  int64_t shard_numel = 0;       // size of shard space
  Tensor exp_avg, exp_avg_sq;    // (shard_numel) f32
  Tensor grad_shard;             // (shard_numel) f32; undefined when Adam reads ParameterSet grads
  Tensor master_shard;           // (shard_numel) f32; undefined when the masters are ParameterSet values
  Tensor compute_shard;          // ZeRO-3 with bf16/f16 compute: (shard_numel) compute dtype
  std::vector<Piece> pieces;
  bool last_microbatch = true;
};

}  // namespace

struct DistributedOptimizer::Impl {
  const DeviceContext& ctx;
  const ParallelState& ps;
  DDPConfig ddp;
  AdamWConfig adam;
  std::vector<Chunk> chunks;
  std::vector<std::unique_ptr<ParamHooks>> hooks;
  int64_t steps = 0;
  bool grads_dirty = false;  // reduced gradients not yet consumed (and zeroed) by step()
  bool tied_embedding = false;
  std::deque<std::pair<int, int>> inflight;  // ZeRO-2/3 overlapped reductions (chunk, bucket), oldest first
  int64_t buffers_peak = 0;

  Impl(const DeviceContext& c, const ParallelState& p, DDPConfig d, AdamWConfig a)
      : ctx(c), ps(p), ddp(d), adam(a) {}

  bool sharded() const { return ddp.sharding != ShardingStrategy::kNone; }
  bool zero3() const { return ddp.sharding == ShardingStrategy::kOptimGradsParams; }
  // ZeRO-2/3: gradients live in per-bucket buffers and are reduced after every micro-batch.
  bool bucket_grads_only() const {
    return ddp.sharding == ShardingStrategy::kOptimGrads || ddp.sharding == ShardingStrategy::kOptimGradsParams;
  }
  int dp() const { return ps.dp_cp().size(); }

  void note_buffers() {
    int64_t live = 0;
    for (const Chunk& ch : chunks)
      for (const Bucket& b : ch.buckets) live += b.transient_bytes();
    buffers_peak = std::max(buffers_peak, live);
  }

  // ---- small buffer helpers ----
  void add_into(TensorView dst_f32, TensorView src) const {
    if (src.dtype() == DType::kF32) {
      ctx.ops().residual_forward(dst_f32, dst_f32, src);
      return;
    }
    Tensor tmp = ctx.empty(src.shape(), DType::kF32);
    ctx.ops().cast(tmp, src);
    ctx.ops().residual_forward(dst_f32, dst_f32, tmp);
  }

  // The bucket's gradients as the model writes them: ParameterSet grads, or the bucket buffer.
  TensorView bucket_grads(Chunk& ch, Bucket& b) const {
    if (bucket_grads_only()) return b.grad_buf.view().slice_flat(0, Shape{b.numel()});
    return ch.set->grads().view().slice_flat(b.begin, Shape{b.numel()});
  }

  TensorView piece_grad(Chunk& ch, const Piece& p) const {
    const Shape s{p.flat_end - p.flat_begin};
    if (!ch.grad_shard.defined()) return ch.set->grads().view().slice_flat(p.flat_begin, s);
    return ch.grad_shard.view().slice_flat(p.shard_off, s);
  }
  TensorView piece_master(Chunk& ch, const Piece& p) const {
    const Shape s{p.flat_end - p.flat_begin};
    if (ch.master_shard.defined()) return ch.master_shard.view().slice_flat(p.shard_off, s);
    return ch.set->values().view().slice_flat(p.flat_begin, s);
  }

  // L2 norm over the whole model of what view(chunk, piece) gives for every owned piece, replicas (TP
  // duplicates, the tied embedding's copy) counted once. ZeRO shards are disjoint across dp_cp, so the
  // whole world holds each element once; without sharding every DP replica has all of it.
  template <typename View>
  double model_norm(View view) {
    double local = 0.0;
    for (Chunk& ch : chunks) {
      // Without sharding, a chunk whose pieces all count tiles its whole flat buffer: one reduction over
      // it (one device read-back instead of one per parameter; a world of one sums as plain AdamW would).
      const bool all_count = std::all_of(ch.pieces.begin(), ch.pieces.end(), [](const Piece& p) { return p.count_in_norm; });
      if (!sharded() && all_count) {
        Piece whole;
        whole.flat_end = ch.set->numel();
        if (whole.flat_end > 0) local += ctx.ops().sum_squares(view(ch, whole));
        continue;
      }
      for (const Piece& p : ch.pieces)
        if (p.count_in_norm) local += ctx.ops().sum_squares(view(ch, p));
    }
    const Communicator& group = sharded() ? ps.world() : ps.mp();
    return std::sqrt(group.all_reduce_scalar(local, ReduceOp::kSum));
  }

  // ---- reductions ----
  void sum_over(const Communicator& g, TensorView grads, const std::vector<Range>& ranges) const {
    if (g.size() == 1) return;
    for (const Range& r : ranges) g.all_reduce(grads.slice_flat(r.begin, Shape{r.numel}), ReduceOp::kSum);
  }

  // Starts bucket b's data-parallel reduction (after its TP sums; the embedding sum is the caller's).
  void launch(Chunk& ch, Bucket& b) {
    b.reduced = true;
    b.units_done = 0;
    if (b.numel() == 0) return;
    TensorView g = bucket_grads(ch, b);
    if (ps.tp().size() > 1) sum_over(ps.tp(), g, b.sp);
    const Communicator& group = ps.dp_cp();
    if (dp() > 1) ctx.ops().scale_(g, 1.0f / float(dp()));
    if (!sharded()) {
      if (dp() > 1) b.work = group.all_reduce_async(g, ReduceOp::kSum);
      return;
    }
    TensorView inp = g;
    if (bucket_grads_only()) {
      b.comm = std::move(b.grad_buf);  // padded, zero beyond the bucket's elements
      b.grad_buf = Tensor();
      inp = b.comm.view();
      unbind_grads(ch, b);
    } else if (b.padded != b.numel()) {
      b.comm = ctx.zeros({b.padded}, g.dtype());
      ctx.copy(b.comm.view().slice_flat(0, Shape{b.numel()}), g);
      inp = b.comm.view();
    }
    b.out = ctx.empty({b.shard}, g.dtype());
    note_buffers();
    b.work = group.reduce_scatter_async(b.out, inp);
  }

  // Waits for bucket b's reduction and moves the result where Adam reads it.
  void complete(Chunk& ch, Bucket& b) {
    if (b.work) {
      b.work->wait();
      b.work.reset();
    }
    if (b.numel() == 0) return;
    if (!sharded()) {
      TensorView g = bucket_grads(ch, b);
      if (ch.grad_shard.defined()) {  // f16 gradients: Adam reads an f32 copy
        // Reduced once per step into a shard that step() (or start_step() after a skip) left at zero: a
        // plain cast, exact and without add_into's f32 temporary of the bucket.
        ctx.ops().cast(ch.grad_shard.view().slice_flat(b.begin, Shape{b.numel()}), g);
        ctx.ops().fill_(g, 0.0f);
      }
      return;
    }
    if (!b.out.defined()) return;
    if (ch.grad_shard.defined()) {
      add_into(ch.grad_shard.view().slice_flat(b.shard_off, Shape{b.shard}), b.out);
      // The reduced values now live in the shard; ZeRO-1's full-size gradients restart from zero.
      if (!bucket_grads_only()) ctx.ops().fill_(bucket_grads(ch, b), 0.0f);
    } else {
      // ZeRO-1 with f32 gradients: Adam reads the owned range of the gradient buffer itself (no shard
      // copy, as Megatron); the rest of the bucket restarts from zero.
      const TensorView g = bucket_grads(ch, b);
      ctx.ops().fill_(g, 0.0f);
      const int64_t own = b.own_end - b.own_begin;
      if (own > 0)
        ctx.copy(g.slice_flat(b.own_begin - b.begin, Shape{own}), b.out.view().slice_flat(0, Shape{own}));
    }
    b.out = Tensor();
    b.comm = Tensor();
  }

  // ZeRO-2/3 with --overlap-grad-reduce: at most one bucket reduction stays in flight, so no more than
  // two bucket buffers (that one and the one backward writes) are ever alive.
  void track_inflight(int c, int bucket) {
    inflight.emplace_back(c, bucket);
    while (inflight.size() > 1) {
      const auto [oc, ob] = inflight.front();
      inflight.pop_front();
      Bucket& o = chunks[size_t(oc)].buckets[size_t(ob)];
      if (o.work || o.out.defined()) complete(chunks[size_t(oc)], o);
    }
  }

  // ---- parameter binding (ZeRO-3) and all-gathers ----
  template <typename F>
  void for_params(Chunk& ch, const Bucket& b, F f) {
    for (Parameter& p : ch.set->all())
      if (p.offset >= b.begin && p.offset < b.end) f(p);
  }
  // Where a sharded-but-not-ZeRO-3 bucket's gathered values go: the f32 values (f32 compute, which the
  // masters are part of) or the compute copy (16-bit compute with an f32 master shard).
  TensorView gather_target(Chunk& ch, const Bucket& b) const {
    const Tensor& full = ch.master_shard.defined() ? ch.set->compute_values() : ch.set->values();
    return full.view().slice_flat(b.begin, Shape{b.numel()});
  }
  // Starts the all-gather of the updated parameters of bucket b (ZeRO-1/2): this rank's slice, padded.
  void start_param_gather(Chunk& ch, Bucket& b) {
    if (b.numel() == 0) return;
    const TensorView dst = gather_target(ch, b);
    b.gather_send = ctx.zeros({b.shard}, dst.dtype());
    const int64_t own = b.own_end - b.own_begin;
    if (own > 0) {
      const TensorView send = b.gather_send.view().slice_flat(0, Shape{own});
      if (ch.master_shard.defined())
        ctx.ops().cast(send, ch.master_shard.view().slice_flat(b.shard_off, Shape{own}));
      else
        ctx.copy(send, ch.set->values().view().slice_flat(b.own_begin, Shape{own}));
    }
    TensorView recv = dst;
    if (b.padded != b.numel()) {
      b.gather_recv = ctx.empty({b.padded}, dst.dtype());
      recv = b.gather_recv.view();
    }
    note_buffers();
    b.gather_work = ps.dp_cp().all_gather_async(recv, b.gather_send);
  }
  void finish_param_gather(Chunk& ch, Bucket& b) {
    if (!b.gather_work) return;
    b.gather_work->wait();
    b.gather_work.reset();
    if (b.gather_recv.defined())
      ctx.copy(gather_target(ch, b), b.gather_recv.view().slice_flat(0, Shape{b.numel()}));
    b.gather_send = Tensor();
    b.gather_recv = Tensor();
  }

  // ZeRO-3: the unit's compute values gathered into params_buf and bound to its parameters.
  void start_unit_gather(Chunk& ch, Bucket& b) {
    const DType cdt = ch.set->compute_dtype();
    b.params_buf = ctx.empty({b.padded}, cdt);
    const Tensor& src = ch.compute_shard.defined() ? ch.compute_shard : ch.master_shard;
    note_buffers();
    b.gather_work = ps.dp_cp().all_gather_async(b.params_buf, src.view().slice_flat(b.shard_off, Shape{b.shard}));
  }
  void bind_params(Chunk& ch, Bucket& b) {
    if (b.gather_work) {
      b.gather_work->wait();
      b.gather_work.reset();
    }
    const DType cdt = ch.set->compute_dtype();
    for_params(ch, b, [&](Parameter& p) {
      p.compute = b.params_buf.slice_flat(p.offset - b.begin, p.shape);
      // The f32 master is sharded; only an f32 compute copy doubles as the full value.
      p.value = cdt == DType::kF32 ? p.compute : Tensor();
    });
  }
  void gather(Chunk& ch, Bucket& b) {
    if (b.numel() == 0) return;
    if (b.prefetched) {  // the prefetch's reference becomes this use's
      b.prefetched = false;
      bind_params(ch, b);
      return;
    }
    if (b.param_refs++ > 0) return;
    start_unit_gather(ch, b);
    bind_params(ch, b);
  }
  // --overlap-param-gather under ZeRO-3: start gathering a unit that is about to run.
  void prefetch(Chunk& ch, Bucket& b) {
    if (b.numel() == 0 || b.param_refs > 0 || b.prefetched) return;
    b.param_refs = 1;
    b.prefetched = true;
    start_unit_gather(ch, b);
  }
  void release(Chunk& ch, Bucket& b) {
    if (b.numel() == 0) return;
    LOOM_CHECK(b.param_refs > 0, "[DistributedOptimizer] unit parameters released more often than gathered (bucket at ",
               b.begin, ")");
    if (--b.param_refs > 0) return;
    for_params(ch, b, [&](Parameter& p) {
      p.compute = Tensor();
      p.value = Tensor();
    });
    b.params_buf = Tensor();
  }
  // Prefetched parameters no unit consumed (a recomputed forward's look-ahead): dropped.
  void drop_prefetches() {
    for (Chunk& ch : chunks)
      for (Bucket& b : ch.buckets)
        if (b.prefetched) {
          if (b.gather_work) b.gather_work->wait();
          b.gather_work.reset();
          b.prefetched = false;
          b.param_refs = 0;
          b.params_buf = Tensor();
        }
  }
  void bind_grads(Chunk& ch, Bucket& b) {
    if (b.grad_buf.defined() || b.numel() == 0) return;
    b.grad_buf = ctx.zeros({b.padded}, ch.set->grad_dtype());
    for_params(ch, b, [&](Parameter& p) { p.grad = b.grad_buf.slice_flat(p.offset - b.begin, p.shape); });
    note_buffers();
  }
  void unbind_grads(Chunk& ch, Bucket& b) {
    for_params(ch, b, [&](Parameter& p) { p.grad = Tensor(); });
  }

  // ---- hooks ----
  Bucket& bucket_of(int c, int unit) {
    Chunk& ch = chunks[size_t(c)];
    LOOM_CHECK(unit >= 0 && unit < int(ch.units.size()), "[DistributedOptimizer] unit ", unit, " out of range (",
               ch.units.size(), " units in chunk ", c, ")");
    return ch.buckets[size_t(ch.unit_bucket[size_t(unit)])];
  }
  // The buckets a unit's computation touches: its own, then those of the units it reads.
  std::vector<Bucket*> buckets_used(int c, int unit) {
    std::vector<Bucket*> out{&bucket_of(c, unit)};
    for (int r : chunks[size_t(c)].units[size_t(unit)].reads) {
      Bucket* b = &bucket_of(c, r);
      if (std::find(out.begin(), out.end(), b) == out.end()) out.push_back(b);
    }
    return out;
  }
  // Whether a finished backward of this micro-batch may start a ZeRO-0/1 bucket's reduction now.
  bool launches_now(const Chunk& ch, const Bucket& b) const {
    return ddp.overlap_grad_reduce && !b.deferred && ch.last_microbatch;
  }
  void before_forward(int c, int unit) {
    Chunk& ch = chunks[size_t(c)];
    for (Bucket* b : buckets_used(c, unit)) {
      if (zero3())
        gather(ch, *b);
      else
        finish_param_gather(ch, *b);
    }
    if (zero3() && ddp.overlap_param_gather && unit + 1 < int(ch.units.size())) prefetch(ch, bucket_of(c, unit + 1));
  }
  void after_forward(int c, int unit) {
    if (!zero3()) return;
    for (Bucket* b : buckets_used(c, unit)) release(chunks[size_t(c)], *b);
  }
  void before_backward(int c, int unit) {
    Chunk& ch = chunks[size_t(c)];
    for (Bucket* b : buckets_used(c, unit)) {
      // A previous micro-batch's reduction of this bucket still in flight: folded before new gradients
      // are written (and before the bucket is launched again).
      if (!b->grad_buf.defined() && (b->work || b->out.defined())) complete(ch, *b);
      b->reduced = false;
      if (bucket_grads_only()) bind_grads(ch, *b);
      if (zero3()) gather(ch, *b);
    }
    if (zero3() && ddp.overlap_param_gather && unit > 0) prefetch(ch, bucket_of(c, unit - 1));
  }
  void after_backward(int c, int unit) {
    Chunk& ch = chunks[size_t(c)];
    if (zero3())
      for (Bucket* b : buckets_used(c, unit)) release(ch, *b);
    Bucket& b = bucket_of(c, unit);
    if (bucket_grads_only()) {
      // Reduced every micro-batch once all of the bucket's units are done; the tied embedding's bucket
      // keeps accumulating until finish_grad_sync.
      if (b.deferred || ++b.units_done < b.last_unit - b.first_unit + 1) return;
      launch(ch, b);
      if (!ddp.overlap_grad_reduce)
        complete(ch, b);
      else
        track_inflight(c, int(&b - ch.buckets.data()));
      return;
    }
    if (!launches_now(ch, b)) return;
    if (++b.units_done == b.last_unit - b.first_unit + 1) launch(ch, b);
  }

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

DistributedOptimizer::DistributedOptimizer(const DeviceContext& ctx, std::vector<ParameterSet*> sets,
                                           std::vector<std::vector<ParamUnit>> units, const ParallelState& ps,
                                           DDPConfig ddp, AdamWConfig adam)
    : impl_(std::make_unique<Impl>(ctx, ps, ddp, adam)) {
  Impl& im = *impl_;
  LOOM_CHECK(!sets.empty(), "[DistributedOptimizer] no model chunks");
  LOOM_CHECK(units.size() == sets.size(), "[DistributedOptimizer] ", units.size(), " unit lists for ", sets.size(),
             " chunks");
  if (ddp.bucket_size < 0) user_error("--ddp-bucket-size: must be > 0, got ", ddp.bucket_size);
  const int dp = im.dp(), dp_rank = ps.dp_cp().rank();
  const int64_t bucket_size =
      ddp.bucket_size > 0 ? ddp.bucket_size : std::max<int64_t>(40'000'000, 1'000'000 * int64_t(dp));

  // The tied embedding: the last stage's copy is flagged; both stages must agree to sum over the group.
  bool has_copy = false;
  for (ParameterSet* s : sets)
    for (const Parameter& p : s->all()) has_copy = has_copy || p.tied_embedding_copy;
  im.tied_embedding =
      ps.embedding().size() > 1 && ps.embedding().all_reduce_scalar(has_copy ? 1.0 : 0.0, ReduceOp::kMax) > 0.0;

  for (size_t c = 0; c < sets.size(); ++c) {
    ParameterSet* set = sets[c];
    LOOM_CHECK(set != nullptr, "[DistributedOptimizer] chunk ", c, " is null");
    LOOM_CHECK(set->storage() == param_storage_for(ddp.sharding), "[DistributedOptimizer] ",
               sharding_strategy_name(ddp.sharding), " needs chunk ", c, " built with param_storage_for(",
               sharding_strategy_name(ddp.sharding), ") (ParamStorage ", int(param_storage_for(ddp.sharding)),
               "), got ParamStorage ", int(set->storage()));
    LOOM_CHECK(im.bucket_grads_only() || set->grads().defined(), "[DistributedOptimizer] chunk ", c,
               " has no gradient buffer");
    Chunk& ch = im.chunks.emplace_back();
    ch.set = set;
    ch.units = std::move(units[c]);
    if (ch.units.empty()) ch.units.push_back({"all", 0, set->numel(), {}});
    int64_t covered = 0;
    for (const ParamUnit& u : ch.units) {
      LOOM_CHECK(u.offset == covered && u.numel >= 0, "[DistributedOptimizer] units must tile chunk ", c,
                 " in order: unit ", u.name, " at ", u.offset, ", expected ", covered);
      covered += u.numel;
    }
    LOOM_CHECK(covered == set->numel(), "[DistributedOptimizer] units cover ", covered, " of ", set->numel(),
               " elements of chunk ", c);

    // Buckets: runs of whole units in backward order (ZeRO-3: one unit each).
    ch.unit_bucket.assign(ch.units.size(), -1);
    for (int u = int(ch.units.size()) - 1; u >= 0;) {
      Bucket& b = ch.buckets.emplace_back();
      b.last_unit = u;
      int64_t n = 0;
      do {
        n += ch.units[size_t(u)].numel;
        ch.unit_bucket[size_t(u)] = int(ch.buckets.size()) - 1;
        --u;
      } while (u >= 0 && !im.zero3() && n < bucket_size);
      b.first_unit = u + 1;
      b.begin = ch.units[size_t(b.first_unit)].offset;
      b.end = b.begin + n;
    }

    // Ownership and shard space (buckets in backward order, as they are reduced).
    int64_t shard_off = 0;
    for (Bucket& b : ch.buckets) {
      const int64_t n = b.numel();
      if (im.sharded()) {
        b.padded = (n + dp - 1) / dp * dp;
        b.shard = b.padded / dp;
        b.own_begin = std::min(b.begin + dp_rank * b.shard, b.end);
        b.own_end = std::min(b.begin + (dp_rank + 1) * b.shard, b.end);
      } else {
        b.padded = b.shard = n;
        b.own_begin = b.begin;
        b.own_end = b.end;
      }
      b.shard_off = im.sharded() ? shard_off : b.begin;
      shard_off += b.shard;
      for (const Parameter& p : set->all()) {
        const int64_t pe = p.offset + p.shape.numel();
        if (p.offset < b.begin || p.offset >= b.end) {
          LOOM_CHECK(pe <= b.begin || p.offset >= b.end, "[DistributedOptimizer] parameter ", p.name,
                     " crosses a unit boundary");
          continue;
        }
        LOOM_CHECK(pe <= b.end, "[DistributedOptimizer] parameter ", p.name, " crosses a unit boundary");
        if (p.sequence_parallel) b.sp.push_back({p.offset - b.begin, p.shape.numel()});
        if (im.tied_embedding && p.tied_embedding)
          b.emb.push_back({p.offset - b.begin, p.shape.numel()});
        const int64_t lo = std::max(p.offset, b.own_begin), hi = std::min(pe, b.own_end);
        if (lo >= hi) continue;
        Piece piece;
        piece.param = &p;
        piece.flat_begin = lo;
        piece.flat_end = hi;
        piece.shard_off = b.shard_off + (lo - b.own_begin);
        piece.weight_decay = !p.no_weight_decay;
        piece.count_in_norm = !(p.partition_dim == -1 && ps.tp_rank() != 0) && !p.tied_embedding_copy;
        ch.pieces.push_back(piece);
      }
      b.deferred = !b.emb.empty();
    }
    ch.shard_numel = im.sharded() ? shard_off : set->numel();
    ch.exp_avg = ctx.zeros({ch.shard_numel}, DType::kF32);
    ch.exp_avg_sq = ctx.zeros({ch.shard_numel}, DType::kF32);
    // Adam reads ParameterSet grads directly (its own range of them under ZeRO-1) when they are f32 and
    // outlive the reduction; ZeRO-2/3 accumulate the reduced micro-batch gradients in an f32 shard.
    if (im.bucket_grads_only() || set->grad_dtype() != DType::kF32)
      ch.grad_shard = ctx.zeros({ch.shard_numel}, DType::kF32);
    // f32 masters of their own where the set has no f32 values: ZeRO-3, and ZeRO-1/2 with 16-bit compute.
    if (im.zero3() || (im.sharded() && set->compute_dtype() != DType::kF32))
      ch.master_shard = ctx.zeros({ch.shard_numel}, DType::kF32);
    if (im.zero3() && set->compute_dtype() != DType::kF32)
      ch.compute_shard = ctx.zeros({ch.shard_numel}, set->compute_dtype());
    im.hooks.push_back(std::make_unique<Impl::ChunkHooks>(impl_.get(), int(c)));
  }
}

DistributedOptimizer::~DistributedOptimizer() {
  // Unfinished asynchronous reductions read buffers owned here: finish them before anything is freed.
  for (Chunk& ch : impl_->chunks)
    for (Bucket& b : ch.buckets) {
      if (b.work) b.work->wait();
      if (b.gather_work) b.gather_work->wait();
    }
}

ShardingStrategy DistributedOptimizer::sharding() const { return impl_->ddp.sharding; }
int DistributedOptimizer::num_buckets(int chunk) const { return int(impl_->chunks.at(size_t(chunk)).buckets.size()); }
ParamHooks* DistributedOptimizer::hooks(int chunk) { return impl_->hooks.at(size_t(chunk)).get(); }
int64_t DistributedOptimizer::num_steps() const { return impl_->steps; }
void DistributedOptimizer::set_num_steps(int64_t n) {
  LOOM_CHECK(n >= 0, "[DistributedOptimizer] step count must be >= 0, got ", n);
  impl_->steps = n;
}

void DistributedOptimizer::initialize(uint64_t seed) {
  Impl& im = *impl_;
  if (!im.chunks.front().master_shard.defined()) {
    for (Chunk& ch : im.chunks) ch.set->initialize(seed);
    return;
  }
  for (Chunk& ch : im.chunks) {
    LOOM_CHECK(ch.master_shard.device().is_cpu(), "[DistributedOptimizer] host initialisation only in this build");
    for (const Bucket& b : ch.buckets)
      if (b.own_end > b.own_begin)
        ch.set->initialize_range(seed, b.own_begin, b.own_end, ch.master_shard.data<float>() + b.shard_off);
  }
  sync_params_from_masters();
}

void DistributedOptimizer::start_step() {
  Impl& im = *impl_;
  im.drop_prefetches();
  for (Chunk& ch : im.chunks) {
    if (im.grads_dirty) {  // the last step was skipped: drop its reduced gradients
      if (ch.grad_shard.defined())
        im.ctx.ops().fill_(ch.grad_shard, 0.0f);
      else
        ch.set->zero_grads(im.ctx);
    }
    for (Bucket& b : ch.buckets) {
      LOOM_CHECK(!b.work && b.param_refs == 0 && !b.grad_buf.defined(), "[DistributedOptimizer] start_step() with "
                 "unit ", b.first_unit, " of chunk still in use");
      b.units_done = 0;
      b.reduced = false;
    }
  }
  im.grads_dirty = false;
}

void DistributedOptimizer::set_last_microbatch(int chunk, bool last) {
  impl_->chunks.at(size_t(chunk)).last_microbatch = last;
}

void DistributedOptimizer::finish_grad_sync() {
  Impl& im = *impl_;
  // Embedding-group sums first, blocking, on buckets not yet launched (always the deferred ones), in
  // the same order on the first and the last stage.
  for (Chunk& ch : im.chunks)
    for (Bucket& b : ch.buckets)
      if (b.deferred && !b.reduced && (!im.bucket_grads_only() || b.grad_buf.defined()))
        im.sum_over(im.ps.embedding(), im.bucket_grads(ch, b), b.emb);
  for (Chunk& ch : im.chunks)
    for (Bucket& b : ch.buckets) {
      if (b.reduced || b.work) continue;
      if (im.bucket_grads_only() && !b.grad_buf.defined()) continue;  // reduced by its hook (or no backward ran)
      im.launch(ch, b);
    }
  for (Chunk& ch : im.chunks)
    for (Bucket& b : ch.buckets)
      if (!im.bucket_grads_only() || b.work || b.out.defined()) im.complete(ch, b);
  im.inflight.clear();
  im.drop_prefetches();
  im.grads_dirty = true;
}

double DistributedOptimizer::grad_norm() {
  Impl& im = *impl_;
  return im.model_norm([&](Chunk& ch, const Piece& p) { return im.piece_grad(ch, p); });
}

double DistributedOptimizer::param_norm() {
  finish_param_sync();
  Impl& im = *impl_;
  return im.model_norm([&](Chunk& ch, const Piece& p) { return im.piece_master(ch, p); });
}

bool DistributedOptimizer::found_inf() {
  Impl& im = *impl_;
  bool any = false;
  for (Chunk& ch : im.chunks)
    for (const Piece& p : ch.pieces) any = any || im.ctx.ops().has_inf_or_nan(im.piece_grad(ch, p));
  return im.ps.world().all_reduce_scalar(any ? 1.0 : 0.0, ReduceOp::kMax) > 0.0;
}

void DistributedOptimizer::step(float lr, float weight_decay, float grad_scale) {
  Impl& im = *impl_;
  ++im.steps;
  AdamWParams p;
  p.lr = lr;
  p.beta1 = im.adam.beta1;
  p.beta2 = im.adam.beta2;
  p.eps = im.adam.eps;
  p.step = im.steps;
  p.grad_scale = grad_scale;
  p.zero_grad = true;  // the gradients Adam reads start the next step from zero
  for (Chunk& ch : im.chunks)
    for (const Piece& pc : ch.pieces) {
      p.weight_decay = pc.weight_decay ? weight_decay : 0.0f;
      const Shape s{pc.flat_end - pc.flat_begin};
      im.ctx.ops().adamw_update(im.piece_master(ch, pc), im.piece_grad(ch, pc),
                                ch.exp_avg.view().slice_flat(pc.shard_off, s),
                                ch.exp_avg_sq.view().slice_flat(pc.shard_off, s), p);
    }
  im.grads_dirty = false;
  sync_params_from_masters();
}

void DistributedOptimizer::sync_params_from_masters() {
  Impl& im = *impl_;
  finish_param_sync();
  for (Chunk& ch : im.chunks) {
    if (im.zero3()) {
      // The next forward gathers the compute copy from these shards.
      if (ch.compute_shard.defined()) im.ctx.ops().cast(ch.compute_shard, ch.master_shard);
      continue;
    }
    if (!im.sharded()) {
      ch.set->sync_compute(im.ctx);
      continue;
    }
    // Every rank's slice of every bucket -> the full parameters on every rank (f32 values, or the 16-bit
    // compute copy cast from the master shard: the same bits as casting the gathered f32 values). With
    // --overlap-param-gather all buckets are in flight at once (their staging buffers too) and each
    // forward waits for its own; otherwise one bucket at a time.
    for (Bucket& b : ch.buckets) {
      im.start_param_gather(ch, b);
      if (!im.ddp.overlap_param_gather) im.finish_param_gather(ch, b);
    }
  }
}

void DistributedOptimizer::finish_param_sync() {
  Impl& im = *impl_;
  if (im.zero3()) return;  // ZeRO-3 gathers (and prefetches) are completed by the unit that uses them
  for (Chunk& ch : im.chunks)
    for (Bucket& b : ch.buckets) im.finish_param_gather(ch, b);
}

std::vector<StateShard> DistributedOptimizer::state_shards() {
  Impl& im = *impl_;
  finish_param_sync();
  std::vector<StateShard> out;
  for (size_t c = 0; c < im.chunks.size(); ++c) {
    Chunk& ch = im.chunks[c];
    for (const Piece& pc : ch.pieces) {
      StateShard s;
      s.param = pc.param;
      s.chunk = int(c);
      s.begin = pc.flat_begin - pc.param->offset;
      s.end = pc.flat_end - pc.param->offset;
      const Shape n{s.end - s.begin};
      s.master = im.piece_master(ch, pc);
      s.exp_avg = ch.exp_avg.view().slice_flat(pc.shard_off, n);
      s.exp_avg_sq = ch.exp_avg_sq.view().slice_flat(pc.shard_off, n);
      out.push_back(s);
    }
  }
  return out;
}

DistributedOptimizer::Memory DistributedOptimizer::memory() const {
  const Impl& im = *impl_;
  Memory m;
  for (const Chunk& ch : im.chunks) {
    const ParameterSet& s = *ch.set;
    m.params += bytes(s.values());
    if (s.compute_values().defined() && s.compute_values().raw() != s.values().raw()) m.params += bytes(s.compute_values());
    m.params += bytes(ch.master_shard) + bytes(ch.compute_shard);
    m.grads += bytes(s.grads()) + bytes(ch.grad_shard);
    m.optimizer += bytes(ch.exp_avg) + bytes(ch.exp_avg_sq);
  }
  m.buffers_peak = im.buffers_peak;
  return m;
}

}  // namespace loom

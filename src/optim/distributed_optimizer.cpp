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

namespace loom {

ShardingStrategy parse_sharding_strategy(const std::string& s) {
  if (s == "no_shard") return ShardingStrategy::kNone;
  if (s == "optim") return ShardingStrategy::kOptim;
  if (s == "optim_grads") return ShardingStrategy::kOptimGrads;
  if (s == "optim_grads_params") return ShardingStrategy::kOptimGradsParams;
  user_error("--data-parallel-sharding-strategy: unknown strategy '", s,
             "' (valid: no_shard, optim, optim_grads, optim_grads_params)");
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

namespace {

constexpr const char* kWordEmbedding = "embedding.word_embeddings.weight";

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
  Tensor comm;                    // reduction input kept alive: padded copy or ZeRO-3 unit grads
  Tensor out;                     // reduce-scatter output (shard elements, grad dtype)
  // ZeRO-3.
  Tensor params_buf;              // gathered compute values (padded elements)
  int param_refs = 0;             // nested uses (forward inside backward for recomputation)
  Tensor grad_buf;                // the unit's gradients while its backward runs (padded elements)

  int64_t numel() const { return end - begin; }
};

struct Chunk {
  ParameterSet* set = nullptr;
  std::vector<ParamUnit> units;
  std::vector<int> unit_bucket;  // unit -> bucket index
  std::vector<Bucket> buckets;   // backward order
  int64_t shard_numel = 0;       // size of shard space
  Tensor exp_avg, exp_avg_sq;    // (shard_numel) f32
  Tensor grad_shard;             // (shard_numel) f32; undefined when Adam reads ParameterSet grads
  Tensor master_shard;           // ZeRO-3: (shard_numel) f32
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

  Impl(const DeviceContext& c, const ParallelState& p, DDPConfig d, AdamWConfig a)
      : ctx(c), ps(p), ddp(d), adam(a) {}

  bool sharded() const { return ddp.sharding != ShardingStrategy::kNone; }
  bool zero3() const { return ddp.sharding == ShardingStrategy::kOptimGradsParams; }
  int dp() const { return ps.dp_cp().size(); }

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

  // The bucket's gradients as the model writes them: ParameterSet grads, or ZeRO-3's unit buffer.
  TensorView bucket_grads(Chunk& ch, Bucket& b) const {
    if (zero3()) return b.grad_buf.view().slice_flat(0, Shape{b.numel()});
    return ch.set->grads().view().slice_flat(b.begin, Shape{b.numel()});
  }

  TensorView piece_grad(Chunk& ch, const Piece& p) const {
    const Shape s{p.flat_end - p.flat_begin};
    if (!ch.grad_shard.defined()) return ch.set->grads().view().slice_flat(p.flat_begin, s);
    return ch.grad_shard.view().slice_flat(p.shard_off, s);
  }
  TensorView piece_master(Chunk& ch, const Piece& p) const {
    const Shape s{p.flat_end - p.flat_begin};
    if (zero3()) return ch.master_shard.view().slice_flat(p.shard_off, s);
    return ch.set->values().view().slice_flat(p.flat_begin, s);
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
    if (zero3()) {
      b.comm = b.grad_buf;  // padded, zero beyond the unit's elements
      inp = b.comm.view();
      unbind_grads(ch, b);
      b.grad_buf = Tensor();
    } else if (b.padded != b.numel()) {
      b.comm = ctx.zeros({b.padded}, g.dtype());
      ctx.copy(b.comm.view().slice_flat(0, Shape{b.numel()}), g);
      inp = b.comm.view();
    }
    b.out = ctx.empty({b.shard}, g.dtype());
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
        add_into(ch.grad_shard.view().slice_flat(b.begin, Shape{b.numel()}), g);
        ctx.ops().fill_(g, 0.0f);
      }
      return;
    }
    if (!b.out.defined()) return;
    add_into(ch.grad_shard.view().slice_flat(b.shard_off, Shape{b.shard}), b.out);
    b.out = Tensor();
    b.comm = Tensor();
    // The reduced values now live in the shard; the bucket's full-size gradients restart from zero.
    if (!zero3()) ctx.ops().fill_(bucket_grads(ch, b), 0.0f);
  }

  // ---- ZeRO-3 parameter binding ----
  template <typename F>
  void for_params(Chunk& ch, const Bucket& b, F f) {
    for (Parameter& p : ch.set->all())
      if (p.offset >= b.begin && p.offset < b.end) f(p);
  }
  void gather(Chunk& ch, Bucket& b) {
    if (b.param_refs++ > 0 || b.numel() == 0) return;
    const DType cdt = ch.set->compute_dtype();
    b.params_buf = ctx.empty({b.padded}, cdt);
    const Tensor& src = ch.compute_shard.defined() ? ch.compute_shard : ch.master_shard;
    ps.dp_cp().all_gather(b.params_buf, src.view().slice_flat(b.shard_off, Shape{b.shard}));
    for_params(ch, b, [&](Parameter& p) {
      p.compute = b.params_buf.slice_flat(p.offset - b.begin, p.shape);
      // The f32 master is sharded; only an f32 compute copy doubles as the full value.
      p.value = cdt == DType::kF32 ? p.compute : Tensor();
    });
  }
  void release(Chunk& ch, Bucket& b) {
    LOOM_CHECK(b.param_refs > 0, "[DistributedOptimizer] unit parameters released more often than gathered (bucket at ",
               b.begin, ")");
    if (--b.param_refs > 0 || b.numel() == 0) return;
    for_params(ch, b, [&](Parameter& p) {
      p.compute = Tensor();
      p.value = Tensor();
    });
    b.params_buf = Tensor();
  }
  void bind_grads(Chunk& ch, Bucket& b) {
    if (b.grad_buf.defined() || b.numel() == 0) return;
    b.grad_buf = ctx.zeros({b.padded}, ch.set->grad_dtype());
    for_params(ch, b, [&](Parameter& p) { p.grad = b.grad_buf.slice_flat(p.offset - b.begin, p.shape); });
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
  // Whether a finished backward of this micro-batch may start the bucket's reduction now.
  bool launches_now(const Chunk& ch, const Bucket& b) const {
    if (!ddp.overlap_grad_reduce || b.deferred) return false;
    return ch.last_microbatch || ddp.sharding == ShardingStrategy::kOptimGrads;
  }
  void before_forward(int c, int unit) {
    if (zero3()) gather(chunks[size_t(c)], bucket_of(c, unit));
  }
  void after_forward(int c, int unit) {
    if (zero3()) release(chunks[size_t(c)], bucket_of(c, unit));
  }
  void before_backward(int c, int unit) {
    Chunk& ch = chunks[size_t(c)];
    Bucket& b = bucket_of(c, unit);
    // A previous micro-batch's reduction still reads this bucket's gradients (ZeRO-2) or must be folded
    // before a new one starts (ZeRO-3).
    if (b.work || b.out.defined()) complete(ch, b);
    b.reduced = false;
    if (zero3()) {
      gather(ch, b);
      bind_grads(ch, b);
    }
  }
  void after_backward(int c, int unit) {
    Chunk& ch = chunks[size_t(c)];
    Bucket& b = bucket_of(c, unit);
    if (zero3()) {
      release(ch, b);
      if (b.deferred) return;  // gradients kept (accumulating) until finish_grad_sync
      launch(ch, b);
      if (!ddp.overlap_grad_reduce) complete(ch, b);
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
    if (im.zero3())
      LOOM_CHECK(set->storage() == ParamStorage::kExternal, "[DistributedOptimizer] optim_grads_params needs the "
                 "model built with ParamStorage::kExternal (chunk ", c, ")");
    else
      LOOM_CHECK(set->storage() == ParamStorage::kFull && set->grads().defined(),
                 "[DistributedOptimizer] chunk ", c, " needs full parameter storage with gradients");
    Chunk& ch = im.chunks.emplace_back();
    ch.set = set;
    ch.units = std::move(units[c]);
    if (ch.units.empty()) ch.units.push_back({"all", 0, set->numel()});
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
        if (im.tied_embedding && (p.tied_embedding_copy || p.name == kWordEmbedding))
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
    // Adam reads ParameterSet grads directly only without sharding and with f32 gradients.
    if (im.sharded() || set->grad_dtype() != DType::kF32) ch.grad_shard = ctx.zeros({ch.shard_numel}, DType::kF32);
    if (im.zero3()) {
      ch.master_shard = ctx.zeros({ch.shard_numel}, DType::kF32);
      if (set->compute_dtype() != DType::kF32) ch.compute_shard = ctx.zeros({ch.shard_numel}, set->compute_dtype());
    }
    im.hooks.push_back(std::make_unique<Impl::ChunkHooks>(impl_.get(), int(c)));
  }
}

DistributedOptimizer::~DistributedOptimizer() {
  // Unfinished asynchronous reductions read buffers owned here: finish them before anything is freed.
  for (Chunk& ch : impl_->chunks)
    for (Bucket& b : ch.buckets)
      if (b.work) b.work->wait();
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
  if (!im.zero3()) {
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
  for (Chunk& ch : im.chunks) {
    if (im.grads_dirty) {  // the last step was skipped: drop its reduced gradients
      if (ch.grad_shard.defined()) im.ctx.ops().fill_(ch.grad_shard, 0.0f);
      if (!im.zero3() && !ch.grad_shard.defined()) ch.set->zero_grads(im.ctx);
    }
    for (Bucket& b : ch.buckets) {
      LOOM_CHECK(!b.work && b.param_refs == 0, "[DistributedOptimizer] start_step() with unit ", b.first_unit,
                 " of chunk still in use");
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
      if (b.deferred && !b.reduced && (!im.zero3() || b.grad_buf.defined()))
        im.sum_over(im.ps.embedding(), im.bucket_grads(ch, b), b.emb);
  for (Chunk& ch : im.chunks)
    for (Bucket& b : ch.buckets) {
      if (b.reduced || b.work) continue;
      if (im.zero3() && !b.grad_buf.defined()) continue;  // reduced by its hook (or no backward ran)
      im.launch(ch, b);
    }
  for (Chunk& ch : im.chunks)
    for (Bucket& b : ch.buckets) im.complete(ch, b);
  im.grads_dirty = true;
}

double DistributedOptimizer::grad_norm() {
  Impl& im = *impl_;
  double local = 0.0;
  for (Chunk& ch : im.chunks)
    for (const Piece& p : ch.pieces)
      if (p.count_in_norm) local += im.ctx.ops().sum_squares(im.piece_grad(ch, p));
  // ZeRO shards are disjoint across dp_cp, so the whole world holds each element once.
  const Communicator& group = im.sharded() ? im.ps.world() : im.ps.mp();
  return std::sqrt(group.all_reduce_scalar(local, ReduceOp::kSum));
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
  for (Chunk& ch : im.chunks) {
    if (im.zero3()) {
      // The next forward gathers the compute copy from these shards.
      if (ch.compute_shard.defined()) im.ctx.ops().cast(ch.compute_shard, ch.master_shard);
      continue;
    }
    if (im.sharded()) {
      // Every rank's slice of every bucket -> the full values on every rank.
      const TensorView values = ch.set->values().view();
      for (Bucket& b : ch.buckets) {
        if (b.numel() == 0) continue;
        Tensor send = im.ctx.zeros({b.shard}, DType::kF32);
        const int64_t own = b.own_end - b.own_begin;
        if (own > 0)
          im.ctx.copy(send.view().slice_flat(0, Shape{own}), values.slice_flat(b.own_begin, Shape{own}));
        const TensorView dst = values.slice_flat(b.begin, Shape{b.numel()});
        if (b.padded == b.numel()) {
          im.ps.dp_cp().all_gather(dst, send);
        } else {
          Tensor recv = im.ctx.empty({b.padded}, DType::kF32);
          im.ps.dp_cp().all_gather(recv, send);
          im.ctx.copy(dst, recv.view().slice_flat(0, Shape{b.numel()}));
        }
      }
    }
    ch.set->sync_compute(im.ctx);
  }
}

std::vector<StateShard> DistributedOptimizer::state_shards() {
  Impl& im = *impl_;
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
    if (im.zero3()) {
      m.params += ch.master_shard.nbytes() + (ch.compute_shard.defined() ? ch.compute_shard.nbytes() : 0);
    } else {
      const ParameterSet& s = *ch.set;
      m.params += s.values().nbytes();
      if (s.compute_values().raw() != s.values().raw()) m.params += s.compute_values().nbytes();
      m.grads += s.grads().nbytes();
    }
    if (ch.grad_shard.defined()) m.grads += ch.grad_shard.nbytes();
    m.optimizer += ch.exp_avg.nbytes() + ch.exp_avg_sq.nbytes();
  }
  return m;
}

}  // namespace loom

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
//     fp16 gradients in range. DP is dp_cp's size for expert buckets too (Megatron's
//     expert_gradient_scaling_factor): an expert's gradient already sums the tokens its EP peers routed to
//     it, so the sum over expert_dp covers all DP·CP micro-batches;
//   - a bucket holds dense units only or expert units only (ParamUnit::expert), and each parameter's flag
//     matches its unit's: expert buckets are reduced, sharded and gathered over expert_dp. Dense and expert
//     units alternate in a MoE model's flat buffer (a layer's dense part, then its experts), so a bucket
//     there is one layer's dense part or one layer's experts, whatever --ddp-bucket-size says.
// This file holds the strategy names, the bucket/shard layout built by the constructor, the lifecycle
// (initialisation, step count, optimizer-state views) and the memory accounting; the per-step reduction
// and Adam step are in distributed_optimizer_reduce.cpp, the parameter gathers and hooks in
// distributed_optimizer_gather.cpp, and the state they share in distributed_optimizer_impl.h.
#include "loom/optim/distributed_optimizer.h"

#include <algorithm>
#include <utility>

#include "optim/distributed_optimizer_impl.h"

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

using namespace dist_optim_detail;

namespace {
// The name of the unit holding flat element `offset` (error messages).
std::string unit_name_at(const Chunk& ch, int64_t offset) {
  for (const ParamUnit& u : ch.units)
    if (offset >= u.offset && offset < u.offset + u.numel) return u.name;
  return "?";
}
}  // namespace

void DistributedOptimizer::Impl::note_buffers() {
  int64_t live = 0;
  for (const Chunk& ch : chunks)
    for (const Bucket& b : ch.buckets) live += b.transient_bytes();
  buffers_peak = std::max(buffers_peak, live);
}

DistributedOptimizer::DistributedOptimizer(const DeviceContext& ctx, std::vector<ParameterSet*> sets,
                                           std::vector<std::vector<ParamUnit>> units, const ParallelState& ps,
                                           DDPConfig ddp, OptimizerConfig optim)
    : impl_(std::make_unique<Impl>(ctx, ps, ddp, optim)) {
  Impl& im = *impl_;
  LOOM_CHECK(!sets.empty(), "[DistributedOptimizer] no model chunks");
  LOOM_CHECK(units.size() == sets.size(), "[DistributedOptimizer] ", units.size(), " unit lists for ", sets.size(),
             " chunks");
  if (ddp.bucket_size < 0) user_error("--ddp-bucket-size: must be > 0, got ", ddp.bucket_size);
  const int64_t bucket_size =
      ddp.bucket_size > 0 ? ddp.bucket_size : std::max<int64_t>(40'000'000, 1'000'000 * int64_t(im.dp()));

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
    if (ch.units.empty()) ch.units.push_back({"all", 0, set->numel(), {}, false});
    int64_t covered = 0;
    for (const ParamUnit& u : ch.units) {
      LOOM_CHECK(u.offset == covered && u.numel >= 0, "[DistributedOptimizer] units must tile chunk ", c,
                 " in order: unit ", u.name, " at ", u.offset, ", expected ", covered);
      covered += u.numel;
    }
    LOOM_CHECK(covered == set->numel(), "[DistributedOptimizer] units cover ", covered, " of ", set->numel(),
               " elements of chunk ", c);
    ch.covered_by.assign(ch.units.size(), -1);
    for (size_t u = 0; u < ch.units.size(); ++u)
      for (int r : ch.units[u].reads) {
        LOOM_CHECK(r >= 0 && r < int(ch.units.size()) && r != int(u), "[DistributedOptimizer] unit ",
                   ch.units[u].name, " of chunk ", c, " reads unit ", r, ", which is not another unit of the chunk");
        if (!ch.units[size_t(r)].expert) continue;
        LOOM_CHECK(ch.covered_by[size_t(r)] == -1, "[DistributedOptimizer] expert unit ", ch.units[size_t(r)].name,
                   " is read by both ", ch.units[size_t(ch.covered_by[size_t(r)])].name, " and ", ch.units[u].name,
                   "; the hooks of one unit must cover it");
        ch.covered_by[size_t(r)] = int(u);
      }

    // Buckets: runs of whole units in backward order (ZeRO-3: one unit each), never mixing dense and
    // expert units.
    ch.unit_bucket.assign(ch.units.size(), -1);
    for (int u = int(ch.units.size()) - 1; u >= 0;) {
      Bucket& b = ch.buckets.emplace_back();
      b.last_unit = u;
      b.expert = ch.units[size_t(u)].expert;
      int64_t n = 0;
      do {
        n += ch.units[size_t(u)].numel;
        ch.unit_bucket[size_t(u)] = int(ch.buckets.size()) - 1;
        --u;
      } while (u >= 0 && !im.zero3() && n < bucket_size && ch.units[size_t(u)].expert == b.expert);
      b.first_unit = u + 1;
      b.begin = ch.units[size_t(b.first_unit)].offset;
      b.end = b.begin + n;
    }

    // Ownership and shard space (buckets in backward order, as they are reduced).
    int64_t shard_off = 0;
    for (Bucket& b : ch.buckets) {
      const int64_t n = b.numel();
      b.group = b.expert ? &ps.expert_dp() : &ps.dp_cp();
      const int dp = b.group->size(), dp_rank = b.group->rank();
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
        LOOM_CHECK(p.expert == b.expert, "[DistributedOptimizer] parameter ", p.name, (p.expert ? " is" : " is not"),
                   " an expert's (Parameter::expert) but its unit ", unit_name_at(ch, p.offset),
                   (b.expert ? " is" : " is not"), " an expert unit (ParamUnit::expert): expert and dense parameters "
                   "are reduced over different groups and need units of their own");
        LOOM_CHECK(!p.expert || !(p.sequence_parallel || p.tied_embedding || p.tied_embedding_copy),
                   "[DistributedOptimizer] expert parameter ", p.name, " cannot be sequence-parallel or tied");
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
        // Replicated over (E)TP: counted on its rank 0 only. Dense parameters are replicated over dp_cp,
        // expert ones over expert_dp; model_sum reduces each kind over the groups that hold it once.
        const int tp_rank = p.expert ? ps.etp_rank() : ps.tp_rank();
        piece.count_in_norm = !(p.partition_dim == -1 && tp_rank != 0) && !p.tied_embedding_copy;
        piece.expert = p.expert;
        ch.pieces.push_back(piece);
      }
      b.deferred = !b.emb.empty();
    }
    ch.shard_numel = im.sharded() ? shard_off : set->numel();
    if (optim.kind == OptimizerKind::kAdam) {
      ch.exp_avg = ctx.zeros({ch.shard_numel}, DType::kF32);
      ch.exp_avg_sq = ctx.zeros({ch.shard_numel}, DType::kF32);
    } else if (optim.sgd_momentum != 0.0f) {
      ch.momentum = ctx.zeros({ch.shard_numel}, DType::kF32);
    }
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
std::vector<DistributedOptimizer::BucketInfo> DistributedOptimizer::bucket_info(int chunk) const {
  std::vector<BucketInfo> out;
  for (const Bucket& b : impl_->chunks.at(size_t(chunk)).buckets) out.push_back({b.begin, b.end, b.expert, b.group->size(), b.padded});
  return out;
}
ParamHooks* DistributedOptimizer::hooks(int chunk) { return impl_->hooks.at(size_t(chunk)).get(); }
OptimizerKind DistributedOptimizer::kind() const { return impl_->optim.kind; }
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
      if (ch.exp_avg.defined()) {
        s.exp_avg = ch.exp_avg.view().slice_flat(pc.shard_off, n);
        s.exp_avg_sq = ch.exp_avg_sq.view().slice_flat(pc.shard_off, n);
      }
      if (ch.momentum.defined()) s.momentum_buffer = ch.momentum.view().slice_flat(pc.shard_off, n);
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
    m.optimizer += bytes(ch.exp_avg) + bytes(ch.exp_avg_sq) + bytes(ch.momentum);
  }
  m.buffers_peak = im.buffers_peak;
  return m;
}

}  // namespace loom

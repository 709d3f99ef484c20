// DistributedOptimizer, per step: the data-parallel gradient reduction of each bucket (TP and
// embedding-group sums, the 1/DP pre-scale, all-reduce or reduce-scatter over dp_cp or, for expert
// buckets, expert_dp, moving the result where Adam reads it), the global gradient and parameter norms, the inf/NaN check and the Adam step over the owned
// pieces. The layout these work on is built in distributed_optimizer.cpp; the invariants are listed there.
#include <algorithm>
#include <cmath>
#include <utility>

#include "optim/distributed_optimizer_impl.h"

namespace loom {

using namespace dist_optim_detail;

// ---- small buffer helpers ----
void DistributedOptimizer::Impl::add_into(TensorView dst_f32, TensorView src) const {
  if (src.dtype() == DType::kF32) {
    ctx.ops().residual_forward(dst_f32, dst_f32, src);
    return;
  }
  Tensor tmp = ctx.empty(src.shape(), DType::kF32);
  ctx.ops().cast(tmp, src);
  ctx.ops().residual_forward(dst_f32, dst_f32, tmp);
}

// The bucket's gradients as the model writes them: ParameterSet grads, or the bucket buffer.
TensorView DistributedOptimizer::Impl::bucket_grads(Chunk& ch, Bucket& b) const {
  if (bucket_grads_only()) return b.grad_buf.view().slice_flat(0, Shape{b.numel()});
  return ch.set->grads().view().slice_flat(b.begin, Shape{b.numel()});
}

TensorView DistributedOptimizer::Impl::piece_grad(Chunk& ch, const Piece& p) const {
  const Shape s{p.flat_end - p.flat_begin};
  if (!ch.grad_shard.defined()) return ch.set->grads().view().slice_flat(p.flat_begin, s);
  return ch.grad_shard.view().slice_flat(p.shard_off, s);
}
TensorView DistributedOptimizer::Impl::piece_master(Chunk& ch, const Piece& p) const {
  const Shape s{p.flat_end - p.flat_begin};
  if (ch.master_shard.defined()) return ch.master_shard.view().slice_flat(p.shard_off, s);
  return ch.set->values().view().slice_flat(p.flat_begin, s);
}

TensorView DistributedOptimizer::Impl::piece_compute(Chunk& ch, const Piece& p) const {
  if (sharded()) return {};
  const Tensor& compute = ch.set->compute_values();
  if (!compute.defined() || compute.raw() == ch.set->values().raw()) return {};
  return compute.view().slice_flat(p.flat_begin, Shape{p.flat_end - p.flat_begin});
}

// Per-rank partials -> the world's figure. ZeRO shards are disjoint across dp_cp (dense) and expert_dp
// (expert), so the whole world holds each counted element once: one sum over the world. Without sharding
// every replica has all of it: dense partials are summed over mp (TP x PP: one model), expert partials over
// expert_mp (ETP x EP x PP: every expert once) — the same communicator, so one reduction, when there is
// no expert parallelism (EP = 1, ETP = TP).
double DistributedOptimizer::Impl::reduce_partials(double dense, double expert, ReduceOp op) const {
  const auto combine = [op](double a, double b) { return op == ReduceOp::kMax ? (!(b <= a) ? b : a) : a + b; };
  if (sharded()) return ps.world().all_reduce_scalar(combine(dense, expert), op);
  if (&ps.expert_mp() == &ps.mp()) return ps.mp().all_reduce_scalar(combine(dense, expert), op);
  return combine(ps.mp().all_reduce_scalar(dense, op), ps.expert_mp().all_reduce_scalar(expert, op));
}

// L2 norm over the whole model of what view(chunk, piece) gives for every owned piece, replicas (TP / ETP
// duplicates, the tied embedding's copy, DP and expert-DP replicas) counted once.
template <typename View, typename F>
double DistributedOptimizer::Impl::model_sum(View view, F f) {
  double dense = 0.0, expert = 0.0;
  for (Chunk& ch : chunks) {
    // Without sharding, a dense chunk whose pieces all count tiles its whole flat buffer: one reduction
    // over it (one device read-back instead of one per parameter; a world of one sums as plain AdamW would).
    const bool all_count = std::all_of(ch.pieces.begin(), ch.pieces.end(),
                                       [](const Piece& p) { return p.count_in_norm && !p.expert; });
    if (!sharded() && all_count) {
      Piece whole;
      whole.flat_end = ch.set->numel();
      if (whole.flat_end > 0) dense += f(view(ch, whole));
      continue;
    }
    for (const Piece& p : ch.pieces)
      if (p.count_in_norm) (p.expert ? expert : dense) += f(view(ch, p));
  }
  return reduce_partials(dense, expert, ReduceOp::kSum);
}

// ---- reductions ----
void DistributedOptimizer::Impl::sum_over(const Communicator& g, TensorView grads,
                                          const std::vector<Range>& ranges) const {
  if (g.size() == 1) return;
  for (const Range& r : ranges) g.all_reduce(grads.slice_flat(r.begin, Shape{r.numel}), ReduceOp::kSum);
}

// Starts bucket b's data-parallel reduction (after its TP sums; the embedding sum is the caller's).
void DistributedOptimizer::Impl::launch(Chunk& ch, Bucket& b) {
  b.reduced = true;
  b.units_done = 0;
  if (b.numel() == 0) return;
  TensorView g = bucket_grads(ch, b);
  if (ps.tp().size() > 1) sum_over(ps.tp(), g, b.sp);  // expert buckets have no sequence-parallel ranges
  const Communicator& group = *b.group;
  // 1/(DP·CP) for expert buckets too, whatever expert_dp's size (see the invariants).
  if (dp() > 1) ctx.ops().scale_(g, 1.0f / float(dp()));
  if (!sharded()) {
    if (group.size() > 1) b.work = group.all_reduce_async(g, ReduceOp::kSum);
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
void DistributedOptimizer::Impl::complete(Chunk& ch, Bucket& b) {
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
void DistributedOptimizer::Impl::track_inflight(int c, int bucket) {
  inflight.emplace_back(c, bucket);
  while (inflight.size() > 1) {
    const auto [oc, ob] = inflight.front();
    inflight.pop_front();
    Bucket& o = chunks[size_t(oc)].buckets[size_t(ob)];
    if (o.work || o.out.defined()) complete(chunks[size_t(oc)], o);
  }
}

// ---- the step ----

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
    // Every gradient the model writes now holds zeros: the set's buffer (zeroed by the last step's update,
    // by complete() outside the owned ranges, or just above) or a bucket buffer bound from ctx.zeros. So
    // each gradient's first write of the step may store instead of add (Parameter::grad_zero).
    ch.set->mark_grads_zero();
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
  return std::sqrt(im.model_sum([&](Chunk& ch, const Piece& p) { return im.piece_grad(ch, p); },
                                 [&](TensorView g) { return im.ctx.ops().sum_squares(g); }));
}

OptimizerStateStats DistributedOptimizer::state_stats() {
  finish_param_sync();
  Impl& im = *impl_;
  OptimizerStateStats st;
  const Chunk& first = im.chunks.front();
  st.has_variance = first.exp_avg_sq.defined();
  st.has_momentum = first.exp_avg.defined() || first.momentum.defined();
  // Local sums (squares, |x|, sqrt|x|) and maxima of each state over the pieces counted in norms, dense
  // ([0]) and expert ([1]) pieces apart (they are reduced over different groups).
  double sq[2][3] = {}, l1[2][3] = {}, sqrt_l1[2] = {}, mx[2][3] = {};
  auto add = [&](int e, int k, TensorView v) {
    sq[e][k] += im.ctx.ops().sum_squares(v);
    const AbsStats a = im.ctx.ops().abs_stats(v);
    l1[e][k] += a.sum_abs;
    if (k == 0) sqrt_l1[e] += a.sum_sqrt_abs;
    if (!(a.max_abs <= mx[e][k])) mx[e][k] = a.max_abs;
  };
  for (Chunk& ch : im.chunks)
    for (const Piece& p : ch.pieces) {
      if (!p.count_in_norm) continue;
      const int e = p.expert ? 1 : 0;
      const Shape n{p.flat_end - p.flat_begin};
      if (ch.exp_avg_sq.defined()) add(e, 0, ch.exp_avg_sq.view().slice_flat(p.shard_off, n));
      if (ch.exp_avg.defined()) add(e, 1, ch.exp_avg.view().slice_flat(p.shard_off, n));
      if (ch.momentum.defined()) add(e, 1, ch.momentum.view().slice_flat(p.shard_off, n));
      add(e, 2, im.piece_master(ch, p));
    }
  double tot_sq[3], tot_l1[3], tot_mx[3];
  for (int k = 0; k < 3; ++k) {
    tot_sq[k] = im.reduce_partials(sq[0][k], sq[1][k], ReduceOp::kSum);
    tot_l1[k] = im.reduce_partials(l1[0][k], l1[1][k], ReduceOp::kSum);
    tot_mx[k] = im.reduce_partials(mx[0][k], mx[1][k], ReduceOp::kMax);
  }
  const double tot_sqrt_l1 = im.reduce_partials(sqrt_l1[0], sqrt_l1[1], ReduceOp::kSum);
  // ||sqrt(v)||_2^2 = Σ v = ||v||_1 (v >= 0); max sqrt(v) = sqrt(max v).
  st.variance_l2 = std::sqrt(tot_sq[0]);
  st.variance_sqrt_l2 = std::sqrt(tot_l1[0]);
  st.variance_l1 = tot_l1[0];
  st.variance_sqrt_l1 = tot_sqrt_l1;
  st.variance_abs_max = tot_mx[0];
  st.variance_sqrt_abs_max = std::sqrt(tot_mx[0]);
  st.momentum_l2 = std::sqrt(tot_sq[1]);
  st.momentum_l1 = tot_l1[1];
  st.momentum_abs_max = tot_mx[1];
  st.weight_l2 = std::sqrt(tot_sq[2]);
  st.weight_l1 = tot_l1[2];
  st.weight_abs_max = tot_mx[2];
  return st;
}

int64_t DistributedOptimizer::num_zeros_in_grad() {
  Impl& im = *impl_;
  return int64_t(im.model_sum([&](Chunk& ch, const Piece& p) { return im.piece_grad(ch, p); },
                              [&](TensorView g) { return double(im.ctx.ops().count_zeros(g)); }));
}

double DistributedOptimizer::param_norm() {
  finish_param_sync();
  Impl& im = *impl_;
  return std::sqrt(im.model_sum([&](Chunk& ch, const Piece& p) { return im.piece_master(ch, p); },
                                 [&](TensorView w) { return im.ctx.ops().sum_squares(w); }));
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
  p.beta1 = im.optim.adam.beta1;
  p.beta2 = im.optim.adam.beta2;
  p.eps = im.optim.adam.eps;
  p.step = im.steps;
  p.grad_scale = grad_scale;
  p.zero_grad = true;  // the gradients the optimizer reads start the next step from zero
  SgdParams sgd;
  sgd.lr = lr;
  sgd.momentum = im.optim.sgd_momentum;
  sgd.grad_scale = grad_scale;
  sgd.zero_grad = true;
  const bool adam = im.optim.kind == OptimizerKind::kAdam;
  // Both updates are elementwise: runs of pieces adjacent in both the flat buffer and shard space with the
  // same weight-decay flag go in one call (a few launches per step on a GPU instead of one per parameter).
  for (Chunk& ch : im.chunks)
    for (size_t i = 0; i < ch.pieces.size();) {
      Piece run = ch.pieces[i];
      size_t j = i + 1;
      for (; j < ch.pieces.size(); ++j) {
        const Piece& next = ch.pieces[j];
        if (next.weight_decay != run.weight_decay || next.flat_begin != run.flat_end ||
            next.shard_off != run.shard_off + (run.flat_end - run.flat_begin))
          break;
        run.flat_end = next.flat_end;
      }
      p.weight_decay = sgd.weight_decay = run.weight_decay ? weight_decay : 0.0f;
      const Shape s{run.flat_end - run.flat_begin};
      if (adam)
        im.ctx.ops().adamw_update(im.piece_master(ch, run), im.piece_grad(ch, run),
                                  ch.exp_avg.view().slice_flat(run.shard_off, s),
                                  ch.exp_avg_sq.view().slice_flat(run.shard_off, s), p, im.piece_compute(ch, run));
      else
        im.ctx.ops().sgd_update(im.piece_master(ch, run), im.piece_grad(ch, run),
                                ch.momentum.defined() ? ch.momentum.view().slice_flat(run.shard_off, s) : TensorView{},
                                sgd, im.piece_compute(ch, run));
      i = j;
    }
  im.grads_dirty = false;
  sync_params(/*unsharded_compute_written=*/true);
}

}  // namespace loom

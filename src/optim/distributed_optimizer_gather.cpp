// DistributedOptimizer, around each unit's forward and backward: the all-gather of updated parameters
// (ZeRO-1/2 after the step, overlapped with the next forward under --overlap-param-gather), ZeRO-3's
// per-unit gather, binding, prefetch and release of parameters and gradient buffers, and the hooks the
// model calls (which also start the overlapped gradient reductions of distributed_optimizer_reduce.cpp).
// The layout these work on is built in distributed_optimizer.cpp; the invariants are listed there.
#include <algorithm>
#include <vector>

#include "optim/distributed_optimizer_impl.h"

namespace loom {

using namespace dist_optim_detail;

// ---- parameter binding (ZeRO-3) and all-gathers ----
template <typename F>
void DistributedOptimizer::Impl::for_params(Chunk& ch, const Bucket& b, F f) {
  for (Parameter& p : ch.set->all())
    if (p.offset >= b.begin && p.offset < b.end) f(p);
}
// Where a sharded-but-not-ZeRO-3 bucket's gathered values go: the f32 values (f32 compute, which the
// masters are part of) or the compute copy (16-bit compute with an f32 master shard).
TensorView DistributedOptimizer::Impl::gather_target(Chunk& ch, const Bucket& b) const {
  const Tensor& full = ch.master_shard.defined() ? ch.set->compute_values() : ch.set->values();
  return full.view().slice_flat(b.begin, Shape{b.numel()});
}
// Starts the all-gather of the updated parameters of bucket b (ZeRO-1/2): this rank's slice, padded.
void DistributedOptimizer::Impl::start_param_gather(Chunk& ch, Bucket& b) {
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
  b.gather_work = b.group->all_gather_async(recv, b.gather_send);
}
void DistributedOptimizer::Impl::finish_param_gather(Chunk& ch, Bucket& b) {
  if (!b.gather_work) return;
  b.gather_work->wait();
  b.gather_work.reset();
  if (b.gather_recv.defined())
    ctx.copy(gather_target(ch, b), b.gather_recv.view().slice_flat(0, Shape{b.numel()}));
  b.gather_send = Tensor();
  b.gather_recv = Tensor();
}

// ZeRO-3: the unit's compute values gathered into params_buf and bound to its parameters.
void DistributedOptimizer::Impl::start_unit_gather(Chunk& ch, Bucket& b) {
  const DType cdt = ch.set->compute_dtype();
  b.params_buf = ctx.empty({b.padded}, cdt);
  const Tensor& src = ch.compute_shard.defined() ? ch.compute_shard : ch.master_shard;
  note_buffers();
  b.gather_work = b.group->all_gather_async(b.params_buf, src.view().slice_flat(b.shard_off, Shape{b.shard}));
}
void DistributedOptimizer::Impl::bind_params(Chunk& ch, Bucket& b) {
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
void DistributedOptimizer::Impl::gather(Chunk& ch, Bucket& b) {
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
void DistributedOptimizer::Impl::prefetch(Chunk& ch, Bucket& b) {
  if (b.numel() == 0 || b.param_refs > 0 || b.prefetched) return;
  b.param_refs = 1;
  b.prefetched = true;
  start_unit_gather(ch, b);
}
void DistributedOptimizer::Impl::release(Chunk& ch, Bucket& b) {
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
void DistributedOptimizer::Impl::drop_prefetches() {
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
void DistributedOptimizer::Impl::bind_grads(Chunk& ch, Bucket& b) {
  if (b.grad_buf.defined() || b.numel() == 0) return;
  b.grad_buf = ctx.zeros({b.padded}, ch.set->grad_dtype());
  for_params(ch, b, [&](Parameter& p) { p.grad = b.grad_buf.slice_flat(p.offset - b.begin, p.shape); });
  note_buffers();
}
void DistributedOptimizer::Impl::unbind_grads(Chunk& ch, Bucket& b) {
  for_params(ch, b, [&](Parameter& p) { p.grad = Tensor(); });
}

// ---- hooks ----
Bucket& DistributedOptimizer::Impl::bucket_of(int c, int unit) {
  Chunk& ch = chunks[size_t(c)];
  LOOM_CHECK(unit >= 0 && unit < int(ch.units.size()), "[DistributedOptimizer] unit ", unit, " out of range (",
             ch.units.size(), " units in chunk ", c, ")");
  return ch.buckets[size_t(ch.unit_bucket[size_t(unit)])];
}
int DistributedOptimizer::Impl::next_hooked_unit(int c, int unit, int step) const {
  const Chunk& ch = chunks[size_t(c)];
  for (int u = unit + step; u >= 0 && u < int(ch.units.size()); u += step)
    if (ch.covered_by[size_t(u)] < 0) return u;
  return -1;
}
// The buckets a unit's computation touches: its own, then those of the units it reads.
std::vector<Bucket*> DistributedOptimizer::Impl::buckets_used(int c, int unit) {
  std::vector<Bucket*> out{&bucket_of(c, unit)};
  const Chunk& ch = chunks[size_t(c)];
  if (const int reader = ch.covered_by[size_t(unit)]; reader >= 0)
    LOOM_FAIL("[DistributedOptimizer] hooks called for expert unit ", ch.units[size_t(unit)].name, ", which unit ",
              ch.units[size_t(reader)].name, " reads: call the reader's hooks only (they cover it)");
  for (int r : chunks[size_t(c)].units[size_t(unit)].reads) {
    Bucket* b = &bucket_of(c, r);
    if (std::find(out.begin(), out.end(), b) == out.end()) out.push_back(b);
  }
  return out;
}
// Whether a finished backward of this micro-batch may start a ZeRO-0/1 bucket's reduction now.
bool DistributedOptimizer::Impl::launches_now(const Chunk& ch, const Bucket& b) const {
  return ddp.overlap_grad_reduce && !b.deferred && ch.last_microbatch;
}
void DistributedOptimizer::Impl::before_forward(int c, int unit) {
  Chunk& ch = chunks[size_t(c)];
  for (Bucket* b : buckets_used(c, unit)) {
    if (zero3())
      gather(ch, *b);
    else
      finish_param_gather(ch, *b);
  }
  if (zero3() && ddp.overlap_param_gather) {
    const int next = next_hooked_unit(c, unit, +1);
    if (next >= 0)
      for (Bucket* b : buckets_used(c, next)) prefetch(ch, *b);
  }
}
void DistributedOptimizer::Impl::after_forward(int c, int unit) {
  if (!zero3()) return;
  for (Bucket* b : buckets_used(c, unit)) release(chunks[size_t(c)], *b);
}
void DistributedOptimizer::Impl::before_backward(int c, int unit) {
  Chunk& ch = chunks[size_t(c)];
  for (Bucket* b : buckets_used(c, unit)) {
    // A previous micro-batch's reduction of this bucket still in flight: folded before new gradients
    // are written (and before the bucket is launched again).
    if (!b->grad_buf.defined() && (b->work || b->out.defined())) complete(ch, *b);
    b->reduced = false;
    if (bucket_grads_only()) bind_grads(ch, *b);
    if (zero3()) gather(ch, *b);
  }
  if (zero3() && ddp.overlap_param_gather) {
    const int next = next_hooked_unit(c, unit, -1);
    if (next >= 0)
      for (Bucket* b : buckets_used(c, next)) prefetch(ch, *b);
  }
}
void DistributedOptimizer::Impl::after_backward(int c, int unit) {
  Chunk& ch = chunks[size_t(c)];
  const std::vector<Bucket*> used = buckets_used(c, unit);
  if (zero3())
    for (Bucket* b : used) release(ch, *b);
  // The units whose gradients are final now: this one and the expert units it covers (its own bucket
  // first, so a dense bucket launches before the experts' when both complete).
  std::vector<int> done{unit};
  for (int r : ch.units[size_t(unit)].reads)
    if (ch.covered_by[size_t(r)] == unit) done.push_back(r);
  for (int u : done) {
    Bucket& b = bucket_of(c, u);
    if (bucket_grads_only()) {
      // Reduced every micro-batch once all of the bucket's units are done; the tied embedding's bucket
      // keeps accumulating until finish_grad_sync.
      if (b.deferred || ++b.units_done < b.last_unit - b.first_unit + 1) continue;
      launch(ch, b);
      if (!ddp.overlap_grad_reduce)
        complete(ch, b);
      else
        track_inflight(c, int(&b - ch.buckets.data()));
      continue;
    }
    if (!launches_now(ch, b)) continue;
    if (++b.units_done == b.last_unit - b.first_unit + 1) launch(ch, b);
  }
}

// ---- parameter sync after the step ----

void DistributedOptimizer::sync_params_from_masters() { sync_params(false); }

void DistributedOptimizer::sync_params(bool unsharded_compute_written) {
  Impl& im = *impl_;
  finish_param_sync();
  for (Chunk& ch : im.chunks) {
    if (im.zero3()) {
      // The next forward gathers the compute copy from these shards.
      if (ch.compute_shard.defined()) im.ctx.ops().cast(ch.compute_shard, ch.master_shard);
      continue;
    }
    if (!im.sharded()) {
      if (!unsharded_compute_written) ch.set->sync_compute(im.ctx);
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

}  // namespace loom

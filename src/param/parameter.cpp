// ParameterSet: contiguous master / compute / grad buffers and name-keyed initialisation.
#include "loom/param/parameter.h"

#include <algorithm>
#include <atomic>
#include <utility>

#include "loom/core/env.h"
#include "loom/core/rng.h"

namespace loom {

namespace {
bool is_compute_dtype(DType dt) { return dt == DType::kF32 || dt == DType::kBF16 || dt == DType::kF16; }

// N(0, std²) (or kUniform's U(-b, b)) values of local elements [begin, end) of p (row-major over its local shape), written to
// v[0, end - begin). The global tensor is viewed as (outer, D, inner) around the partition dim D; each
// shard range is a (outer, size, inner) box whose rows of `size · inner` elements are contiguous both
// locally and in the global flat index, so every row is one Philox run at its global offset.
// The Philox run of n values at stream offset `offset`: N(0, std²), or U(-b, b) for kUniform.
void fill_run(const Parameter& p, float* v, int64_t n, uint64_t seed, uint64_t stream, uint64_t offset) {
  if (p.init == InitKind::kUniform) {
    philox_fill_uniform(v, n, seed, stream, offset);
    for (int64_t i = 0; i < n; ++i) v[i] = (2.0f * v[i] - 1.0f) * p.init_std;
  } else {
    philox_fill_normal(v, n, seed, stream, offset, 0.0f, p.init_std);
  }
}

void init_normal(const Parameter& p, float* v, uint64_t seed, int64_t begin, int64_t end) {
  const uint64_t stream = hash_stream(p.name);
  if (p.shard.empty()) {
    fill_run(p, v, end - begin, seed, stream, uint64_t(begin));
    return;
  }
  const Shape& g = p.global_shape;
  const int d = p.partition_dim;
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < d; ++i) outer *= g[i];
  for (int i = d + 1; i < g.ndim(); ++i) inner *= g[i];
  const int64_t local_d = p.shape[d];
  int64_t local_start = 0;  // along the local partition dim
  for (const ShardRange& r : p.shard) {
    for (int64_t o = 0; o < outer; ++o) {
      const int64_t row_begin = (o * local_d + local_start) * inner, row_end = row_begin + r.size * inner;
      const int64_t lo = std::max(row_begin, begin), hi = std::min(row_end, end);
      if (lo >= hi) continue;
      const uint64_t global = uint64_t((o * g[d] + r.start) * inner + (lo - row_begin));
      fill_run(p, v + (lo - begin), hi - lo, seed, stream, global);
    }
    local_start += r.size;
  }
}
}  // namespace

Parameter& ParameterSet::add(std::string name, Shape shape, InitKind init, float init_std, bool no_weight_decay,
                             int partition_dim) {
  LOOM_CHECK(!allocated_, "[ParameterSet] cannot add ", name, " after allocate()");
  LOOM_CHECK(index_.emplace(name, params_.size()).second, "[ParameterSet] duplicate parameter name ", name);
  Parameter& p = params_.emplace_back();
  p.name = std::move(name);
  p.shape = shape;
  p.init = init;
  p.init_std = init_std;
  p.no_weight_decay = no_weight_decay;
  p.partition_dim = partition_dim;
  p.global_shape = shape;
  p.offset = numel_;
  numel_ += shape.numel();
  return p;
}

Parameter& ParameterSet::add_sharded(std::string name, Shape global_shape, int partition_dim,
                                     std::vector<ShardRange> shard, InitKind init, float init_std,
                                     bool no_weight_decay) {
  LOOM_CHECK(partition_dim >= 0 && partition_dim < global_shape.ndim(), "[ParameterSet] ", name,
             ": partition dim ", partition_dim, " out of range for ", global_shape.str());
  LOOM_CHECK(!shard.empty(), "[ParameterSet] ", name, ": a sharded parameter needs at least one range");
  int64_t local = 0;
  for (const ShardRange& r : shard) {
    LOOM_CHECK(r.start >= 0 && r.size > 0 && r.start + r.size <= global_shape[partition_dim], "[ParameterSet] ",
               name, ": shard range [", r.start, ", ", r.start + r.size, ") outside dim ", partition_dim, " of ",
               global_shape.str());
    local += r.size;
  }
  std::vector<int64_t> dims(global_shape.begin(), global_shape.end());
  dims[size_t(partition_dim)] = local;
  Parameter& p = add(std::move(name), Shape(std::span<const int64_t>(dims)), init, init_std, no_weight_decay,
                     partition_dim);
  p.global_shape = global_shape;
  if (local != global_shape[partition_dim]) p.shard = std::move(shard);
  return p;
}

void ParameterSet::allocate(const DeviceContext& ctx, DType compute_dtype, DType grad_dtype, bool with_grads,
                            ParamStorage storage) {
  LOOM_CHECK(!allocated_, "[ParameterSet] allocate() called twice");
  LOOM_CHECK(is_compute_dtype(compute_dtype), "[ParameterSet] compute dtype must be f32, bf16 or f16, got ",
             dtype_name(compute_dtype));
  LOOM_CHECK(grad_dtype == DType::kF32 || grad_dtype == compute_dtype,
             "[ParameterSet] grad dtype must be f32 or the compute dtype ", dtype_name(compute_dtype), ", got ",
             dtype_name(grad_dtype));
  ctx_ = &ctx;
  allocated_ = true;
  storage_ = storage;
  compute_dtype_ = compute_dtype;
  grad_dtype_ = with_grads ? grad_dtype : DType::kF32;
  if (storage == ParamStorage::kExternal) return;  // the owner binds the views
  const bool masters = storage == ParamStorage::kFull || compute_dtype == DType::kF32;
  with_grads = with_grads && storage != ParamStorage::kShardedMasterGrads && storage != ParamStorage::kFrozen;
  if (storage == ParamStorage::kFrozen) grad_dtype_ = DType::kF32;
  compute_ = ctx.empty({numel_}, compute_dtype);
  if (masters) values_ = compute_dtype == DType::kF32 ? compute_ : ctx.empty({numel_}, DType::kF32);
  if (with_grads) grads_ = ctx.zeros({numel_}, grad_dtype);
  for (Parameter& p : params_) {
    if (masters) p.value = values_.slice_flat(p.offset, p.shape);
    p.compute = compute_.slice_flat(p.offset, p.shape);
    if (with_grads) p.grad = grads_.slice_flat(p.offset, p.shape);
  }
}

void ParameterSet::initialize(uint64_t seed) {
  if (storage_ == ParamStorage::kFrozen && !values_.defined() && allocated_) {
    // No f32 values: initialise in host chunks and round each into the compute copy.
    constexpr int64_t kChunk = int64_t(1) << 24;
    Tensor host = Tensor::empty({std::min(kChunk, std::max<int64_t>(numel_, 1))}, DType::kF32);
    Tensor staged = compute_.device().is_cpu() ? Tensor() : ctx_->empty(host.shape(), DType::kF32);
    for (int64_t b = 0; b < numel_; b += kChunk) {
      const int64_t n = std::min(kChunk, numel_ - b);
      initialize_range(seed, b, b + n, host.data<float>());
      TensorView src = host.view().slice_flat(0, {n});
      if (staged.defined()) {
        ctx_->copy(staged.view().slice_flat(0, {n}), src);
        src = staged.view().slice_flat(0, {n});
      }
      ctx_->ops().cast(compute_.view().slice_flat(b, {n}), src);
    }
    return;
  }
  LOOM_CHECK(values_.defined(), "[ParameterSet] initialize() before allocate() (or on external storage: the "
             "owner initialises through initialize_range)");
  if (values_.device().is_cpu()) {
    initialize_range(seed, 0, numel_, values_.data<float>());
  } else {  // initialised on the host from the same Philox streams, then copied: identical on every device
    Tensor host = Tensor::empty({numel_}, DType::kF32);
    initialize_range(seed, 0, numel_, host.data<float>());
    ctx_->copy(values_, host);
  }
  sync_compute(*ctx_);
}

void ParameterSet::initialize_range(uint64_t seed, int64_t begin, int64_t end, float* out) const {
  LOOM_CHECK(0 <= begin && begin <= end && end <= numel_, "[ParameterSet] initialize_range [", begin, ", ", end,
             ") outside the layout of ", numel_, " elements");
  for (const Parameter& p : params_) {
    const int64_t lo = std::max(begin, p.offset), hi = std::min(end, p.offset + p.shape.numel());
    if (lo >= hi) continue;
    float* v = out + (lo - begin);
    switch (p.init) {
      case InitKind::kNormal:
      case InitKind::kUniform: init_normal(p, v, seed, lo - p.offset, hi - p.offset); break;
      case InitKind::kZeros: std::fill(v, v + (hi - lo), 0.0f); break;
      case InitKind::kOnes: std::fill(v, v + (hi - lo), 1.0f); break;
    }
  }
}

void ParameterSet::sync_compute(const DeviceContext& ctx) const {
  if (storage_ == ParamStorage::kFrozen && !values_.defined()) return;  // the compute copy is the only one
  LOOM_CHECK(values_.defined(), "[ParameterSet] sync_compute() before allocate() (or without f32 master values: "
             "the distributed optimizer writes the compute copy of sharded storage)");
  if (compute_.raw() == values_.raw()) return;  // f32 compute reads the master weights directly
  ctx.ops().cast(compute_, values_);
}

void ParameterSet::write_value(Parameter& p, TensorView src) const {
  LOOM_CHECK(allocated_ && storage_ != ParamStorage::kExternal, "[ParameterSet] write_value(", p.name,
             ") needs allocated storage");
  LOOM_CHECK(src.dtype() == DType::kF32 && src.shape() == p.shape, "[ParameterSet] write_value(", p.name,
             ") expects f32 ", p.shape.str(), ", got ", src.desc());
  if (p.value.defined()) {
    ctx_->copy(p.value, src);
    return;
  }
  Tensor staged;
  if (src.device() != p.compute.device()) {
    staged = ctx_->empty(p.shape, DType::kF32);
    ctx_->copy(staged, src);
    src = staged;
  }
  ctx_->ops().cast(p.compute, src);
}

const Parameter* ParameterSet::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &params_[it->second];
}

Parameter* ParameterSet::find(const std::string& name) {
  return const_cast<Parameter*>(std::as_const(*this).find(name));
}

void ParameterSet::zero_grads(const DeviceContext& ctx) const {
  LOOM_CHECK(grads_.defined(), "[ParameterSet] zero_grads() on a set allocated without gradients");
  ctx.ops().fill_(grads_, 0.0f);
}

// ---- first writes of a step ----

namespace {
std::atomic<bool>& overwrite_checks() {
  static std::atomic<bool> on{env_flag("LOOM_CHECK_GRAD_OVERWRITE")};
  return on;
}

void check_zero(const DeviceContext& ctx, const Parameter& p) {
  if (!p.grad.defined() || !grad_overwrite_checks()) return;
  const int64_t zeros = ctx.ops().count_zeros(p.grad);
  LOOM_CHECK(zeros == p.grad.numel(), "[ParameterSet] the gradient of ", p.name, " is marked as holding zeros but ",
             p.grad.numel() - zeros, " of its ", p.grad.numel(), " elements are not: a writer added to it before "
             "the first matmul without clear_grad_zero()");
}
}  // namespace

bool grad_overwrite_checks() { return overwrite_checks().load(std::memory_order_relaxed); }
void set_grad_overwrite_checks(bool on) { overwrite_checks().store(on, std::memory_order_relaxed); }

GradWrite take_grad_write(const DeviceContext& ctx, Parameter& p) {
  if (!p.grad_zero || !p.grad.defined()) return GradWrite::kAccumulate;
  p.grad_zero = false;
  check_zero(ctx, p);
  return GradWrite::kOverwrite;
}

GradWrite take_grad_write(const DeviceContext& ctx, const std::vector<Parameter*>& ps) {
  bool all = !ps.empty();
  for (Parameter* p : ps) {
    all = all && p->grad_zero;
    if (p->grad_zero) check_zero(ctx, *p);
    p->grad_zero = false;
  }
  return all ? GradWrite::kOverwrite : GradWrite::kAccumulate;
}

void ParameterSet::mark_grads_zero() {
  for (Parameter& p : params_) p.grad_zero = true;
}

}  // namespace loom

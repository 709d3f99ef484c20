// ParameterSet: contiguous master / compute / grad buffers and name-keyed initialisation.
#include "loom/nn/parameter.h"

#include <algorithm>
#include <utility>

#include "loom/core/rng.h"

namespace loom {

namespace {
bool is_compute_dtype(DType dt) { return dt == DType::kF32 || dt == DType::kBF16 || dt == DType::kF16; }
}  // namespace

Parameter& ParameterSet::add(std::string name, Shape shape, InitKind init, float init_std, bool no_weight_decay,
                             int partition_dim) {
  LOOM_CHECK(!values_.defined(), "[ParameterSet] cannot add ", name, " after allocate()");
  LOOM_CHECK(find(name) == nullptr, "[ParameterSet] duplicate parameter name ", name);
  Parameter& p = params_.emplace_back();
  p.name = std::move(name);
  p.shape = shape;
  p.init = init;
  p.init_std = init_std;
  p.no_weight_decay = no_weight_decay;
  p.partition_dim = partition_dim;
  p.offset = numel_;
  numel_ += shape.numel();
  return p;
}

void ParameterSet::allocate(const DeviceContext& ctx, DType compute_dtype, DType grad_dtype, bool with_grads) {
  LOOM_CHECK(!values_.defined(), "[ParameterSet] allocate() called twice");
  LOOM_CHECK(is_compute_dtype(compute_dtype), "[ParameterSet] compute dtype must be f32, bf16 or f16, got ",
             dtype_name(compute_dtype));
  LOOM_CHECK(grad_dtype == DType::kF32 || grad_dtype == compute_dtype,
             "[ParameterSet] grad dtype must be f32 or the compute dtype ", dtype_name(compute_dtype), ", got ",
             dtype_name(grad_dtype));
  ctx_ = &ctx;
  values_ = ctx.empty({numel_}, DType::kF32);
  compute_ = compute_dtype == DType::kF32 ? values_ : ctx.empty({numel_}, compute_dtype);
  if (with_grads) grads_ = ctx.zeros({numel_}, grad_dtype);
  for (Parameter& p : params_) {
    p.value = values_.slice_flat(p.offset, p.shape);
    p.compute = compute_.slice_flat(p.offset, p.shape);
    if (with_grads) p.grad = grads_.slice_flat(p.offset, p.shape);
  }
}

void ParameterSet::initialize(uint64_t seed) {
  LOOM_CHECK(values_.defined(), "[ParameterSet] initialize() before allocate()");
  LOOM_CHECK(values_.device().is_cpu(), "[ParameterSet] host initialisation only in this build");
  for (Parameter& p : params_) {
    float* v = p.value.data<float>();
    const int64_t n = p.shape.numel();
    switch (p.init) {
      case InitKind::kNormal: philox_fill_normal(v, n, seed, hash_stream(p.name), 0, 0.0f, p.init_std); break;
      case InitKind::kZeros: std::fill(v, v + n, 0.0f); break;
      case InitKind::kOnes: std::fill(v, v + n, 1.0f); break;
    }
  }
  sync_compute(*ctx_);
}

void ParameterSet::sync_compute(const DeviceContext& ctx) const {
  LOOM_CHECK(values_.defined(), "[ParameterSet] sync_compute() before allocate()");
  if (compute_.raw() == values_.raw()) return;  // f32 compute reads the master weights directly
  ctx.ops().cast(compute_, values_);
}

const Parameter* ParameterSet::find(const std::string& name) const {
  for (const Parameter& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

Parameter* ParameterSet::find(const std::string& name) {
  return const_cast<Parameter*>(std::as_const(*this).find(name));
}

void ParameterSet::zero_grads(const DeviceContext& ctx) const {
  LOOM_CHECK(grads_.defined(), "[ParameterSet] zero_grads() on a set allocated without gradients");
  ctx.ops().fill_(grads_, 0.0f);
}

}  // namespace loom

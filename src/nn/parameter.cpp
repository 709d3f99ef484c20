#include "loom/nn/parameter.h"

#include <algorithm>

#include "loom/core/rng.h"

namespace loom {

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

void ParameterSet::allocate(const DeviceContext& ctx) {
  values_ = ctx.empty({numel_}, DType::kF32);
  grads_ = ctx.zeros({numel_}, DType::kF32);
  for (Parameter& p : params_) {
    p.value = values_.slice_flat(p.offset, p.shape);
    p.grad = grads_.slice_flat(p.offset, p.shape);
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
}

Parameter* ParameterSet::find(const std::string& name) {
  for (Parameter& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

void ParameterSet::zero_grads(const DeviceContext& ctx) const { ctx.ops().fill_(grads_, 0.0f); }

}  // namespace loom

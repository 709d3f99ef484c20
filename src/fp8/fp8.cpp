// FP8 recipe parsing and the per-tensor delayed-scaling state (loom/fp8/fp8.h); the arithmetic is the
// backend's fp8 ops.
#include "loom/fp8/fp8.h"

#include "loom/core/check.h"
#include "loom/dist/communicator.h"

namespace loom {

Fp8Format parse_fp8_format(const std::string& s) {
  if (s == "e4m3") return Fp8Format::kE4M3;
  if (s == "hybrid") return Fp8Format::kHybrid;
  user_error("--fp8-format must be e4m3 or hybrid, got '", s, "'");
}

AmaxComputeAlgo parse_amax_compute_algo(const std::string& s) {
  if (s == "max") return AmaxComputeAlgo::kMax;
  if (s == "most_recent") return AmaxComputeAlgo::kMostRecent;
  user_error("--fp8-amax-compute-algo must be max or most_recent, got '", s, "'");
}

const char* fp8_format_name(Fp8Format f) { return f == Fp8Format::kE4M3 ? "e4m3" : "hybrid"; }
const char* amax_compute_algo_name(AmaxComputeAlgo a) { return a == AmaxComputeAlgo::kMax ? "max" : "most_recent"; }

void Fp8Recipe::validate() const {
  if (margin < 0) user_error("--fp8-margin must be >= 0, got ", margin);
  if (amax_history_len < 1) user_error("--fp8-amax-history-len must be >= 1, got ", amax_history_len);
}

Fp8ScalingGroup::Fp8ScalingGroup(const DeviceContext& ctx, DType fp8_dtype, int num_tensors, const Fp8Recipe& recipe)
    : ctx_(ctx), dtype_(fp8_dtype), n_(num_tensors), recipe_(recipe) {
  LOOM_CHECK(fp8_dtype == DType::kF8E4M3 || fp8_dtype == DType::kF8E5M2, "[Fp8ScalingGroup] expected an fp8 dtype, got ",
             dtype_name(fp8_dtype));
  LOOM_CHECK(num_tensors >= 1, "[Fp8ScalingGroup] needs at least one tensor, got ", num_tensors);
  recipe.validate();
  history_ = ctx.zeros({int64_t(recipe.amax_history_len), int64_t(n_)}, DType::kF32);
  scale_ = ctx.empty({int64_t(n_)}, DType::kF32);
  scale_inv_ = ctx.empty({int64_t(n_)}, DType::kF32);
  ctx.ops().fill_(scale_, 1.0f);
  ctx.ops().fill_(scale_inv_, 1.0f);
}

TensorView Fp8ScalingGroup::scale(int i) const {
  LOOM_CHECK(i >= 0 && i < n_, "[Fp8ScalingGroup] tensor ", i, " out of range (", n_, ")");
  return scale_.view().slice_flat(i, Shape{1});
}
TensorView Fp8ScalingGroup::scale_inv(int i) const {
  LOOM_CHECK(i >= 0 && i < n_, "[Fp8ScalingGroup] tensor ", i, " out of range (", n_, ")");
  return scale_inv_.view().slice_flat(i, Shape{1});
}
TensorView Fp8ScalingGroup::amax(int i) const {
  LOOM_CHECK(i >= 0 && i < n_, "[Fp8ScalingGroup] tensor ", i, " out of range (", n_, ")");
  return history_.view().slice_flat(i, Shape{1});
}
TensorView Fp8ScalingGroup::current_amaxes() const { return history_.view().slice_flat(0, Shape{int64_t(n_)}); }

void Fp8ScalingGroup::reduce_amaxes(const Communicator& group) const {
  // A rank that saw a non-finite value recorded +inf (fp8_quantize), which wins the max: every rank then
  // keeps its scale for that tensor.
  group.all_reduce(current_amaxes(), ReduceOp::kMax);
}

void Fp8ScalingGroup::update() const {
  ctx_.ops().fp8_update_scaling(history_, scale_, scale_inv_, float(dtype_max(dtype_)), recipe_.margin,
                                recipe_.amax_compute_algo == AmaxComputeAlgo::kMax);
}

}  // namespace loom

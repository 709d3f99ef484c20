// FP8 training state (Transformer Engine's delayed scaling, Megatron's --fp8-* flags): the recipe and the
// per-tensor scaling metadata of a group of tensors that share one fp8 format.
//
// Delayed scaling: a tensor is quantised with the scale derived from the amaxes of earlier steps, and
// its own amax is recorded for later ones. Per tensor, an amax history of L steps (row 0: this step);
// after the step (and after the amaxes were reduced over the ranks that share the tensors):
//   amax  = max over the history ("max") or this step's ("most_recent"),
//   scale = (fp8_max / amax) / 2^margin, kept as it was when amax is 0 or not finite,
//   scale_inv = 1 / scale; the history rolls by one step.
// Formats: E4M3 everywhere ("e4m3"), or E4M3 for forward tensors (inputs, weights) and E5M2 for
// gradients ("hybrid", Transformer Engine's default). The state lives on the device of the context, as
// (1)-element views the backend's fp8 ops read and write, so a step needs no host round trip.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/backend/device_context.h"
#include "loom/core/tensor.h"

namespace loom {

class Communicator;

enum class Fp8Format { kE4M3, kHybrid };
enum class AmaxComputeAlgo { kMax, kMostRecent };

// --fp8-format e4m3|hybrid, --fp8-amax-compute-algo max|most_recent: UserError naming the flag and the
// valid values otherwise.
Fp8Format parse_fp8_format(const std::string& s);
AmaxComputeAlgo parse_amax_compute_algo(const std::string& s);
const char* fp8_format_name(Fp8Format f);
const char* amax_compute_algo_name(AmaxComputeAlgo a);

struct Fp8Recipe {
  Fp8Format format = Fp8Format::kHybrid;             // --fp8-format
  int margin = 0;                                    // --fp8-margin
  int amax_history_len = 1;                          // --fp8-amax-history-len (Megatron's default 1)
  AmaxComputeAlgo amax_compute_algo = AmaxComputeAlgo::kMostRecent;  // --fp8-amax-compute-algo
  bool wgrad = true;                                 // weight gradients from fp8 operands (else high precision)
  DType forward_dtype() const { return DType::kF8E4M3; }
  DType backward_dtype() const { return format == Fp8Format::kHybrid ? DType::kF8E5M2 : DType::kF8E4M3; }
  // UserError naming the flag for a negative margin or a history length < 1.
  void validate() const;
};

// The scaling state of n tensors quantised to one fp8 dtype: amax history (L, n), scale (n), scale_inv
// (n), all f32 on the context's device. Scales start at 1.
class Fp8ScalingGroup {
 public:
  Fp8ScalingGroup(const DeviceContext& ctx, DType fp8_dtype, int num_tensors, const Fp8Recipe& recipe);

  DType dtype() const { return dtype_; }
  int size() const { return n_; }
  // Tensor i's current scale, inverse scale and this step's amax slot, as (1) views for the fp8 ops.
  TensorView scale(int i) const;
  TensorView scale_inv(int i) const;
  TensorView amax(int i) const;
  // This step's amaxes of all tensors (n): reduced with kMax over the ranks that share the tensors
  // (data- and tensor-parallel replicas) before update(), so every rank derives the same scales.
  TensorView current_amaxes() const;
  void reduce_amaxes(const Communicator& group) const;
  // The delayed-scaling update of every tensor (the rule above), then the history rolls.
  void update() const;
  // The whole state (history, scale, scale_inv) for checkpoints.
  const Tensor& amax_history() const { return history_; }
  const Tensor& scales() const { return scale_; }
  const Tensor& scale_invs() const { return scale_inv_; }

 private:
  const DeviceContext& ctx_;
  DType dtype_;
  int n_;
  Fp8Recipe recipe_;
  Tensor history_, scale_, scale_inv_;
};

}  // namespace loom

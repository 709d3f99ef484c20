// Megatron's tensor-parallel linear layers (tensor_parallel/layers.py) built on its named mappings
// (tensor_parallel/mappings.py), each mapping a forward with its paired backward:
//   copy_to_tp          forward identity                 backward all-reduce      (column input, no SP)
//   gather_from_sp      forward all-gather of row shards backward reduce-scatter  (column input, SP)
//   reduce_from_tp      forward all-reduce               backward identity        (row output, no SP)
//   reduce_scatter_to_sp forward reduce-scatter          backward all-gather      (row output, SP)
// Row shards are blocks of the flattened (B·T) token axis: rank r holds rows [r·N/TP, (r+1)·N/TP).
// With TP = 1 every mapping is the identity and the layers are plain linears (one code path).
//
// ColumnParallelLinear splits the weight's output rows (Y_r = X · W_r^T + b_r); RowParallelLinear its input
// columns (Y = Σ_r X_r · W_r^T, the bias added once by TP rank 0 before the reduction). Each owns its
// weight and bias (nn::Linear, with the TP partition in the Parameter) and, with FP8, its Fp8Gemm: the
// model finds its FP8 sites by walking its layers' linears, never by index arithmetic. A column-parallel
// output layer may borrow the tied word embedding as its weight (Megatron's
// skip_weight_param_allocation).
//
// LoRA: a layer may carry adapters (loom/nn/lora.h, declared into the trainable parameter set while the
// layer's own weights stay frozen). They run after the base GEMM on the same input: column-parallel, on
// the (gathered) input with A whole and B split like the weight, their input gradient joining the base's
// partial sum before its all-reduce / reduce-scatter; row-parallel, on this rank's input columns with A
// split like the weight, h all-reduced over the group and h·B^T added once (by TP rank 0, like the bias)
// before the reduction. Their activations are recomputed in backward (h is N x rank), so they add no saved
// state and recomputation needs nothing from them. `lora_dropout` is the dropout mask of the call (adapter k
// draws stream lora_stream(mask.stream, k)); with TP the masks of row-parallel adapters are drawn per rank
// over its own columns, and with CP per rank over its own tokens (the same rate and expectation as one
// process, not the same bits).
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/dist/communicator.h"
#include "loom/nn/fp8_gemm.h"
#include "loom/nn/lora.h"
#include "loom/nn/modules.h"

namespace loom {

// The tensor-parallel group a layer works in and whether the residual stream is sequence-parallel.
struct TpRegion {
  const Communicator* tp = nullptr;  // null: TP = 1
  bool sequence_parallel = false;
  int size() const { return tp ? tp->size() : 1; }
  int rank() const { return tp ? tp->rank() : 0; }
};

// The mappings. `shard` is the residual-stream layout ((N/TP, C) rows under SP), `full` all N rows.
// Column input: returns what the GEMM reads — `shard` itself, or (SP) `full` filled by the all-gather.
TensorView copy_or_gather_to_tp_forward(const TpRegion& r, TensorView shard, TensorView full);
// Its backward: the input gradient is the sum of every rank's partial: all-reduce in place on `dshard`,
// or (SP) reduce-scatter of `dfull` into `dshard`.
void copy_or_gather_to_tp_backward(const TpRegion& r, TensorView dshard, TensorView dfull);
// Row output: all-reduce `full` in place, or (SP) reduce-scatter it into `shard`; returns the result.
TensorView reduce_or_scatter_from_tp_forward(const TpRegion& r, TensorView full, TensorView shard);
// Its backward: `dshard` replicated (identity, returned as is) or (SP) all-gathered into `dfull`.
TensorView reduce_or_scatter_from_tp_backward(const TpRegion& r, TensorView dfull, TensorView dshard);

// An elementwise epilogue on the full-row output of a row-parallel layer (the hidden dropout of a
// bias-dropout-add): forward(out, in) and backward(dinp, dout), either may run in place. Under SP it
// runs before the reduce-scatter on every rank's partial sum, with the single-process mask of the full
// tensor (dropout is linear in its input, so the reduced result is the single-process one); without SP
// after the all-reduce.
struct RowEpilogue {
  bool active = false;
  std::function<void(TensorView out, TensorView inp)> forward, backward;
};

// The dropout stream of a layer's k-th adapter.
uint64_t lora_stream(uint64_t stream, size_t k);

// What both parallel linears share: the optional FP8 GEMM and the LoRA adapters they own.
class Fp8GemmOwner {
 public:
  // A LoRA adapter on this layer, its parameters declared into `ps` (the trainable set).
  LoraAdapter& add_lora(ParameterSet& ps, const std::string& prefix, const LoraPlacement& place,
                        const LoraConfig& cfg);
  const std::vector<std::unique_ptr<LoraAdapter>>& lora() const { return lora_; }
  // FP8 (delayed scaling): this layer's GEMM quantises its input and weight with slots of `fwd`, its
  // output gradient with a slot of `bwd`; the weight cache (for `weight_shape`) is allocated here.
  void enable_fp8(const DeviceContext& ctx, const Shape& weight_shape, const Fp8ScalingGroup* fwd, int input_slot,
                  int weight_slot, const Fp8ScalingGroup* bwd, int grad_slot, bool wgrad);
  Fp8Gemm* fp8() { return fp8_ ? &*fp8_ : nullptr; }

 protected:
  std::optional<Fp8Gemm> fp8_;
  std::vector<std::unique_ptr<LoraAdapter>> lora_;
};

class ColumnParallelLinear : public Fp8GemmOwner {
 public:
  // (out_features, in_features) global; this rank holds the output rows `shard` (several ranges for a
  // gated fc1: its gate rows and its up rows). Whole at TP = 1.
  ColumnParallelLinear(ParameterSet& ps, const std::string& prefix, int64_t in_features, int64_t out_features,
                       bool bias, float init_std, const TpRegion& region, std::vector<ShardRange> shard);
  // A head whose weight is another module's parameter (the tied word embedding), no bias.
  ColumnParallelLinear(const std::string& prefix, Parameter& borrowed_weight, const TpRegion& region);

  // out (N, out_local) = input · W^T + b; `input` in the residual layout, `gathered` (N, in) scratch for SP.
  void forward(const DeviceContext& ctx, TensorView out, TensorView input, TensorView gathered,
               const DropoutMask& lora_dropout = {}) const;
  // dinput (residual layout) overwritten with the full input gradient; dW, db accumulate. `input` as in
  // forward (re-gathered under SP into `gathered`); `dgathered` (N, in) scratch for SP.
  void backward(const DeviceContext& ctx, TensorView dinput, TensorView dout, TensorView input, TensorView gathered,
                TensorView dgathered, const DropoutMask& lora_dropout = {}) const;

  Parameter& weight() const { return *weight_; }
  Parameter* bias() const { return bias_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  TpRegion region_;
  Parameter* weight_ = nullptr;
  Parameter* bias_ = nullptr;
};

class RowParallelLinear : public Fp8GemmOwner {
 public:
  // (out_features, in_features) global; this rank holds the input columns `shard`; the bias is whole
  // (sequence-parallel under SP: each rank's gradient covers its own token rows).
  RowParallelLinear(ParameterSet& ps, const std::string& prefix, int64_t in_features, int64_t out_features,
                    bool bias, float init_std, const TpRegion& region, ShardRange shard);

  // Y = reduce(input · W^T (+ b on rank 0)), the epilogue on the full rows. `full` (N, out) receives the
  // GEMM output; returns the result in the residual layout: `full` itself, or (SP) `shard`.
  TensorView forward(const DeviceContext& ctx, TensorView full, TensorView input, const RowEpilogue& epilogue,
                     TensorView shard, const DropoutMask& lora_dropout = {}) const;
  // dinput (N, in_local) overwritten; dW, db accumulate. `dout` in the residual layout; `full` (N, out)
  // scratch (the epilogue's backward and the SP all-gather write it).
  // before_weight_grad (only where splits_backward()): called once dinput is complete and before `input` is
  // read, so the caller may write `input` there (an MLP recomputing its activation in the pass that takes
  // the activation's gradient from dinput).
  void backward(const DeviceContext& ctx, TensorView dinput, TensorView dout, TensorView input,
                const RowEpilogue& epilogue, TensorView full, const DropoutMask& lora_dropout = {},
                const std::function<void()>& before_weight_grad = {}) const;
  // Whether backward can run before_weight_grad: no FP8 GEMM (its backward takes both products at once) and
  // no LoRA adapter (whose input gradient needs `input`).
  bool splits_backward() const { return !fp8_ && lora_.empty(); }

  Parameter& weight() const { return linear_.weight(); }
  Parameter* bias() const { return linear_.bias(); }
  bool sequence_parallel() const { return region_.sequence_parallel; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  TpRegion region_;
  Linear linear_;
};

}  // namespace loom

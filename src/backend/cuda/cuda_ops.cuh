// CudaOps: the CUDA op table. The OpTable entry points check every op's arguments (src/backend/op_checks*.cpp);
// each do_<op> then forwards to its launcher (one .cu + .cuh per op family in src/backend/cuda/), which
// checks only this backend's own limits and runs on the context's compute stream. The semantics of every op
// are those of loom/backend/ops.h; the CPU backend is the reference and every launcher has a cross-check
// test against it (tests/unit/backend/test_cuda_*.cpp).
// Host-only header.
#pragma once
#include "backend/cuda/cuda_context.cuh"
#include "loom/backend/ops.h"

namespace loom::cuda {

class CudaOps final : public OpTable {
 public:
  explicit CudaOps(const CudaContext& ctx) : OpTable(ctx.device()), ctx_(ctx) {}

 private:
  // The computations; arguments were checked by the OpTable entry points (src/backend/op_checks*.cpp).
  void do_matmul_forward(TensorView out, TensorView inp, TensorView weight, TensorView bias) const override;
  void do_matmul_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout, TensorView inp,
                          TensorView weight, GradWrite dweight_write) const override;
  void do_embedding_forward(TensorView out, TensorView tokens, TensorView wte, TensorView wpe,
                            TensorView position_ids) const override;
  void do_embedding_backward(TensorView dwte, TensorView dwpe, TensorView dout, TensorView tokens,
                             TensorView position_ids) const override;
  void do_layernorm_forward(TensorView out, TensorView mean, TensorView rstd, TensorView inp, TensorView weight,
                            TensorView bias, float eps) const override;
  void do_layernorm_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout, TensorView inp,
                             TensorView weight, TensorView mean, TensorView rstd) const override;
  void do_residual_layernorm_forward(TensorView residual, TensorView out, TensorView mean, TensorView rstd,
                                     TensorView a, TensorView b, TensorView weight, TensorView bias,
                                     float eps) const override;
  void do_rmsnorm_forward(TensorView out, TensorView rstd, TensorView inp, TensorView weight, float eps) const override;
  void do_rmsnorm_backward(TensorView dinp, TensorView dweight, TensorView dout, TensorView inp, TensorView weight,
                           TensorView rstd) const override;
  void do_residual_rmsnorm_forward(TensorView residual, TensorView out, TensorView rstd, TensorView a, TensorView b,
                                   TensorView weight, float eps) const override;
  void do_glu_forward(TensorView out, TensorView inp, GluKind kind) const override;
  void do_glu_backward(TensorView dinp, TensorView inp, TensorView dout, GluKind kind, TensorView out) const override;
  void do_rope_forward(TensorView qkv, TensorView cos, TensorView sin, const AttentionParams& p, const RopeParams& r,
                       TensorView position_ids) const override;
  void do_rope_backward(TensorView dqkv, TensorView cos, TensorView sin, const AttentionParams& p, const RopeParams& r,
                        TensorView position_ids) const override;
  void do_residual_forward(TensorView out, TensorView a, TensorView b) const override;
  void do_gelu_forward(TensorView out, TensorView inp) const override;
  void do_gelu_backward(TensorView dinp, TensorView inp, TensorView dout, TensorView out) const override;
  void do_bias_add_forward(TensorView out, TensorView bias) const override;
  void do_bias_backward(TensorView dbias, TensorView dout) const override;
  void do_dropout_forward(TensorView out, TensorView inp, float p, uint64_t seed, uint64_t stream,
                          uint64_t offset) const override;
  void do_dropout_backward(TensorView dinp, TensorView dout, float p, uint64_t seed, uint64_t stream,
                           uint64_t offset) const override;
  void do_attention_forward(TensorView out, TensorView lse, TensorView qkv, const AttentionParams& p,
                            TensorView segment_ids) const override;
  void do_attention_backward(TensorView dqkv, TensorView dout, TensorView qkv, TensorView out, TensorView lse,
                             const AttentionParams& p, TensorView segment_ids) const override;
  void do_attention_block_forward(TensorView out, TensorView lse, TensorView q, TensorView kv,
                                  const AttentionBlock& blk, const AttentionParams& p) const override;
  void do_attention_merge(TensorView out, TensorView lse, TensorView out_block, TensorView lse_block) const override;
  void do_attention_block_backward(TensorView dq, TensorView dkv, TensorView dout, TensorView q, TensorView kv,
                                   TensorView out, TensorView lse, const AttentionBlock& blk,
                                   const AttentionParams& p) const override;
  void do_attention_kv_pack(TensorView kv, TensorView qkv, const AttentionParams& p) const override;
  void do_attention_qkv_grad_unpack(TensorView dqkv, TensorView dq, TensorView dkv,
                                    const AttentionParams& p) const override;
  void do_moe_permute_forward(TensorView out, TensorView inp, TensorView row_id_map) const override;
  void do_moe_permute_backward(TensorView dinp, TensorView dout, TensorView row_id_map) const override;
  void do_moe_unpermute_forward(TensorView out, TensorView inp, TensorView probs, TensorView row_id_map) const override;
  void do_moe_unpermute_backward(TensorView dinp, TensorView dprobs, TensorView dout, TensorView inp, TensorView probs,
                                 TensorView row_id_map) const override;
  void do_grouped_matmul_forward(TensorView out, TensorView inp, TensorView weight,
                                 const std::vector<int64_t>& group_sizes) const override;
  void do_grouped_matmul_backward(TensorView dinp, TensorView dweight, TensorView dout, TensorView inp,
                                  TensorView weight, const std::vector<int64_t>& group_sizes,
                                  GradWrite dweight_write) const override;
  void do_cross_entropy_forward_backward(TensorView losses, TensorView logits, TensorView targets, int64_t vocab_size,
                                         TensorView loss_mask, float dlogits_scale) const override;
  void do_adamw_update(TensorView param, TensorView grad, TensorView m, TensorView v, const AdamWParams& p,
                       TensorView compute) const override;
  void do_sgd_update(TensorView param, TensorView grad, TensorView momentum_buf, const SgdParams& p,
                     TensorView compute) const override;
  double do_sum_squares(TensorView x) const override;
  int64_t do_count_zeros(TensorView x) const override;
  AbsStats do_abs_stats(TensorView x) const override;
  bool do_has_inf_or_nan(TensorView x) const override;
  void do_scale_(TensorView x, float s) const override;
  void do_fill_(TensorView x, float value) const override;
  void do_cast(TensorView out, TensorView inp) const override;
  void do_fp8_quantize(TensorView out, TensorView inp, TensorView scale, TensorView amax) const override;
  void do_fp8_dequantize(TensorView out, TensorView inp, TensorView scale_inv) const override;
  void do_fp8_update_scaling(TensorView amax_history, TensorView scale, TensorView scale_inv, float fp8_max, int margin,
                             bool use_max) const override;
  void do_fp8_gemm(TensorView out, TensorView a, TensorView a_scale_inv, TensorView b, TensorView b_scale_inv,
                   TensorView bias, bool accumulate) const override;
  void do_transpose(TensorView out, TensorView inp) const override;

  const CudaContext& ctx_;
};

}  // namespace loom::cuda

// CudaOps: forwarding from the op table to the launchers (see cuda_ops.cuh).
#include "backend/cuda/attention.cuh"
#include "backend/cuda/cast.cuh"
#include "backend/cuda/cross_entropy.cuh"
#include "backend/cuda/cuda_ops.cuh"
#include "backend/cuda/elementwise.cuh"
#include "backend/cuda/embedding.cuh"
#include "backend/cuda/fp8.cuh"
#include "backend/cuda/matmul.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/norm.cuh"
#include "backend/cuda/optimizer.cuh"

namespace loom::cuda {

void CudaOps::do_matmul_forward(TensorView out, TensorView inp, TensorView weight, TensorView bias) const {
  cuda::matmul_forward(ctx_, out, inp, weight, bias);
}
void CudaOps::do_matmul_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout, TensorView inp,
                                 TensorView weight, GradWrite dweight_write) const {
  cuda::matmul_backward(ctx_, dinp, dweight, dbias, dout, inp, weight, dweight_write);
}
void CudaOps::do_embedding_forward(TensorView out, TensorView tokens, TensorView wte, TensorView wpe,
                                   TensorView position_ids) const {
  cuda::embedding_forward(ctx_, out, tokens, wte, wpe, position_ids);
}
void CudaOps::do_embedding_backward(TensorView dwte, TensorView dwpe, TensorView dout, TensorView tokens,
                                    TensorView position_ids) const {
  cuda::embedding_backward(ctx_, dwte, dwpe, dout, tokens, position_ids);
}
void CudaOps::do_layernorm_forward(TensorView out, TensorView mean, TensorView rstd, TensorView inp, TensorView weight,
                                   TensorView bias, float eps) const {
  cuda::layernorm_forward(ctx_, out, mean, rstd, inp, weight, bias, eps);
}
void CudaOps::do_layernorm_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout,
                                    TensorView inp, TensorView weight, TensorView mean, TensorView rstd) const {
  cuda::layernorm_backward(ctx_, dinp, dweight, dbias, dout, inp, weight, mean, rstd);
}
void CudaOps::do_residual_layernorm_forward(TensorView residual, TensorView out, TensorView mean, TensorView rstd,
                                            TensorView a, TensorView b, TensorView weight, TensorView bias,
                                            float eps) const {
  cuda::residual_layernorm_forward(ctx_, residual, out, mean, rstd, a, b, weight, bias, eps);
}
void CudaOps::do_rmsnorm_forward(TensorView out, TensorView rstd, TensorView inp, TensorView weight, float eps) const {
  cuda::rmsnorm_forward(ctx_, out, rstd, inp, weight, eps);
}
void CudaOps::do_rmsnorm_backward(TensorView dinp, TensorView dweight, TensorView dout, TensorView inp,
                                  TensorView weight, TensorView rstd) const {
  cuda::rmsnorm_backward(ctx_, dinp, dweight, dout, inp, weight, rstd);
}
void CudaOps::do_residual_rmsnorm_forward(TensorView residual, TensorView out, TensorView rstd, TensorView a,
                                          TensorView b, TensorView weight, float eps) const {
  cuda::residual_rmsnorm_forward(ctx_, residual, out, rstd, a, b, weight, eps);
}
void CudaOps::do_glu_forward(TensorView out, TensorView inp, GluKind kind) const {
  cuda::glu_forward(ctx_, out, inp, kind);
}
// With `out`, the activation is recomputed by the forward kernel first (dinp may alias inp, so before the
// backward overwrites it): the same bits as glu_forward by construction. One pass over inp more than a fused
// kernel would take; the CPU, where that pass is the cost, fuses them.
void CudaOps::do_glu_backward(TensorView dinp, TensorView inp, TensorView dout, GluKind kind, TensorView out) const {
  if (out.defined()) cuda::glu_forward(ctx_, out, inp, kind);
  cuda::glu_backward(ctx_, dinp, inp, dout, kind);
}
void CudaOps::do_rope_forward(TensorView qkv, TensorView cos, TensorView sin, const AttentionParams& p,
                              const RopeParams& r, TensorView position_ids) const {
  cuda::rope_forward(ctx_, qkv, cos, sin, p, r, position_ids);
}
void CudaOps::do_rope_backward(TensorView dqkv, TensorView cos, TensorView sin, const AttentionParams& p,
                               const RopeParams& r, TensorView position_ids) const {
  cuda::rope_backward(ctx_, dqkv, cos, sin, p, r, position_ids);
}
void CudaOps::do_residual_forward(TensorView out, TensorView a, TensorView b) const {
  cuda::residual_forward(ctx_, out, a, b);
}
void CudaOps::do_gelu_forward(TensorView out, TensorView inp) const { cuda::gelu_forward(ctx_, out, inp); }
void CudaOps::do_gelu_backward(TensorView dinp, TensorView inp, TensorView dout, TensorView out) const {
  if (out.defined()) cuda::gelu_forward(ctx_, out, inp);  // as do_glu_backward's out
  cuda::gelu_backward(ctx_, dinp, inp, dout);
}
void CudaOps::do_bias_add_forward(TensorView out, TensorView bias) const { cuda::bias_add_forward(ctx_, out, bias); }
void CudaOps::do_bias_backward(TensorView dbias, TensorView dout) const { cuda::bias_backward(ctx_, dbias, dout); }
void CudaOps::do_dropout_forward(TensorView out, TensorView inp, float p, uint64_t seed, uint64_t stream,
                                 uint64_t offset) const {
  cuda::dropout_forward(ctx_, out, inp, p, seed, stream, offset);
}
void CudaOps::do_dropout_backward(TensorView dinp, TensorView dout, float p, uint64_t seed, uint64_t stream,
                                  uint64_t offset) const {
  cuda::dropout_backward(ctx_, dinp, dout, p, seed, stream, offset);
}
void CudaOps::do_attention_forward(TensorView out, TensorView lse, TensorView qkv, const AttentionParams& p,
                                   TensorView segment_ids) const {
  cuda::attention_forward(ctx_, out, lse, qkv, p, segment_ids);
}
void CudaOps::do_attention_backward(TensorView dqkv, TensorView dout, TensorView qkv, TensorView out, TensorView lse,
                                    const AttentionParams& p, TensorView segment_ids) const {
  cuda::attention_backward(ctx_, dqkv, dout, qkv, out, lse, p, segment_ids);
}
void CudaOps::do_attention_block_forward(TensorView out, TensorView lse, TensorView q, TensorView kv,
                                         const AttentionBlock& blk, const AttentionParams& p) const {
  cuda::attention_block_forward(ctx_, out, lse, q, kv, blk, p);
}
void CudaOps::do_attention_merge(TensorView out, TensorView lse, TensorView out_block, TensorView lse_block) const {
  cuda::attention_merge(ctx_, out, lse, out_block, lse_block);
}
void CudaOps::do_attention_block_backward(TensorView dq, TensorView dkv, TensorView dout, TensorView q, TensorView kv,
                                          TensorView out, TensorView lse, const AttentionBlock& blk,
                                          const AttentionParams& p) const {
  cuda::attention_block_backward(ctx_, dq, dkv, dout, q, kv, out, lse, blk, p);
}
void CudaOps::do_attention_kv_pack(TensorView kv, TensorView qkv, const AttentionParams& p) const {
  cuda::attention_kv_pack(ctx_, kv, qkv, p);
}
void CudaOps::do_attention_qkv_grad_unpack(TensorView dqkv, TensorView dq, TensorView dkv,
                                           const AttentionParams& p) const {
  cuda::attention_qkv_grad_unpack(ctx_, dqkv, dq, dkv, p);
}
void CudaOps::do_moe_permute_forward(TensorView out, TensorView inp, TensorView row_id_map) const {
  cuda::moe_permute_forward(ctx_, out, inp, row_id_map);
}
void CudaOps::do_moe_permute_backward(TensorView dinp, TensorView dout, TensorView row_id_map) const {
  cuda::moe_permute_backward(ctx_, dinp, dout, row_id_map);
}
void CudaOps::do_moe_unpermute_forward(TensorView out, TensorView inp, TensorView probs, TensorView row_id_map) const {
  cuda::moe_unpermute_forward(ctx_, out, inp, probs, row_id_map);
}
void CudaOps::do_moe_unpermute_backward(TensorView dinp, TensorView dprobs, TensorView dout, TensorView inp,
                                        TensorView probs, TensorView row_id_map) const {
  cuda::moe_unpermute_backward(ctx_, dinp, dprobs, dout, inp, probs, row_id_map);
}
void CudaOps::do_grouped_matmul_forward(TensorView out, TensorView inp, TensorView weight,
                                        const std::vector<int64_t>& group_sizes) const {
  cuda::grouped_matmul_forward(ctx_, out, inp, weight, group_sizes);
}
void CudaOps::do_grouped_matmul_backward(TensorView dinp, TensorView dweight, TensorView dout, TensorView inp,
                                         TensorView weight, const std::vector<int64_t>& group_sizes,
                                         GradWrite dweight_write) const {
  cuda::grouped_matmul_backward(ctx_, dinp, dweight, dout, inp, weight, group_sizes, dweight_write);
}
void CudaOps::do_cross_entropy_forward_backward(TensorView losses, TensorView logits, TensorView targets,
                                                int64_t vocab_size, TensorView loss_mask, float dlogits_scale) const {
  cuda::cross_entropy_forward_backward(ctx_, losses, logits, targets, vocab_size, loss_mask, dlogits_scale);
}
// The compute copy is written by a cast after the update (a second pass over param, on the device).
void CudaOps::do_adamw_update(TensorView param, TensorView grad, TensorView m, TensorView v, const AdamWParams& p,
                              TensorView compute) const {
  cuda::adamw_update(ctx_, param, grad, m, v, p);
  if (compute.defined()) cuda::cast(ctx_, compute, param);
}
void CudaOps::do_sgd_update(TensorView param, TensorView grad, TensorView momentum_buf, const SgdParams& p,
                            TensorView compute) const {
  cuda::sgd_update(ctx_, param, grad, momentum_buf, p);
  if (compute.defined()) cuda::cast(ctx_, compute, param);
}
double CudaOps::do_sum_squares(TensorView x) const { return cuda::sum_squares(ctx_, x); }
int64_t CudaOps::do_count_zeros(TensorView x) const { return cuda::count_zeros(ctx_, x); }
AbsStats CudaOps::do_abs_stats(TensorView x) const { return cuda::abs_stats(ctx_, x); }
bool CudaOps::do_has_inf_or_nan(TensorView x) const { return cuda::has_inf_or_nan(ctx_, x); }
void CudaOps::do_scale_(TensorView x, float s) const { cuda::scale_(ctx_, x, s); }
void CudaOps::do_fill_(TensorView x, float value) const { cuda::fill_(ctx_, x, value); }
void CudaOps::do_cast(TensorView out, TensorView inp) const { cuda::cast(ctx_, out, inp); }
void CudaOps::do_fp8_quantize(TensorView out, TensorView inp, TensorView scale, TensorView amax) const {
  cuda::fp8_quantize(ctx_, out, inp, scale, amax);
}
void CudaOps::do_fp8_dequantize(TensorView out, TensorView inp, TensorView scale_inv) const {
  cuda::fp8_dequantize(ctx_, out, inp, scale_inv);
}
void CudaOps::do_fp8_update_scaling(TensorView amax_history, TensorView scale, TensorView scale_inv, float fp8_max,
                                    int margin, bool use_max) const {
  cuda::fp8_update_scaling(ctx_, amax_history, scale, scale_inv, fp8_max, margin, use_max);
}
void CudaOps::do_fp8_gemm(TensorView out, TensorView a, TensorView a_scale_inv, TensorView b, TensorView b_scale_inv,
                          TensorView bias, bool accumulate) const {
  cuda::fp8_gemm(ctx_, out, a, a_scale_inv, b, b_scale_inv, bias, accumulate);
}
void CudaOps::do_transpose(TensorView out, TensorView inp) const { cuda::transpose(ctx_, out, inp); }

}  // namespace loom::cuda

// CudaOps: the CUDA op table. Each method forwards to its launcher (one .cu + .cuh per op family in
// src/backend/cuda/), which validates its arguments on the host and runs on the context's compute stream.
// The semantics of every op are those of loom/backend/ops.h; the CPU backend is the reference and every
// launcher has a cross-check test against it (tests/unit/backend/test_cuda_*.cpp).
// Host-only header.
#pragma once
#include "backend/cuda/cuda_context.cuh"
#include "loom/backend/ops.h"

namespace loom::cuda {

class CudaOps final : public OpTable {
 public:
  explicit CudaOps(const CudaContext& ctx) : ctx_(ctx) {}

  void matmul_forward(TensorView out, TensorView inp, TensorView weight, TensorView bias) const override;
  void matmul_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout, TensorView inp,
                       TensorView weight) const override;
  void embedding_forward(TensorView out, TensorView tokens, TensorView wte, TensorView wpe,
                         TensorView position_ids) const override;
  void embedding_backward(TensorView dwte, TensorView dwpe, TensorView dout, TensorView tokens,
                          TensorView position_ids) const override;
  void layernorm_forward(TensorView out, TensorView mean, TensorView rstd, TensorView inp, TensorView weight,
                         TensorView bias, float eps) const override;
  void layernorm_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout, TensorView inp,
                          TensorView weight, TensorView mean, TensorView rstd) const override;
  void residual_layernorm_forward(TensorView residual, TensorView out, TensorView mean, TensorView rstd, TensorView a,
                                  TensorView b, TensorView weight, TensorView bias, float eps) const override;
  void rmsnorm_forward(TensorView out, TensorView rstd, TensorView inp, TensorView weight, float eps) const override;
  void rmsnorm_backward(TensorView dinp, TensorView dweight, TensorView dout, TensorView inp, TensorView weight,
                        TensorView rstd) const override;
  void residual_rmsnorm_forward(TensorView residual, TensorView out, TensorView rstd, TensorView a, TensorView b,
                                TensorView weight, float eps) const override;
  void glu_forward(TensorView out, TensorView inp, GluKind kind) const override;
  void glu_backward(TensorView dinp, TensorView inp, TensorView dout, GluKind kind) const override;
  void rope_forward(TensorView qkv, TensorView cos, TensorView sin, const AttentionParams& p, const RopeParams& r,
                    TensorView position_ids) const override;
  void rope_backward(TensorView dqkv, TensorView cos, TensorView sin, const AttentionParams& p, const RopeParams& r,
                     TensorView position_ids) const override;
  void residual_forward(TensorView out, TensorView a, TensorView b) const override;
  void gelu_forward(TensorView out, TensorView inp) const override;
  void gelu_backward(TensorView dinp, TensorView inp, TensorView dout) const override;
  void bias_add_forward(TensorView out, TensorView bias) const override;
  void bias_backward(TensorView dbias, TensorView dout) const override;
  void dropout_forward(TensorView out, TensorView inp, float p, uint64_t seed, uint64_t stream,
                       uint64_t offset) const override;
  void dropout_backward(TensorView dinp, TensorView dout, float p, uint64_t seed, uint64_t stream,
                        uint64_t offset) const override;
  void attention_forward(TensorView out, TensorView lse, TensorView qkv, const AttentionParams& p,
                         TensorView segment_ids) const override;
  void attention_backward(TensorView dqkv, TensorView dout, TensorView qkv, TensorView out, TensorView lse,
                          const AttentionParams& p, TensorView segment_ids) const override;
  void attention_block_forward(TensorView out, TensorView lse, TensorView q, TensorView kv, const AttentionBlock& blk,
                               const AttentionParams& p) const override;
  void attention_merge(TensorView out, TensorView lse, TensorView out_block, TensorView lse_block) const override;
  void attention_block_backward(TensorView dq, TensorView dkv, TensorView dout, TensorView q, TensorView kv,
                                TensorView out, TensorView lse, const AttentionBlock& blk,
                                const AttentionParams& p) const override;
  void attention_kv_pack(TensorView kv, TensorView qkv, const AttentionParams& p) const override;
  void attention_qkv_grad_unpack(TensorView dqkv, TensorView dq, TensorView dkv,
                                 const AttentionParams& p) const override;
  void cross_entropy_forward_backward(TensorView losses, TensorView logits, TensorView targets, int64_t vocab_size,
                                      TensorView loss_mask, float dlogits_scale) const override;
  void adamw_update(TensorView param, TensorView grad, TensorView m, TensorView v, const AdamWParams& p) const override;
  double sum_squares(TensorView x) const override;
  bool has_inf_or_nan(TensorView x) const override;
  void scale_(TensorView x, float s) const override;
  void fill_(TensorView x, float value) const override;
  void cast(TensorView out, TensorView inp) const override;
  void fp8_quantize(TensorView out, TensorView inp, TensorView scale, TensorView amax) const override;
  void fp8_dequantize(TensorView out, TensorView inp, TensorView scale_inv) const override;
  void fp8_update_scaling(TensorView amax_history, TensorView scale, TensorView scale_inv, float fp8_max, int margin,
                          bool use_max) const override;
  void fp8_gemm(TensorView out, TensorView a, TensorView a_scale_inv, TensorView b, TensorView b_scale_inv,
                TensorView bias, bool accumulate) const override;
  void transpose(TensorView out, TensorView inp) const override;

 private:
  const CudaContext& ctx_;
};

}  // namespace loom::cuda

// The CPU op table (the reference backend). Its public ops are OpTable's entry points, which check the
// arguments (src/backend/op_checks*.cpp) before calling the do_<op> computations defined here, split by
// op family:
//   matmul.cpp (oneDNN), attention.cpp, attention_blocks.cpp (context-parallel blocks), norm.cpp,
//   elementwise.cpp, embedding.cpp, cross_entropy.cpp, optimizer.cpp, dropout.cpp, rmsnorm.cpp (with
//   norm.cpp's helpers in norm_common.h), glu.cpp, rope.cpp, moe.cpp (MoE token permutation and grouped GEMM).
//   Parallel with OpenMP; reductions use fixed-size blocks summed in a fixed order so results do not depend
//   on the number of threads.
#pragma once
#include "loom/backend/ops.h"

namespace loom::cpu {

// Rows per reduction block: partial sums over blocks of this many rows, combined in block order.
inline constexpr int64_t kReduceBlockRows = 64;

class CpuOps final : public OpTable {
 public:
  CpuOps() : OpTable(cpu_device()) {}

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
};

// True when matmuls in compute dtype dt run on a oneDNN primitive that matmul.cpp builds and caches per
// product shape (bf16 on CPUs with oneDNN's bf16 kernels); f32 (sgemm) and f16 (widened) keep no per-shape
// state. The grouped GEMM uses it to keep the shapes it asks for few (moe.cpp).
bool matmul_caches_shapes(DType dt);
// How many of those primitives are cached now, and the most that are kept (least recently used dropped).
size_t matmul_cached_primitives();
size_t matmul_max_cached_primitives();
// How many primitives have been built since the process started (each cache miss builds one; a shape
// dropped from the cache and asked for again is built again). Tests count new shapes with it: the cached
// count stops growing once the cache is full.
size_t matmul_built_primitives();
// Whether oneDNN runs bf16 products on AMX here (its effective ISA, which DNNL_MAX_CPU_ISA can lower): some
// of matmul.cpp's kernel choices differ by it. Fixed for the process.
bool matmul_uses_amx();
// Whether oneDNN runs bf16 products on its AVX512-BF16 kernels (VDPBF16PS) here, AMX CPUs included. Loom
// packs bf16 weights (packs_b) only where these run without AMX: oneDNN's bf16 kernels for plain AVX-512
// (bf16 emulated on f32 FMAs) take B in another layout.
bool matmul_uses_avx512_bf16();
// How many bf16 products have run on a B operand Loom packed into oneDNN's blocked layout (matmul.cpp,
// packs_b), and a switch for tests and benchmarks: off, products asked for from then on take B as stored.
size_t matmul_packed_products();
void set_matmul_packing(bool on);
// How many bf16 forward products have run swapped (out^T = W · inp^T, then transposed; matmul.cpp,
// swaps_forward), and the same kind of switch for them.
size_t matmul_swapped_products();
void set_matmul_swapping(bool on);

// C (M, N) = op(A) · op(B) (+ C when accumulate), f32, row-major with leading dimensions, op = transpose
// when trans_*: one oneDNN sgemm on the calling thread (serial inside or outside a parallel region), for
// callers that run independent products in parallel themselves (the grouped GEMM). Its bits depend only
// on the arguments.
void sgemm_serial(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                  const float* B, int64_t ldb, bool accumulate, float* C, int64_t ldc);

}  // namespace loom::cpu

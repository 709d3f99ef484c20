// Launchers of the CUDA attention core (kernels in attention.cu) and of the context-parallel block ops
// (attention_blocks.cu). Semantics, shapes and dtypes are those of the OpTable methods of the same names
// (loom/backend/ops.h); the CPU backend (src/backend/cpu/attention*.cpp) is the reference.
//
// Invariants: no T x T buffer (flash-attention tiling with online softmax); all work on
// ctx.compute_stream(), no host synchronisation; deterministic (no float atomics: every output element is
// owned by one thread block and summed in a fixed order). Head sizes up to 256.
// Host-only header: no device code.
#pragma once
#include <cstdint>

#include "backend/cuda/cuda_context.cuh"
#include "loom/backend/ops.h"
#include "loom/core/tensor.h"

namespace loom::cuda {

void attention_forward(const CudaContext& ctx, TensorView out, TensorView lse, TensorView qkv,
                       const AttentionParams& p, TensorView segment_ids);
void attention_backward(const CudaContext& ctx, TensorView dqkv, TensorView dout, TensorView qkv, TensorView out,
                        TensorView lse, const AttentionParams& p, TensorView segment_ids);

void attention_block_forward(const CudaContext& ctx, TensorView out, TensorView lse, TensorView q, TensorView kv,
                             const AttentionBlock& blk, const AttentionParams& p);
void attention_merge(const CudaContext& ctx, TensorView out, TensorView lse, TensorView out_block,
                     TensorView lse_block);
void attention_block_backward(const CudaContext& ctx, TensorView dq, TensorView dkv, TensorView dout, TensorView q,
                              TensorView kv, TensorView out, TensorView lse, const AttentionBlock& blk,
                              const AttentionParams& p);
void attention_kv_pack(const CudaContext& ctx, TensorView kv, TensorView qkv, const AttentionParams& p);
void attention_qkv_grad_unpack(const CudaContext& ctx, TensorView dqkv, TensorView dq, TensorView dkv,
                               const AttentionParams& p);

// ---- shared by attention.cu and attention_blocks.cu (not part of the op table) ----------------------
// One attention problem, its arguments checked (by the OpTable entry point, and kMaxHeadDim by the launcher):
// the whole-sequence op and the block ops run the same kernels, which differ only in where positions,
// segments and heads come from.
namespace attn_detail {

constexpr int64_t kMaxHeadDim = 256;

struct Problem {
  TensorView q;   // (B, Tq, NKV*(NH/NKV+2)*HS): the query heads are read (packed layout)
  TensorView kv;  // (B, Tk, NKV*(kv_g+2)*HS): packed (kv_g = NH/NKV) or compact (kv_g = 0); dtype of q
  int64_t B = 0, Tq = 0, Tk = 0, NH = 0, NKV = 0, HS = 0, kv_g = 0;
  float scale = 0;
  bool causal = true;
  int64_t window = -1;
  // Device i32 arrays. Null positions mean 0..T-1 (the whole-sequence op), which also enables skipping
  // key/query tiles that the causal/window/segment rules mask entirely (segments are then assumed
  // non-decreasing along T, as the op's contract says).
  const int32_t* q_pos = nullptr;  // (Tq)
  const int32_t* k_pos = nullptr;  // (Tk)
  const int32_t* q_seg = nullptr;  // (B, Tq) or null
  const int32_t* k_seg = nullptr;  // (B, Tk) or null (given with q_seg)
  float dropout_p = 0;
  uint64_t dropout_seed = 0, dropout_stream = 0;
  uint64_t mask_len = 0;  // T of the dropout mask index ((b*NH + h)*T + qpos)*T + kpos
};

// out (B, Tq, NH*HS) in q's dtype or f32, lse (B, NH, Tq) f32 (overwrite).
void forward(const CudaContext& ctx, const Problem& pb, TensorView out, TensorView lse);

// Where the gradients go. dq: rows of dq_stride elements, head h at q_col(h) of the packed layout
// (dq_grouped, e.g. dqkv) or at h*HS; dkv: rows of dkv_stride elements, group g's key head at
// (g*(dkv_g+2)+dkv_g)*HS and its value head right after. accumulate: += in f32 (dq, dkv f32), else
// overwrite (dq, dkv in q's dtype).
struct Grads {
  TensorView dq, dkv;
  int64_t dq_stride = 0, dkv_stride = 0, dkv_g = 0;
  bool dq_grouped = false;
  bool accumulate = false;
};
void backward(const CudaContext& ctx, const Problem& pb, const Grads& g, TensorView dout, TensorView out,
              TensorView lse);

// D (B, NH, Tq) f32 = rowsum(dout * out) for each (b, t, h) row of HS elements (out and dout (B, Tq, NH*HS),
// f32 or 16-bit each): the D term of every attention backward. One warp per row, fixed order.
void row_dot(const CudaContext& ctx, TensorView D, TensorView out, TensorView dout, int64_t B, int64_t Tq,
             int64_t NH, int64_t HS);

}  // namespace attn_detail
}  // namespace loom::cuda

// The whole-sequence attention ops (attention_forward / attention_backward of the op table; arguments checked
// by the OpTable entry point, src/backend/op_checks_attention.cpp): the register-tiled flash kernels
// (flash_attention.cu) when they take the problem, else the general kernels (attention.cu).
#include "backend/cuda/attention.cuh"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/flash_attention.cuh"

namespace loom::cuda {

// ---- the whole-sequence op ----------------------------------------------------------------------------

namespace {

using attn_detail::Problem;

// The problem of a call whose arguments the OpTable entry point has checked. Head sizes above
// kMaxHeadDim are this backend's limit (the kernels keep a head row in registers and shared memory; the CPU
// takes any size), so that one is checked here.
Problem whole_sequence(TensorView qkv, const AttentionParams& p, TensorView segment_ids, const char* op) {
  LOOM_CHECK(p.head_dim <= attn_detail::kMaxHeadDim, "[", op, "] expected head_dim in [1, ", attn_detail::kMaxHeadDim,
             "] on a CUDA device, got ", p.head_dim);
  Problem pb;
  pb.q = qkv;
  pb.kv = qkv;
  pb.B = qkv.size(0);
  pb.Tq = pb.Tk = qkv.size(1);
  pb.NH = p.num_heads;
  pb.NKV = p.num_kv_heads;
  pb.HS = p.head_dim;
  pb.kv_g = p.num_heads / p.num_kv_heads;
  pb.scale = p.softmax_scale;
  pb.causal = p.causal;
  pb.window = p.window;
  if (segment_ids.defined()) pb.q_seg = pb.k_seg = cptr<int32_t>(segment_ids);
  pb.dropout_p = p.dropout_p;
  pb.dropout_seed = p.dropout_seed;
  pb.dropout_stream = p.dropout_stream;
  pb.mask_len = uint64_t(pb.Tq);
  return pb;
}

}  // namespace

void attention_forward(const CudaContext& ctx, TensorView out, TensorView lse, TensorView qkv,
                       const AttentionParams& p, TensorView segment_ids) {
  const Problem pb = whole_sequence(qkv, p, segment_ids, "attention_forward");
  if (flash::eligible(pb, {out})) {
    flash::forward(ctx, pb, out, lse);
    return;
  }
  attn_detail::forward(ctx, pb, out, lse);
}

void attention_backward(const CudaContext& ctx, TensorView dqkv, TensorView dout, TensorView qkv, TensorView out,
                        TensorView lse, const AttentionParams& p, TensorView segment_ids) {
  const Problem pb = whole_sequence(qkv, p, segment_ids, "attention_backward");
  if (flash::eligible(pb, {out, dout, dqkv})) {
    flash::backward(ctx, pb, dqkv, dout, out, lse);
    return;
  }
  attn_detail::Grads gr;
  gr.dq = gr.dkv = dqkv;
  gr.dq_stride = gr.dkv_stride = qkv.size(2);
  gr.dq_grouped = true;
  gr.dkv_g = pb.NH / pb.NKV;
  gr.accumulate = false;
  attn_detail::backward(ctx, pb, gr, dout, out, lse);
}

}  // namespace loom::cuda

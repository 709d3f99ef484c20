// The whole-sequence attention ops (attention_forward / attention_backward of the op table): argument
// checks as the CPU op makes them (src/backend/cpu/attention.cpp), then the register-tiled flash kernels
// (flash_attention.cu) when they take the problem, else the general kernels (attention.cu).
#include "backend/cuda/attention.cuh"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/flash_attention.cuh"

namespace loom::cuda {

// ---- the whole-sequence op ----------------------------------------------------------------------------

namespace {

using attn_detail::Problem;

// Validates as the CPU op does (src/backend/cpu/attention.cpp) and builds the problem.
Problem whole_sequence(const CudaContext& ctx, TensorView qkv, const AttentionParams& p, TensorView segment_ids,
                       const char* op) {
  LOOM_CHECK(p.num_heads > 0 && p.num_kv_heads > 0 && p.num_heads % p.num_kv_heads == 0, "[", op,
             "] expected num_heads to be a positive multiple of num_kv_heads, got ", p.num_heads, " and ",
             p.num_kv_heads);
  LOOM_CHECK(p.head_dim > 0 && p.head_dim <= attn_detail::kMaxHeadDim, "[", op, "] expected head_dim in [1, ",
             attn_detail::kMaxHeadDim, "], got ", p.head_dim);
  LOOM_CHECK(p.window == -1 || p.window > 0, "[", op, "] expected window -1 (unlimited) or > 0, got ", p.window);
  LOOM_CHECK(p.causal || p.window == -1, "[", op, "] a sliding window needs causal attention");
  LOOM_CHECK(p.dropout_p >= 0.0f && p.dropout_p < 1.0f, "[", op, "] expected dropout_p in [0, 1), got ",
             p.dropout_p);
  const DType dt = qkv.dtype();
  LOOM_CHECK((dt == DType::kF32 || dt == DType::kBF16 || dt == DType::kF16) && qkv.ndim() == 3, "[", op,
             "] expected qkv f32, bf16 or f16 (B, T, 3*C), got ", qkv.desc());
  check_on_device(ctx, qkv, op, "qkv");
  const int64_t G = p.num_heads / p.num_kv_heads;
  const int64_t row = p.num_kv_heads * (G + 2) * p.head_dim;
  LOOM_CHECK(qkv.size(2) == row, "[", op, "] expected qkv last dim NKV*(NH/NKV+2)*HS = ", row, ", got ",
             qkv.desc());
  Problem pb;
  pb.q = qkv;
  pb.kv = qkv;
  pb.B = qkv.size(0);
  pb.Tq = pb.Tk = qkv.size(1);
  pb.NH = p.num_heads;
  pb.NKV = p.num_kv_heads;
  pb.HS = p.head_dim;
  pb.kv_g = G;
  pb.scale = p.softmax_scale;
  pb.causal = p.causal;
  pb.window = p.window;
  if (segment_ids.defined()) {
    const Shape want{pb.B, pb.Tq};
    LOOM_CHECK(segment_ids.dtype() == DType::kI32 && segment_ids.shape() == want, "[", op,
               "] expected i32 segment_ids (", pb.B, ", ", pb.Tq, "), got ", segment_ids.desc());
    check_on_device(ctx, segment_ids, op, "segment_ids");
    pb.q_seg = pb.k_seg = cptr<int32_t>(segment_ids);
  }
  pb.dropout_p = p.dropout_p;
  pb.dropout_seed = p.dropout_seed;
  pb.dropout_stream = p.dropout_stream;
  pb.mask_len = uint64_t(pb.Tq);
  return pb;
}

void check_same(const CudaContext& ctx, TensorView t, Shape s, DType dt, const char* op, const char* name) {
  LOOM_CHECK(t.dtype() == dt && t.shape() == s, "[", op, "] expected ", name, " ", dtype_name(dt), s.str(), ", got ",
             t.desc());
  check_on_device(ctx, t, op, name);
}

}  // namespace

void attention_forward(const CudaContext& ctx, TensorView out, TensorView lse, TensorView qkv,
                       const AttentionParams& p, TensorView segment_ids) {
  const char* op = "attention_forward";
  const Problem pb = whole_sequence(ctx, qkv, p, segment_ids, op);
  check_same(ctx, out, Shape{pb.B, pb.Tq, pb.NH * pb.HS}, qkv.dtype(), op, "out");
  check_same(ctx, lse, Shape{pb.B, pb.NH, pb.Tq}, DType::kF32, op, "lse");
  if (flash::eligible(pb, {out})) {
    flash::forward(ctx, pb, out, lse);
    return;
  }
  attn_detail::forward(ctx, pb, out, lse);
}

void attention_backward(const CudaContext& ctx, TensorView dqkv, TensorView dout, TensorView qkv, TensorView out,
                        TensorView lse, const AttentionParams& p, TensorView segment_ids) {
  const char* op = "attention_backward";
  const Problem pb = whole_sequence(ctx, qkv, p, segment_ids, op);
  check_same(ctx, dqkv, qkv.shape(), qkv.dtype(), op, "dqkv");
  check_same(ctx, out, Shape{pb.B, pb.Tq, pb.NH * pb.HS}, qkv.dtype(), op, "out");
  check_same(ctx, dout, Shape{pb.B, pb.Tq, pb.NH * pb.HS}, qkv.dtype(), op, "dout");
  check_same(ctx, lse, Shape{pb.B, pb.NH, pb.Tq}, DType::kF32, op, "lse");
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

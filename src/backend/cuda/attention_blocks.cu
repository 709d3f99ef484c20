// CUDA attention blocks for context parallelism (ops.h, AttentionBlock): one query block against one key/value
// block with explicit global positions (the flash-attention kernels of attention.cu with a positions
// policy: visibility and the dropout mask index come from q_pos/k_pos, so a sequence cut into blocks sees
// and drops exactly what the whole-sequence op does), the merge of partial results, the block backward
// (accumulating into f32 dq/dkv), and the K/V pack / dqkv unpack around them.
//
// Semantics follow the CPU reference (src/backend/cpu/attention_blocks.cpp). Block ops visit every tile
// (positions are arbitrary per token, so no tile skipping). Determinism: every element is written by one
// thread (merge, pack, unpack) or one thread block after a fixed-order sum (attention kernels).
// Not checked here (it would need a device-to-host copy): that positions lie in [0, seq_len) when dropout
// is on; out-of-range positions draw some other element's mask bit instead of failing.
#include <cmath>
#include <limits>
#include <tuple>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/device_utils.cuh"

namespace loom::cuda {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

bool is_float_activation(DType dt) { return dt == DType::kF32 || dt == DType::kBF16 || dt == DType::kF16; }

struct Heads {
  int64_t NH, NKV, G, HS;
  int64_t qkv_row() const { return NKV * (G + 2) * HS; }
  int64_t kv_row() const { return NKV * 2 * HS; }
  int64_t out_row() const { return NH * HS; }
};

Heads make_heads(const AttentionParams& p, const char* op) {
  LOOM_CHECK(p.num_heads > 0 && p.num_kv_heads > 0 && p.num_heads % p.num_kv_heads == 0, "[", op,
             "] expected num_heads to be a positive multiple of num_kv_heads, got ", p.num_heads, " and ",
             p.num_kv_heads);
  LOOM_CHECK(p.head_dim > 0, "[", op, "] expected head_dim > 0, got ", p.head_dim);
  return Heads{p.num_heads, p.num_kv_heads, p.num_heads / p.num_kv_heads, p.head_dim};
}

void check_dev(const CudaContext& ctx, TensorView t, Shape s, const char* op, const char* name) {
  LOOM_CHECK(t.defined() && t.shape() == s, "[", op, "] expected ", name, " ", s.str(), ", got ", t.desc());
  check_on_device(ctx, t, op, name);
}

// Validates as the CPU's make_block_geometry and builds the problem.
attn_detail::Problem block_problem(const CudaContext& ctx, TensorView q, TensorView kv, const AttentionBlock& blk,
                                   const AttentionParams& p, const char* op) {
  const Heads hd = make_heads(p, op);
  LOOM_CHECK(p.head_dim <= attn_detail::kMaxHeadDim, "[", op, "] expected head_dim <= ", attn_detail::kMaxHeadDim,
             ", got ", p.head_dim);
  LOOM_CHECK(p.window == -1 || p.window > 0, "[", op, "] expected window -1 (unlimited) or > 0, got ", p.window);
  LOOM_CHECK(p.causal || p.window == -1, "[", op, "] a sliding window needs causal attention");
  LOOM_CHECK(p.dropout_p >= 0.0f && p.dropout_p < 1.0f, "[", op, "] expected dropout_p in [0, 1), got ",
             p.dropout_p);
  const DType dt = q.dtype();
  LOOM_CHECK(is_float_activation(dt) && q.ndim() == 3 && q.size(2) == hd.qkv_row(), "[", op,
             "] expected q f32, bf16 or f16 (B, Tq, NKV*(NH/NKV+2)*HS = ", hd.qkv_row(), "), got ", q.desc());
  check_on_device(ctx, q, op, "q");
  LOOM_CHECK(kv.dtype() == dt && kv.ndim() == 3 && kv.size(0) == q.size(0) &&
                 (kv.size(2) == hd.qkv_row() || kv.size(2) == hd.kv_row()),
             "[", op, "] expected kv ", dtype_name(dt), "(", q.size(0), ", Tk, ", hd.qkv_row(), " or ", hd.kv_row(),
             "), got ", kv.desc());
  check_on_device(ctx, kv, op, "kv");
  attn_detail::Problem pb;
  pb.q = q;
  pb.kv = kv;
  pb.B = q.size(0);
  pb.Tq = q.size(1);
  pb.Tk = kv.size(1);
  pb.NH = hd.NH;
  pb.NKV = hd.NKV;
  pb.HS = hd.HS;
  pb.kv_g = kv.size(2) == hd.qkv_row() ? hd.G : 0;
  pb.scale = p.softmax_scale;
  pb.causal = p.causal;
  pb.window = p.window;
  for (auto [t, n, name] : {std::tuple{blk.q_pos, pb.Tq, "q_pos"}, std::tuple{blk.k_pos, pb.Tk, "k_pos"}}) {
    const Shape want{n};
    LOOM_CHECK(t.defined() && t.dtype() == DType::kI32 && t.shape() == want, "[", op, "] expected i32 ", name, " (",
               n, "), got ", t.desc());
    check_on_device(ctx, t, op, name);
  }
  pb.q_pos = cptr<int32_t>(blk.q_pos);
  pb.k_pos = cptr<int32_t>(blk.k_pos);
  LOOM_CHECK(blk.q_segment_ids.defined() == blk.k_segment_ids.defined(), "[", op,
             "] q_segment_ids and k_segment_ids go together");
  if (blk.q_segment_ids.defined()) {
    for (auto [t, n, name] : {std::tuple{blk.q_segment_ids, pb.Tq, "q_segment_ids"},
                              std::tuple{blk.k_segment_ids, pb.Tk, "k_segment_ids"}}) {
      const Shape want{pb.B, n};
      LOOM_CHECK(t.dtype() == DType::kI32 && t.shape() == want, "[", op, "] expected i32 ", name, " (", pb.B, ", ",
                 n, "), got ", t.desc());
      check_on_device(ctx, t, op, name);
    }
    pb.q_seg = cptr<int32_t>(blk.q_segment_ids);
    pb.k_seg = cptr<int32_t>(blk.k_segment_ids);
  }
  if (p.dropout_p > 0.0f) {
    LOOM_CHECK(blk.seq_len > 0, "[", op, "] attention dropout needs the global sequence length (seq_len)");
    pb.dropout_p = p.dropout_p;
    pb.dropout_seed = p.dropout_seed;
    pb.dropout_stream = p.dropout_stream;
    pb.mask_len = uint64_t(blk.seq_len);
  }
  return pb;
}

// out/dout-like tensors: (B, Tq, NH*HS) in f32 or the compute dtype.
void check_rows(const CudaContext& ctx, TensorView t, const attn_detail::Problem& pb, const char* op,
                const char* name) {
  const Shape want{pb.B, pb.Tq, pb.NH * pb.HS};
  LOOM_CHECK((t.dtype() == DType::kF32 || t.dtype() == pb.q.dtype()) && t.shape() == want, "[", op, "] expected ",
             name, " f32 or ", dtype_name(pb.q.dtype()), want.str(), ", got ", t.desc());
  check_on_device(ctx, t, op, name);
}

// ---- merge -----------------------------------------------------------------------------------------------

// One warp per (b, t, h) row: the row's lse pair decides the two weights, the lanes blend HS elements.
template <typename TO, typename TB>
__global__ void attention_merge_kernel(TO* __restrict__ out, float* __restrict__ lse, const TB* __restrict__ ob,
                                       const float* __restrict__ lb, int64_t B, int64_t T, int64_t NH, int64_t HS) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = B * T * NH;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t w = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; w < rows; w += warps) {
    const int64_t h = w % NH, t = (w / NH) % T, b = w / (NH * T);
    const int64_t li = (b * NH + h) * T + t, off = w * HS;
    const float x = lse[li], y = lb[li];
    if (y == kNegInf) continue;  // nothing visible in the block (uniform over the warp)
    float wa = 0.0f, wb = 1.0f, lsum = y;  // nothing visible so far: the block's result is the result
    if (x != kNegInf) {
      const float mx = fmaxf(x, y);
      lsum = mx + logf(expf(x - mx) + expf(y - mx));
      wa = expf(x - lsum);
      wb = expf(y - lsum);
    }
    for (int64_t d = lane; d < HS; d += 32) {
      const float c = load(ob[off + d]);
      out[off + d] = store<TO>(x == kNegInf ? c : wa * load(out[off + d]) + wb * c);
    }
    __syncwarp();  // every lane has read lse[li] before it changes
    if (lane == 0) lse[li] = lsum;
  }
}

// ---- pack / unpack ----------------------------------------------------------------------------------------

// kv (rows, NKV*2*HS) = the key and value heads of qkv (rows, NKV*(G+2)*HS); element-wise copy of bits.
template <typename E>
__global__ void attention_kv_pack_kernel(E* __restrict__ kv, const E* __restrict__ qkv, int64_t rows, int64_t NKV,
                                         int64_t G, int64_t HS) {
  const int64_t kv_row = NKV * 2 * HS, qkv_row = NKV * (G + 2) * HS, n = rows * kv_row;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / kv_row, c = e % kv_row, g = c / (2 * HS), w = c % (2 * HS);
    kv[e] = qkv[r * qkv_row + (g * (G + 2) + G) * HS + w];
  }
}

// dqkv (rows, NKV*(G+2)*HS) = dq (rows, NH*HS) f32 for the query heads, dkv (rows, NKV*2*HS) f32 for the
// key/value heads, rounded once (overwrite; every element written).
template <typename TG>
__global__ void attention_qkv_grad_unpack_kernel(TG* __restrict__ dqkv, const float* __restrict__ dq,
                                                 const float* __restrict__ dkv, int64_t rows, int64_t NKV, int64_t G,
                                                 int64_t HS) {
  const int64_t qkv_row = NKV * (G + 2) * HS, n = rows * qkv_row, NH = NKV * G;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / qkv_row, c = e % qkv_row;
    const int64_t grp = c / ((G + 2) * HS), w = c % ((G + 2) * HS), slot = w / HS, d = w % HS;
    const float v = slot < G ? dq[r * NH * HS + (grp * G + slot) * HS + d]
                             : dkv[r * NKV * 2 * HS + (2 * grp + (slot - G)) * HS + d];
    dqkv[e] = store<TG>(v);
  }
}

// Copies of 1, 2 or 4 bytes: the pack moves bits, whatever the float dtype.
template <typename F>
void dispatch_bits(DType dt, F&& f) {
  switch (dtype_size(dt)) {
    case 4: f(uint32_t{}); return;
    case 2: f(uint16_t{}); return;
    default: f(uint8_t{}); return;
  }
}

}  // namespace

void attention_block_forward(const CudaContext& ctx, TensorView out, TensorView lse, TensorView q, TensorView kv,
                             const AttentionBlock& blk, const AttentionParams& p) {
  const char* op = "attention_block_forward";
  const attn_detail::Problem pb = block_problem(ctx, q, kv, blk, p, op);
  check_rows(ctx, out, pb, op, "out");
  LOOM_CHECK(lse.dtype() == DType::kF32, "[", op, "] expected lse f32, got ", lse.desc());
  check_dev(ctx, lse, Shape{pb.B, pb.NH, pb.Tq}, op, "lse");
  attn_detail::forward(ctx, pb, out, lse);
}

void attention_merge(const CudaContext& ctx, TensorView out, TensorView lse, TensorView out_block,
                     TensorView lse_block) {
  const char* op = "attention_merge";
  LOOM_CHECK(out.ndim() == 3 && is_float_activation(out.dtype()), "[", op,
             "] expected out f32, bf16 or f16 (B, T, NH*HS), got ", out.desc());
  check_on_device(ctx, out, op, "out");
  LOOM_CHECK(lse.ndim() == 3 && lse.dtype() == DType::kF32 && lse.size(0) == out.size(0) &&
                 lse.size(2) == out.size(1) && lse.size(1) > 0 && out.size(2) % lse.size(1) == 0,
             "[", op, "] expected lse f32 (B, NH, T) matching out ", out.desc(), ", got ", lse.desc());
  check_on_device(ctx, lse, op, "lse");
  LOOM_CHECK(is_float_activation(out_block.dtype()), "[", op, "] expected out_block f32, bf16 or f16, got ",
             out_block.desc());
  check_dev(ctx, out_block, out.shape(), op, "out_block");
  LOOM_CHECK(lse_block.dtype() == DType::kF32, "[", op, "] expected lse_block f32, got ", lse_block.desc());
  check_dev(ctx, lse_block, lse.shape(), op, "lse_block");
  const int64_t B = out.size(0), T = out.size(1), NH = lse.size(1), HS = out.size(2) / NH;
  const int64_t rows = B * T * NH;
  if (rows == 0) return;
  dispatch_float(out.dtype(), "[attention_merge] out", [&](auto to) {
    using TO = decltype(to);
    dispatch_float(out_block.dtype(), "[attention_merge] out_block", [&](auto tb) {
      using TB = decltype(tb);
      attention_merge_kernel<TO, TB><<<grid_for(rows * 32), kThreads, 0, ctx.compute_stream()>>>(
          ptr<TO>(out), ptr<float>(lse), cptr<TB>(out_block), cptr<float>(lse_block), B, T, NH, HS);
      LOOM_CUDA_LAUNCH_CHECK();
    });
  });
}

void attention_block_backward(const CudaContext& ctx, TensorView dq, TensorView dkv, TensorView dout, TensorView q,
                              TensorView kv, TensorView out, TensorView lse, const AttentionBlock& blk,
                              const AttentionParams& p) {
  const char* op = "attention_block_backward";
  const attn_detail::Problem pb = block_problem(ctx, q, kv, blk, p, op);
  check_rows(ctx, out, pb, op, "out");
  check_rows(ctx, dout, pb, op, "dout");
  LOOM_CHECK(lse.dtype() == DType::kF32, "[", op, "] expected lse f32, got ", lse.desc());
  check_dev(ctx, lse, Shape{pb.B, pb.NH, pb.Tq}, op, "lse");
  LOOM_CHECK(dq.dtype() == DType::kF32, "[", op, "] expected dq f32, got ", dq.desc());
  check_dev(ctx, dq, Shape{pb.B, pb.Tq, pb.NH * pb.HS}, op, "dq");
  LOOM_CHECK(dkv.dtype() == DType::kF32, "[", op, "] expected dkv f32 (compact layout), got ", dkv.desc());
  check_dev(ctx, dkv, Shape{pb.B, pb.Tk, pb.NKV * 2 * pb.HS}, op, "dkv");
  attn_detail::Grads gr;
  gr.dq = dq;
  gr.dkv = dkv;
  gr.dq_stride = pb.NH * pb.HS;
  gr.dq_grouped = false;
  gr.dkv_stride = pb.NKV * 2 * pb.HS;
  gr.dkv_g = 0;
  gr.accumulate = true;
  attn_detail::backward(ctx, pb, gr, dout, out, lse);
}

void attention_kv_pack(const CudaContext& ctx, TensorView kv, TensorView qkv, const AttentionParams& p) {
  const char* op = "attention_kv_pack";
  const Heads hd = make_heads(p, op);
  LOOM_CHECK(qkv.ndim() == 3 && qkv.size(2) == hd.qkv_row() && is_float_activation(qkv.dtype()), "[", op,
             "] expected qkv f32, bf16 or f16 (B, T, ", hd.qkv_row(), "), got ", qkv.desc());
  check_on_device(ctx, qkv, op, "qkv");
  LOOM_CHECK(kv.dtype() == qkv.dtype(), "[", op, "] expected kv ", dtype_name(qkv.dtype()), ", got ", kv.desc());
  check_dev(ctx, kv, Shape{qkv.size(0), qkv.size(1), hd.kv_row()}, op, "kv");
  const int64_t rows = qkv.size(0) * qkv.size(1);
  if (rows == 0) return;
  dispatch_bits(qkv.dtype(), [&](auto e) {
    using E = decltype(e);
    attention_kv_pack_kernel<E><<<grid_for(rows * hd.kv_row()), kThreads, 0, ctx.compute_stream()>>>(
        ptr<E>(kv), cptr<E>(qkv), rows, hd.NKV, hd.G, hd.HS);
    LOOM_CUDA_LAUNCH_CHECK();
  });
}

void attention_qkv_grad_unpack(const CudaContext& ctx, TensorView dqkv, TensorView dq, TensorView dkv,
                               const AttentionParams& p) {
  const char* op = "attention_qkv_grad_unpack";
  const Heads hd = make_heads(p, op);
  LOOM_CHECK(dqkv.ndim() == 3 && dqkv.size(2) == hd.qkv_row() && is_float_activation(dqkv.dtype()), "[", op,
             "] expected dqkv f32, bf16 or f16 (B, T, ", hd.qkv_row(), "), got ", dqkv.desc());
  check_on_device(ctx, dqkv, op, "dqkv");
  const int64_t B = dqkv.size(0), T = dqkv.size(1);
  LOOM_CHECK(dq.dtype() == DType::kF32, "[", op, "] expected dq f32, got ", dq.desc());
  check_dev(ctx, dq, Shape{B, T, hd.out_row()}, op, "dq");
  LOOM_CHECK(dkv.dtype() == DType::kF32, "[", op, "] expected dkv f32, got ", dkv.desc());
  check_dev(ctx, dkv, Shape{B, T, hd.kv_row()}, op, "dkv");
  const int64_t rows = B * T;
  if (rows == 0) return;
  dispatch_float(dqkv.dtype(), "[attention_qkv_grad_unpack] dqkv", [&](auto tg) {
    using TG = decltype(tg);
    attention_qkv_grad_unpack_kernel<TG><<<grid_for(rows * hd.qkv_row()), kThreads, 0, ctx.compute_stream()>>>(
        ptr<TG>(dqkv), cptr<float>(dq), cptr<float>(dkv), rows, hd.NKV, hd.G, hd.HS);
    LOOM_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace loom::cuda

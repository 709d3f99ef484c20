// CUDA attention blocks for context parallelism (ops.h, AttentionBlock): one query block against one key/value
// block with explicit global positions (the flash-attention kernels of attention.cu with a positions
// policy: visibility and the dropout mask index come from q_pos/k_pos, so a sequence cut into blocks sees
// and drops exactly what the whole-sequence op does), the merge of partial results, the block backward
// (accumulating into f32 dq/dkv), and the K/V pack / dqkv unpack around them.
//
// Semantics follow the CPU reference (src/backend/cpu/attention_blocks.cpp). Block ops visit every tile
// (positions are arbitrary per token, so no tile skipping). Determinism: every element is written by one
// thread (merge, pack, unpack) or one thread block after a fixed-order sum (attention kernels).
// Arguments are checked by the OpTable entry point (src/backend/op_checks_attention.cpp). Not checked at all
// (it would need a device-to-host copy; the CPU backend checks it): that positions lie in [0, seq_len) when
// dropout is on; out-of-range positions draw some other element's mask bit instead of failing.
#include <cmath>
#include <limits>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/device_utils.cuh"

namespace loom::cuda {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Heads {
  int64_t NH, NKV, G, HS;
  int64_t qkv_row() const { return NKV * (G + 2) * HS; }
  int64_t kv_row() const { return NKV * 2 * HS; }
};

Heads make_heads(const AttentionParams& p) {
  return Heads{p.num_heads, p.num_kv_heads, p.num_heads / p.num_kv_heads, p.head_dim};
}

// The problem of a call whose arguments the OpTable entry point has checked. Head sizes above kMaxHeadDim
// are this backend's limit (the CPU takes any size), so that one is checked here.
attn_detail::Problem block_problem(TensorView q, TensorView kv, const AttentionBlock& blk, const AttentionParams& p,
                                   const char* op) {
  const Heads hd = make_heads(p);
  LOOM_CHECK(p.head_dim <= attn_detail::kMaxHeadDim, "[", op, "] expected head_dim <= ", attn_detail::kMaxHeadDim,
             " on a CUDA device, got ", p.head_dim);
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
  pb.q_pos = cptr<int32_t>(blk.q_pos);
  pb.k_pos = cptr<int32_t>(blk.k_pos);
  if (blk.q_segment_ids.defined()) {
    pb.q_seg = cptr<int32_t>(blk.q_segment_ids);
    pb.k_seg = cptr<int32_t>(blk.k_segment_ids);
  }
  if (p.dropout_p > 0.0f) {
    pb.dropout_p = p.dropout_p;
    pb.dropout_seed = p.dropout_seed;
    pb.dropout_stream = p.dropout_stream;
    pb.mask_len = uint64_t(blk.seq_len);
  }
  return pb;
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
  const attn_detail::Problem pb = block_problem(q, kv, blk, p, "attention_block_forward");
  attn_detail::forward(ctx, pb, out, lse);
}

void attention_merge(const CudaContext& ctx, TensorView out, TensorView lse, TensorView out_block,
                     TensorView lse_block) {
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
  const attn_detail::Problem pb = block_problem(q, kv, blk, p, "attention_block_backward");
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
  const Heads hd = make_heads(p);
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
  const Heads hd = make_heads(p);
  const int64_t B = dqkv.size(0), T = dqkv.size(1);
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

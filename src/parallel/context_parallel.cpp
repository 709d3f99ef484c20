// Context-parallel attention (ring over the cp group) and the sequence slicing helpers: see
// loom/parallel/context_parallel.h for the layout, the ring and the message order.
// Buffers per call: two compact K/V blocks (compute dtype, double-buffered so the next block arrives while the
// current one computes); forward: an f32 running out (unless out is f32) and one block's out/lse; backward:
// the f32 dq accumulator and three compact f32 dK/dV blocks (two alternate as send buffers, one receives).
#include "loom/parallel/context_parallel.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <string>

#include "loom/core/check.h"

namespace loom {

namespace {

constexpr const char* kWhere = "[context_parallel]";

void check_layout(int64_t seq_len, int cp_size, int cp_rank) {
  LOOM_CHECK(cp_size >= 1 && cp_rank >= 0 && cp_rank < cp_size, kWhere, " cp_rank ", cp_rank, " outside [0, ",
             cp_size, ")");
  if (cp_size > 1 && (seq_len <= 0 || seq_len % (2 * int64_t(cp_size)) != 0))
    user_error("--seq-length ", seq_len, " must be a multiple of 2 x --context-parallel-size = ", 2 * cp_size,
               " (each context-parallel rank holds two equal chunks of the sequence)");
}

// Copies between inp and out of this rank's two chunks; to_local: out is local (slice) or full (unslice).
void move_chunks(const DeviceContext& ctx, TensorView full, TensorView local, int cp_size, int cp_rank,
                 bool to_local) {
  LOOM_CHECK(full.ndim() >= 2 && local.ndim() == full.ndim() && full.dtype() == local.dtype(), kWhere,
             " expected (B, T, ...) tensors of one dtype, got ", full.desc(), " and ", local.desc());
  const int64_t B = full.size(0), T = full.size(1);
  check_layout(T, cp_size, cp_rank);
  LOOM_CHECK(local.size(0) == B && local.size(1) * cp_size == T && local.numel() * cp_size == full.numel(), kWhere,
             " expected the local tensor to hold T / ", cp_size, " tokens of ", full.desc(), ", got ", local.desc());
  const int64_t R = full.numel() / std::max<int64_t>(B * T, 1);  // elements per token
  const int64_t c = T / (2 * int64_t(cp_size));                  // tokens per chunk (T when cp_size is 1)
  const int64_t chunk_src[2] = {cp_rank * c, (2 * int64_t(cp_size) - 1 - cp_rank) * c};
  const int64_t Tl = T / cp_size;
  if (cp_size == 1) {
    if (to_local) ctx.copy(local, full);
    else ctx.copy(full, local);
    return;
  }
  for (int64_t b = 0; b < B; ++b)
    for (int k = 0; k < 2; ++k) {
      const Shape s{c * R};
      TensorView f = full.slice_flat((b * T + chunk_src[k]) * R, s);
      TensorView l = local.slice_flat((b * Tl + k * c) * R, s);
      if (to_local) ctx.copy(l, f);
      else ctx.copy(f, l);
    }
}

struct Geometry {
  int64_t B, Tl, T, NH, NKV, HS;
  Shape kv_shape() const { return Shape{B, Tl, NKV * 2 * HS}; }
  Shape out_shape() const { return Shape{B, Tl, NH * HS}; }
  Shape lse_shape() const { return Shape{B, NH, Tl}; }
};

Geometry make_geometry(TensorView qkv, const AttentionParams& p, int cp_size, const char* op) {
  LOOM_CHECK(qkv.ndim() == 3 && p.num_heads > 0 && p.num_kv_heads > 0 && p.num_heads % p.num_kv_heads == 0 &&
                 qkv.size(2) == p.num_kv_heads * (p.num_heads / p.num_kv_heads + 2) * p.head_dim,
             kWhere, " ", op, ": expected qkv (B, T_local, NKV*(NH/NKV+2)*HS), got ", qkv.desc());
  Geometry g{qkv.size(0), qkv.size(1), qkv.size(1) * cp_size, p.num_heads, p.num_kv_heads, p.head_dim};
  check_layout(g.T, cp_size, 0);
  return g;
}

// Per-rank global positions on the device, and the all-gathered segment ids (when given).
struct RingPositions {
  std::vector<std::vector<int32_t>> host;  // [rank] -> T_l positions
  std::vector<Tensor> pos;                 // [rank] -> (T_l) i32 on the device
  Tensor segments;                         // (CP, B, T_l) i32, or empty
  TensorView q_segments;

  RingPositions(const DeviceContext& ctx, const Geometry& g, const Communicator& cp, TensorView segment_ids) {
    for (int r = 0; r < cp.size(); ++r) {
      host.push_back(cp_local_positions(g.T, cp.size(), r));
      Tensor t = ctx.empty(Shape{g.Tl}, DType::kI32);
      ctx.copy(t, TensorView(host.back().data(), DType::kI32, Shape{g.Tl}));
      pos.push_back(t);
    }
    if (segment_ids.defined()) {
      const Shape want{g.B, g.Tl};
      LOOM_CHECK(segment_ids.dtype() == DType::kI32 && segment_ids.shape() == want, kWhere,
                 " expected segment_ids i32 (B, T_local) = ", want.str(), ", got ", segment_ids.desc());
      segments = ctx.empty(Shape{int64_t(cp.size()), g.B, g.Tl}, DType::kI32);
      cp.all_gather(segments, segment_ids);
      q_segments = segment_ids;
    }
  }
  AttentionBlock block(const Geometry& g, int cp_rank, int src) const {
    AttentionBlock b;
    b.q_pos = pos[size_t(cp_rank)];
    b.k_pos = pos[size_t(src)];
    b.seq_len = g.T;
    if (segments.defined()) {
      b.q_segment_ids = q_segments;
      b.k_segment_ids = segments.view().slice_flat(int64_t(src) * g.B * g.Tl, Shape{g.B, g.Tl});
    }
    return b;
  }
};

// False when no query of rank q can see any key of rank k (causal / window), so the block is skipped: its
// forward would add lse -inf (nothing) and its backward exact zeros. A rank's positions are two contiguous
// chunks; for query range [q0, q1) the visible keys form [q0 - window + 1, q1 - 1] (unbounded below without
// a window).
bool any_visible(const std::vector<int32_t>& qp, const std::vector<int32_t>& kp, const AttentionParams& p) {
  if (!p.causal) return true;
  const size_t h = qp.size() / 2;
  for (size_t a = 0; a < 2; ++a)
    for (size_t b = 0; b < 2; ++b) {
      const int64_t q0 = qp[a * h], q1 = int64_t(qp[a * h + h - 1]) + 1;
      const int64_t k0 = kp[b * h], k1 = int64_t(kp[b * h + h - 1]) + 1;
      const int64_t lo = p.window > 0 ? q0 - p.window + 1 : std::numeric_limits<int64_t>::min();
      if (k0 <= q1 - 1 && k1 - 1 >= lo) return true;
    }
  return false;
}

}  // namespace

std::vector<int32_t> cp_local_positions(int64_t seq_len, int cp_size, int cp_rank) {
  check_layout(seq_len, cp_size, cp_rank);
  std::vector<int32_t> p;
  p.reserve(size_t(seq_len / cp_size));
  if (cp_size == 1) {
    for (int64_t t = 0; t < seq_len; ++t) p.push_back(int32_t(t));
    return p;
  }
  const int64_t c = seq_len / (2 * int64_t(cp_size));
  for (int64_t chunk : {int64_t(cp_rank), 2 * int64_t(cp_size) - 1 - cp_rank})
    for (int64_t t = 0; t < c; ++t) p.push_back(int32_t(chunk * c + t));
  return p;
}

void cp_slice_sequence(const DeviceContext& ctx, TensorView out, TensorView inp, int cp_size, int cp_rank) {
  move_chunks(ctx, inp, out, cp_size, cp_rank, true);
}

void cp_unslice_sequence(const DeviceContext& ctx, TensorView out, TensorView inp, int cp_size, int cp_rank) {
  move_chunks(ctx, out, inp, cp_size, cp_rank, false);
}

void ContextParallelAttention::forward(const DeviceContext& ctx, TensorView out, TensorView lse, TensorView qkv,
                                       const AttentionParams& p, const Communicator& cp, TensorView segment_ids) {
  const OpTable& ops = ctx.ops();
  const int n = cp.size(), r = cp.rank();
  if (n == 1) {
    ops.attention_forward(out, lse, qkv, p, segment_ids);
    return;
  }
  const Geometry g = make_geometry(qkv, p, n, "forward");
  const RingPositions rp(ctx, g, cp, segment_ids);
  const int next = (r + 1) % n, prev = (r - 1 + n) % n;
  Tensor kv[2] = {ctx.empty(g.kv_shape(), qkv.dtype()), ctx.empty(g.kv_shape(), qkv.dtype())};
  ops.attention_kv_pack(kv[0], qkv, p);
  // The running result stays f32 until every block is in: rounding to 16 bits once, at the end.
  const bool f32_out = out.dtype() == DType::kF32;
  Tensor acc_store = f32_out ? Tensor() : ctx.empty(g.out_shape(), DType::kF32);
  TensorView acc = f32_out ? out : acc_store.view();
  Tensor ob = ctx.empty(g.out_shape(), DType::kF32), lb = ctx.empty(g.lse_shape(), DType::kF32);
  for (int s = 0; s < n; ++s) {
    const int src = (r - s + n) % n, cur = s % 2;
    std::unique_ptr<Work> send, recv;
    if (s + 1 < n) {
      send = cp.send_async(kv[cur], next);
      recv = cp.recv_async(kv[1 - cur], prev);
    }
    const AttentionBlock blk = rp.block(g, r, src);
    if (s == 0) {  // the diagonal block: every query sees at least itself (causal) or everything
      ops.attention_block_forward(acc, lse, qkv, kv[cur], blk, p);
    } else if (any_visible(rp.host[size_t(r)], rp.host[size_t(src)], p)) {
      ops.attention_block_forward(ob, lb, qkv, kv[cur], blk, p);
      ops.attention_merge(acc, lse, ob, lb);
    }
    if (recv) recv->wait();
    if (send) send->wait();
  }
  if (!f32_out) ops.cast(out, acc);
}

void ContextParallelAttention::backward(const DeviceContext& ctx, TensorView dqkv, TensorView dout, TensorView qkv,
                                        TensorView out, TensorView lse, const AttentionParams& p,
                                        const Communicator& cp, TensorView segment_ids) {
  const OpTable& ops = ctx.ops();
  const int n = cp.size(), r = cp.rank();
  if (n == 1) {
    ops.attention_backward(dqkv, dout, qkv, out, lse, p, segment_ids);
    return;
  }
  const Geometry g = make_geometry(qkv, p, n, "backward");
  const RingPositions rp(ctx, g, cp, segment_ids);
  const int next = (r + 1) % n, prev = (r - 1 + n) % n;
  Tensor kv[2] = {ctx.empty(g.kv_shape(), qkv.dtype()), ctx.empty(g.kv_shape(), qkv.dtype())};
  ops.attention_kv_pack(kv[0], qkv, p);
  Tensor dq = ctx.zeros(g.out_shape(), DType::kF32);
  Tensor dkv[2] = {ctx.empty(g.kv_shape(), DType::kF32), ctx.empty(g.kv_shape(), DType::kF32)};
  Tensor dkv_in = ctx.empty(g.kv_shape(), DType::kF32);
  std::unique_ptr<Work> dkv_send[2];
  for (int s = 0; s < n; ++s) {
    const int src = (r - s + n) % n, cur = s % 2;
    // Post order must match the sender's (header): last step's dK/dV first, then the next K/V.
    std::unique_ptr<Work> dkv_recv, kv_send, kv_recv;
    if (s > 0) dkv_recv = cp.recv_async(dkv_in, prev);
    if (s + 1 < n) {
      kv_send = cp.send_async(kv[cur], next);
      kv_recv = cp.recv_async(kv[1 - cur], prev);
    }
    if (dkv_send[cur]) dkv_send[cur]->wait();  // the buffer sent two steps ago is free again
    ops.fill_(dkv[cur], 0.0f);
    if (s == 0 || any_visible(rp.host[size_t(r)], rp.host[size_t(src)], p))
      ops.attention_block_backward(dq, dkv[cur], dout, qkv, kv[cur], out, lse, rp.block(g, r, src), p);
    if (dkv_recv) {
      dkv_recv->wait();
      ops.residual_forward(dkv[cur], dkv[cur], dkv_in);  // this block's dK/dV summed over the ranks so far
    }
    dkv_send[cur] = cp.send_async(dkv[cur], next);
    if (kv_recv) kv_recv->wait();
    if (kv_send) kv_send->wait();
  }
  cp.recv(dkv_in, prev);  // this rank's own block, summed over every rank's queries
  for (auto& w : dkv_send)
    if (w) w->wait();
  ops.attention_qkv_grad_unpack(dqkv, dq, dkv_in, p);
}

}  // namespace loom

// The op table's entry points for the attention core, the context-parallel attention blocks and RoPE:
// head geometry, masking and dropout parameters, the grouped qkv layout and every tensor's shape, dtype and
// device, checked once (the union of the CPU reference's and the CUDA launchers' former checks) before the
// backend's do_<op>. Values that live in the backend's memory (segment ids, positions) are the backend's to
// check where it can read them. See op_checks.cpp for the rest.
#include <tuple>
#include <utility>

#include "backend/op_checks.h"

namespace loom {

using namespace op_checks;

namespace {

// Columns of a packed qkv row (Megatron's grouped layout), of a compact kv row and of an out row.
int64_t qkv_row(const AttentionParams& p) {
  return p.num_kv_heads * (p.num_heads / p.num_kv_heads + 2) * p.head_dim;
}
int64_t kv_row(const AttentionParams& p) { return p.num_kv_heads * 2 * p.head_dim; }
int64_t out_row(const AttentionParams& p) { return p.num_heads * p.head_dim; }

// t is given, on dev, with shape s and dtype dt.
void check_same(Device dev, TensorView t, Shape s, DType dt, const char* op, const char* name) {
  LOOM_CHECK(t.defined() && t.dtype() == dt && t.shape() == s, "[", op, "] expected ", name, " ", dtype_name(dt),
             s.str(), ", got ", t.desc());
  on_device(dev, t, op, name);
}

// t is given, on dev, with shape s (its dtype is checked by the caller).
void check_shape(Device dev, TensorView t, Shape s, const char* op, const char* name) {
  LOOM_CHECK(t.defined() && t.shape() == s, "[", op, "] expected ", name, " ", s.str(), ", got ", t.desc());
  on_device(dev, t, op, name);
}

// A packed qkv-like tensor (B, T, NKV*(NH/NKV+2)*HS) in f32, bf16 or f16 on dev.
void check_qkv(Device dev, TensorView t, const AttentionParams& p, const char* op, const char* name) {
  LOOM_CHECK(t.defined() && is_compute_dtype(t.dtype()) && t.ndim() == 3 && t.size(2) == qkv_row(p), "[", op,
             "] expected ", name, " f32, bf16 or f16 (B, T, NKV*(NH/NKV+2)*HS = ", qkv_row(p), "), got ", t.desc());
  on_device(dev, t, op, name);
}

// The whole-sequence op's qkv (B, T, row) and segment_ids (B, T) i32 when given.
void check_whole_sequence(Device dev, TensorView qkv, const AttentionParams& p, TensorView segment_ids,
                          const char* op) {
  check_heads(p, op);
  check_attention_params(p, op);
  check_qkv(dev, qkv, p, op, "qkv");
  if (segment_ids.defined()) {
    const Shape want{qkv.size(0), qkv.size(1)};
    LOOM_CHECK(segment_ids.dtype() == DType::kI32 && segment_ids.shape() == want, "[", op,
               "] expected i32 segment_ids ", want.str(), ", got ", segment_ids.desc());
    on_device(dev, segment_ids, op, "segment_ids");
  }
}

// q (B, Tq, qkv row) and kv (B, Tk, qkv row or compact kv row) of one dtype, the block's positions and
// segment ids; returns (B, Tq, Tk).
std::tuple<int64_t, int64_t, int64_t> check_block(Device dev, TensorView q, TensorView kv, const AttentionBlock& blk,
                                                  const AttentionParams& p, const char* op) {
  check_heads(p, op);
  check_attention_params(p, op);
  check_qkv(dev, q, p, op, "q");
  const int64_t B = q.size(0), Tq = q.size(1);
  LOOM_CHECK(kv.defined() && kv.dtype() == q.dtype() && kv.ndim() == 3 && kv.size(0) == B &&
                 (kv.size(2) == qkv_row(p) || kv.size(2) == kv_row(p)),
             "[", op, "] expected kv ", dtype_name(q.dtype()), "(", B, ", Tk, ", qkv_row(p), " or ", kv_row(p),
             "), got ", kv.desc());
  on_device(dev, kv, op, "kv");
  const int64_t Tk = kv.size(1);
  for (auto [t, n, name] : {std::tuple{blk.q_pos, Tq, "q_pos"}, std::tuple{blk.k_pos, Tk, "k_pos"}}) {
    const Shape want{n};
    LOOM_CHECK(t.defined() && t.dtype() == DType::kI32 && t.shape() == want, "[", op, "] expected i32 ", name, " (",
               n, "), got ", t.desc());
    on_device(dev, t, op, name);
  }
  LOOM_CHECK(blk.q_segment_ids.defined() == blk.k_segment_ids.defined(), "[", op,
             "] q_segment_ids and k_segment_ids go together");
  if (blk.q_segment_ids.defined()) {
    for (auto [t, n, name] : {std::tuple{blk.q_segment_ids, Tq, "q_segment_ids"},
                              std::tuple{blk.k_segment_ids, Tk, "k_segment_ids"}}) {
      const Shape want{B, n};
      LOOM_CHECK(t.dtype() == DType::kI32 && t.shape() == want, "[", op, "] expected i32 ", name, " (", B, ", ", n,
                 "), got ", t.desc());
      on_device(dev, t, op, name);
    }
  }
  // The dropout mask index needs the global length (positions are global).
  if (p.dropout_p > 0.0f)
    LOOM_CHECK(blk.seq_len > 0, "[", op, "] attention dropout needs the global sequence length (seq_len)");
  return {B, Tq, Tk};
}

// out/dout-like tensors of a block: (B, Tq, NH*HS) in f32 or q's dtype.
void check_block_rows(Device dev, TensorView t, Shape want, DType dt, const char* op, const char* name) {
  LOOM_CHECK(t.defined() && (t.dtype() == DType::kF32 || t.dtype() == dt) && t.shape() == want, "[", op,
             "] expected ", name, " f32 or ", dtype_name(dt), want.str(), ", got ", t.desc());
  on_device(dev, t, op, name);
}

// RoPE: the heads, an even rotary_dim <= HS, qkv (B, T, row) in a compute dtype, cos/sin tables
// (max_positions, rotary_dim/2) f32, and either position_ids (B, T) i32 or T <= max_positions.
void check_rope(Device dev, const char* op, TensorView qkv, TensorView cos, TensorView sin, const AttentionParams& p,
                const RopeParams& r, TensorView position_ids) {
  check_heads(p, op);
  LOOM_CHECK(r.rotary_dim > 0 && r.rotary_dim % 2 == 0 && r.rotary_dim <= p.head_dim, "[", op,
             "] expected an even rotary_dim in [2, head_dim = ", p.head_dim, "], got ", r.rotary_dim);
  LOOM_CHECK(qkv.defined() && is_compute_dtype(qkv.dtype()) && qkv.ndim() == 3, "[", op,
             "] expected qkv f32, bf16 or f16 (B, T, NKV*(NH/NKV+2)*HS), got ", qkv.desc());
  on_device(dev, qkv, op, "qkv");
  LOOM_CHECK(qkv.size(2) == qkv_row(p), "[", op, "] expected qkv last dim NKV*(NH/NKV+2)*HS = ", qkv_row(p), ", got ",
             qkv.desc());
  const int64_t half = r.rotary_dim / 2, B = qkv.size(0), T = qkv.size(1);
  for (const auto& [t, name] : {std::pair{cos, "cos"}, std::pair{sin, "sin"}}) {
    LOOM_CHECK(t.defined() && t.dtype() == DType::kF32 && t.ndim() == 2 && t.size(1) == half, "[", op,
               "] expected f32 ", name, " table (max_positions, rotary_dim/2 = ", half, "), got ", t.desc());
    on_device(dev, t, op, name);
  }
  LOOM_CHECK(cos.shape() == sin.shape(), "[", op, "] cos ", cos.desc(), " and sin ", sin.desc(),
             " must have the same shape");
  const int64_t max_pos = cos.size(0);
  if (position_ids.defined()) {
    LOOM_CHECK(position_ids.dtype() == DType::kI32 && position_ids.shape() == Shape({B, T}), "[", op,
               "] expected i32 position_ids (", B, ", ", T, "), got ", position_ids.desc());
    on_device(dev, position_ids, op, "position_ids");
  } else {
    LOOM_CHECK(T <= max_pos, "[", op, "] sequence length ", T, " exceeds the ", max_pos,
               " positions of the cos/sin tables");
  }
}

}  // namespace

void OpTable::rope_forward(TensorView qkv, TensorView cos, TensorView sin, const AttentionParams& p,
                           const RopeParams& r, TensorView position_ids) const {
  check_rope(device(), "rope_forward", qkv, cos, sin, p, r, position_ids);
  do_rope_forward(qkv, cos, sin, p, r, position_ids);
}

void OpTable::rope_backward(TensorView dqkv, TensorView cos, TensorView sin, const AttentionParams& p,
                            const RopeParams& r, TensorView position_ids) const {
  check_rope(device(), "rope_backward", dqkv, cos, sin, p, r, position_ids);
  do_rope_backward(dqkv, cos, sin, p, r, position_ids);
}

void OpTable::attention_forward(TensorView out, TensorView lse, TensorView qkv, const AttentionParams& p,
                                TensorView segment_ids) const {
  const char* op = "attention_forward";
  const Device dev = device();
  check_whole_sequence(dev, qkv, p, segment_ids, op);
  const int64_t B = qkv.size(0), T = qkv.size(1);
  check_same(dev, out, Shape{B, T, out_row(p)}, qkv.dtype(), op, "out");
  check_same(dev, lse, Shape{B, p.num_heads, T}, DType::kF32, op, "lse");
  do_attention_forward(out, lse, qkv, p, segment_ids);
}

void OpTable::attention_backward(TensorView dqkv, TensorView dout, TensorView qkv, TensorView out, TensorView lse,
                                 const AttentionParams& p, TensorView segment_ids) const {
  const char* op = "attention_backward";
  const Device dev = device();
  check_whole_sequence(dev, qkv, p, segment_ids, op);
  const int64_t B = qkv.size(0), T = qkv.size(1);
  check_same(dev, dqkv, qkv.shape(), qkv.dtype(), op, "dqkv");
  check_same(dev, out, Shape{B, T, out_row(p)}, qkv.dtype(), op, "out");
  check_same(dev, dout, Shape{B, T, out_row(p)}, qkv.dtype(), op, "dout");
  check_same(dev, lse, Shape{B, p.num_heads, T}, DType::kF32, op, "lse");
  do_attention_backward(dqkv, dout, qkv, out, lse, p, segment_ids);
}

void OpTable::attention_block_forward(TensorView out, TensorView lse, TensorView q, TensorView kv,
                                      const AttentionBlock& blk, const AttentionParams& p) const {
  const char* op = "attention_block_forward";
  const Device dev = device();
  const auto [B, Tq, Tk] = check_block(dev, q, kv, blk, p, op);
  check_block_rows(dev, out, Shape{B, Tq, out_row(p)}, q.dtype(), op, "out");
  LOOM_CHECK(lse.dtype() == DType::kF32, "[", op, "] expected lse f32, got ", lse.desc());
  check_shape(dev, lse, Shape{B, p.num_heads, Tq}, op, "lse");
  do_attention_block_forward(out, lse, q, kv, blk, p);
}

void OpTable::attention_merge(TensorView out, TensorView lse, TensorView out_block, TensorView lse_block) const {
  const char* op = "attention_merge";
  const Device dev = device();
  LOOM_CHECK(out.ndim() == 3 && is_compute_dtype(out.dtype()), "[", op,
             "] expected out f32, bf16 or f16 (B, T, NH*HS), got ", out.desc());
  require(dev, out, op, "out");
  LOOM_CHECK(lse.ndim() == 3 && lse.dtype() == DType::kF32 && lse.size(0) == out.size(0) &&
                 lse.size(2) == out.size(1) && lse.size(1) > 0 && out.size(2) % lse.size(1) == 0,
             "[", op, "] expected lse f32 (B, NH, T) matching out ", out.desc(), ", got ", lse.desc());
  require(dev, lse, op, "lse");
  LOOM_CHECK(is_compute_dtype(out_block.dtype()), "[", op, "] expected out_block f32, bf16 or f16, got ",
             out_block.desc());
  check_shape(dev, out_block, out.shape(), op, "out_block");
  LOOM_CHECK(lse_block.dtype() == DType::kF32, "[", op, "] expected lse_block f32, got ", lse_block.desc());
  check_shape(dev, lse_block, lse.shape(), op, "lse_block");
  do_attention_merge(out, lse, out_block, lse_block);
}

void OpTable::attention_block_backward(TensorView dq, TensorView dkv, TensorView dout, TensorView q, TensorView kv,
                                       TensorView out, TensorView lse, const AttentionBlock& blk,
                                       const AttentionParams& p) const {
  const char* op = "attention_block_backward";
  const Device dev = device();
  const auto [B, Tq, Tk] = check_block(dev, q, kv, blk, p, op);
  check_block_rows(dev, out, Shape{B, Tq, out_row(p)}, q.dtype(), op, "out");
  check_block_rows(dev, dout, Shape{B, Tq, out_row(p)}, q.dtype(), op, "dout");
  LOOM_CHECK(lse.dtype() == DType::kF32, "[", op, "] expected lse f32, got ", lse.desc());
  check_shape(dev, lse, Shape{B, p.num_heads, Tq}, op, "lse");
  LOOM_CHECK(dq.dtype() == DType::kF32, "[", op, "] expected dq f32, got ", dq.desc());
  check_shape(dev, dq, Shape{B, Tq, out_row(p)}, op, "dq");
  LOOM_CHECK(dkv.dtype() == DType::kF32, "[", op, "] expected dkv f32 (compact layout), got ", dkv.desc());
  check_shape(dev, dkv, Shape{B, Tk, kv_row(p)}, op, "dkv");
  do_attention_block_backward(dq, dkv, dout, q, kv, out, lse, blk, p);
}

void OpTable::attention_kv_pack(TensorView kv, TensorView qkv, const AttentionParams& p) const {
  const char* op = "attention_kv_pack";
  const Device dev = device();
  check_heads(p, op);
  check_qkv(dev, qkv, p, op, "qkv");
  LOOM_CHECK(kv.dtype() == qkv.dtype(), "[", op, "] expected kv ", dtype_name(qkv.dtype()), ", got ", kv.desc());
  check_shape(dev, kv, Shape{qkv.size(0), qkv.size(1), kv_row(p)}, op, "kv");
  do_attention_kv_pack(kv, qkv, p);
}

void OpTable::attention_qkv_grad_unpack(TensorView dqkv, TensorView dq, TensorView dkv,
                                        const AttentionParams& p) const {
  const char* op = "attention_qkv_grad_unpack";
  const Device dev = device();
  check_heads(p, op);
  check_qkv(dev, dqkv, p, op, "dqkv");
  const int64_t B = dqkv.size(0), T = dqkv.size(1);
  LOOM_CHECK(dq.dtype() == DType::kF32, "[", op, "] expected dq f32, got ", dq.desc());
  check_shape(dev, dq, Shape{B, T, out_row(p)}, op, "dq");
  LOOM_CHECK(dkv.dtype() == DType::kF32, "[", op, "] expected dkv f32, got ", dkv.desc());
  check_shape(dev, dkv, Shape{B, T, kv_row(p)}, op, "dkv");
  do_attention_qkv_grad_unpack(dqkv, dq, dkv, p);
}

}  // namespace loom

// QKNorm (Megatron's --qk-layernorm): per-head norms of the query and key heads of a grouped qkv tensor.
// In the grouped layout a token's row is, per query group g, [q heads of g (G·HS) | k_g (HS) | v_g (HS)],
// so the q and k heads are not rows of one matrix; they are gathered into contiguous (rows, HS) buffers
// (query heads in head order h = g·G + j, key heads in group order), normalised there by the norm ops and
// scattered back. Gathers and scatters are plain DeviceContext copies (bit-exact), so the forward a
// recomputation re-runs produces the same bits.
#include "loom/nn/modules.h"

namespace loom {

namespace {

enum class HeadKind { kQuery, kKey };

// Copies the query (or key) heads between qkv (B, T, NKV·(G+2)·HS) and the packed (B·T·heads, HS) rows, in
// the direction `to_qkv`. One contiguous copy per (token, group): G heads of q, or the one k head.
void copy_heads(const DeviceContext& ctx, TensorView qkv, TensorView packed, const AttentionParams& p, HeadKind kind,
                bool to_qkv) {
  const int64_t BT = qkv.size(0) * qkv.size(1), NKV = p.num_kv_heads, G = p.num_heads / p.num_kv_heads,
                HS = p.head_dim, row = NKV * (G + 2) * HS;
  const bool q = kind == HeadKind::kQuery;
  const int64_t chunk = (q ? G : 1) * HS;  // elements per (token, group)
  const int64_t first = q ? 0 : G * HS;   // the chunk's column within its group
  for (int64_t i = 0; i < BT; ++i) {
    for (int64_t g = 0; g < NKV; ++g) {
      const TensorView a = qkv.slice_flat(i * row + g * (G + 2) * HS + first, {chunk});
      const TensorView b = packed.slice_flat((i * NKV + g) * chunk, {chunk});
      if (to_qkv) ctx.copy(a, b);
      else ctx.copy(b, a);
    }
  }
}

}  // namespace

QKNorm::QKNorm(ParameterSet& ps, const std::string& prefix, const AttentionParams& p, float eps, NormKind kind)
    : p_(p),
      q_norm_(ps, prefix + ".q_layernorm", p.head_dim, eps, kind),
      k_norm_(ps, prefix + ".k_layernorm", p.head_dim, eps, kind) {
  LOOM_CHECK(p.num_heads > 0 && p.num_kv_heads > 0 && p.num_heads % p.num_kv_heads == 0 && p.head_dim > 0,
             "[QKNorm] expected num_heads a positive multiple of num_kv_heads and head_dim > 0, got ", p.num_heads,
             ", ", p.num_kv_heads, ", ", p.head_dim);
}

void QKNorm::forward(const DeviceContext& ctx, TensorView qkv, Saved& s, TensorView scratch) const {
  const int64_t B = qkv.size(0), T = qkv.size(1), NH = p_.num_heads, NKV = p_.num_kv_heads, HS = p_.head_dim;
  LOOM_CHECK(qkv.ndim() == 3 && qkv.size(2) == (NH + 2 * NKV) * HS, "[QKNorm] expected qkv (B, T, ",
             (NH + 2 * NKV) * HS, "), got ", qkv.desc());
  LOOM_CHECK(scratch.dtype() == qkv.dtype() && scratch.numel() >= B * T * NH * HS, "[QKNorm] scratch needs ",
             B * T * NH * HS, " elements of ", dtype_name(qkv.dtype()), ", got ", scratch.desc());
  ensure_tensor(ctx, s.q_inp, {B, T, NH * HS}, qkv.dtype());
  ensure_tensor(ctx, s.k_inp, {B, T, NKV * HS}, qkv.dtype());
  copy_heads(ctx, qkv, s.q_inp, p_, HeadKind::kQuery, false);
  copy_heads(ctx, qkv, s.k_inp, p_, HeadKind::kKey, false);
  const TensorView qn = scratch.slice_flat(0, {B * T * NH, HS});
  q_norm_.forward(ctx, qn, s.q, s.q_inp);
  copy_heads(ctx, qkv, qn, p_, HeadKind::kQuery, true);
  const TensorView kn = scratch.slice_flat(0, {B * T * NKV, HS});
  k_norm_.forward(ctx, kn, s.k, s.k_inp);
  copy_heads(ctx, qkv, kn, p_, HeadKind::kKey, true);
}

void QKNorm::backward(const DeviceContext& ctx, TensorView dqkv, const Saved& s, TensorView scratch_a,
                      TensorView scratch_b) const {
  const int64_t BT = dqkv.size(0) * dqkv.size(1), NH = p_.num_heads, NKV = p_.num_kv_heads, HS = p_.head_dim;
  for (const TensorView* t : {&scratch_a, &scratch_b})
    LOOM_CHECK(t->dtype() == dqkv.dtype() && t->numel() >= BT * NH * HS, "[QKNorm] backward scratch needs ",
               BT * NH * HS, " elements of ", dtype_name(dqkv.dtype()), ", got ", t->desc());
  const struct {
    HeadKind kind;
    int64_t heads;
    const Norm& norm;
    const Tensor& inp;
    const Norm::Saved& saved;
  } parts[] = {{HeadKind::kQuery, NH, q_norm_, s.q_inp, s.q}, {HeadKind::kKey, NKV, k_norm_, s.k_inp, s.k}};
  for (const auto& part : parts) {
    const TensorView dout = scratch_a.slice_flat(0, {BT * part.heads, HS});
    const TensorView dinp = scratch_b.slice_flat(0, {BT * part.heads, HS});
    copy_heads(ctx, dqkv, dout, p_, part.kind, false);
    ctx.ops().fill_(dinp, 0.0f);  // the norm's dinp accumulates
    part.norm.backward(ctx, dinp, dout, part.inp, part.saved);
    copy_heads(ctx, dqkv, dinp, p_, part.kind, true);
  }
}

}  // namespace loom

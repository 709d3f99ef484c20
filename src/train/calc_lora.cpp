// `loom calc` with LoRA: the adapters one transformer layer declares (the shapes of
// TransformerLayer::add_lora in src/model/transformer_layer_lora.cpp, with the rank check of LoraAdapter),
// their executed FLOPs per token and the transient scratch a single process allocates for them. The
// figures built from these are compute_calc's (calc.cpp); docs/calc.md, "LoRA fine-tuning", states them.
#include <algorithm>

#include "loom/core/check.h"
#include "train/calc_impl.h"

namespace loom {

double LoraAdapterShape::forward_flops_per_token(int64_t rank, int t) const {
  const double r = double(rank), tt = double(t);
  if (column_parallel) return tt * 2.0 * double(in) * r + 2.0 * r * double(layer_out);
  return 2.0 * double(in) * r + 2.0 * r * double(layer_out);  // up GEMM on TP rank 0 only
}

double LoraAdapterShape::backward_flops_per_token(int64_t rank, int t) const {
  const double r = double(rank), tt = double(t);
  if (column_parallel) return tt * 3.0 * 2.0 * double(in) * r + 2.0 * 2.0 * r * double(layer_out);
  return 3.0 * 2.0 * double(in) * r + tt * 2.0 * 2.0 * r * double(layer_out);
}

namespace calc_detail {

std::vector<LoraAdapterShape> lora_layer_adapters(const GPTConfig& m, const LoraOptions& lora) {
  const int64_t C = m.hidden_size, HS = m.head_dim(), NH = m.num_attention_heads, NKV = m.num_kv_heads();
  const int64_t F = m.ffn_hidden_size(), F1 = (m.gated_mlp() ? 2 : 1) * F, QKV = m.qkv_size();
  std::vector<LoraAdapterShape> out;
  for (LoraTarget t : lora.targets) {
    LoraAdapterShape a{t};
    switch (t) {
      case LoraTarget::kQkv: a = {t, true, C, QKV, QKV}; break;
      case LoraTarget::kQ: a = {t, true, C, NH * HS, QKV}; break;
      case LoraTarget::kK:
      case LoraTarget::kV: a = {t, true, C, NKV * HS, QKV}; break;
      case LoraTarget::kFc1: a = {t, true, C, F1, F1}; break;
      case LoraTarget::kGate:
      case LoraTarget::kUp: a = {t, true, C, F, F1}; break;
      case LoraTarget::kProj: a = {t, false, NH * HS, C, C}; break;
      case LoraTarget::kFc2: a = {t, false, F, C, C}; break;
    }
    // LoraAdapter's rule: the update must be low rank for the global (in, out).
    const int64_t lim = std::min(a.in, a.out);
    if (lora.config.rank > lim)
      user_error("--lora-rank must be in [1, ", lim, "] for ", lora_target_name(t), " (", a.in, " -> ", a.out,
                 "), got ", lora.config.rank);
    out.push_back(a);
  }
  return out;
}

int64_t lora_scratch_bytes(const std::vector<LoraAdapterShape>& adapters, const LoraConfig& cfg, int64_t tokens,
                           int64_t compute_bytes, int64_t grad_bytes) {
  const int64_t N = tokens, r = cfg.rank, cb = compute_bytes;
  int64_t peak = 0;
  for (const LoraAdapterShape& a : adapters) {
    const bool slice = a.out != a.layer_out;
    const int64_t dropped = cfg.dropout > 0.0f ? N * a.in * cb : 0;  // the dropped input (training)
    const int64_t h = N * r * cb, spread = slice ? a.layer_out * r * cb : 0;
    // Forward: dropped x and h alive while the up GEMM writes its (N, layer_out) output, then adds it.
    const int64_t forward = dropped + h + spread + N * a.layer_out * cb;
    // Backward: h recomputed (with its dropped x), dh, then either dB through the spread B (and its
    // gradient, in the gradient dtype) or the input gradient dh·A (N, in).
    const int64_t spread_grads = slice ? spread + a.layer_out * r * grad_bytes : 0;
    const int64_t backward = dropped + h + N * r * cb + std::max(spread_grads, N * a.in * cb);
    peak = std::max({peak, forward, backward});
  }
  return peak;
}

}  // namespace calc_detail

}  // namespace loom

// Private to the train layer: the two architecture/precision tests that both halves of `loom calc` ask,
// calc.cpp (validation and arithmetic) and calc_report.cpp (the printed report), calc_lora.cpp's LoRA
// shapes and scratch, and calc_moe.cpp's mixture-of-experts figures.
#pragma once
#include "loom/train/calc.h"

namespace loom::calc_detail {

// GPT-2's layer (LayerNorm, 4h GeLU MLP, multi-head attention with h/a heads, biases, learned positions, tied
// output): the shapes the paper's formulas describe.
inline bool is_gpt2_architecture(const GPTConfig& m) {
  const GPTConfig d;
  return m.normalization == d.normalization && m.activation == d.activation &&
         m.ffn_hidden_size() == 4 * m.hidden_size && m.head_dim() * m.num_attention_heads == m.hidden_size &&
         m.num_kv_heads() == m.num_attention_heads &&
         m.add_bias_linear && !m.untie_embeddings_and_output_weights &&
         m.position_embedding_type == d.position_embedding_type && !m.qk_layernorm && !m.is_moe();
}

inline bool is_16bit(const PrecisionConfig& pr) { return pr.bf16 || pr.fp16; }

// The adapters of one transformer layer for `lora`, in target order, global shapes; UserError naming
// --lora-rank when the rank exceeds an adapter's min(in, out), as LoraAdapter refuses it.
std::vector<LoraAdapterShape> lora_layer_adapters(const GPTConfig& m, const LoraOptions& lora);

// A single process's largest transient LoRA allocation (bytes): over the adapters, the most that one
// adapter's forward (dropped input, h, spread B, the up GEMM's output) or backward (dropped input, h, dh,
// then the spread B and its gradient, or the input gradient) holds at once. `tokens` = micro-batch x
// sequence; compute_bytes / grad_bytes: the compute and gradient dtypes' sizes.
int64_t lora_scratch_bytes(const std::vector<LoraAdapterShape>& adapters, const LoraConfig& cfg, int64_t tokens,
                           int64_t compute_bytes, int64_t grad_bytes);

// Mixture of experts (calc_moe.cpp). Validates the expert layout (UserError naming the flag) and notes
// what `loom train` itself does not run yet.
void validate_moe_calc(CalcInput& in, const TrainConfig& cfg);
// r.moe for a MoE model (r.moe stays empty for a dense one): EP, ETP, the expert-data-parallel group, the
// per-rank parameters of a MoE layer beyond its attention and norms (router, shared experts, gate: TP-split
// like the dense layer; routed experts: E/EP of them, FFN / ETP), the stages' MoE layers and the MoE
// layer's activation bytes. L_stage: layers per pipeline stage.
void moe_figures(const CalcInput& in, int64_t L_stage, CalcReport& r);
// MoE layers among global layers [first, first + count).
int64_t moe_layers_in(const GPTConfig& m, int64_t first, int64_t count);

}  // namespace loom::calc_detail

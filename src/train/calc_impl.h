// Private to the train layer: the two architecture/precision tests that both halves of `loom calc` ask,
// calc.cpp (validation and arithmetic) and calc_report.cpp (the printed report).
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
         m.position_embedding_type == d.position_embedding_type && !m.qk_layernorm;
}

inline bool is_16bit(const PrecisionConfig& pr) { return pr.bf16 || pr.fp16; }

}  // namespace loom::calc_detail

// Hugging Face <-> Loom parameter mapping for GPT-2, Llama-family (Llama, Mistral) and mixture-of-experts
// (Mixtral, Qwen2-MoE, Qwen3-MoE) models: which HF tensors make up each Loom parameter and how their rows
// are laid out. Pure layout code: no files (the train layer's model_io.h reads and writes HF directories
// and Loom checkpoints with it).
//
// GPT-2 (HF names under "transformer."; the Hub's gpt2 files have no prefix):
//   wte (V, C) -> embedding.word_embeddings.weight (Vp, C): rows V..Vp-1 are zero padding (dropped on export)
//   wpe -> embedding.position_embeddings.weight; h.N.ln_1 / ln_2 / ln_f -> input_layernorm / pre_mlp_layernorm
//   / decoder.final_layernorm (weight, bias); h.N.attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj are Conv1D,
//   stored (in, out): transposed into linear_qkv, linear_proj, linear_fc1, linear_fc2 (out, in). c_attn's
//   columns are [Q of all heads | K | V]; linear_qkv's rows are regrouped per head ([q_h, k_h, v_h]), the
//   bias likewise. lm_head is tied to wte (untied when tie_word_embeddings is false).
// Llama / Mistral (HF names under "model."):
//   embed_tokens -> word embeddings (padded as above); layers.N.self_attn.{q,k,v}_proj -> linear_qkv in
//   Megatron's grouped order (per key/value group g: its NH/NKV query heads, its key head, its value head);
//   o_proj -> linear_proj; mlp.gate_proj + up_proj -> linear_fc1 = [gate | up]; down_proj -> linear_fc2;
//   input_layernorm / post_attention_layernorm / norm -> input_layernorm / pre_mlp_layernorm /
//   final_layernorm; lm_head -> output_layer.weight (padded), or tied to embed_tokens.
// Mixtral / Qwen2-MoE / Qwen3-MoE (the Llama layer with a sparse MoE block; hf_mapping_moe.cpp):
//   layers.N.block_sparse_moe (Mixtral) or layers.N.mlp (Qwen): gate.weight (E, C) -> mlp.router.weight;
//   experts.M.w1 + w3 (Qwen: gate_proj + up_proj) -> mlp.experts.linear_fc1.weightM = [gate | up];
//   experts.M.w2 (down_proj) -> mlp.experts.linear_fc2.weightM. Qwen2-MoE: mlp.shared_expert.gate_proj +
//   up_proj -> mlp.shared_experts.linear_fc1 = [gate | up], down_proj -> shared_experts.linear_fc2,
//   mlp.shared_expert_gate.weight (1, C) -> mlp.shared_experts.gate_weight. Qwen3-MoE: self_attn.q_norm /
//   k_norm (HS) -> self_attention.q_layernorm / k_layernorm. Qwen's dense layers (mlp_only_layers,
//   decoder_sparse_step) map as Llama's MLP.
// RoPE: HF rotates channel pairs (c, c + d/2) (rotate_half), which is Loom's default, so q/k rows are kept.
// With rotary_interleaved Loom pairs (2c, 2c + 1): row 2c of each query/key head is HF row c and row
// 2c + 1 is HF row c + d/2 (the same permutation of q and k leaves every score unchanged).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/model/gpt.h"

namespace loom {

enum class HfFamily { kGPT2, kLlama, kMixtral, kQwen2Moe, kQwen3Moe };
const char* hf_family_name(HfFamily f);  // "gpt2", "llama", "mixtral", "qwen2_moe", "qwen3_moe"

// One HF tensor that makes up (part of) a Loom parameter.
struct HfPart {
  std::string name;         // full HF name, e.g. "transformer.h.0.attn.c_attn.weight"
  Shape shape;              // its shape as HF stores it
  bool transposed = false;  // Conv1D (in, out): its transpose's rows are what gets stacked
};

// A Loom parameter as a function of HF tensors: the parts' rows (after transposing) are stacked in order,
// then Loom row r = stacked row row_source[r]; -1 is a zero row (vocabulary padding). 1-D tensors are
// columns of one element. Every stacked row is used exactly once.
struct HfParamMap {
  std::string loom_name;
  Shape loom_shape;
  std::vector<HfPart> parts;
  std::vector<int64_t> row_source;  // size loom_shape[0]
  std::string note;                 // how the layout changes, for the summary ("transposed, regrouped")
};

// An HF tensor that repeats another one (a tied lm_head): optional on import, where it must equal the
// original; not written on export.
struct HfAlias {
  std::string name;
  std::string same_as;
};

struct HfLayout {
  HfFamily family = HfFamily::kGPT2;
  std::vector<HfParamMap> params;  // one per Loom parameter, in GPTModel's declaration order
  std::vector<HfAlias> aliases;
  // HF tensors with no Loom counterpart that must be all zeros (Llama's o_proj bias when only q/k/v have
  // biases, i.e. --add-qkv-bias with --disable-bias-linear): checked and dropped on import, written as
  // zeros on export so transformers finds every parameter it builds.
  std::vector<HfPart> zero_tensors;
};

// The family a config exports to: GPT-2 for learned absolute positions, Llama for RoPE; a MoE model
// (--num-experts) Qwen2-MoE with shared experts, Qwen3-MoE with --qk-layernorm, else Mixtral. UserError
// naming the option when the architecture has no HF counterpart (qk-layernorm on a dense model, partial
// RoPE, a LayerNorm Llama, sigmoid routing, Mixtral with pre-softmax routing or dense layers, ...).
HfFamily hf_family_for(const GPTConfig& cfg);

// transformers' default name prefix of the base model: "transformer." (GPT-2) or "model." (the others).
const char* hf_default_prefix(HfFamily f);

// The mapping for `cfg` (cfg.padded_vocab_size rows in Loom's vocabulary tables, cfg.vocab_size in HF's).
// `prefix` goes in front of every name but lm_head's ("" for the Hub's prefix-free GPT-2 files).
HfLayout hf_layout(const GPTConfig& cfg, const std::string& prefix);
HfLayout hf_layout(const GPTConfig& cfg);  // with hf_default_prefix

// HF tensors that are not parameters: GPT-2's causal-mask buffers (h.N.attn.bias, h.N.attn.masked_bias)
// and old Llama files' rotary_emb.inv_freq. Skipped on import.
bool hf_is_buffer(const std::string& name);

// The grouped qkv permutation: Loom row r of linear_qkv comes from row result[r] of [Q; K; V] (the HF q, k
// and v rows stacked). rotary_dim > 0 with interleaved: each query/key head's first rotary_dim rows are
// interleaved as described at the top.
std::vector<int64_t> hf_qkv_row_source(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                       bool interleaved = false, int64_t rotary_dim = 0);

// HF -> Loom: fills `out` (f32, host, loom_shape) from the parts (f32, host, each in its HF shape).
void hf_to_loom(const HfParamMap& m, const std::vector<TensorView>& parts, TensorView out);
// Loom -> HF: the parts (f32, host, HF shapes) of `loom` (f32, host, loom_shape); padding rows are dropped.
std::vector<Tensor> loom_to_hf(const HfParamMap& m, TensorView loom);

// ---- LoRA adapters as Hugging Face PEFT saves them (adapter_model.safetensors; Llama family) ----
// A Loom adapter decoder.layers.N.<module>.lora_{A,B}.weight is one or more PEFT modules: the HF tensors
// that the rows it updates (lora_site) come from. Each PEFT module gets the same A (rank, in) and its own
// rows of B (rows, rank), in the HF weight's row order (hf_layout's row permutation, the RoPE interleaving
// of --rotary-interleaved included), so that PEFT's W_hf + s·B_hf·A is the HF export of Loom's W + s·B·A:
//   linear_qkv -> q_proj, k_proj, v_proj (A repeated; B's grouped rows split per projection)
//   q_proj, k_proj, v_proj -> themselves (B's rows in head order; only their RoPE rows may move)
//   linear_fc1 -> gate_proj, up_proj (A repeated; B's halves); gate_proj, up_proj -> themselves
//   linear_proj -> o_proj; linear_fc2 -> down_proj
// PEFT's names: "base_model.model." + the HF name of the module + ".lora_A.weight" / ".lora_B.weight"
// (get_peft_model_state_dict drops the adapter name, ".default").
inline constexpr const char* kPeftPrefix = "base_model.model.";

struct HfLoraMap {
  LoraTarget target = LoraTarget::kQkv;
  int64_t layer = 0;
  std::string loom_a;                   // decoder.layers.N.<module>.lora_A.weight
  Shape a_shape;                        // (rank, in)
  std::vector<std::string> hf_modules;  // PEFT's target_modules names, one per PEFT module: "q_proj", ...
  std::vector<std::string> hf_a;        // one per PEFT module, each a copy of Loom's A
  HfParamMap b;                         // loom_name: Loom's B (out, rank); parts: PEFT's B tensors (rows, rank)
};

// Every adapter of `targets` in every layer, layer by layer in target order. UserError for a MoE model, for
// a model that does not export to Llama (hf_family_for), and for GPT-2: its attention is one Conv1D c_attn
// (PEFT adapts it whole with fan_in_fan_out), which Loom does not map.
std::vector<HfLoraMap> hf_lora_layout(const GPTConfig& cfg, const std::vector<LoraTarget>& targets, int64_t rank);

// One line per kind of mapping, layer numbers folded into '*', with a count:
//   "transformer.h.*.attn.c_attn.weight -> decoder.layers.*.self_attention.linear_qkv.weight (transposed, regrouped) x2"
// (Loom names first, pointing at HF's, for an export).
std::vector<std::string> hf_mapping_summary(const HfLayout& layout, bool to_hf = false);

}  // namespace loom

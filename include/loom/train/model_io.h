// Model weights in and out of Loom: Loom checkpoints (ckpt/checkpoint.h, written by the trainer) and
// Hugging Face model directories (ckpt/hf_dir.h) of GPT-2, Llama-family and MoE models, with the layouts of
// model/hf_mapping.h. Used by `loom convert`, `loom generate` and `loom train --load <HF dir> --finetune`.
//
// Import is strict: every HF tensor must map to a Loom parameter (GPT-2's mask buffers and rotary_emb
// inv_freq are skipped), every Loom parameter must find its HF tensors, shapes must match exactly, a tied
// lm_head stored anyway must equal the embedding; the first problem is a UserError naming the tensor, and
// nothing is written into the parameters before every check passed. Values are exact: f32 and narrower HF
// dtypes widen to the f32 masters without rounding, and export to the same dtype reproduces every byte.
#pragma once
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "loom/ckpt/hf_dir.h"
#include "loom/model/gpt.h"
#include "loom/model/hf_mapping.h"

namespace loom {

// True when `dir` holds config.json and model.safetensors or model.safetensors.index.json.
bool is_hf_model_dir(const std::string& dir);

// The architecture of a Loom checkpoint (a root with latest_checkpointed_iteration.txt, or one iter_*
// dir holding metadata.json; padded vocabulary as saved) or of an HF model directory (vocabulary padded to
// a multiple of make_vocab_size_divisible_by, as the trainer pads it). Dropout is 0. UserError naming the
// file when it is neither, or the HF config has no Loom equivalent.
GPTConfig read_model_config(const std::string& dir, int64_t make_vocab_size_divisible_by = 128);

// HF config.json -> GPTConfig (the same rules as read_model_config). Llama 3 rope_scaling needs Megatron's
// fixed low/high frequency factors (1, 4) and original context (8192); Mistral's sliding_window W becomes
// --window-size W-1,0; attention_bias without mlp_bias becomes --add-qkv-bias (o_proj's bias must be zero).
// MoE families: num_local_experts / num_experts -> --num-experts, num_experts_per_tok -> --moe-router-topk,
// moe_intermediate_size -> --moe-ffn-hidden-size (dense layers keep intermediate_size), norm_topk_prob
// false -> --moe-router-pre-softmax, the sparse layers -> --moe-layer-freq's pattern, Qwen2-MoE's shared
// expert -> --moe-shared-expert-intermediate-size with --moe-shared-expert-gate and its qkv_bias ->
// --add-qkv-bias, Qwen3-MoE's q_norm / k_norm -> --qk-layernorm, router_aux_loss_coef -> the aux-loss
// coefficient (docs/models.md: Megatron's loss is defined differently).
GPTConfig gpt_config_from_hf(const HfConfig& hf, int64_t make_vocab_size_divisible_by = 128);

struct HfExportOptions {
  DType dtype = DType::kF32;                         // --dtype f32 | bf16 | f16 (rounded to nearest even)
  int64_t max_shard_bytes = kHfDefaultMaxShardBytes;  // --max-shard-size
  std::optional<int64_t> bos_token_id;               // written to config.json when set
  std::vector<int64_t> eos_token_ids;                 // written when set: one id, or a list of several
  std::ostream* log = nullptr;                        // the mapping summary, when set
  const DeviceContext* ctx = nullptr;                 // to copy parameters that live on a device
};

// config.json text for `cfg` in transformers' keys (model_type gpt2, llama, or mistral with a window;
// mixtral, qwen2_moe or qwen3_moe for a MoE model, as hf_family_for chooses).
std::string hf_config_json(const GPTConfig& cfg, const HfExportOptions& opts = {});
// The model_type hf_config_json writes; UserError (hf_family_for's) when there is none.
std::string hf_model_type(const GPTConfig& cfg);

struct HfImportOptions {
  // The Loom model pairs RoPE channels (2c, 2c + 1) (--rotary-interleaved): q/k rows are permuted.
  bool rotary_interleaved = false;
  std::ostream* log = nullptr;         // the mapping summary, when set
  // One-line notes (a checkpoint that records no checksums to verify); log when not set.
  std::ostream* notes = nullptr;
  const DeviceContext* ctx = nullptr;  // to copy into parameters that live on a device
  // MoE routers' expert biases (GPTModel::expert_biases(): buffers, not parameters) to fill from a Loom
  // checkpoint that holds them (left as they are otherwise, e.g. from a Hugging Face directory).
  std::vector<std::pair<std::string, std::vector<float>*>> expert_biases;
};

// Fills every parameter's f32 master value from a Loom checkpoint or an HF directory (as above); the caller
// then calls sync_compute(). The vocabulary tables' padded row count comes from `params`.
void load_model_weights(const std::string& dir, ParameterSet& params, const HfImportOptions& opts = {});

// Writes `params` (a model of `cfg`) as an HF model directory `out_dir` (must not exist or be empty).
void export_hf(const ParameterSet& params, const GPTConfig& cfg, const std::string& out_dir,
               const HfExportOptions& opts = {});

// `loom convert`. HF -> a Loom checkpoint at iteration 0 under loom_root (weights and metadata only: load it
// with `loom train --load ROOT --finetune`); Loom checkpoint (root or iter dir) -> HF directory.
struct HfToLoomOptions {
  int64_t make_vocab_size_divisible_by = 128;
  bool rotary_interleaved = false;
};
void convert_hf_to_loom(const std::string& hf_dir, const std::string& loom_root, const HfToLoomOptions& opts,
                        std::ostream& log);
void convert_loom_to_hf(const std::string& loom_dir, const std::string& hf_dir, const HfExportOptions& opts,
                        std::ostream& log);

}  // namespace loom

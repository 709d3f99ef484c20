// LoRA adapters in and out of Loom (issue 17): reading the adapter-only checkpoints `loom train --lora-rank`
// saves, merging adapters into their base, and Hugging Face PEFT adapter directories both ways. Used by
// `loom convert` (--to peft:, --from peft:, --merge-lora) and `loom generate --load <LoRA checkpoint>`.
//
// A LoRA checkpoint is a Loom checkpoint whose metadata.json has a "lora" block (rank, alpha, dropout,
// target_modules in lora_target_name's canonical spelling, base: the full model it adapts) and whose tensors
// are decoder.layers.N.<module>.lora_A.weight (rank, in) and .lora_B.weight (out, rank) (plus optimizer state).
// Merging is W[rows] += (alpha / rank) · B·A at the rows lora_site() gives (the fused qkv's grouped rows of
// q_proj, a gated fc1's halves, ...), computed in f64 per element and rounded once to the f32 master, so
// every merge of the same adapters gives the same bytes.
//
// A PEFT directory is adapter_config.json (LoraConfig's fields, as PEFT's save_pretrained writes them:
// sorted keys, 2-space indent) and adapter_model.safetensors with PEFT's names (model/hf_mapping.h,
// hf_lora_layout); f32 values, exact both ways. Its safetensors metadata records Loom's canonical targets
// ("loom_lora_target_modules"), so a whole-layer adapter (linear_qkv exported as q/k/v_proj with one A
// repeated) imports back as itself; without that record (a directory PEFT wrote) q/k/v and gate/up import
// as the slice targets q_proj ... up_proj, which adapt the same rows.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <ostream>
#include <string>

#include "loom/model/gpt.h"
#include "loom/train/model_io.h"

namespace loom {

struct LoraCheckpoint {
  std::string dir;    // the committed iter_* dir
  GPTConfig model;    // its model_config
  LoraOptions lora;   // rank, alpha, dropout, canonical targets
  std::string base;   // the "base" of its lora block ("" when the run's base was random)
};

// True when `dir` is a Loom checkpoint (root or iter_* dir) whose metadata.json has a "lora" block.
bool is_lora_checkpoint(const std::string& dir);
// The lora block and model_config of a LoRA checkpoint. UserError naming metadata.json for a checkpoint
// without a lora block (naming --merge-lora's purpose) or a malformed one.
LoraCheckpoint read_lora_checkpoint(const std::string& dir);
// The adapters as whole f32 host tensors by Loom name (any saved layout). UserError naming the tensor
// when one the lora block implies is missing or misshapen, or the checkpoint holds any other weight.
std::map<std::string, Tensor> read_lora_adapters(const LoraCheckpoint& ck);

// W += (alpha / rank) · B·A for every adapter of `lora` (named as read_lora_adapters names them) into
// `weights`: the model's whole weights by name, f32 on the host, of the model `cfg`.
void merge_lora(const GPTConfig& cfg, const LoraOptions& lora, const std::map<std::string, Tensor>& adapters,
                const std::map<std::string, TensorView>& weights);

// Loads the base of a LoRA checkpoint (`base_override`, else its lora.base: a Loom checkpoint of any layout
// or an HF directory) into `params` (a model of ck.model, f32 masters on the host) and merges the adapters;
// the caller then calls sync_compute(). Returns the base's directory. UserError naming `base_flag` when
// there is no base or it does not fit.
std::string load_merged_lora(const LoraCheckpoint& ck, const std::string& base_override, const char* base_flag,
                             ParameterSet& params, std::ostream* log);

// `loom convert --from loom:LORA --merge-lora --to loom:OUT | hf:OUT [--base DIR]`: the base with the
// adapters merged, as a full Loom checkpoint at iteration 0 or an HF directory (opts: dtype, shards, ids).
void convert_merge_lora(const std::string& lora_dir, const std::string& base_override, const std::string& out_dir,
                        bool to_hf, const HfExportOptions& opts, std::ostream& log);

// `loom convert --from loom:LORA --to peft:OUT [--base NAME]`: adapter_config.json (base_model_name_or_path:
// `base_name`, else the checkpoint's base) and adapter_model.safetensors. Llama-family models only.
void convert_loom_to_peft(const std::string& lora_dir, const std::string& out_dir, const std::string& base_name,
                          std::ostream& log);

struct PeftImportOptions {
  std::string base;                     // --base: the model the adapters belong to ("": the config's
                                        // base_model_name_or_path when that is a local directory)
  // An HF base's vocabulary padding, as `loom train` pads it (unset: 128, its default).
  std::optional<int64_t> make_vocab_size_divisible_by;
  bool rotary_interleaved = false;      // an HF base trained on with --rotary-interleaved
};
// `loom convert --from peft:DIR --to loom:OUT --base BASE`: a LoRA checkpoint at iteration 0 (adapters,
// no optimizer state; resume with `loom train --lora-rank R ... --load OUT --finetune`). UserError naming the
// file and tensor for a missing adapter_config.json, settings Loom has no equivalent of (DoRA, rsLoRA, rank
// or alpha patterns, biases, modules_to_save, layers_to_transform), targets it cannot place, unknown or
// missing keys, shapes that do not fit the base and ranks that differ from r.
void convert_peft_to_loom(const std::string& peft_dir, const std::string& loom_root, const PeftImportOptions& opts,
                          std::ostream& log);

}  // namespace loom

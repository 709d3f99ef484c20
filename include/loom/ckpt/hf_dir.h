// Hugging Face model directories: config.json plus safetensors weights, read and written in the layout
// `transformers` uses, so a directory from the Hub loads here and one written here loads there.
//
//   <dir>/config.json                              model_type and shape (parsed into HfConfig)
//   <dir>/model.safetensors                        all weights in one file, or
//   <dir>/model.safetensors.index.json             {"metadata": {"total_size": N}, "weight_map": {tensor: file}}
//   <dir>/model-00001-of-00003.safetensors ...     the shards it names
//
// Reading validates everything at open: config.json's fields (types, ranges, supported model_type), every
// shard's header (SafetensorsFile's strict rules), and that the index and the shards agree exactly — every
// mapped file exists, every mapped tensor is in the shard the map names, no tensor is mapped or stored
// twice, no shard holds a tensor the map leaves out. Every problem is a UserError naming the file and the
// field or tensor. When both model.safetensors and an index exist, model.safetensors wins (as in
// transformers). pytorch_model.bin checkpoints are not read.
//
// Writing builds the whole directory under <dir>.loom-staging (each file written to .tmp, fsynced,
// renamed), fsyncs it and renames it to <dir>, so a crash leaves either no <dir> or a complete one. Every
// shard records the CRC-32C of its tensors in its "__metadata__" (safetensors.h), which transformers
// ignores and this reader verifies.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loom/ckpt/safetensors.h"

namespace loom {

// rope_scaling of Llama 3.1+ ("rope_type": "llama3"); other scaling types are rejected at parse time.
struct HfRopeScaling {
  std::string rope_type = "llama3";
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// The fields of config.json that Loom's models need, under one set of names for every family. GPT-2's
// keys map as noted; a field a family does not have takes what that architecture implies. The
// mixture-of-experts families (mixtral, qwen2_moe, qwen3_moe) are Llama's layer with a sparse MoE block in
// place of the MLP (in every layer, or in those the pattern marks); parsing is src/ckpt/hf_config.cpp's.
struct HfConfig {
  std::string model_type;               // "gpt2" | "llama" | "mistral" | "mixtral" | "qwen2_moe" | "qwen3_moe"
  int64_t vocab_size = 0;               // vocab_size
  int64_t hidden_size = 0;              // hidden_size | gpt2: n_embd
  int64_t intermediate_size = 0;        // intermediate_size | gpt2: n_inner (null: 4 * n_embd)
  int64_t num_hidden_layers = 0;        // num_hidden_layers | gpt2: n_layer
  int64_t num_attention_heads = 0;      // num_attention_heads | gpt2: n_head
  int64_t num_key_value_heads = 0;      // num_key_value_heads (absent: = heads) | gpt2: = heads
  int64_t head_dim = 0;                 // head_dim (absent or null: hidden_size / heads)
  int64_t max_position_embeddings = 0;  // max_position_embeddings | gpt2: n_positions
  double norm_eps = 0.0;                // rms_norm_eps | gpt2: layer_norm_epsilon (default 1e-5)
  std::string activation;               // hidden_act (default "silu") | gpt2: activation_function ("gelu_new")
  bool tie_word_embeddings = false;     // default false | gpt2: default true
  // RoPE (llama/mistral only; gpt2 has learned absolute positions).
  double rope_theta = 10000.0;
  std::optional<HfRopeScaling> rope_scaling;
  bool attention_bias = false;          // q/k/v/o biases | gpt2: always true
  bool mlp_bias = false;                // MLP biases | gpt2: always true
  std::optional<int64_t> sliding_window;  // mistral, mixtral: tokens a query sees, itself included (null: none)
  bool qkv_bias = false;                // qwen2_moe: q/k/v biases, no o_proj bias (qkv_bias, default true)
  bool qk_norm = false;                 // qwen3_moe: RMSNorm over each q and k head (q_norm, k_norm) before RoPE
  // Mixture of experts (num_experts 0: a dense model).
  int64_t num_experts = 0;              // num_experts | mixtral: num_local_experts
  int64_t num_experts_per_tok = 0;      // top-k
  int64_t moe_intermediate_size = 0;    // each expert's width | mixtral: intermediate_size
  int64_t shared_expert_intermediate_size = 0;  // qwen2_moe: the shared expert (always gated); else 0
  // Renormalise the top-k probabilities (norm_topk_prob, default false; mixtral: always). false: the
  // top-k of the softmax over all experts as they are.
  bool norm_topk_prob = true;
  // Per layer: 1 a sparse MoE block, 0 a dense MLP of intermediate_size (qwen: layer i is sparse unless
  // listed in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0; mixtral: every layer).
  std::vector<int> moe_layers;
  double router_aux_loss_coef = 0.0;    // router_aux_loss_coef (training only; default 0.001)
  std::string torch_dtype;              // "float32", "bfloat16", ... ("" when absent)
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;   // eos_token_id: an id or a list of ids (Llama 3.1 Instruct)
  std::string raw_json;                 // the file's text, unchanged, for writing it back

  bool is_gpt2() const { return model_type == "gpt2"; }
  bool is_moe() const { return num_experts > 0; }
};

// Parses config.json's text; `path` names the file in errors ("<path>: field 'n_embd': ...").
HfConfig parse_hf_config(const std::string& json_text, const std::string& path = "config.json");

// model.safetensors.index.json, parsed and checked on its own (shards not opened).
struct HfIndex {
  std::optional<int64_t> total_size;            // metadata.total_size, when present
  std::map<std::string, std::string> weight_map;  // tensor -> shard file name (plain name, no '/')
};
HfIndex parse_hf_index(const std::string& json_text, const std::string& path = "model.safetensors.index.json");

class HfCheckpoint {
 public:
  // Opens and validates a model directory (see the top of this file). Throws UserError.
  static HfCheckpoint open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const HfConfig& config() const { return config_; }
  bool sharded() const { return sharded_; }
  // Every tensor name, sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  const SafetensorsInfo& info(const std::string& name) const;
  // The path of the file that holds `name`.
  const std::string& file_of(const std::string& name) const;
  // Sum of every tensor's bytes (what the index's total_size should say).
  int64_t total_bytes() const { return total_bytes_; }

  // A fresh CPU tensor, converted to `as` (SafetensorsFile::read rules: float <-> float, int -> i32/i64).
  // Both reads verify the tensor's checksum when its file records one (files Loom wrote): ChecksumError
  // naming the directory, the file and the tensor.
  Tensor read(const std::string& name, DType as) const;
  // Copies the stored bytes into `dst`, whose dtype and shape must match exactly.
  void read_into(const std::string& name, TensorView dst) const;
  // "" when every file records checksums, else a one-line note for the log that its tensors load
  // unverified (directories from the Hub or other tools, or from Loom before checksums).
  std::string checksum_note() const;

 private:
  const SafetensorsFile& file(const std::string& name) const;
  [[noreturn]] void damaged(const ChecksumError& e) const;

  std::string dir_;
  HfConfig config_;
  bool sharded_ = false;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> where_;  // tensor -> index into files_
  int64_t total_bytes_ = 0;
};

// transformers' default max_shard_size ("5GB").
constexpr int64_t kHfDefaultMaxShardBytes = 5'000'000'000;

// Writes an HF model directory at `dir`, which must not exist or be an empty directory. `config_json` is
// written verbatim as config.json after parse_hf_config() accepts it. Tensors go, in the given order, into
// shards of at most `max_shard_bytes` (a tensor larger than that gets a shard of its own); one shard is
// written as model.safetensors without an index, several as model-0000i-of-0000n.safetensors plus
// model.safetensors.index.json (total_size = the sum of tensor bytes, keys sorted, 2-space indent).
// Every shard carries the metadata {"format": "pt"} transformers expects. `extra_files` (name -> bytes:
// generation_config.json, tokenizer files ...) are written alongside.
void write_hf_dir(const std::string& dir, const std::string& config_json, const NamedTensors& tensors,
                  int64_t max_shard_bytes = kHfDefaultMaxShardBytes,
                  const std::map<std::string, std::string>& extra_files = {});

// Creates the directory `dir` (which must not exist or be an empty directory; UserError naming `what`
// otherwise) atomically: `fill(staging)` writes its files into <dir>.loom-staging (with
// write_checkpoint_tensors / write_checkpoint_text), which is then fsynced and renamed to `dir`. On any
// error the staging directory is removed. write_hf_dir and PEFT adapter directories are written this way.
void write_dir_atomically(const std::string& dir, const std::string& what,
                          const std::function<void(const std::string& staging)>& fill);

}  // namespace loom

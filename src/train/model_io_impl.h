// Private to the train layer: what model_io.cpp (weights: Hugging Face import/export, the conversions)
// and model_config_io.cpp (configurations: Loom checkpoint metadata, HF config.json) share: reading a
// Loom checkpoint's committed dir, its metadata.json and model_config, and the HF dtype names.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "loom/train/model_io.h"
#include "train/checkpoint_format.h"

namespace loom::model_io_detail {

// The trainer's metadata.json format (trainer_checkpoint.cpp writes and reads the same keys).
inline constexpr const char* kLoomFormat = kCheckpointFormat;
inline constexpr int kLoomFormatVersion = kCheckpointFormatVersion;

// Checkpoints written before the architecture fields existed are GPT-2: a missing field keeps the default.
GPTConfig model_config_from_json(const nlohmann::json& j, const std::string& file);

// The committed dir of a Loom checkpoint: `dir` itself when it holds metadata.json (an iter_* dir), else
// the one its tracker names.
std::string loom_checkpoint_dir(const std::string& dir);

// metadata.json of a committed checkpoint dir, checked for the Loom format, a readable version and a
// model_config.
nlohmann::json read_loom_metadata(const std::string& ckpt_dir);

// config.json's torch_dtype for an export dtype (f32, bf16, f16); UserError for any other.
const char* torch_dtype_name(DType dt);

// A float as the double with the fewest digits that reads back as the same float (1e-06, not
// 9.99999997e-07): how metadata and config files print float settings.
double tidy_float(float x);

// The bos/eos token ids a converted model's metadata recorded ("converted_from"), into `opts` where it
// has none of its own.
void token_ids_from_metadata(const nlohmann::json& meta, HfExportOptions& opts);

// UserError naming --to loom:ROOT when `root` exists and is not an empty directory.
void check_new_loom_root(const std::string& root);

// Writes a Loom checkpoint of whole f32 tensors (by name) at iteration 0 under `root` (checked by
// check_new_loom_root), as a world of one: metadata.json with the format, zero progress, the model_config of
// `cfg`, precision fp32 and the keys of `extra` (converted_from, lora). No optimizer state: load it with
// `loom train --load ROOT --finetune`.
void write_weights_checkpoint(const std::string& root, const GPTConfig& cfg,
                              const std::vector<std::pair<std::string, TensorView>>& tensors,
                              const nlohmann::json& extra);

}  // namespace loom::model_io_detail

// Private to the train layer: what model_io.cpp (weights: Hugging Face import/export, the conversions)
// and model_config_io.cpp (configurations: Loom checkpoint metadata, HF config.json) share: reading a
// Loom checkpoint's committed dir, its metadata.json and model_config, and the HF dtype names.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

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

}  // namespace loom::model_io_detail

// The metadata.json format of Loom checkpoints, shared by the trainer (save/load) and model_io (convert,
// generate): the format tag and version, and the model_config object (every architecture field, under
// Megatron-style names; a reader treats a missing field as the GPT-2 default). Private to the train layer.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "loom/model/gpt.h"

namespace loom {

inline constexpr const char* kCheckpointFormat = "loom-checkpoint";
inline constexpr int kCheckpointFormatVersion = 1;

nlohmann::json model_config_json(const GPTConfig& m);

// Reads and parses a JSON file; UserError naming `what` and the path when it cannot be read or parsed.
nlohmann::json read_json_file(const std::string& path, const char* what);

}  // namespace loom

// Command-line parsing with Megatron's flag names. A table of flags (name, help, setter) drives parsing,
// `--help`, and the error for an unknown flag, which names the closest known flag.
#pragma once
#include <string>
#include <vector>

#include "loom/train/config.h"

namespace loom {

// Parses `loom train` arguments (without the program and subcommand names). Throws UserError.
TrainConfig parse_train_args(const std::vector<std::string>& args);
std::string train_help();
// Levenshtein distance, for "did you mean" suggestions.
size_t edit_distance(const std::string& a, const std::string& b);

}  // namespace loom

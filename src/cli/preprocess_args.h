// Flag parsing for `loom preprocess` (Megatron's tools/preprocess_data.py flag names).
#pragma once
#include <string>
#include <vector>

#include "loom/data/preprocess.h"

namespace loom {

// Parses the arguments after `loom preprocess`. Throws UserError (unknown flags name the closest one).
PreprocessConfig parse_preprocess_args(const std::vector<std::string>& args);
std::string preprocess_help();

}  // namespace loom

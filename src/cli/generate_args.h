// Flag parsing for `loom generate` (Megatron's tokenizer flag names; sampling flags as Megatron's text
// generation: --temperature, --top-k, --top-p, --seed).
#pragma once
#include <string>
#include <vector>

#include "loom/train/generate.h"

namespace loom {

// Parses and validates the arguments after `loom generate`. Throws UserError (unknown flags name the
// closest one).
GenerateConfig parse_generate_args(const std::vector<std::string>& args);
std::string generate_help();

}  // namespace loom

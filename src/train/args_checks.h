// Checks of `loom train`'s flags that need to know which flags were named, run after the table is applied
// (Megatron's validate_args for iteration- vs sample-based training). Private to the train layer.
#pragma once
#include <set>
#include <string>

#include "loom/train/config.h"

namespace loom {

// `given`: the flags named on the command line, by their table names. UserError naming the flags.
void check_sample_based_flags(const TrainConfig& cfg, const std::set<std::string>& given);

}  // namespace loom

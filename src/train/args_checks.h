// Checks of `loom train`'s flags that need to know which flags were named, run after the table is applied
// (Megatron's validate_args for iteration- vs sample-based training). Private to the train layer.
#pragma once
#include <set>
#include <string>

#include "loom/train/config.h"
#include "loom/train/flags.h"

namespace loom {

// `given`: the flags named on the command line, by their table names. UserError naming the flags.
void check_sample_based_flags(const TrainConfig& cfg, const std::set<std::string>& given);

// The mixture-of-experts flags (args_moe.cpp), spliced into the train table.
std::vector<FlagSpec<TrainConfig>> moe_flag_specs();
// --moe-layer-freq (an int N, or Megatron's list expression) as a per-layer 0/1 pattern of num_layers.
std::vector<int> parse_moe_layer_freq(const std::string& v, int64_t num_layers);
// After the table: the layer pattern from --moe-layer-freq and --num-layers; flags that need --num-experts.
void resolve_moe_flags(TrainConfig& cfg);

}  // namespace loom

// Flag parsing for `loom calc`: calc's own flags (--num-gpus, --train-tokens, --gpu, --mfu, --gpu-tflops,
// --sequence-parallel) are taken out first, everything else goes to `loom train`'s parser unchanged, so a
// Megatron launch script's flags work here too.
#pragma once
#include <string>
#include <vector>

#include "loom/train/calc.h"

namespace loom {

// Parses the arguments after `loom calc` and resolves them (make_calc_input). Throws UserError.
CalcInput parse_calc_args(const std::vector<std::string>& args);
std::string calc_help();

}  // namespace loom

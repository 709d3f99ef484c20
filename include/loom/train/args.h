// `loom train` command line with Megatron's flag names (table in args.cpp, parser in flags.h).
#pragma once
#include <string>
#include <vector>

#include "loom/train/config.h"
#include "loom/train/flags.h"

namespace loom {

// Parses `loom train` arguments (without the program and subcommand names). Throws UserError.
TrainConfig parse_train_args(const std::vector<std::string>& args);
std::string train_help();

}  // namespace loom

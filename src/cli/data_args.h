// `loom data check PREFIX [PREFIX ...]`: flag parsing and the run (the scan itself is data/data_check.h).
#pragma once
#include <ostream>
#include <string>
#include <vector>

#include "loom/data/data_check.h"
#include "loom/data/tokenizer.h"

namespace loom {

struct DataCheckCommand {
  std::vector<std::string> prefixes;  // positional, or --data-path
  TokenizerConfig tokenizer;          // --tokenizer-type and its files; --vocab-size
  DataCheckOptions options;           // vocab_size / vocab_source are resolved from the tokenizer flags
};

// Parses the arguments after `loom data check`: the prefixes first, then flags. UserError for a missing
// prefix, an unknown flag or a tokenizer that cannot be built.
DataCheckCommand parse_data_check_args(const std::vector<std::string>& args);
std::string data_help();
// Runs `loom data <subcommand> ...`; returns the exit code (0: no problems, 1: problems found).
int run_data_command(const std::vector<std::string>& args, std::ostream& out);

}  // namespace loom

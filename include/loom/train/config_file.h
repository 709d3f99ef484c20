// `--config FILE`: YAML presets whose keys are Megatron flag names, for `loom train` and `loom calc`.
//
//   # configs/gpt2-124m.yaml
//   num-layers: 12          ->  --num-layers=12
//   bf16: true              ->  --bf16        (false, or null: the key is left out: the default applies)
//   data-path: [1, a, 2, b] ->  --data-path 1 a 2 b
//
// The file's tokens go BEFORE the rest of the command line, and a flag the command line gives explicitly
// drops the file's value for it altogether, so the command line wins: for a list flag (data-path) the
// file's list is replaced, not extended. Keys may be written with '-' or '_' and without the leading "--".
// Everything is
// then parsed by the command's normal parser, so an unknown or unsupported key gets the usual error
// ("unknown flag --foo (did you mean ...)"), to which parse_with_config_file() adds the config file and
// line that set it. Only the YAML 1.2 booleans true/false (any case style) act as switches; quoted
// "true" and other scalars are passed through as text, exactly as written (1e-4 stays "1e-4").
#pragma once
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "loom/core/check.h"

namespace loom {

struct ConfigFileKey {
  std::string flag;  // "--num-layers" (normalized: leading "--", '_' -> '-')
  int64_t line = 0;  // 1-based line of the key in the file
  bool overridden = false;  // the command line gives the flag too; the file's value was dropped
};

struct ConfigFileExpansion {
  std::vector<std::string> args;  // the file's tokens, then the command line without --config FILE
  std::string path;               // the config file; empty when there was no --config
  std::vector<ConfigFileKey> keys;
  std::set<std::string> command_line_flags;  // flags given explicitly (normalized, without "=value")
};

// Finds `--config FILE` / `--config=FILE` in `args` (at most once) and splices the file's tokens in
// front of the remaining arguments. Without --config, returns `args` unchanged. UserError (naming the
// file and line) for an unreadable file, invalid YAML, a top level that is not a mapping, a nested
// mapping value, an empty list, or a key that is not a flag name.
ConfigFileExpansion expand_config_file_traced(const std::vector<std::string>& args);
std::vector<std::string> expand_config_file(const std::vector<std::string>& args);

// `message` (a parse error) plus where the config file sets the flag it is about, when it names one.
std::string annotate_config_error(const std::string& message, const ConfigFileExpansion& ex);

// parse(expanded args), with config-file context added to any UserError it throws.
template <typename Parse>
auto parse_with_config_file(const std::vector<std::string>& args, Parse&& parse) -> decltype(parse(args)) {
  const ConfigFileExpansion ex = expand_config_file_traced(args);
  if (ex.path.empty()) return parse(ex.args);
  try {
    return parse(ex.args);
  } catch (const UserError& e) {
    throw UserError(annotate_config_error(e.what(), ex));
  }
}

}  // namespace loom

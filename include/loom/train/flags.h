// Command-line parsing shared by the loom subcommands, with argparse's conventions (what Megatron's
// scripts rely on): "--flag value" and "--flag=value", "--flag_name" == "--flag-name", a unique prefix
// of a flag name is accepted ("--output" for --output-prefix), one-or-more value flags take every
// argument up to the next flag, and a repeated flag keeps its last occurrence only. Unknown flags are errors naming the closest known flag; flags of the
// Megatron tool that the subcommand does not implement get their own error, never silent acceptance.
#pragma once
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "loom/data/tokenizer.h"

namespace loom {

enum class Arity { kSwitch, kOne, kOneOrMore };

struct FlagInfo {
  std::string name;     // "--num-layers"
  Arity arity = Arity::kOne;
  std::string metavar;  // shown in help: "N", "FILE", "PREFIX [PREFIX ...]"
  std::string help;
};

struct ParsedFlag {
  size_t index;                     // into the table
  std::vector<std::string> values;  // empty for switches
};

// Matches `args` against `table`, in order. `unsupported` lists flag names of the original tool that this
// command does not implement; `tool` names that tool in their error ("Megatron's pretrain_gpt.py").
std::vector<ParsedFlag> parse_flags(const std::vector<FlagInfo>& table, const std::vector<std::string>& args,
                                    const std::vector<std::string>& unsupported = {}, const std::string& tool = "");
std::string flags_help(const std::string& usage, const std::vector<FlagInfo>& table);
// Levenshtein distance, for "did you mean" suggestions.
size_t edit_distance(const std::string& a, const std::string& b);
// Strict integer and number parsing; UserError naming the flag.
int64_t parse_int_flag(const std::string& flag, const std::string& v);
// A size, count or interval: an integer in [1, max] ("--num-layers must be >= 1, got 0").
int64_t parse_positive_flag(const std::string& flag, const std::string& v,
                            int64_t max = std::numeric_limits<int64_t>::max());
double parse_float_flag(const std::string& flag, const std::string& v);

// A flag and what it does to a config.
template <typename Config>
struct FlagSpec {
  FlagInfo info;
  std::function<void(Config&, const std::vector<std::string>&)> set;
};

// Applies every flag of `args` to cfg; returns the table names of the flags given (in order).
template <typename Config>
std::vector<std::string> apply_flags(const std::vector<FlagSpec<Config>>& specs, const std::vector<std::string>& args,
                                     Config& cfg, const std::vector<std::string>& unsupported = {},
                                     const std::string& tool = "") {
  std::vector<FlagInfo> infos;
  for (const auto& s : specs) infos.push_back(s.info);
  std::vector<std::string> named;
  for (const ParsedFlag& p : parse_flags(infos, args, unsupported, tool)) {
    specs[p.index].set(cfg, p.values);
    named.push_back(specs[p.index].info.name);
  }
  return named;
}

// The tokenizer flags of every command that tokenizes (Megatron's names), setting the TokenizerConfig that
// `tok` picks out of Config. --vocab-size is not here: each command gives it its own meaning.
template <typename Config>
std::vector<FlagSpec<Config>> tokenizer_flag_specs(TokenizerConfig& (*tok)(Config&)) {
  using V = const std::vector<std::string>&;
  return {
      {{"--tokenizer-type", Arity::kOne, "NAME",
        "GPT2BPETokenizer | TikTokenizer | SentencePieceTokenizer | GPTSentencePieceTokenizer | Llama2Tokenizer | "
        "NullTokenizer"},
       [tok](Config& c, V v) { tok(c).type = v[0]; }},
      {{"--vocab-file", Arity::kOne, "FILE", "GPT-2 encoder.json / vocab.json"},
       [tok](Config& c, V v) { tok(c).vocab_file = v[0]; }},
      {{"--merge-file", Arity::kOne, "FILE", "GPT-2 vocab.bpe / merges.txt"},
       [tok](Config& c, V v) { tok(c).merge_file = v[0]; }},
      {{"--tokenizer-model", Arity::kOne, "FILE", "tiktoken rank file or SentencePiece .model"},
       [tok](Config& c, V v) { tok(c).tokenizer_model = v[0]; }},
      {{"--tiktoken-pattern", Arity::kOne, "v1|v2",
        "TikTokenizer split pattern: v1 | v2 (Megatron's) | gpt2 | cl100k (default v2)"},
       [tok](Config& c, V v) { tok(c).tiktoken_pattern = v[0]; }},
      {{"--tiktoken-num-special-tokens", Arity::kOne, "N", "TikTokenizer special ids before the ranks (default 1000)"},
       [tok](Config& c, V v) {
         tok(c).tiktoken_num_special_tokens = parse_int_flag("--tiktoken-num-special-tokens", v[0]);
       }},
  };
}

template <typename Config>
std::string specs_help(const std::string& usage, const std::vector<FlagSpec<Config>>& specs) {
  std::vector<FlagInfo> infos;
  for (const auto& s : specs) infos.push_back(s.info);
  return flags_help(usage, infos);
}

}  // namespace loom

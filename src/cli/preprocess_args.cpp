// Flag table for `loom preprocess`. Like Megatron's argparse parser: "--flag value" or "--flag=value",
// --json-keys takes one or more values, and a unique prefix of a flag name is accepted ("--output"
// for --output-prefix). Megatron flags this command does not implement are errors that say so.
#include "cli/preprocess_args.h"

#include <algorithm>
#include <charconv>
#include <functional>
#include <sstream>

#include "loom/core/check.h"
#include "loom/train/args.h"

namespace loom {

namespace {

enum class Arity { kSwitch, kOne, kOneOrMore };

struct Flag {
  std::string name;
  Arity arity;
  std::string metavar;
  std::string help;
  std::function<void(PreprocessConfig&, const std::vector<std::string>&)> set;
};

int64_t to_int(const std::string& flag, const std::string& v) {
  int64_t out = 0;
  const auto r = std::from_chars(v.data(), v.data() + v.size(), out);
  if (r.ec != std::errc() || r.ptr != v.data() + v.size()) user_error(flag, ": expected an integer, got '", v, "'");
  return out;
}

const std::vector<Flag>& flags() {
  using C = PreprocessConfig;
  using V = const std::vector<std::string>&;
  static const std::vector<Flag> table = {
      {"--input", Arity::kOne, "FILE", "JSONL input, one JSON object (document) per line",
       [](C& c, V v) { c.input = v[0]; }},
      {"--json-keys", Arity::kOneOrMore, "KEY [KEY ...]",
       "keys to extract (default: text); one output pair per key", [](C& c, V v) { c.json_keys = v; }},
      {"--output-prefix", Arity::kOne, "PREFIX", "writes PREFIX_<key>_document.bin/.idx",
       [](C& c, V v) { c.output_prefix = v[0]; }},
      {"--tokenizer-type", Arity::kOne, "NAME",
       "GPT2BPETokenizer | TikTokenizer | SentencePieceTokenizer | GPTSentencePieceTokenizer | "
       "Llama2Tokenizer | NullTokenizer",
       [](C& c, V v) { c.tokenizer.type = v[0]; }},
      {"--vocab-file", Arity::kOne, "FILE", "GPT-2 encoder.json / vocab.json",
       [](C& c, V v) { c.tokenizer.vocab_file = v[0]; }},
      {"--merge-file", Arity::kOne, "FILE", "GPT-2 vocab.bpe / merges.txt",
       [](C& c, V v) { c.tokenizer.merge_file = v[0]; }},
      {"--tokenizer-model", Arity::kOne, "FILE", "tiktoken rank file or SentencePiece .model",
       [](C& c, V v) { c.tokenizer.tokenizer_model = v[0]; }},
      {"--tiktoken-pattern", Arity::kOne, "v1|v2", "TikTokenizer pre-tokenisation pattern (default v2)",
       [](C& c, V v) { c.tokenizer.tiktoken_pattern = v[0]; }},
      {"--tiktoken-num-special-tokens", Arity::kOne, "N", "TikTokenizer special tokens (default 1000)",
       [](C& c, V v) { c.tokenizer.tiktoken_num_special_tokens = to_int("--tiktoken-num-special-tokens", v[0]); }},
      {"--vocab-size", Arity::kOne, "V", "vocabulary size (NullTokenizer)",
       [](C& c, V v) { c.tokenizer.vocab_size = to_int("--vocab-size", v[0]); }},
      {"--append-eod", Arity::kSwitch, "", "append the end-of-document token to each non-empty document",
       [](C& c, V) { c.append_eod = true; }},
      {"--workers", Arity::kOne, "N", "tokenizer threads (default 1); output does not depend on N",
       [](C& c, V v) {
         const int64_t n = to_int("--workers", v[0]);
         if (n < 1 || n > 1024) user_error("--workers must be in [1, 1024], got ", n);
         c.workers = int(n);
       }},
      {"--log-interval", Arity::kOne, "N", "documents between progress lines (default 100)",
       [](C& c, V v) { c.log_interval = to_int("--log-interval", v[0]); }},
      {"--skip-bad-lines", Arity::kSwitch, "",
       "skip and count malformed lines instead of failing (default: error naming file:line)",
       [](C& c, V) { c.skip_bad_lines = true; }},
      {"--dataset-impl", Arity::kOne, "mmap", "accepted for old Megatron scripts; only mmap exists",
       [](C&, V v) {
         if (v[0] != "mmap") user_error("--dataset-impl: only 'mmap' is supported, got '", v[0], "'");
       }},
  };
  return table;
}

// Megatron flags whose features this command does not have: a clear error instead of a guess.
const std::vector<std::string>& unsupported() {
  static const std::vector<std::string> names = {
      "--split-sentences", "--keep-newlines",   "--lang",          "--partitions",      "--keep-sequential-samples",
      "--find-optimal-num-workers", "--workers-to-check", "--max-documents", "--performance-dir", "--vocab-extra-ids"};
  return names;
}

const Flag& lookup(const std::string& name) {
  const auto& table = flags();
  for (const Flag& f : table)
    if (f.name == name) return f;
  for (const auto& u : unsupported())
    if (u == name) user_error(name, " (a Megatron preprocess_data.py flag) is not supported by loom preprocess");
  std::vector<const Flag*> prefixed;  // argparse accepts a unique prefix
  for (const Flag& f : table)
    if (f.name.rfind(name, 0) == 0) prefixed.push_back(&f);
  if (prefixed.size() == 1 && name.size() > 2) return *prefixed[0];
  if (prefixed.size() > 1 && name.size() > 2) {
    std::string list;
    for (const Flag* f : prefixed) list += (list.empty() ? "" : ", ") + f->name;
    user_error("ambiguous flag ", name, " (could be ", list, ")");
  }
  const Flag* best = nullptr;
  size_t best_d = ~size_t(0);
  for (const Flag& f : table)
    if (const size_t d = edit_distance(name, f.name); d < best_d) {
      best_d = d;
      best = &f;
    }
  user_error("unknown flag ", name, best ? " (did you mean " + best->name + "?)" : std::string());
}

}  // namespace

PreprocessConfig parse_preprocess_args(const std::vector<std::string>& args) {
  PreprocessConfig cfg;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string name = args[i], inline_value;
    bool has_inline = false;
    if (name.rfind("--", 0) != 0) user_error("unexpected argument '", name, "' (flags start with --)");
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      inline_value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_inline = true;
    }
    std::replace(name.begin() + 2, name.end(), '_', '-');  // Megatron accepts --json_keys style too
    const Flag& f = lookup(name);
    std::vector<std::string> values;
    if (f.arity == Arity::kSwitch) {
      if (has_inline) user_error(f.name, " takes no value");
    } else if (has_inline) {
      values.push_back(inline_value);
    } else {
      while (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) {
        values.push_back(args[++i]);
        if (f.arity == Arity::kOne) break;
      }
      if (values.empty()) user_error(f.name, " needs a value (", f.metavar, ")");
    }
    f.set(cfg, values);
  }
  cfg.validate();
  return cfg;
}

std::string preprocess_help() {
  std::ostringstream os;
  os << "usage: loom preprocess --input FILE --output-prefix PREFIX --tokenizer-type NAME [flags]\n"
        "Tokenizes a JSONL file into Megatron indexed datasets (tools/preprocess_data.py flag names).\n\n";
  for (const Flag& f : flags()) {
    std::string lhs = "  " + f.name + (f.metavar.empty() ? "" : " " + f.metavar);
    if (lhs.size() < 40) lhs.resize(40, ' ');
    os << lhs << " " << f.help << "\n";
  }
  return os.str();
}

}  // namespace loom

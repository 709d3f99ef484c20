// Flag table for `loom preprocess` (Megatron's tools/preprocess_data.py names), parsed by the shared
// argparse-style parser in train/flags.h. Megatron flags this command does not implement are errors
// that say so.
#include "cli/preprocess_args.h"

#include <algorithm>

#include "loom/core/check.h"
#include "loom/train/flags.h"

namespace loom {

namespace {

using Flag = FlagSpec<PreprocessConfig>;

int64_t to_int(const std::string& flag, const std::string& v) { return parse_int_flag(flag, v); }

const std::vector<Flag>& flags() {
  using C = PreprocessConfig;
  using V = const std::vector<std::string>&;
  static const std::vector<Flag> table = [] {
    std::vector<Flag> t = {
      {{"--input", Arity::kOne, "FILE", "JSONL input, one JSON object (document) per line"},
       [](C& c, V v) { c.input = v[0]; }},
      {{"--json-keys", Arity::kOneOrMore, "KEY [KEY ...]", "keys to extract (default: text); one output pair per key"},
       [](C& c, V v) { c.json_keys = v; }},
      {{"--output-prefix", Arity::kOne, "PREFIX", "writes PREFIX_<key>_document.bin/.idx"},
       [](C& c, V v) { c.output_prefix = v[0]; }},
    };
    for (Flag& f : tokenizer_flag_specs<C>([](C& c) -> TokenizerConfig& { return c.tokenizer; })) t.push_back(std::move(f));
    t.insert(t.end(), {
      {{"--vocab-size", Arity::kOne, "V", "vocabulary size (NullTokenizer)"},
       [](C& c, V v) { c.tokenizer.vocab_size = to_int("--vocab-size", v[0]); }},
      {{"--append-eod", Arity::kSwitch, "", "append the end-of-document token to each non-empty document"},
       [](C& c, V) { c.append_eod = true; }},
      {{"--workers", Arity::kOne, "N", "tokenizer threads (default 1); output does not depend on N"},
       [](C& c, V v) {
         const int64_t n = to_int("--workers", v[0]);
         if (n < 1 || n > 1024) user_error("--workers must be in [1, 1024], got ", n);
         c.workers = int(n);
       }},
      {{"--log-interval", Arity::kOne, "N", "documents between progress lines (default 100)"},
       [](C& c, V v) { c.log_interval = to_int("--log-interval", v[0]); }},
      {{"--skip-bad-lines", Arity::kSwitch, "", "skip and count malformed lines instead of failing (default: error naming file:line)"},
       [](C& c, V) { c.skip_bad_lines = true; }},
      {{"--sft", Arity::kSwitch, "", "supervised fine-tuning data: --json-keys PROMPT ANSWER (default input output) "
        "become one sample of PREFIX_sft_document with its answer mask in PREFIX_sft_document_loss_mask"},
       [](C& c, V) { c.sft = true; }},
      {{"--answer-only-loss", Arity::kOne, "BOOL", "--sft: only answer tokens are in the loss (default true, as NeMo)"},
       [](C& c, V v) {
         if (v[0] == "true" || v[0] == "True" || v[0] == "1") c.answer_only_loss = true;
         else if (v[0] == "false" || v[0] == "False" || v[0] == "0") c.answer_only_loss = false;
         else user_error("--answer-only-loss takes true or false, got '", v[0], "'");
       }},
      {{"--chat-template", Arity::kOne, "llama2|llama3|chatml", "--sft: each line's \"messages\" conversation rendered "
        "with this template; the assistant turns are the answer"},
       [](C& c, V v) { c.chat_template = v[0]; }},
      {{"--dataset-impl", Arity::kOne, "mmap", "accepted for old Megatron scripts; only mmap exists"},
       [](C&, V v) {
         if (v[0] != "mmap") user_error("--dataset-impl: only 'mmap' is supported, got '", v[0], "'");
       }},
    });
    return t;
  }();
  return table;
}

// Megatron flags whose features this command does not have: a clear error instead of a guess.
const std::vector<std::string>& unsupported() {
  static const std::vector<std::string> names = {
      "--split-sentences", "--keep-newlines",   "--lang",          "--partitions",      "--keep-sequential-samples",
      "--find-optimal-num-workers", "--workers-to-check", "--max-documents", "--performance-dir", "--vocab-extra-ids"};
  return names;
}

}  // namespace

PreprocessConfig parse_preprocess_args(const std::vector<std::string>& args) {
  PreprocessConfig cfg;
  const std::vector<std::string> named = apply_flags(flags(), args, cfg, unsupported(), "Megatron's preprocess_data.py");
  const bool keys_given = std::find(named.begin(), named.end(), "--json-keys") != named.end();
  if (cfg.sft && !keys_given) {
    if (cfg.chat_template.empty()) cfg.json_keys = {"input", "output"};  // NeMo's SFT fields
    else cfg.json_keys = {"messages"};
  }
  if (!cfg.sft && std::find(named.begin(), named.end(), "--answer-only-loss") != named.end())
    user_error("--answer-only-loss applies to --sft data");
  cfg.validate();
  return cfg;
}

std::string preprocess_help() {
  return specs_help(
      "usage: loom preprocess --input FILE --output-prefix PREFIX --tokenizer-type NAME [flags]\n"
      "Tokenizes a JSONL file into Megatron indexed datasets (tools/preprocess_data.py flag names).",
      flags());
}

}  // namespace loom

// `loom data` subcommands: `check` scans datasets (loom/data/data_check.h) and prints one report per
// prefix. The vocabulary the ids are checked against is the tokenizer's (--tokenizer-type and its files,
// NullTokenizer with --vocab-size), else a bare --vocab-size, else none (then only negative ids are wrong).
#include "cli/data_args.h"

#include "loom/core/check.h"
#include "loom/train/flags.h"

namespace loom {

namespace {

using Flag = FlagSpec<DataCheckCommand>;

const std::vector<Flag>& flags() {
  using C = DataCheckCommand;
  using V = const std::vector<std::string>&;
  static const std::vector<Flag> table = [] {
    std::vector<Flag> t = {
      {{"--data-path", Arity::kOneOrMore, "PREFIX [PREFIX ...]", "datasets to check (instead of the positional "
        "prefixes); Megatron's weights in the list are skipped"},
       [](C& c, V v) { c.prefixes.insert(c.prefixes.end(), v.begin(), v.end()); }},
    };
    for (Flag& f : tokenizer_flag_specs<C>([](C& c) -> TokenizerConfig& { return c.tokenizer; })) t.push_back(std::move(f));
    t.insert(t.end(), {
      {{"--vocab-size", Arity::kOne, "V", "ids must be < V; with --tokenizer-type NullTokenizer, Megatron's meaning "
        "(ids 0..V-1 and the EOD id V)"},
       [](C& c, V v) { c.tokenizer.vocab_size = parse_int_flag("--vocab-size", v[0]); }},
      {{"--max-listed", Arity::kOne, "N", "bad ids listed one by one per dataset (default 20); the rest are counted"},
       [](C& c, V v) {
         c.options.max_listed = parse_int_flag("--max-listed", v[0]);
         if (c.options.max_listed < 0) user_error("--max-listed must be >= 0, got ", c.options.max_listed);
       }},
      {{"--strict", Arity::kSwitch, "", "warnings (empty documents or sequences) are problems too"},
       [](C& c, V) { c.options.strict = true; }},
    });
    return t;
  }();
  return table;
}

bool is_number(const std::string& s) {
  try {
    size_t pos = 0;
    (void)std::stod(s, &pos);
    return pos == s.size();
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

DataCheckCommand parse_data_check_args(const std::vector<std::string>& args) {
  DataCheckCommand c;
  size_t first_flag = 0;
  while (first_flag < args.size() && args[first_flag].rfind("-", 0) != 0) c.prefixes.push_back(args[first_flag++]);
  try {
    apply_flags(flags(), std::vector<std::string>(args.begin() + long(first_flag), args.end()), c);
  } catch (const UserError& e) {
    const std::string what = e.what();
    if (what.rfind("unexpected argument", 0) == 0)
      user_error(what, "; give the dataset prefixes first: loom data check PREFIX [PREFIX ...] [flags]");
    throw;
  }
  // A Megatron --data-path may hold weights ("0.3 a 0.7 b"): the numbers are not datasets.
  std::erase_if(c.prefixes, is_number);
  if (c.prefixes.empty()) user_error("loom data check needs at least one dataset prefix (PREFIX for PREFIX.bin/.idx)");
  if (!c.tokenizer.type.empty()) {
    const std::unique_ptr<Tokenizer> tok = make_tokenizer(c.tokenizer);
    c.options.vocab_size = tok->vocab_size();
    c.options.vocab_source = tok->name() == "NullTokenizer"
                                 ? "NullTokenizer (--vocab-size " + std::to_string(tok->vocab_size() - 1) +
                                       " and its end-of-document id " + std::to_string(tok->eod()) + ")"
                                 : tok->name();
  } else if (c.tokenizer.vocab_size) {
    if (*c.tokenizer.vocab_size < 1 || *c.tokenizer.vocab_size > (int64_t(1) << 31))
      user_error("--vocab-size must be in [1, 2^31], got ", *c.tokenizer.vocab_size);
    c.options.vocab_size = *c.tokenizer.vocab_size;
    c.options.vocab_source = "--vocab-size";
  }
  return c;
}

std::string data_help() {
  return specs_help(
      "usage: loom data check PREFIX [PREFIX ...] [--vocab-size V | --tokenizer-type NAME [tokenizer files]] [flags]\n"
      "Scans Megatron indexed datasets (PREFIX.bin/.idx) once and prints their documents, tokens, id range and a\n"
      "histogram of document lengths, then every problem: structural ones (sizes, pointers, document indices),\n"
      "ids outside the vocabulary (file, document, offset, id), an SFT loss mask that does not match. Exit status\n"
      "0 when no problem was found, 1 otherwise (2: bad flags).",
      flags());
}

int run_data_command(const std::vector<std::string>& args, std::ostream& out) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    out << data_help();
    return args.empty() ? 2 : 0;
  }
  if (args[0] != "check") user_error("unknown `loom data` command '", args[0], "' (valid: check)");
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  for (const auto& a : rest)
    if (a == "--help" || a == "-h") {
      out << data_help();
      return 0;
    }
  const DataCheckCommand c = parse_data_check_args(rest);
  int64_t failed = 0;
  for (const std::string& p : c.prefixes) {
    const DataCheckReport r = check_indexed_dataset(p, c.options);
    print_data_check(r, c.options, out);
    failed += !r.ok();
  }
  if (c.prefixes.size() > 1)
    out << c.prefixes.size() << " datasets checked, " << failed << " with problems\n";
  return failed ? 1 : 0;
}

}  // namespace loom

// Flag table for `loom generate`, parsed by the shared argparse-style parser in train/flags.h.
#include "cli/generate_args.h"

#include "loom/core/check.h"
#include "loom/train/flags.h"

namespace loom {

namespace {

using Flag = FlagSpec<GenerateConfig>;

const std::vector<Flag>& flags() {
  using C = GenerateConfig;
  using V = const std::vector<std::string>&;
  static const std::vector<Flag> table = [] {
    std::vector<Flag> t = {
      {{"--load", Arity::kOne, "DIR",
        "model to generate from: a `loom train --save` dir (or one iter_* dir in it; a LoRA one is merged into its "
        "base), or a Hugging Face model dir"},
       [](C& c, V v) { c.load = v[0]; }},
      {{"--pretrained-checkpoint", Arity::kOne, "DIR",
        "with --load of a LoRA checkpoint: the base model to merge its adapters into (default: the base its "
        "metadata names)"},
       [](C& c, V v) { c.pretrained_checkpoint = v[0]; }},
    };
    for (Flag& f : tokenizer_flag_specs<C>([](C& c) -> TokenizerConfig& { return c.tokenizer; })) t.push_back(std::move(f));
    t.insert(t.end(), {
      {{"--vocab-size", Arity::kOne, "V", "NullTokenizer vocabulary (ids 0..V-1, EOD = V)"},
       [](C& c, V v) { c.tokenizer.vocab_size = parse_int_flag("--vocab-size", v[0]); }},
      {{"--prompt", Arity::kOne, "TEXT", "the text to continue"},
       [](C& c, V v) {
         c.prompt = v[0];
         c.has_prompt = true;
       }},
      {{"--prompt-file", Arity::kOne, "FILE", "one prompt per line (empty lines skipped), generated as one batch"},
       [](C& c, V v) { c.prompt_file = v[0]; }},
      {{"--max-new-tokens", Arity::kOne, "N", "tokens to generate per prompt (default 64); stops earlier at EOD"},
       [](C& c, V v) { c.generation.max_new_tokens = parse_int_flag("--max-new-tokens", v[0]); }},
      {{"--temperature", Arity::kOne, "T", "softmax temperature (default 1.0); 0: greedy"},
       [](C& c, V v) { c.generation.sampling.temperature = float(parse_float_flag("--temperature", v[0])); }},
      {{"--top-k", Arity::kOne, "K", "sample from the K most likely tokens (default 0: all; 1: greedy)"},
       [](C& c, V v) { c.generation.sampling.top_k = parse_int_flag("--top-k", v[0]); }},
      {{"--top-p", Arity::kOne, "P",
        "nucleus sampling: the smallest most-likely set with probability >= P, after --top-k (default 1: off)"},
       [](C& c, V v) { c.generation.sampling.top_p = float(parse_float_flag("--top-p", v[0])); }},
      {{"--seed", Arity::kOne, "S", "sampling seed (default 1234): the same seed gives the same tokens"},
       [](C& c, V v) {
         const int64_t s = parse_int_flag("--seed", v[0]);
         if (s < 0) user_error("--seed must be >= 0, got ", s);
         c.generation.sampling.seed = uint64_t(s);
       }},
      {{"--no-kv-cache", Arity::kSwitch, "",
        "re-run the full forward over the whole prefix every step (slow; for checking)"},
       [](C& c, V) { c.generation.use_kv_cache = false; }},
      {{"--bf16", Arity::kSwitch, "", "compute in bf16 (a bf16 copy of the f32 weights)"},
       [](C& c, V) { c.bf16 = true; }},
    });
    return t;
  }();
  return table;
}

}  // namespace

GenerateConfig parse_generate_args(const std::vector<std::string>& args) {
  GenerateConfig cfg;
  apply_flags(flags(), args, cfg, {"--fp16", "--fp8-format"}, "Megatron's text generation");
  cfg.validate();
  return cfg;
}

std::string generate_help() {
  return specs_help(
      "usage: loom generate --load DIR --tokenizer-type NAME [tokenizer files] (--prompt TEXT | --prompt-file FILE) "
      "[flags]\n"
      "Continues the prompt(s) with a trained model, using a KV cache; text goes to stdout as it is generated, "
      "statistics (tokens/s) to stderr.",
      flags());
}

}  // namespace loom

// `loom calc` flags. Calc's own flags must be written in full (an abbreviation of one is an error, since
// it could as well be a prefix of a train flag); every other argument, in order, goes to
// parse_train_args(), which applies argparse's rules and errors. An unknown flag closer to one of calc's
// flags than to any train flag is reported with calc's flag as the suggestion.
#include "cli/calc_args.h"

#include <algorithm>

#include "loom/core/check.h"
#include "loom/train/args.h"
#include "loom/train/flags.h"

namespace loom {

namespace {

using Flag = FlagSpec<CalcOptions>;

const std::vector<Flag>& flags() {
  using C = CalcOptions;
  using V = const std::vector<std::string>&;
  static const std::vector<Flag> table = {
      {{"--num-gpus", Arity::kOne, "N", "GPUs in the run, a multiple of TP x PP x CP (default TP x PP x CP: DP 1)"},
       [](C& c, V v) { c.num_gpus = parse_int_flag("--num-gpus", v[0]); }},
      {{"--train-tokens", Arity::kOne, "T",
        "tokens to train on: 300e9, 300B, 1.5T, 50M ... (default --train-iters x global batch x --seq-length)"},
       [](C& c, V v) { c.train_tokens = parse_token_count("--train-tokens", v[0]); }},
      {{"--gpu", Arity::kOne, "NAME", "A100 | H100 | H200 | B200: the dense peak --mfu applies to (default H100)"},
       [](C& c, V v) { c.gpu = v[0]; }},
      {{"--mfu", Arity::kOne, "F", "achieved fraction of the GPU's dense peak, counting every executed FLOP "
                                   "(default 0.4)"},
       [](C& c, V v) { c.mfu = parse_float_flag("--mfu", v[0]); }},
      {{"--gpu-tflops", Arity::kOne, "X", "achieved TFLOP/s per GPU, counting recomputation (instead of --mfu)"},
       [](C& c, V v) { c.gpu_tflops = parse_float_flag("--gpu-tflops", v[0]); }},
      {{"--sequence-parallel", Arity::kSwitch, "",
        "estimate activations with Megatron's sequence parallelism (as `loom train --sequence-parallel`)"},
       [](C& c, V) { c.sequence_parallel = true; }},
  };
  return table;
}

std::string normalized_name(const std::string& arg) {
  std::string name = arg.substr(0, arg.find('='));
  std::replace(name.begin() + 2, name.end(), '_', '-');
  return name;
}

// Re-suggests for "unknown flag X (did you mean Y?)" from parse_train_args when one of calc's flags is closer.
[[noreturn]] void rethrow_with_calc_suggestion(const UserError& e) {
  const std::string msg = e.what(), head = "unknown flag ", mid = " (did you mean ";
  const size_t name_end = msg.find(mid);
  if (msg.rfind(head, 0) == 0 && name_end != std::string::npos) {
    const std::string name = msg.substr(head.size(), name_end - head.size());
    const std::string train_best = msg.substr(name_end + mid.size(), msg.find("?)", name_end) - name_end - mid.size());
    const Flag* best = nullptr;
    for (const Flag& f : flags())
      if (!best || edit_distance(name, f.info.name) < edit_distance(name, best->info.name)) best = &f;
    if (best && edit_distance(name, best->info.name) < edit_distance(name, train_best))
      user_error(head, name, mid, best->info.name, "?)");
  }
  throw e;
}

}  // namespace

CalcInput parse_calc_args(const std::vector<std::string>& args) {
  std::vector<std::string> own, rest;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) == 0 && a.size() > 2) {
      const std::string name = normalized_name(a);
      const auto it = std::find_if(flags().begin(), flags().end(), [&](const Flag& f) { return f.info.name == name; });
      if (it != flags().end()) {
        own.push_back(a);
        if (it->info.arity == Arity::kOne && a.find('=') == std::string::npos && i + 1 < args.size() &&
            args[i + 1].rfind("--", 0) != 0)
          own.push_back(args[++i]);
        continue;
      }
      for (const Flag& f : flags())
        if (f.info.name.rfind(name, 0) == 0)
          user_error("ambiguous or abbreviated flag ", name, " (loom calc's own flags are written in full: ",
                     f.info.name, ")");
    }
    rest.push_back(a);
  }
  CalcOptions opts;
  apply_flags(flags(), own, opts);
  TrainConfig cfg;
  try {
    cfg = parse_train_args(rest);
  } catch (const UserError& e) {
    rethrow_with_calc_suggestion(e);
  }
  return make_calc_input(cfg, opts);
}

std::string calc_help() {
  return specs_help("usage: loom calc [loom train flags] [calc flags]\n\n"
                    "Model size, FLOPs per iteration, memory per rank and training time (docs/calc.md).\n"
                    "Every `loom train` flag is accepted (see `loom train --help`); the ones used are the model\n"
                    "shape, --seq-length, --micro-batch-size, --global-batch-size, --train-iters, the parallel\n"
                    "sizes, --bf16/--fp16, --accumulate-allreduce-grads-in-fp32, --recompute-*,\n"
                    "--use-distributed-optimizer, --data-parallel-sharding-strategy, --ddp-bucket-size (ZeRO\n"
                    "memory per rank), --vocab-size, --make-vocab-size-divisible-by, the tokenizer flags and\n"
                    "--lora-rank, --lora-target-modules, --lora-dropout (LoRA: frozen base, trainable adapters,\n"
                    "hardware FLOPs of a LoRA step).\n"
                    "Data flags and --train-iters are not required. Calc's own flags:",
                    flags());
}

}  // namespace loom

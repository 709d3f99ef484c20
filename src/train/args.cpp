// Flag table for `loom train`. Values: "--flag value" or "--flag=value"; switches take no value.
// Every flag in the table changes what the run does; flags Megatron has but this build does not
// implement are unknown flags here (an error with a suggestion), never silently accepted.
#include "loom/train/args.h"

#include <algorithm>
#include <charconv>
#include <functional>
#include <sstream>

namespace loom {

namespace {

struct Flag {
  std::string name;
  std::string metavar;  // empty for switches; ending in "..." takes every value up to the next flag
  std::string help;
  std::function<void(TrainConfig&, const std::string&)> set;
};

int64_t parse_int(const std::string& flag, const std::string& v) {
  int64_t out = 0;
  const auto r = std::from_chars(v.data(), v.data() + v.size(), out);
  if (r.ec != std::errc() || r.ptr != v.data() + v.size())
    user_error(flag, ": expected an integer, got '", v, "'");
  return out;
}

double parse_float(const std::string& flag, const std::string& v) {
  try {
    size_t pos = 0;
    const double d = std::stod(v, &pos);
    if (pos == v.size()) return d;
  } catch (const std::exception&) {
  }
  user_error(flag, ": expected a number, got '", v, "'");
}

const std::vector<Flag>& flags() {
  using C = TrainConfig;
  using S = const std::string&;
  static const std::vector<Flag> table = {
      // model
      {"--num-layers", "N", "transformer layers", [](C& c, S v) { c.model.num_layers = parse_int("--num-layers", v); }},
      {"--hidden-size", "C", "hidden size", [](C& c, S v) { c.model.hidden_size = parse_int("--hidden-size", v); }},
      {"--num-attention-heads", "NH", "attention heads",
       [](C& c, S v) { c.model.num_attention_heads = parse_int("--num-attention-heads", v); }},
      {"--max-position-embeddings", "P", "learned position embeddings (default: --seq-length)",
       [](C& c, S v) {
         c.model.max_position_embeddings = parse_int("--max-position-embeddings", v);
         c.max_position_embeddings_given = true;
       }},
      {"--init-method-std", "F", "std of the normal init (default 0.02)",
       [](C& c, S v) { c.model.init_method_std = float(parse_float("--init-method-std", v)); }},
      {"--norm-epsilon", "F", "LayerNorm epsilon (default 1e-5)",
       [](C& c, S v) { c.model.layernorm_epsilon = float(parse_float("--norm-epsilon", v)); }},
      {"--vocab-size", "V", "vocabulary size (required with --mock-data)",
       [](C& c, S v) { c.data.vocab_size = parse_int("--vocab-size", v); }},
      {"--make-vocab-size-divisible-by", "N", "pad the vocabulary to a multiple of N (default 128)",
       [](C& c, S v) { c.data.make_vocab_size_divisible_by = parse_int("--make-vocab-size-divisible-by", v); }},
      // batch
      {"--seq-length", "T", "sequence length", [](C& c, S v) { c.batch.seq_length = parse_int("--seq-length", v); }},
      {"--micro-batch-size", "B", "sequences per micro-batch",
       [](C& c, S v) { c.batch.micro_batch_size = parse_int("--micro-batch-size", v); }},
      {"--global-batch-size", "G", "sequences per step; micro-batches accumulate (default: micro-batch size)",
       [](C& c, S v) { c.batch.global_batch_size = parse_int("--global-batch-size", v); }},
      {"--train-iters", "N", "optimizer steps", [](C& c, S v) { c.batch.train_iters = parse_int("--train-iters", v); }},
      // optimizer and schedule
      {"--lr", "F", "peak learning rate", [](C& c, S v) { c.optim.lr = parse_float("--lr", v); }},
      {"--min-lr", "F", "final learning rate (default 0)", [](C& c, S v) { c.optim.min_lr = parse_float("--min-lr", v); }},
      {"--lr-warmup-iters", "N", "linear warmup iterations (default 0)",
       [](C& c, S v) { c.optim.lr_warmup_iters = parse_int("--lr-warmup-iters", v); }},
      {"--lr-decay-iters", "N", "iterations to decay over (default --train-iters)",
       [](C& c, S v) { c.optim.lr_decay_iters = parse_int("--lr-decay-iters", v); }},
      {"--lr-decay-style", "S", "constant | linear | cosine (default linear)",
       [](C& c, S v) { c.optim.lr_decay_style = parse_lr_decay_style(v); }},
      {"--weight-decay", "F", "AdamW weight decay, not applied to biases and norms (default 0.01)",
       [](C& c, S v) { c.optim.weight_decay = parse_float("--weight-decay", v); }},
      {"--adam-beta1", "F", "default 0.9", [](C& c, S v) { c.optim.adam.beta1 = float(parse_float("--adam-beta1", v)); }},
      {"--adam-beta2", "F", "default 0.999",
       [](C& c, S v) { c.optim.adam.beta2 = float(parse_float("--adam-beta2", v)); }},
      {"--adam-eps", "F", "default 1e-8", [](C& c, S v) { c.optim.adam.eps = float(parse_float("--adam-eps", v)); }},
      {"--clip-grad", "F", "clip the global gradient norm to F, 0 disables (default 1.0)",
       [](C& c, S v) { c.optim.clip_grad = parse_float("--clip-grad", v); }},
      // data
      {"--mock-data", "", "train on random tokens (needs --vocab-size)", [](C& c, S) { c.data.mock_data = true; }},
      {"--data-path", "PREFIX...", "indexed datasets: PREFIX, or W1 PREFIX1 W2 PREFIX2 ... (split by --split)",
       [](C& c, S v) { c.data.data_path.push_back(v); }},
      {"--train-data-path", "PREFIX...", "like --data-path, all used for training (no split)",
       [](C& c, S v) { c.data.train_data_path.push_back(v); }},
      {"--split", "W,W,W", "train,valid,test weights of the documents (default 969, 30, 1)",
       [](C& c, S v) { c.data.split = v; }},
      {"--data-cache-path", "DIR", "where dataset index caches go (default <data dir>/cache/GPTDataset_indices)",
       [](C& c, S v) { c.data.data_cache_path = v; }},
      {"--tokenizer-type", "T",
       "GPT2BPETokenizer | TikTokenizer | SentencePieceTokenizer | GPTSentencePieceTokenizer | Llama2Tokenizer | "
       "NullTokenizer",
       [](C& c, S v) { c.data.tokenizer.type = v; }},
      {"--vocab-file", "FILE", "GPT-2 encoder.json / vocab.json", [](C& c, S v) { c.data.tokenizer.vocab_file = v; }},
      {"--merge-file", "FILE", "GPT-2 vocab.bpe / merges.txt", [](C& c, S v) { c.data.tokenizer.merge_file = v; }},
      {"--tokenizer-model", "FILE", "tiktoken rank file or SentencePiece model",
       [](C& c, S v) { c.data.tokenizer.tokenizer_model = v; }},
      {"--tiktoken-pattern", "v1|v2", "TikTokenizer split pattern: v1 | v2 (Megatron's) | gpt2 | cl100k (default v2)",
       [](C& c, S v) { c.data.tokenizer.tiktoken_pattern = v; }},
      {"--tiktoken-num-special-tokens", "N", "TikTokenizer special ids before the ranks (default 1000)",
       [](C& c, S v) { c.data.tokenizer.tiktoken_num_special_tokens = parse_int("--tiktoken-num-special-tokens", v); }},
      {"--reset-position-ids", "", "restart position ids after each end-of-document token",
       [](C& c, S) { c.data.reset_position_ids = true; }},
      {"--reset-attention-mask", "", "documents in one sequence do not attend to each other",
       [](C& c, S) { c.data.reset_attention_mask = true; }},
      {"--eod-mask-loss", "", "no loss on end-of-document tokens", [](C& c, S) { c.data.eod_mask_loss = true; }},
      // parallelism (single process in this build)
      {"--tensor-model-parallel-size", "N", "default 1",
       [](C& c, S v) { c.parallel.tensor_model_parallel_size = int(parse_int("--tensor-model-parallel-size", v)); }},
      {"--pipeline-model-parallel-size", "N", "default 1",
       [](C& c, S v) {
         c.parallel.pipeline_model_parallel_size = int(parse_int("--pipeline-model-parallel-size", v));
       }},
      {"--context-parallel-size", "N", "default 1",
       [](C& c, S v) { c.parallel.context_parallel_size = int(parse_int("--context-parallel-size", v)); }},
      // misc
      {"--seed", "N", "random seed for init and data order (default 1234)",
       [](C& c, S v) { c.seed = uint64_t(parse_int("--seed", v)); }},
      {"--log-interval", "N", "iterations between log lines (default 100)",
       [](C& c, S v) { c.logging.log_interval = parse_int("--log-interval", v); }},
  };
  return table;
}

}  // namespace

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

TrainConfig parse_train_args(const std::vector<std::string>& args) {
  TrainConfig cfg;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string name = args[i], value;
    bool has_value = false;
    if (name.rfind("--", 0) != 0) user_error("unexpected argument '", name, "' (flags start with --)");
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    std::string norm = name;  // Megatron accepts underscores in a few names; treat _ as -
    std::replace(norm.begin() + 2, norm.end(), '_', '-');
    const auto& table = flags();
    const auto it = std::find_if(table.begin(), table.end(), [&](const Flag& f) { return f.name == norm; });
    if (it == table.end()) {
      const Flag* best = nullptr;
      size_t best_d = ~size_t(0);
      for (const Flag& f : table)
        if (const size_t d = edit_distance(norm, f.name); d < best_d) {
          best_d = d;
          best = &f;
        }
      user_error("unknown flag ", name, best ? " (did you mean " + best->name + "?)" : std::string());
    }
    const bool multi = it->metavar.size() > 3 && it->metavar.ends_with("...");
    if (it->metavar.empty()) {
      if (has_value) user_error(name, " takes no value");
    } else if (multi && !has_value) {
      size_t taken = 0;
      while (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) {
        it->set(cfg, args[++i]);
        ++taken;
      }
      if (taken == 0) user_error(name, " needs at least one value (", it->metavar, ")");
      continue;
    } else if (!has_value) {
      if (i + 1 >= args.size()) user_error(name, " needs a value (", it->metavar, ")");
      value = args[++i];
    }
    it->set(cfg, value);
  }
  if (!cfg.max_position_embeddings_given) cfg.model.max_position_embeddings = cfg.batch.seq_length;
  cfg.data.tokenizer.vocab_size = cfg.data.vocab_size;  // NullTokenizer's --vocab-size
  return cfg;
}

std::string train_help() {
  std::ostringstream os;
  os << "usage: loom train [flags]   (Megatron-LM flag names)\n\n";
  for (const Flag& f : flags()) {
    std::string lhs = "  " + f.name + (f.metavar.empty() ? "" : " " + f.metavar);
    if (lhs.size() < 40) lhs.resize(40, ' ');
    os << lhs << " " << f.help << "\n";
  }
  return os.str();
}

}  // namespace loom

// Flag table for `loom train`, parsed by the shared argparse-style parser (train/flags.h). Every flag in
// the table changes what the run does; Megatron flags for features this build does not have yet are
// errors that say so, never silently accepted.
#include "loom/train/args.h"

#include <functional>

namespace loom {

namespace {

struct Flag {
  std::string name;
  std::string metavar;  // empty for switches; ending in "..." takes every value up to the next flag
  std::string help;
  std::function<void(TrainConfig&, const std::string&)> set;
};

int64_t parse_int(const std::string& flag, const std::string& v) { return parse_int_flag(flag, v); }
double parse_float(const std::string& flag, const std::string& v) { return parse_float_flag(flag, v); }

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

namespace {

// The table above, as specs for the shared parser: the metavar decides the arity.
std::vector<FlagSpec<TrainConfig>> specs() {
  std::vector<FlagSpec<TrainConfig>> out;
  for (const Flag& f : flags()) {
    const bool multi = f.metavar.ends_with("...");
    const Arity arity = f.metavar.empty() ? Arity::kSwitch : multi ? Arity::kOneOrMore : Arity::kOne;
    std::string metavar = f.metavar;
    if (multi) metavar = metavar.substr(0, metavar.size() - 3) + " [...]";
    out.push_back({{f.name, arity, metavar, f.help}, [set = f.set](TrainConfig& c, const std::vector<std::string>& v) {
                     if (v.empty()) set(c, "");
                     for (const std::string& x : v) set(c, x);
                   }});
  }
  return out;
}

// Megatron flags for features this build does not have yet: a clear error instead of "unknown flag".
const std::vector<std::string>& unsupported() {
  static const std::vector<std::string> names = {
      "--bf16", "--fp16", "--fp8-format", "--recompute-granularity", "--recompute-activations",
      "--checkpoint-activations", "--save", "--load", "--save-interval", "--eval-interval", "--eval-iters",
      "--valid-data-path", "--test-data-path", "--tensorboard-dir", "--hidden-dropout", "--attention-dropout",
      "--use-distributed-optimizer", "--sequence-parallel", "--swiglu", "--normalization",
      "--position-embedding-type", "--group-query-attention", "--num-query-groups", "--untie-embeddings-and-output-weights",
      "--disable-bias-linear", "--ffn-hidden-size", "--use-flash-attn", "--use-mcore-models"};
  return names;
}

}  // namespace

TrainConfig parse_train_args(const std::vector<std::string>& args) {
  TrainConfig cfg;
  apply_flags(specs(), args, cfg, unsupported(), "Megatron's pretrain_gpt.py");
  if (!cfg.max_position_embeddings_given) cfg.model.max_position_embeddings = cfg.batch.seq_length;
  cfg.data.tokenizer.vocab_size = cfg.data.vocab_size;  // NullTokenizer's and TikTokenizer's --vocab-size
  return cfg;
}

std::string train_help() { return specs_help("usage: loom train [flags]   (Megatron-LM flag names)", specs()); }

}  // namespace loom

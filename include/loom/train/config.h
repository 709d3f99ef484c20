// Configuration of `loom train`: one small struct per concern, filled from Megatron's flag names
// (see train/args.h), with cross-field rules in TrainConfig::validate().
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include <vector>

#include "loom/data/tokenizer.h"
#include "loom/dist/parallel_state.h"
#include "loom/model/gpt.h"
#include "loom/optim/optimizer.h"

namespace loom {

struct DataConfig {
  bool mock_data = false;   // --mock-data: uniform random tokens over --vocab-size
  // --data-path: Megatron indexed-dataset prefixes, "prefix" or "w1 prefix1 w2 prefix2 ...", split by --split.
  std::vector<std::string> data_path;
  std::vector<std::string> train_data_path;  // --train-data-path: like --data-path, all of it for training
  std::string split = "969, 30, 1";          // --split (Megatron's default)
  std::string data_cache_path;               // --data-cache-path (default <prefix dir>/cache/GPTDataset_indices)
  TokenizerConfig tokenizer;                 // --tokenizer-type, --vocab-file, --merge-file, --tokenizer-model, ...
  std::optional<int64_t> vocab_size;         // --vocab-size (--mock-data, NullTokenizer)
  int64_t make_vocab_size_divisible_by = 128;  // --make-vocab-size-divisible-by
  bool reset_position_ids = false;    // --reset-position-ids: positions restart after each EOD
  bool reset_attention_mask = false;  // --reset-attention-mask: no attention across documents
  bool eod_mask_loss = false;         // --eod-mask-loss: no loss on EOD tokens
};

struct BatchConfig {
  int64_t seq_length = 0;        // --seq-length (T)
  int64_t micro_batch_size = 0;  // --micro-batch-size (B)
  std::optional<int64_t> global_batch_size;  // --global-batch-size (default micro x data-parallel size)
  int64_t train_iters = 0;       // --train-iters
};

struct OptimConfig {
  double lr = 0;                       // --lr (peak)
  double min_lr = 0;                   // --min-lr
  int64_t lr_warmup_iters = 0;         // --lr-warmup-iters
  std::optional<int64_t> lr_decay_iters;  // --lr-decay-iters (default --train-iters)
  LRDecayStyle lr_decay_style = LRDecayStyle::kLinear;  // --lr-decay-style (Megatron default linear)
  double weight_decay = 0.01;          // --weight-decay
  AdamWConfig adam;                    // --adam-beta1/--adam-beta2/--adam-eps
  double clip_grad = 1.0;              // --clip-grad (0 disables)
};

struct LoggingConfig {
  int64_t log_interval = 100;  // --log-interval (iterations)
};

struct TrainConfig {
  GPTConfig model;  // vocab sizes are filled in by resolve_vocab()
  DataConfig data;
  BatchConfig batch;
  OptimConfig optim;
  ParallelConfig parallel;
  LoggingConfig logging;
  uint64_t seed = 1234;  // --seed
  bool max_position_embeddings_given = false;

  // Cross-field checks that need no data and no allocation; UserError names the flags.
  void validate(int world_size) const;
  int64_t global_batch_size(int dp_size) const {
    return batch.global_batch_size.value_or(batch.micro_batch_size * dp_size);
  }
  int64_t num_micro_batches(int dp_size) const {
    return global_batch_size(dp_size) / (batch.micro_batch_size * dp_size);
  }
};

// Megatron's _vocab_size_with_padding: round up to a multiple of divisible_by x TP size.
int64_t padded_vocab_size(int64_t vocab_size, int64_t divisible_by, int tp_size);

}  // namespace loom

// Micro-batches for one data-parallel rank, in Megatron's order (MegatronPretrainingSampler): samples
// are taken sequentially from consumed_samples on; each step takes the next micro_batch x dp_size
// samples and rank r keeps rows [r * micro_batch, (r + 1) * micro_batch) of them. A trailing group
// smaller than micro_batch x dp_size is dropped. The batches are a pure function of (dataset,
// consumed_samples), so a resumed run that restores its consumed-sample count sees the same batches.
// A background thread fills a bounded queue of upcoming micro-batches; the destructor stops and joins
// it (no thread outlives the Loader), and an exception raised while filling is rethrown by next().
// Per-token extras follow Megatron's _get_ltor_masks_and_position_ids, with the attention mask given as
// segment ids (key j is visible to query i iff j <= i and both have the same segment id).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <span>

#include "loom/core/tensor.h"
#include "loom/data/gpt_dataset.h"

namespace loom {

struct BatchOptions {
  bool reset_position_ids = false;    // --reset-position-ids: positions restart after each EOD
  bool reset_attention_mask = false;  // --reset-attention-mask: segment id += 1 after each EOD
  bool eod_mask_loss = false;         // --eod-mask-loss: loss_mask = 0 where the input token is EOD
  int32_t eod = -1;                   // the tokenizer's end-of-document id (-1: none)
  int64_t vocab_size = 0;             // every token id must lie in [0, vocab_size) (0: not checked); the
                                      // tokenizer's vocabulary, not the padded one (those rows are dummies)
  bool dataset_extras = false;        // the dataset gives loss mask, positions and segments (SFT): use them
  std::string vocab_source = "";      // names vocab_size in errors, e.g. "GPT2BPETokenizer"
};

struct Batch {
  Tensor tokens;        // (B, T) i32, sample tokens [0, T)
  Tensor labels;        // (B, T) i32, sample tokens [1, T]
  Tensor loss_mask;     // (B, T) f32, 1 or 0
  Tensor position_ids;  // (B, T) i32
  Tensor segment_ids;   // (B, T) i32, all 0 without --reset-attention-mask
  int64_t first_sample = 0;  // dataset index of row 0; row b is first_sample + b
};

// Fills `out` (allocated here, host) with the samples first .. first + B - 1 of `ds`. With
// opt.vocab_size set, a token id outside [0, vocab_size) (input or label) is a UserError naming the id, the
// sample and position, where the dataset read it from (file, document, offset: SampleDataset::locate) and
// the valid range: a GPU's embedding could only flag it later, and an id in the padded rows of the table
// would train silently. The check is one branch-free max per sample (vectorised), next to the copy.
void fill_batch(const SampleDataset& ds, int64_t first, int64_t B, const BatchOptions& opt, Batch& out);
// The first of n ids outside [0, vocab_size), or -1 (vocab_size <= 2^31).
int64_t first_id_outside(const int32_t* ids, int64_t n, int64_t vocab_size);
// The extras of one row of T input tokens (Megatron's rules; see BatchOptions).
void token_extras(std::span<const int32_t> tokens, const BatchOptions& opt, float* loss_mask, int32_t* position_ids,
                  int32_t* segment_ids);

struct LoaderConfig {
  int64_t global_batch_size = 0;  // --global-batch-size (a multiple of micro_batch_size x dp_size)
  int64_t micro_batch_size = 0;   // --micro-batch-size (B)
  int dp_rank = 0, dp_size = 1;
  int64_t consumed_samples = 0;   // samples consumed by all ranks before this loader (resume point)
  int prefetch_depth = 2;         // micro-batches prepared ahead (0: no background thread)
  std::string role = "training";  // names the loader in errors: "training" (batches numbered by
                                  // iteration), "validation", "test"
  BatchOptions batch;
};

class Loader {
 public:
  // UserError when the sizes are inconsistent, the reset/EOD flags are set without an EOD id, or
  // consumed_samples already covers the whole dataset.
  Loader(std::shared_ptr<const SampleDataset> dataset, const LoaderConfig& cfg);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // The next micro-batch of this rank; nullopt once fewer than micro_batch x dp_size samples remain.
  std::optional<Batch> next();
  // Samples consumed by all ranks through the micro-batches next() has returned.
  int64_t consumed_samples() const { return consumed_; }
  int64_t micro_batches_per_step() const { return cfg_.global_batch_size / (cfg_.micro_batch_size * cfg_.dp_size); }
  const SampleDataset& dataset() const { return *dataset_; }

 private:
  struct Prefetcher;
  std::optional<Batch> produce(int64_t step) const;  // micro-batch `step` after the start, or nullopt at the end

  std::shared_ptr<const SampleDataset> dataset_;
  LoaderConfig cfg_;
  int64_t consumed_ = 0;
  int64_t step_ = 0;  // micro-batches returned so far
  std::unique_ptr<Prefetcher> prefetcher_;
};

}  // namespace loom

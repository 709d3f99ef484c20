// GPT pretraining samples built exactly as Megatron-Core builds them (gpt_dataset.py, blended_dataset.py,
// blended_megatron_dataset_builder.py, helpers.cpp), so the same --data-path/--split/--seq-length/--seed
// give the same token windows in the same order:
//   - --split "949,50,1": weights normalised, cumulated into [begin, end) fractions, and the sequences
//     [round(begin * S), round(end * S)) of a prefix (round half to even, as Python's round) form a split;
//   - GPTDataset: the split's sequences repeated for as many epochs as the requested sample count needs,
//     shuffled with numpy's RandomState(seed) (the final epoch shuffled on its own when it would be less
//     than 80% used), cut into windows of seq_length + 1 tokens that span sequences (consecutive windows
//     share one token), and the windows shuffled (again separately for a separate final epoch);
//   - BlendedDataset: Megatron's greedy blend (each sample goes to the dataset furthest below its
//     weight), components built with ceil(ceil(N * w) * (1 + surplus)) samples.
// The three GPTDataset index arrays are cached on disk (<hash>-GPTDataset-<split>-*.npy plus the
// description the hash was taken of), written atomically and re-validated on load.
// Thread safety: a built dataset is immutable; sample() may be called from any thread.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "loom/data/indexed_dataset.h"

namespace loom {

enum class Split { kTrain = 0, kValid = 1, kTest = 2 };
const char* split_name(Split s);  // "train", "valid", "test" (Megatron's Split names)

// [begin, end) fractions of each split; nullopt where the split is empty (weight 0).
using SplitMatrix = std::array<std::optional<std::pair<double, double>>, 3>;
// Parses --split as Megatron does (runs of digits and dots are the numbers, so "949,50,1", "949 50 1"
// and "0.9,0.1" all work; missing ones are 0); UserError naming --split when there is no positive
// weight, more than three, or a malformed number such as "1..2".
SplitMatrix parse_split(const std::string& split);
// Sequence range [begin, end) of one split of a dataset with num_sequences sequences.
std::pair<int64_t, int64_t> split_sequence_range(std::pair<double, double> bookends, int64_t num_sequences);

// --data-path as Megatron reads it: "prefix1 prefix2 ..." (no weights) or "w1 prefix1 w2 prefix2 ...".
struct DataBlend {
  std::vector<std::string> prefixes;
  std::vector<double> weights;  // empty: no weights given (blend by dataset length)
};
DataBlend parse_data_path(const std::vector<std::string>& items);  // UserError naming --data-path
std::vector<std::string> split_whitespace(const std::string& s);

struct GPTDatasetConfig {
  int64_t seq_length = 0;          // --seq-length (T); samples hold T + 1 tokens
  uint64_t seed = 1234;            // --seed; numpy's RandomState takes [0, 2^32 - 1]
  std::string split = "969,30,1";  // --split (Megatron's default)
  // --data-cache-path. Empty: <prefix>/cache/GPTDataset_indices as in Megatron, skipped silently
  // when it cannot be created; an explicit path that cannot be written is a UserError.
  std::string data_cache_path;
  bool use_cache = true;                   // false: neither read nor write index files
  double mid_level_dataset_surplus = 0.005;  // --mid-level-dataset-surplus (blends only)
};

// Fixed windows of seq_length + 1 tokens (inputs are [0, T), labels [1, T]).
class SampleDataset {
 public:
  virtual ~SampleDataset() = default;
  virtual int64_t size() const = 0;
  virtual int64_t seq_length() const = 0;
  virtual void sample(int64_t index, int32_t* out) const = 0;  // writes seq_length + 1 tokens
  virtual std::string description() const = 0;
  // Datasets that know more than their tokens (SFT: the answer-only loss mask and packed documents) fill
  // each of the seq_length input positions' loss_mask (of the label at that position), position id
  // and segment id, and return true; the others return false and the loader derives them from the
  // tokens (BatchOptions).
  virtual bool extras(int64_t /*index*/, float* /*loss_mask*/, int32_t* /*position_ids*/,
                      int32_t* /*segment_ids*/) const {
    return false;
  }
  // Where token `position` (0 .. seq_length) of sample `index` comes from, for error messages, e.g.
  // "data/x.bin: document 812, token 3 of the document (token 123456 of the file)"; empty when the
  // dataset cannot say. Not for the hot path: it may scan the index.
  virtual std::string locate(int64_t /*index*/, int64_t /*position*/) const { return {}; }
};

class GPTDataset final : public SampleDataset {
 public:
  // Sequences [seq_begin, seq_end) of `data`. num_samples: the samples the run will draw (more may
  // exist, up to the end of the last epoch); nullopt builds exactly one epoch. UserError naming
  // --split (and the prefix) when the range holds fewer than 2 tokens but samples are needed.
  GPTDataset(std::shared_ptr<const IndexedDataset> data, Split split, int64_t seq_begin, int64_t seq_end,
             std::optional<int64_t> num_samples, const GPTDatasetConfig& cfg);
  ~GPTDataset() override;

  int64_t size() const override { return int64_t(shuffle_index_.size()); }
  int64_t seq_length() const override { return seq_length_; }
  void sample(int64_t index, int32_t* out) const override;
  std::string description() const override;
  std::string locate(int64_t index, int64_t position) const override;

  // Megatron's arrays: document_index (sequence ids, epochs x sequences, shuffled), sample_index
  // ((size + 1) x 2 row-major: position in document_index, token offset in that sequence),
  // shuffle_index (a permutation of [0, size)).
  std::span<const int32_t> document_index() const { return document_index_; }
  std::span<const int64_t> sample_index() const { return sample_index_; }
  std::span<const int64_t> shuffle_index() const { return shuffle_index_; }
  int64_t num_epochs() const { return num_epochs_; }
  bool separate_final_epoch() const { return separate_final_epoch_; }
  int64_t tokens_per_epoch() const { return tokens_per_epoch_; }
  Split split() const { return split_; }
  bool loaded_from_cache() const { return loaded_from_cache_; }
  const std::string& cache_dir() const { return cache_dir_; }  // empty when caching is off
  // The text whose hash names the cache files: everything the indices depend on.
  const std::string& unique_description() const { return unique_description_; }

 private:
  void build_indices(std::optional<int64_t> num_samples);
  bool load_cache(const std::string& base);
  void save_cache(const std::string& base) const;

  std::shared_ptr<const IndexedDataset> data_;
  Split split_;
  int64_t seq_begin_, seq_end_;
  int64_t seq_length_;
  uint32_t seed_;
  int64_t tokens_per_epoch_ = 0;
  int64_t num_epochs_ = 0;
  bool separate_final_epoch_ = false;
  int64_t num_samples_sans_final_epoch_ = 0;
  std::vector<int32_t> document_index_;
  std::vector<int64_t> sample_index_;
  std::vector<int64_t> shuffle_index_;
  std::string unique_description_;
  std::string cache_dir_;
  bool loaded_from_cache_ = false;
};

class BlendedDataset final : public SampleDataset {
 public:
  // weights are normalised here (Megatron normalises twice; so do we, for identical doubles).
  // size nullopt: Megatron's exhaustive blend (every sample of every component, weights = lengths).
  // UserError naming --data-path when the blend would draw more samples from a component than it has.
  BlendedDataset(std::vector<std::shared_ptr<const SampleDataset>> datasets, std::vector<double> weights,
                 std::optional<int64_t> size);

  int64_t size() const override { return int64_t(dataset_index_.size()); }
  int64_t seq_length() const override { return datasets_[0]->seq_length(); }
  void sample(int64_t index, int32_t* out) const override;
  std::string description() const override;
  std::string locate(int64_t index, int64_t position) const override;

  std::span<const int16_t> dataset_index() const { return dataset_index_; }
  std::span<const int64_t> dataset_sample_index() const { return dataset_sample_index_; }
  const std::vector<double>& weights() const { return weights_; }
  const std::vector<std::shared_ptr<const SampleDataset>>& datasets() const { return datasets_; }

 private:
  std::vector<std::shared_ptr<const SampleDataset>> datasets_;
  std::vector<double> weights_;
  std::vector<int16_t> dataset_index_;
  std::vector<int64_t> dataset_sample_index_;
};

// Megatron's numpy-style helpers, exposed for tests and the trainer's logging.
std::vector<double> normalize_weights(const std::vector<double>& w);  // w / numpy.sum(w)
// _get_size_per_split_per_dataset: ceil(ceil(target * w) * (1 + surplus)) per dataset per split.
int64_t blend_component_samples(int64_t target, double weight, double surplus);

using IndexedDatasetOpener = std::function<std::shared_ptr<const IndexedDataset>(const std::string& prefix)>;

// BlendedMegatronDatasetBuilder for --data-path and --split: one dataset per split (train, valid,
// test), nullptr where the split is empty. num_samples[i]: samples the run draws from split i
// (Megatron: train_iters * global_batch, (train_iters / eval_interval + 1) * eval_iters * global_batch,
// eval_iters * global_batch); nullopt builds one epoch (not allowed with weights); 0 skips the split
// (nullptr in the result). open defaults to
// IndexedDataset::open; each prefix is opened once and shared by its splits.
std::array<std::shared_ptr<const SampleDataset>, 3> build_gpt_datasets(
    const std::vector<std::string>& data_path, const std::array<std::optional<int64_t>, 3>& num_samples,
    const GPTDatasetConfig& cfg, const IndexedDatasetOpener& open = {});

}  // namespace loom

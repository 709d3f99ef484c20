// Supervised fine-tuning data (docs/data.md, "SFT datasets"): `loom preprocess --sft` writes each
// prompt/answer sample as one document of <prefix>.bin/.idx (its tokens) and of <prefix>_loss_mask.bin/.idx
// (uint8, 1 where the token is part of the answer), and SftDataset turns a split of those documents into
// training sequences of seq_length + 1 tokens:
//   packed  first-fit decreasing (NeMo's packing): samples sorted by length (longest first, ties by
//           document order), each put into the first sequence with room for it; every sample is its own
//           document for attention (segment ids: no attention across samples) with positions restarting
//           at 0; the label that would cross into the next sample and the padding are out of the loss;
//   padded  one sample per sequence, padded.
// The label at input position j (token j + 1) is in the loss iff token j + 1 is an answer token of the same
// sample. Padding is the tokenizer's end-of-document id (0 without one) in a segment of its own. A sample
// longer than seq_length + 1 tokens is truncated, skipped or an error (--sft-overlong); the counts are in
// stats(). The sequences are shuffled with --seed and repeated for as many epochs as the run needs, each
// epoch reshuffled.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/data/gpt_dataset.h"
#include "loom/data/indexed_dataset.h"

namespace loom {

enum class SftOverlong { kTruncate, kSkip, kError };
SftOverlong parse_sft_overlong(const std::string& s);  // UserError naming --sft-overlong

struct SftConfig {
  int64_t seq_length = 0;
  bool packing = true;        // --sft-packing / --no-sft-packing
  SftOverlong overlong = SftOverlong::kTruncate;
  uint32_t seed = 1234;
  int32_t pad_id = 0;         // the tokenizer's EOD, or 0
  // The packing is cached like the GPT indices: --data-cache-path, else <prefix>/cache/SftDataset_indices
  // (skipped when that cannot be written); files <hash>-SftDataset-<split>-*.npy plus a description.
  std::string data_cache_path;
  bool use_cache = true;
};

struct SftStats {
  int64_t samples = 0;        // documents of the split
  int64_t truncated = 0, skipped = 0;
  int64_t sequences = 0;      // per epoch
  int64_t tokens = 0;         // sample tokens per epoch (after truncation)
  int64_t loss_tokens = 0;    // labels in the loss per epoch
};

// The loss-mask dataset that goes with an SFT token dataset.
std::string sft_loss_mask_prefix(const std::string& prefix);  // prefix + "_loss_mask"

class SftDataset final : public SampleDataset {
 public:
  // Documents [doc_begin, doc_end) of `tokens` (and its loss mask); num_samples: sequences the run
  // draws (nullopt: one epoch). UserError naming the files for a mask that does not match the tokens, an
  // overlong sample under --sft-overlong error, or a split without any sample.
  SftDataset(std::shared_ptr<const IndexedDataset> tokens, std::shared_ptr<const IndexedDataset> loss_mask,
             int64_t doc_begin, int64_t doc_end, std::optional<int64_t> num_samples, const SftConfig& cfg,
             const std::string& split_name);

  int64_t size() const override { return num_samples_; }
  int64_t seq_length() const override { return cfg_.seq_length; }
  void sample(int64_t index, int32_t* out) const override;
  bool extras(int64_t index, float* loss_mask, int32_t* position_ids, int32_t* segment_ids) const override;
  std::string description() const override;
  std::string locate(int64_t index, int64_t position) const override;
  const SftStats& stats() const { return stats_; }
  // The samples of packed sequence `seq` of an epoch (document ids), in order.
  std::vector<int64_t> sequence_documents(int64_t seq) const;
  bool loaded_from_cache() const { return loaded_from_cache_; }
  const std::string& cache_dir() const { return cache_dir_; }  // empty when caching is off

 private:
  int64_t sequence_of(int64_t index) const;  // the epoch's sequence behind sample `index`
  // The sequence's T + 1 answer flags and sample ids (-1: padding), from the loss mask only.
  void layout(int64_t seq, std::vector<uint8_t>& answer, std::vector<int32_t>& owner) const;

  std::shared_ptr<const IndexedDataset> tokens_, mask_;
  SftConfig cfg_;
  std::string split_name_;
  std::vector<int64_t> docs_;       // kept documents (after skipping)
  std::vector<int64_t> lengths_;    // their lengths after truncation
  std::vector<int64_t> seq_start_;  // sequence s holds bin_docs_[seq_start_[s] .. seq_start_[s + 1])
  std::vector<int64_t> bin_docs_;   // indices into docs_
  std::vector<int64_t> order_;      // sample index -> sequence (per-epoch shuffles)
  int64_t num_samples_ = 0;
  SftStats stats_;
  std::string description_, cache_dir_;
  bool loaded_from_cache_ = false;
  void pack(int64_t doc_begin, int64_t doc_end);
  bool load_cache(const std::string& base, int64_t doc_begin, int64_t doc_end);
  void save_cache(const std::string& base) const;
};

// The train / validation / test SftDatasets of one prefix (its documents split by --split as Megatron
// splits sequences), each sized for num_samples (0: none); a split without documents is null.
// UserError naming --data-path for a blend (SFT takes one prefix) or missing files.
std::array<std::shared_ptr<const SampleDataset>, 3> build_sft_datasets(const std::vector<std::string>& data_path,
                                                                       const std::array<int64_t, 3>& num_samples,
                                                                       const std::string& split, const SftConfig& cfg);

}  // namespace loom

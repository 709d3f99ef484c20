// NeMo's packed SFT files, the format of the MLPerf Llama-2 70B LoRA data as NVIDIA's implementation ships
// it (train.npy / validation.npy): a NumPy object array (read without unpickling code, data/npy_pickle.h)
// of records {"input_ids": [...], "loss_mask": [...], "seq_start_id": [...]}, each record one packed
// sequence of several samples starting at the seq_start_id offsets.
// The training examples are NeMo's GPTSFTPackedDataset.collate_fn: for each sample [b_i, b_{i+1}) the labels
// are input_ids[b_i + 1 .. b_{i+1}) with loss mask loss_mask[b_i + 1 .. b_{i+1}) (the mask of the predicted
// token), positions restart at 0, and no attention crosses samples. Loom lays a record out as one window
// of --seq-length + 1 tokens holding every sample whole (each sample's last token is an input whose
// label is out of the loss, which changes nothing NeMo computes), then padding (EOD, out of the loss).
// Order: NeMo's samples mapping — numpy.random.seed(seed), then one RandomState.shuffle of the records
// per epoch — so a run draws the records NeMo would.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/data/gpt_dataset.h"

namespace loom {

class NpyPackedDataset final : public SampleDataset {
 public:
  // UserError naming `path` for anything but that layout, a record that does not fit seq_length + 1
  // tokens, seq_start_id not starting at 0 or not increasing, or lengths that differ.
  NpyPackedDataset(const std::string& path, int64_t seq_length, std::optional<int64_t> num_samples, uint32_t seed,
                   int32_t pad_id);
  int64_t size() const override { return int64_t(order_.size()); }
  int64_t seq_length() const override { return seq_length_; }
  void sample(int64_t index, int32_t* out) const override;
  bool extras(int64_t index, float* loss_mask, int32_t* position_ids, int32_t* segment_ids) const override;
  std::string description() const override;
  std::string locate(int64_t index, int64_t position) const override;
  int64_t records() const { return int64_t(start_.size()) - 1; }

 private:
  std::string path_;
  int64_t seq_length_;
  int32_t pad_id_;
  // Record r: tokens ids_[start_[r] .. start_[r + 1]), its mask and its samples' starts (relative).
  std::vector<int32_t> ids_;
  std::vector<uint8_t> mask_;
  std::vector<int64_t> start_;
  std::vector<std::vector<int64_t>> seq_starts_;
  std::vector<int64_t> order_;  // sample index -> record
  int64_t loss_tokens_ = 0;
};

}  // namespace loom

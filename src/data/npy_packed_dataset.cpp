// NpyPackedDataset (loom/data/npy_packed_dataset.h).
#include "loom/data/npy_packed_dataset.h"

#include <algorithm>
#include <numeric>
#include <sstream>

#include "data/npy_pickle.h"
#include "data/numpy_random.h"
#include "loom/core/check.h"

namespace loom {

NpyPackedDataset::NpyPackedDataset(const std::string& path, int64_t seq_length, std::optional<int64_t> num_samples,
                                   uint32_t seed, int32_t pad_id)
    : path_(path), seq_length_(seq_length), pad_id_(pad_id) {
  const npy::Array arr = npy::load_npy(path);
  if (arr.dtype != "O" || arr.shape.size() != 1)
    user_error(path, ": expected a 1-D NumPy object array of packed records (dtype O), got dtype ", arr.dtype);
  start_.push_back(0);
  for (size_t r = 0; r < arr.objects.size(); ++r) {
    const npy::Value& rec = *arr.objects[r];
    const std::string where = path + ": record " + std::to_string(r);
    if (rec.kind != npy::Value::Kind::kDict) user_error(where, " is not a dict");
    for (const char* k : {"input_ids", "loss_mask", "seq_start_id"})
      if (!rec.dict.count(k)) user_error(where, " has no '", k, "' (keys: input_ids, loss_mask, seq_start_id)");
    const std::vector<int64_t> ids = npy::int_list(*rec.dict.at("input_ids"), where + " input_ids");
    const std::vector<int64_t> mask = npy::int_list(*rec.dict.at("loss_mask"), where + " loss_mask");
    std::vector<int64_t> starts = npy::int_list(*rec.dict.at("seq_start_id"), where + " seq_start_id");
    if (mask.size() != ids.size())
      user_error(where, ": loss_mask has ", mask.size(), " entries for ", ids.size(), " input_ids");
    if (int64_t(ids.size()) > seq_length_ + 1)
      user_error(where, ": ", ids.size(), " tokens do not fit --seq-length + 1 = ", seq_length_ + 1,
                 " (set --seq-length to the packed length the file was made for)");
    if (starts.empty() || starts[0] != 0) user_error(where, ": seq_start_id must start with 0");
    for (size_t k = 1; k < starts.size(); ++k)
      if (starts[k] <= starts[k - 1] || starts[k] >= int64_t(ids.size()))
        user_error(where, ": seq_start_id must increase within [0, ", ids.size(), ")");
    for (size_t k = 0; k < ids.size(); ++k) {
      if (ids[k] < 0 || ids[k] > INT32_MAX) user_error(where, ": input_ids[", k, "] = ", ids[k], " is not a token id");
      if (mask[k] != 0 && mask[k] != 1) user_error(where, ": loss_mask[", k, "] = ", mask[k], " (0 or 1 expected)");
      ids_.push_back(int32_t(ids[k]));
      mask_.push_back(uint8_t(mask[k]));
    }
    // Labels in the loss: every token but each sample's first, where its mask is 1.
    for (size_t k = 0; k < ids.size(); ++k)
      if (mask[k] && std::find(starts.begin(), starts.end(), int64_t(k)) == starts.end()) ++loss_tokens_;
    start_.push_back(int64_t(ids_.size()));
    seq_starts_.push_back(std::move(starts));
  }
  const int64_t n = records();
  if (n == 0) user_error(path, ": no records");
  // NeMo's _build_samples_mapping: seed once, shuffle arange(n) per epoch, take the first num_samples.
  const int64_t want = num_samples.value_or(n);
  detail::NumpyRandomState rs(seed);
  std::vector<int64_t> perm(static_cast<size_t>(n));
  while (int64_t(order_.size()) < want) {
    std::iota(perm.begin(), perm.end(), int64_t(0));
    rs.shuffle(std::span<int64_t>(perm));
    order_.insert(order_.end(), perm.begin(), perm.end());
  }
  order_.resize(size_t(want));
}

void NpyPackedDataset::sample(int64_t index, int32_t* out) const {
  LOOM_CHECK(index >= 0 && index < size(), "[NpyPackedDataset] sample ", index, " outside [0, ", size(), ")");
  const int64_t r = order_[size_t(index)], b = start_[size_t(r)], e = start_[size_t(r) + 1];
  std::fill(out, out + seq_length_ + 1, pad_id_);
  std::copy(ids_.begin() + b, ids_.begin() + e, out);
}

bool NpyPackedDataset::extras(int64_t index, float* loss_mask, int32_t* position_ids, int32_t* segment_ids) const {
  const int64_t r = order_[size_t(index)], b = start_[size_t(r)], len = start_[size_t(r) + 1] - b;
  const std::vector<int64_t>& starts = seq_starts_[size_t(r)];
  size_t next = 1;  // the next sample's start
  int32_t seg = 0, pos = 0;
  for (int64_t j = 0; j < seq_length_; ++j) {
    if (j == len || (next < starts.size() && j == starts[next])) {  // a new sample, or the padding
      if (j > 0) ++seg;
      pos = 0;
      if (j != len) ++next;
    }
    segment_ids[j] = seg;
    position_ids[j] = pos++;
    // Label j is token j + 1: in the loss iff it is in the same sample and its mask is 1.
    const bool next_in_sample = j + 1 < len && !(next < starts.size() && j + 1 == starts[next]);
    loss_mask[j] = j < len && next_in_sample && mask_[size_t(b + j + 1)] ? 1.0f : 0.0f;
  }
  return true;
}

std::string NpyPackedDataset::locate(int64_t index, int64_t position) const {
  if (index < 0 || index >= size() || position < 0 || position > seq_length_) return {};
  const int64_t r = order_[size_t(index)], len = start_[size_t(r) + 1] - start_[size_t(r)];
  if (position >= len) return path_ + ": padding after record " + std::to_string(r) + " (the pad id " + std::to_string(pad_id_) + ")";
  return path_ + ": record " + std::to_string(r) + ", input_ids[" + std::to_string(position) + "]";
}

std::string NpyPackedDataset::description() const {
  std::ostringstream o;
  o << "packed SFT records " << path_ << ": " << records() << " records of up to " << seq_length_ + 1 << " tokens ("
    << ids_.size() << " tokens, " << loss_tokens_ << " labels in the loss), " << size() << " samples";
  return o.str();
}

}  // namespace loom

// Megatron-Core GPTDataset index building (see include/loom/data/gpt_dataset.h): the document, sample and
// shuffle indices of one split of one prefix, and their on-disk cache. Every floating-point step mirrors the
// Python it replaces (int(0.8 * n) in the final-epoch rule), and every random draw goes through
// NumpyRandomState in Megatron's order: document index shuffle(s) first, then shuffle index shuffle(s), all
// from one RandomState(seed).
// Cache files are .npy (numpy can open them) named like Megatron's; a file is used only when its
// description matches byte for byte and its contents pass the same structural checks a fresh build
// satisfies (sizes, value ranges, windows of exactly seq_length + 1 tokens, a true permutation).
// The --split/--data-path parsing, BlendedDataset and build_gpt_datasets are in gpt_dataset_blend.cpp.
#include "loom/data/gpt_dataset.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "data/index_cache.h"
#include "data/numpy_random.h"
#include "loom/core/check.h"
#include "loom/core/file_io.h"

namespace loom {

namespace fs = std::filesystem;

const char* split_name(Split s) {
  switch (s) {
    case Split::kTrain: return "train";
    case Split::kValid: return "valid";
    case Split::kTest: return "test";
  }
  return "?";
}

// ---- GPTDataset -------------------------------------------------------------------------------------

GPTDataset::GPTDataset(std::shared_ptr<const IndexedDataset> data, Split split, int64_t seq_begin,
                       int64_t seq_end, std::optional<int64_t> num_samples, const GPTDatasetConfig& cfg)
    : data_(std::move(data)), split_(split), seq_begin_(seq_begin), seq_end_(seq_end), seq_length_(cfg.seq_length) {
  LOOM_CHECK(data_ != nullptr, "[GPTDataset] null indexed dataset");
  const int64_t S = data_->num_sequences();
  LOOM_CHECK(seq_begin >= 0 && seq_begin <= seq_end && seq_end <= S, "[GPTDataset] sequence range [", seq_begin,
             ", ", seq_end, ") outside [0, ", S, ") of ", data_->prefix());
  if (cfg.seq_length < 1) user_error("--seq-length must be >= 1, got ", cfg.seq_length);
  if (cfg.seed > 0xffffffffULL)
    user_error("--seed ", cfg.seed, " is out of range for the dataset shuffle (numpy RandomState takes 0 .. 2^32-1)");
  if (num_samples && *num_samples < 0) LOOM_FAIL("[GPTDataset] negative sample count ", *num_samples);
  seed_ = uint32_t(cfg.seed);

  const auto lengths = data_->sequence_lengths();
  std::vector<int32_t> range_lengths(lengths.begin() + seq_begin, lengths.begin() + seq_end);
  for (int32_t len : range_lengths) tokens_per_epoch_ += len;
  if (tokens_per_epoch_ < 2)
    user_error("--split '", cfg.split, "' gives the ", split_name(split), " split of ", data_->prefix(), " sequences [",
               seq_begin, ", ", seq_end, ") of ", S, ", holding ", tokens_per_epoch_,
               " tokens; it needs at least 2 (change --split or --data-path)");

  // Everything the indices depend on; its hash names the cache files (Megatron: MD5 of a JSON).
  nlohmann::ordered_json d;
  d["class"] = "GPTDataset";
  d["dataset_path"] = data_->prefix();
  d["num_samples"] = num_samples ? nlohmann::ordered_json(*num_samples) : nlohmann::ordered_json(nullptr);
  d["index_split"] = split_name(split);
  d["sequence_range"] = {seq_begin, seq_end};
  d["num_sequences"] = S;
  d["sequence_lengths_fnv1a64"] = hex64(fnv1a64(range_lengths.data(), range_lengths.size() * sizeof(int32_t)));
  d["random_seed"] = seed_;
  d["sequence_length"] = seq_length_;
  d["add_extra_token_to_sequence"] = true;
  d["drop_last_partial_sequence"] = true;
  d["loom_index_format"] = 1;
  unique_description_ = d.dump(4);
  const std::string hash = hex64(fnv1a64(unique_description_.data(), unique_description_.size()));

  if (cfg.use_cache) {
    const bool explicit_dir = !cfg.data_cache_path.empty();
    const std::string dir = explicit_dir ? cfg.data_cache_path : data_->prefix() + "/cache/GPTDataset_indices";
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (!ec && fs::is_directory(dir, ec) && ::access(dir.c_str(), W_OK) == 0) {
      cache_dir_ = dir;
    } else if (explicit_dir) {
      user_error("--data-cache-path '", dir, "' cannot be created or written", ec ? ": " + ec.message() : "");
    }
  }
  const std::string base = cache_dir_.empty() ? "" : cache_dir_ + "/" + hash + "-GPTDataset-" + split_name(split);

  // Epoch arithmetic is needed to validate a cached file, so it runs before the load.
  num_epochs_ = 1;
  if (num_samples) {
    const int64_t requested = *num_samples * seq_length_ + 1;
    num_epochs_ = std::max<int64_t>(1, (requested + tokens_per_epoch_ - 1) / tokens_per_epoch_);
  }
  if (num_epochs_ > 1) {
    num_samples_sans_final_epoch_ = ((num_epochs_ - 1) * tokens_per_epoch_ - 1) / seq_length_;
    const int64_t from_final = *num_samples - num_samples_sans_final_epoch_;
    const int64_t per_epoch = (tokens_per_epoch_ - 1) / seq_length_;
    LOOM_CHECK(from_final >= 0 && from_final <= per_epoch + 1, "[GPTDataset] final epoch draws ", from_final,
               " samples of ", per_epoch);
    // The last epoch is shuffled on its own when less than 80% of it is used, so the samples drawn
    // are not biased towards the documents of one partial epoch.
    separate_final_epoch_ = from_final < int64_t(0.80 * double(per_epoch));
  }

  if (!base.empty() && load_cache(base)) {
    loaded_from_cache_ = true;
    return;
  }
  build_indices(num_samples);
  if (!base.empty()) {
    try {
      save_cache(base);
    } catch (const UserError&) {
      if (!cfg.data_cache_path.empty()) throw;
      cache_dir_.clear();  // default location not writable after all: run without a cache
    }
  }
}

GPTDataset::~GPTDataset() = default;

void GPTDataset::build_indices(std::optional<int64_t> num_samples) {
  detail::NumpyRandomState rng(seed_);
  const int64_t n_seq = seq_end_ - seq_begin_;

  // Document index: sequence ids epoch after epoch, shuffled as one array, or as (epochs - 1) and 1.
  document_index_.resize(size_t(num_epochs_ * n_seq));
  for (int64_t e = 0; e < num_epochs_; ++e)
    for (int64_t s = 0; s < n_seq; ++s) document_index_[size_t(e * n_seq + s)] = int32_t(seq_begin_ + s);
  std::span<int32_t> all(document_index_);
  if (separate_final_epoch_) {
    rng.shuffle(all.first(size_t((num_epochs_ - 1) * n_seq)));
    rng.shuffle(all.subspan(size_t((num_epochs_ - 1) * n_seq)));
  } else {
    rng.shuffle(all);
  }

  // Sample index (helpers.cpp build_sample_idx, add_extra_token_to_sequence, drop_last_partial_sequence):
  // row k is where window k starts; a window spans seq_length + 1 tokens, so the next window starts on
  // the last token of this one.
  const auto lengths = data_->sequence_lengths();
  const int64_t num_samples_total = (num_epochs_ * tokens_per_epoch_ - 1) / seq_length_;
  sample_index_.assign(size_t(2 * (num_samples_total + 1)), 0);
  int64_t doc_pos = 0, offset = 0;
  const auto last_pos = int64_t(document_index_.size()) - 1;
  for (int64_t k = 1; k <= num_samples_total; ++k) {
    int64_t remaining = seq_length_ + 1;
    while (remaining != 0) {
      const int64_t doc_len = lengths[size_t(document_index_[size_t(doc_pos)])] - offset;
      remaining -= doc_len;
      if (remaining <= 0) {
        offset += remaining + doc_len - 1;
        remaining = 0;
      } else {
        if (doc_pos == last_pos) {
          LOOM_CHECK(k == num_samples_total, "[GPTDataset] ran out of documents at sample ", k);
          offset = lengths[size_t(document_index_[size_t(doc_pos)])] - 1;
          break;
        }
        ++doc_pos;
        offset = 0;
      }
    }
    sample_index_[size_t(2 * k)] = doc_pos;
    sample_index_[size_t(2 * k + 1)] = offset;
  }

  // Shuffle index: [0, sans) and [sans, total) shuffled separately when the final epoch is separate.
  shuffle_index_.resize(size_t(num_samples_total));
  for (int64_t i = 0; i < num_samples_total; ++i) shuffle_index_[size_t(i)] = i;
  std::span<int64_t> sh(shuffle_index_);
  const int64_t first = separate_final_epoch_ ? num_samples_sans_final_epoch_ : num_samples_total;
  rng.shuffle(sh.first(size_t(first)));
  if (first < num_samples_total) rng.shuffle(sh.subspan(size_t(first)));
  if (num_samples)
    LOOM_CHECK(size() >= *num_samples, "[GPTDataset] built ", size(), " samples, ", *num_samples, " requested");
}

bool GPTDataset::load_cache(const std::string& base) {
  const std::optional<std::string> desc = read_file_if_present(base + "-description.txt");
  if (!desc || *desc != unique_description_) return false;
  const int64_t n_seq = seq_end_ - seq_begin_;
  const size_t n_doc = size_t(num_epochs_ * n_seq);
  const int64_t n_samples = (num_epochs_ * tokens_per_epoch_ - 1) / seq_length_;
  std::vector<int32_t> doc;
  std::vector<int64_t> smp, shf;
  if (!read_npy(base + "-document_index.npy", npy_header("<i4", shape_1d(n_doc)), n_doc, doc) ||
      !read_npy(base + "-sample_index.npy", npy_header("<i8", shape_2d(size_t(n_samples + 1), 2)),
                size_t(2 * (n_samples + 1)), smp) ||
      !read_npy(base + "-shuffle_index.npy", npy_header("<i8", shape_1d(size_t(n_samples))), size_t(n_samples), shf))
    return false;

  // Every sequence of the range exactly num_epochs times.
  std::vector<int64_t> seen(size_t(n_seq), 0);
  for (int32_t s : doc) {
    if (s < seq_begin_ || s >= seq_end_) return false;
    ++seen[size_t(s - seq_begin_)];
  }
  for (int64_t c : seen)
    if (c != num_epochs_) return false;
  // Windows of exactly seq_length + 1 tokens, in order.
  const auto lengths = data_->sequence_lengths();
  if (smp[0] != 0 || smp[1] != 0) return false;
  for (int64_t k = 0; k < n_samples; ++k) {
    const int64_t p0 = smp[size_t(2 * k)], o0 = smp[size_t(2 * k + 1)];
    const int64_t p1 = smp[size_t(2 * k + 2)], o1 = smp[size_t(2 * k + 3)];
    if (p1 < p0 || p1 >= int64_t(n_doc) || o0 < 0 || o1 < 0) return false;
    if (o0 >= lengths[size_t(doc[size_t(p0)])] || o1 >= lengths[size_t(doc[size_t(p1)])]) return false;
    int64_t tokens = 0;
    if (p0 == p1) {
      tokens = o1 - o0 + 1;
    } else {
      tokens = lengths[size_t(doc[size_t(p0)])] - o0 + o1 + 1;
      for (int64_t p = p0 + 1; p < p1; ++p) tokens += lengths[size_t(doc[size_t(p)])];
    }
    if (tokens != seq_length_ + 1) return false;
  }
  // A permutation of [0, n_samples).
  std::vector<bool> hit(size_t(n_samples), false);
  for (int64_t v : shf) {
    if (v < 0 || v >= n_samples || hit[size_t(v)]) return false;
    hit[size_t(v)] = true;
  }
  document_index_ = std::move(doc);
  sample_index_ = std::move(smp);
  shuffle_index_ = std::move(shf);
  return true;
}

void GPTDataset::save_cache(const std::string& base) const {
  // The description goes last: its presence marks a complete set.
  const size_t n_samples = shuffle_index_.size();
  const bool ok =
      write_atomic(base + "-document_index.npy", npy_header("<i4", shape_1d(document_index_.size())),
                   document_index_.data(), document_index_.size() * sizeof(int32_t)) &&
      write_atomic(base + "-sample_index.npy", npy_header("<i8", shape_2d(n_samples + 1, 2)), sample_index_.data(),
                   sample_index_.size() * sizeof(int64_t)) &&
      write_atomic(base + "-shuffle_index.npy", npy_header("<i8", shape_1d(n_samples)), shuffle_index_.data(),
                   n_samples * sizeof(int64_t)) &&
      write_atomic(base + "-description.txt", unique_description_, nullptr, 0);
  if (!ok) user_error("--data-cache-path: cannot write the dataset index files ", base, "-*: ", std::strerror(errno));
}

namespace {
// The pieces of window k in order, as sample() reads them: f(sequence, begin, end) for each document slice
// [begin, end); the walk stops early when f returns true.
template <class F>
void walk_window(std::span<const int64_t> sample_index, std::span<const int32_t> document_index,
                 std::span<const int32_t> lengths, int64_t k, F&& f) {
  const int64_t p0 = sample_index[size_t(2 * k)], o0 = sample_index[size_t(2 * k + 1)];
  const int64_t p1 = sample_index[size_t(2 * k + 2)], o1 = sample_index[size_t(2 * k + 3)];
  for (int64_t p = p0; p <= p1; ++p) {
    const int32_t seq = document_index[size_t(p)];
    const int64_t begin = (p == p0) ? o0 : 0;
    const int64_t end = (p == p1) ? o1 + 1 : lengths[size_t(seq)];
    if (f(seq, begin, end)) return;
  }
}
}  // namespace

void GPTDataset::sample(int64_t index, int32_t* out) const {
  LOOM_CHECK(index >= 0 && index < size(), "[GPTDataset] sample ", index, " outside [0, ", size(), ") of ",
             data_->prefix(), " ", split_name(split_));
  const int64_t k = shuffle_index_[size_t(index)];
  int64_t written = 0;
  walk_window(sample_index_, document_index_, data_->sequence_lengths(), k,
              [&](int32_t seq, int64_t begin, int64_t end) {
                LOOM_CHECK(written + end - begin <= seq_length_ + 1, "[GPTDataset] window ", k, " overflows");
                if (end > begin) data_->read(seq, begin, end - begin, out + written);
                written += end - begin;
                return false;
              });
  LOOM_CHECK(written == seq_length_ + 1, "[GPTDataset] window ", k, " has ", written, " tokens, expected ",
             seq_length_ + 1);
}

std::string GPTDataset::locate(int64_t index, int64_t position) const {
  if (index < 0 || index >= size() || position < 0 || position > seq_length_) return {};
  // The walk of sample(): the window's sequences in order, until the one holding `position`.
  std::string where;
  int64_t at = 0;
  walk_window(sample_index_, document_index_, data_->sequence_lengths(), shuffle_index_[size_t(index)],
              [&](int32_t seq, int64_t begin, int64_t end) {
                if (position < at + end - begin) {
                  where = locate_token(*data_, seq, begin + position - at);
                  return true;
                }
                at += end - begin;
                return false;
              });
  return where;
}

std::string GPTDataset::description() const {
  std::ostringstream os;
  os << "GPTDataset(" << data_->prefix() << ", " << split_name(split_) << ", sequences [" << seq_begin_ << ", "
     << seq_end_ << "), " << size() << " samples, " << num_epochs_ << " epochs"
     << (separate_final_epoch_ ? ", separate final epoch" : "") << ")";
  return os.str();
}

}  // namespace loom

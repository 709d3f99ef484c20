// SftDataset (loom/data/sft_dataset.h): first-fit-decreasing packing over a max-tree of the sequences'
// free room (the leftmost sequence with room for a sample in O(log n)), per-epoch shuffles from --seed,
// and the per-position loss mask, positions and segments of a packed sequence.
#include "loom/data/sft_dataset.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <sstream>

#include "data/index_cache.h"
#include "loom/core/check.h"

namespace loom {

namespace fs = std::filesystem;

SftOverlong parse_sft_overlong(const std::string& s) {
  if (s == "truncate") return SftOverlong::kTruncate;
  if (s == "skip") return SftOverlong::kSkip;
  if (s == "error") return SftOverlong::kError;
  user_error("--sft-overlong: unknown policy '", s, "' (valid: truncate, skip, error)");
}

std::string sft_loss_mask_prefix(const std::string& prefix) { return prefix + "_loss_mask"; }

namespace {

// Leftmost slot whose value is >= need, over a fixed number of slots (values only grow by set()).
class MaxTree {
 public:
  explicit MaxTree(int64_t n) {
    while (size_ < n) size_ *= 2;
    t_.assign(size_t(2 * size_), 0);
  }
  void set(int64_t i, int64_t v) {
    int64_t k = i + size_;
    t_[size_t(k)] = v;
    for (k /= 2; k >= 1; k /= 2) t_[size_t(k)] = std::max(t_[size_t(2 * k)], t_[size_t(2 * k + 1)]);
  }
  int64_t get(int64_t i) const { return t_[size_t(i + size_)]; }
  // -1 when no slot has room.
  int64_t leftmost_at_least(int64_t need) const {
    if (t_[1] < need) return -1;
    int64_t k = 1;
    while (k < size_) k = t_[size_t(2 * k)] >= need ? 2 * k : 2 * k + 1;
    return k - size_;
  }

 private:
  int64_t size_ = 1;
  std::vector<int64_t> t_;
};

// Fisher-Yates with the raw outputs of mt19937_64 (std::shuffle's use of the engine is unspecified, so
// its order would differ between standard libraries).
void shuffle(std::vector<int64_t>& v, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[size_t(rng() % i)]);
}

}  // namespace

SftDataset::SftDataset(std::shared_ptr<const IndexedDataset> tokens, std::shared_ptr<const IndexedDataset> loss_mask,
                       int64_t doc_begin, int64_t doc_end, std::optional<int64_t> num_samples, const SftConfig& cfg,
                       const std::string& split_name)
    : tokens_(std::move(tokens)), mask_(std::move(loss_mask)), cfg_(cfg), split_name_(split_name) {
  const std::string& tp = tokens_->prefix();
  const std::string& mp = mask_->prefix();
  LOOM_CHECK(cfg_.seq_length > 0, "[SftDataset] seq_length must be > 0");
  // One sequence per document, the mask aligned with the tokens: what `loom preprocess --sft` writes.
  if (tokens_->num_sequences() != int64_t(tokens_->document_indices().size()) - 1)
    user_error(tp, ".idx: ", tokens_->num_sequences(), " sequences in ", tokens_->document_indices().size() - 1,
               " documents; an SFT dataset has one sequence per sample (write it with `loom preprocess --sft`)");
  if (mask_->num_sequences() != tokens_->num_sequences())
    user_error(mp, ".idx holds ", mask_->num_sequences(), " samples, ", tp, ".idx ", tokens_->num_sequences(),
               ": the loss mask does not belong to these tokens");
  const auto tl = tokens_->sequence_lengths(), ml = mask_->sequence_lengths();
  for (int64_t i = 0; i < tokens_->num_sequences(); ++i)
    if (tl[size_t(i)] != ml[size_t(i)])
      user_error(mp, ": sample ", i, " has ", ml[size_t(i)], " mask entries for ", tl[size_t(i)], " tokens in ", tp);
  // Everything the packing depends on; its hash names the cache files.
  nlohmann::ordered_json d;
  d["class"] = "SftDataset";
  d["dataset_path"] = tp;
  d["loss_mask_path"] = mp;
  d["document_range"] = {doc_begin, doc_end};
  d["num_documents"] = tokens_->num_sequences();
  std::vector<int32_t> range(tl.begin() + doc_begin, tl.begin() + doc_end);
  d["sequence_lengths_fnv1a64"] = hex64(fnv1a64(range.data(), range.size() * sizeof(int32_t)));
  d["sequence_length"] = cfg_.seq_length;
  d["packing"] = cfg_.packing ? "first_fit_decreasing" : "none";
  d["overlong"] = cfg_.overlong == SftOverlong::kTruncate ? "truncate" : cfg_.overlong == SftOverlong::kSkip ? "skip" : "error";
  d["loom_index_format"] = 1;
  description_ = d.dump(4);
  std::string base;
  if (cfg_.use_cache) {
    const bool explicit_dir = !cfg_.data_cache_path.empty();
    const std::string dir = explicit_dir ? cfg_.data_cache_path : tp + "/cache/SftDataset_indices";
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (!ec && fs::is_directory(dir, ec) && ::access(dir.c_str(), W_OK) == 0)
      cache_dir_ = dir;
    else if (explicit_dir)
      user_error("--data-cache-path '", dir, "' cannot be created or written", ec ? ": " + ec.message() : "");
    if (!cache_dir_.empty())
      base = cache_dir_ + "/" + hex64(fnv1a64(description_.data(), description_.size())) + "-SftDataset-" + split_name_;
  }
  // The description holds the overlong policy; a packing that failed (--sft-overlong error) wrote no cache.
  if (!base.empty() && load_cache(base, doc_begin, doc_end)) {
    loaded_from_cache_ = true;
  } else {
    pack(doc_begin, doc_end);
    if (!base.empty()) {
      try {
        save_cache(base);
      } catch (const UserError&) {
        if (!cfg_.data_cache_path.empty()) throw;
        cache_dir_.clear();
      }
    }
  }
  num_samples_ = num_samples.value_or(stats_.sequences);
  // The sample order: each epoch a permutation of the sequences from (seed, epoch), as many epochs as
  // the run draws.
  const int64_t S = stats_.sequences;
  std::vector<int64_t> perm(static_cast<size_t>(S));
  for (int64_t epoch = 0; int64_t(order_.size()) < num_samples_; ++epoch) {
    std::iota(perm.begin(), perm.end(), int64_t(0));
    shuffle(perm, (uint64_t(cfg_.seed) << 32) ^ uint64_t(epoch) ^ 0x5f7a1c3ull);
    order_.insert(order_.end(), perm.begin(), perm.end());
  }
  order_.resize(size_t(num_samples_));
}

void SftDataset::pack(int64_t doc_begin, int64_t doc_end) {
  const std::string& tp = tokens_->prefix();
  const auto tl = tokens_->sequence_lengths();
  const int64_t cap = cfg_.seq_length + 1;
  for (int64_t d = doc_begin; d < doc_end; ++d) {
    int64_t len = tl[size_t(d)];
    ++stats_.samples;
    if (len < 2) continue;  // nothing to predict
    if (len > cap) {
      if (cfg_.overlong == SftOverlong::kError)
        user_error(tp, ": sample ", d, " has ", len, " tokens, more than --seq-length + 1 = ", cap,
                   "; --sft-overlong truncate or skip handles such samples");
      if (cfg_.overlong == SftOverlong::kSkip) {
        ++stats_.skipped;
        continue;
      }
      ++stats_.truncated;
      len = cap;
    }
    docs_.push_back(d);
    lengths_.push_back(len);
    stats_.tokens += len;
    std::vector<int32_t> m(static_cast<size_t>(len));
    mask_->read(d, 0, len, m.data());
    for (int64_t j = 1; j < len; ++j) stats_.loss_tokens += m[size_t(j)] != 0;
  }
  if (docs_.empty())
    user_error(tp, ": the ", split_name_, " split (documents [", doc_begin, ", ", doc_end,
               ")) holds no sample with at least 2 tokens; change --split or the data");
  // Sequences: first-fit decreasing, or one sample each.
  std::vector<int64_t> order(docs_.size());
  std::iota(order.begin(), order.end(), int64_t(0));
  std::vector<std::vector<int64_t>> bins;
  if (cfg_.packing) {
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lengths_[size_t(a)] > lengths_[size_t(b)]; });
    MaxTree room(int64_t(order.size()));
    for (int64_t k : order) {
      const int64_t len = lengths_[size_t(k)];
      int64_t b = room.leftmost_at_least(len);
      if (b < 0) {
        b = int64_t(bins.size());
        bins.emplace_back();
        room.set(b, cap);
      }
      bins[size_t(b)].push_back(k);
      room.set(b, room.get(b) - len);
    }
  } else {
    for (int64_t k : order) bins.push_back({k});
  }
  seq_start_.push_back(0);
  for (const auto& b : bins) {
    bin_docs_.insert(bin_docs_.end(), b.begin(), b.end());
    seq_start_.push_back(int64_t(bin_docs_.size()));
  }
  stats_.sequences = int64_t(bins.size());
}

bool SftDataset::load_cache(const std::string& base, int64_t doc_begin, int64_t doc_end) {
  const std::optional<std::string> desc = read_file_if_present(base + "-description.txt");
  if (!desc || *desc != description_) return false;
  std::vector<int64_t> st;
  if (!read_npy(base + "-stats.npy", npy_header("<i8", shape_1d(6)), 6, st)) return false;
  const size_t n = size_t(st[0]), bins = size_t(st[1]);
  std::vector<int64_t> docs, lengths, starts, bin_docs;
  if (!read_npy(base + "-docs.npy", npy_header("<i8", shape_1d(n)), n, docs) ||
      !read_npy(base + "-lengths.npy", npy_header("<i8", shape_1d(n)), n, lengths) ||
      !read_npy(base + "-seq_start.npy", npy_header("<i8", shape_1d(bins + 1)), bins + 1, starts) ||
      !read_npy(base + "-bin_docs.npy", npy_header("<i8", shape_1d(n)), n, bin_docs))
    return false;
  // Kept documents increasing in the range, lengths that fit, sequences that tile a permutation.
  const auto tl = tokens_->sequence_lengths();
  const int64_t cap = cfg_.seq_length + 1;
  for (size_t k = 0; k < n; ++k) {
    if (docs[k] < doc_begin || docs[k] >= doc_end || (k > 0 && docs[k] <= docs[k - 1])) return false;
    if (lengths[k] < 2 || lengths[k] > cap || lengths[k] > tl[size_t(docs[k])]) return false;
  }
  if (n == 0 || bins == 0 || starts[0] != 0 || starts[bins] != int64_t(n)) return false;
  std::vector<bool> seen(n, false);
  for (size_t b = 0; b < bins; ++b) {
    if (starts[b + 1] <= starts[b]) return false;
    int64_t used = 0;
    for (int64_t i = starts[b]; i < starts[b + 1]; ++i) {
      const int64_t k = bin_docs[size_t(i)];
      if (k < 0 || k >= int64_t(n) || seen[size_t(k)]) return false;
      seen[size_t(k)] = true;
      used += lengths[size_t(k)];
    }
    if (used > cap) return false;
  }
  docs_ = std::move(docs);
  lengths_ = std::move(lengths);
  seq_start_ = std::move(starts);
  bin_docs_ = std::move(bin_docs);
  stats_.samples = st[2];
  stats_.truncated = st[3];
  stats_.skipped = st[4];
  stats_.loss_tokens = st[5];
  stats_.sequences = int64_t(bins);
  stats_.tokens = std::accumulate(lengths_.begin(), lengths_.end(), int64_t(0));
  return true;
}

void SftDataset::save_cache(const std::string& base) const {
  const std::vector<int64_t> st = {int64_t(docs_.size()), stats_.sequences, stats_.samples, stats_.truncated,
                                   stats_.skipped, stats_.loss_tokens};
  const auto put = [&](const char* name, const std::vector<int64_t>& v) {
    return write_atomic(base + name, npy_header("<i8", shape_1d(v.size())), v.data(), v.size() * sizeof(int64_t));
  };
  // The description goes last: its presence marks a complete set.
  const bool ok = put("-stats.npy", st) && put("-docs.npy", docs_) && put("-lengths.npy", lengths_) &&
                  put("-seq_start.npy", seq_start_) && put("-bin_docs.npy", bin_docs_) &&
                  write_atomic(base + "-description.txt", description_, nullptr, 0);
  if (!ok) user_error("--data-cache-path: cannot write the SFT packing files ", base, "-*: ", std::strerror(errno));
}

int64_t SftDataset::sequence_of(int64_t index) const {
  LOOM_CHECK(index >= 0 && index < num_samples_, "[SftDataset] sample ", index, " outside [0, ", num_samples_, ")");
  return order_[size_t(index)];
}

void SftDataset::layout(int64_t seq, std::vector<uint8_t>& answer, std::vector<int32_t>& owner) const {
  const int64_t cap = cfg_.seq_length + 1;
  answer.assign(size_t(cap), 0);
  owner.assign(size_t(cap), -1);
  std::vector<int32_t> m;
  int64_t at = 0;
  for (int64_t i = seq_start_[size_t(seq)]; i < seq_start_[size_t(seq) + 1]; ++i) {
    const int64_t k = bin_docs_[size_t(i)], len = lengths_[size_t(k)];
    m.resize(size_t(len));
    mask_->read(docs_[size_t(k)], 0, len, m.data());
    for (int64_t j = 0; j < len; ++j) {
      answer[size_t(at + j)] = m[size_t(j)] != 0;
      owner[size_t(at + j)] = int32_t(i - seq_start_[size_t(seq)]);
    }
    at += len;
  }
}

void SftDataset::sample(int64_t index, int32_t* out) const {
  const int64_t seq = sequence_of(index);
  std::fill(out, out + cfg_.seq_length + 1, cfg_.pad_id);
  int64_t at = 0;
  for (int64_t i = seq_start_[size_t(seq)]; i < seq_start_[size_t(seq) + 1]; ++i) {
    const int64_t k = bin_docs_[size_t(i)], len = lengths_[size_t(k)];
    tokens_->read(docs_[size_t(k)], 0, len, out + at);
    at += len;
  }
}

bool SftDataset::extras(int64_t index, float* loss_mask, int32_t* position_ids, int32_t* segment_ids) const {
  std::vector<int32_t> owner;
  std::vector<uint8_t> answer;
  layout(sequence_of(index), answer, owner);
  const int64_t T = cfg_.seq_length;
  int32_t seg = 0, pos = 0;
  for (int64_t j = 0; j < T; ++j) {
    if (j > 0 && owner[size_t(j)] != owner[size_t(j - 1)]) {
      ++seg;
      pos = 0;
    }
    segment_ids[j] = seg;
    position_ids[j] = pos++;
    const bool same = owner[size_t(j)] >= 0 && owner[size_t(j + 1)] == owner[size_t(j)];
    loss_mask[j] = same && answer[size_t(j + 1)] ? 1.0f : 0.0f;
  }
  return true;
}

std::string SftDataset::locate(int64_t index, int64_t position) const {
  if (index < 0 || index >= num_samples_ || position < 0 || position > cfg_.seq_length) return {};
  const int64_t seq = order_[size_t(index)];
  int64_t at = 0;
  for (int64_t i = seq_start_[size_t(seq)]; i < seq_start_[size_t(seq) + 1]; ++i) {
    const int64_t k = bin_docs_[size_t(i)], len = lengths_[size_t(k)];
    if (position < at + len) return locate_token(*tokens_, docs_[size_t(k)], position - at);
    at += len;
  }
  return "padding after the packed samples (the pad id " + std::to_string(cfg_.pad_id) + ")";
}

std::vector<int64_t> SftDataset::sequence_documents(int64_t seq) const {
  std::vector<int64_t> out;
  for (int64_t i = seq_start_[size_t(seq)]; i < seq_start_[size_t(seq) + 1]; ++i) out.push_back(docs_[size_t(bin_docs_[size_t(i)])]);
  return out;
}

std::array<std::shared_ptr<const SampleDataset>, 3> build_sft_datasets(const std::vector<std::string>& data_path,
                                                                       const std::array<int64_t, 3>& num_samples,
                                                                       const std::string& split, const SftConfig& cfg) {
  if (data_path.size() != 1)
    user_error("--sft takes one --data-path prefix (the _sft_document output of `loom preprocess --sft`), got ",
               data_path.size(), " words; blends of SFT sets are not supported");
  const std::string& prefix = data_path[0];
  std::shared_ptr<const IndexedDataset> tokens = IndexedDataset::open(prefix);
  std::shared_ptr<const IndexedDataset> mask = IndexedDataset::open(sft_loss_mask_prefix(prefix));
  const int64_t docs = int64_t(tokens->document_indices().size()) - 1;
  const SplitMatrix m = parse_split(split);
  std::array<std::shared_ptr<const SampleDataset>, 3> out;
  for (int s = 0; s < 3; ++s) {
    if (!m[size_t(s)] || num_samples[size_t(s)] <= 0) continue;
    const auto [b, e] = split_sequence_range(*m[size_t(s)], docs);
    if (e <= b) continue;
    out[size_t(s)] = std::make_shared<SftDataset>(tokens, mask, b, e, num_samples[size_t(s)], cfg,
                                                  split_name(Split(s)));
  }
  return out;
}

std::string SftDataset::description() const {
  std::ostringstream o;
  o << "SFT " << split_name_ << " " << tokens_->prefix() << ": " << docs_.size() << " samples "
    << (cfg_.packing ? "packed into " : "padded to ") << stats_.sequences << " sequences of " << cfg_.seq_length + 1
    << " tokens (" << stats_.tokens << " sample tokens, " << stats_.loss_tokens << " in the loss";
  if (stats_.truncated) o << "; " << stats_.truncated << " truncated";
  if (stats_.skipped) o << "; " << stats_.skipped << " skipped";
  o << ")";
  return o.str();
}

}  // namespace loom

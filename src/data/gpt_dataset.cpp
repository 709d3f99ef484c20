// Megatron-Core GPTDataset / BlendedDataset index building (see include/loom/data/gpt_dataset.h).
// Every floating-point step mirrors the Python it replaces (numpy's pairwise sum in normalize, Python's
// round-half-even in the split boundaries, int(0.8 * n) in the final-epoch rule, ceil of doubles in the
// blend sizes), and every random draw goes through NumpyRandomState in Megatron's order: document
// index shuffle(s) first, then shuffle index shuffle(s), all from one RandomState(seed).
// Cache files are .npy (numpy can open them) named like Megatron's; a file is used only when its
// description matches byte for byte and its contents pass the same structural checks a fresh build
// satisfies (sizes, value ranges, windows of exactly seq_length + 1 tokens, a true permutation).
#include "loom/data/gpt_dataset.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

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

namespace {

// Python's round() on a float: nearest integer, ties to even (independent of the FP rounding mode).
int64_t python_round(double x) {
  const double f = std::floor(x);
  const double diff = x - f;
  if (diff > 0.5) return int64_t(f) + 1;
  if (diff < 0.5) return int64_t(f);
  const auto fi = int64_t(f);
  return (fi % 2 == 0) ? fi : fi + 1;
}

// numpy's pairwise summation of float64 (used by numpy.sum), so normalised weights are the same doubles.
double numpy_pairwise_sum(const double* a, int64_t n) {
  if (n < 8) {
    double res = 0.0;
    for (int64_t i = 0; i < n; ++i) res += a[i];
    return res;
  }
  if (n <= 128) {
    double r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    int64_t i = 8;
    for (; i < n - (n % 8); i += 8)
      for (int j = 0; j < 8; ++j) r[j] += a[i + j];
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i];
    return res;
  }
  int64_t n2 = n / 2;
  n2 -= n2 % 8;
  return numpy_pairwise_sum(a, n2) + numpy_pairwise_sum(a + n2, n - n2);
}

// Python float(): the whole token must parse.
bool parse_double(const std::string& s, double& out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  out = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() && errno != ERANGE;
}

// w * x - c with the product rounded before the subtraction, as numpy and Megatron's helpers.cpp
// compute it; the volatile stops the compiler from fusing it into an FMA under -march=native.
double mul_sub_unfused(double w, double x, double c) {
  volatile double p = w * x;
  return p - c;
}

uint64_t fnv1a64(const void* data, size_t n, uint64_t h = 1469598103934665603ULL) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// ---- .npy files (format 1.0, little-endian, C order) -----------------------------------------------

std::string npy_header(const char* descr, const std::string& shape) {
  std::string dict = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  const size_t unpadded = 10 + dict.size() + 1;  // magic(6) + version(2) + length(2) + dict + '\n'
  dict.append((64 - unpadded % 64) % 64, ' ');
  dict.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(char(dict.size() & 0xff));
  out.push_back(char(dict.size() >> 8));
  return out + dict;
}

// Python's repr of the shape tuple, as numpy.save writes it.
std::string shape_1d(size_t n) {
  std::ostringstream os;
  os << '(' << n << ",)";
  return os.str();
}
std::string shape_2d(size_t n, size_t m) {
  std::ostringstream os;
  os << '(' << n << ", " << m << ')';
  return os.str();
}

// Writes header + payload to path atomically (core/file_io.h); false (leaving nothing) on any failure:
// the cache is an optimisation, and a read-only data directory must not stop a run.
bool write_atomic(const std::string& path, const std::string& header, const void* data, size_t bytes) {
  return try_write_file_atomic(path, [&](int fd) {
    return write_all(fd, header.data(), header.size()) && (bytes == 0 || write_all(fd, data, bytes));
  });
}

// Loads an .npy written by write_atomic with exactly the expected header (dtype and shape).
template <typename T>
bool read_npy(const std::string& path, const std::string& header, size_t count, std::vector<T>& out) {
  const std::optional<std::string> file = read_file_if_present(path);
  if (!file) return false;
  const std::string& bytes = *file;
  if (bytes.size() != header.size() + count * sizeof(T)) return false;
  if (bytes.compare(0, header.size(), header) != 0) return false;
  out.resize(count);
  if (count > 0) std::memcpy(out.data(), bytes.data() + header.size(), count * sizeof(T));
  return true;
}

}  // namespace

// ---- split and blend arguments ---------------------------------------------------------------------

SplitMatrix parse_split(const std::string& split) {
  // Megatron takes every run of digits and dots as a number (re.findall(r"[.0-9]+")).
  std::vector<double> w;
  for (size_t i = 0; i < split.size();) {
    if (std::isdigit(static_cast<unsigned char>(split[i])) || split[i] == '.') {
      size_t j = i;
      while (j < split.size() && (std::isdigit(static_cast<unsigned char>(split[j])) || split[j] == '.')) ++j;
      double v;
      if (!parse_double(split.substr(i, j - i), v))
        user_error("--split '", split, "': '", split.substr(i, j - i), "' is not a number");
      w.push_back(v);
      i = j;
    } else {
      ++i;
    }
  }
  if (w.size() > 3) user_error("--split '", split, "' has ", w.size(), " weights; give at most 3 (train,valid,test)");
  w.resize(3, 0.0);
  const std::vector<double> n = normalize_weights(w);
  if (!std::isfinite(n[0]) || !std::isfinite(n[1]) || !std::isfinite(n[2]))
    user_error("--split '", split, "' needs at least one positive weight, e.g. 949,50,1");
  SplitMatrix m;
  double begin = 0.0;
  for (int i = 0; i < 3; ++i) {
    const double end = begin + n[size_t(i)];  // cumulative, left to right, as functools.reduce does
    if (end > begin) m[size_t(i)] = std::make_pair(begin, end);
    begin = end;
  }
  return m;
}

std::pair<int64_t, int64_t> split_sequence_range(std::pair<double, double> bookends, int64_t num_sequences) {
  return {python_round(bookends.first * double(num_sequences)),
          python_round(bookends.second * double(num_sequences))};
}

std::vector<std::string> split_whitespace(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  std::string item;
  while (in >> item) out.push_back(item);
  return out;
}

DataBlend parse_data_path(const std::vector<std::string>& items) {
  if (items.empty()) user_error("--data-path is empty; give a prefix or 'weight prefix' pairs");
  DataBlend b;
  bool weighted = items.size() % 2 == 0;
  if (weighted) {
    // Megatron: weights only if every even entry is a number; a mix of numbers and names is an error.
    int numbers = 0;
    for (size_t i = 0; i < items.size(); i += 2) {
      double v;
      numbers += parse_double(items[i], v) ? 1 : 0;
    }
    if (numbers != 0 && numbers != int(items.size() / 2))
      user_error("--data-path mixes weights and prefixes; give either 'prefix ...' or 'weight prefix ...'");
    weighted = numbers != 0;
  }
  if (!weighted) {
    b.prefixes = items;
    return b;
  }
  for (size_t i = 0; i < items.size(); i += 2) {
    double v = 0;
    parse_double(items[i], v);
    if (!std::isfinite(v) || v < 0)
      user_error("--data-path weight '", items[i], "' for ", items[i + 1], " must be a finite number >= 0");
    b.weights.push_back(v);
    b.prefixes.push_back(items[i + 1]);
  }
  double total = 0;
  for (double v : b.weights) total += v;
  if (!(total > 0)) user_error("--data-path weights are all zero");
  return b;
}

std::vector<double> normalize_weights(const std::vector<double>& w) {
  const double sum = numpy_pairwise_sum(w.data(), int64_t(w.size()));
  std::vector<double> out(w.size());
  for (size_t i = 0; i < w.size(); ++i) out[i] = w[i] / sum;
  return out;
}

int64_t blend_component_samples(int64_t target, double weight, double surplus) {
  const double planned = std::ceil(double(target) * weight);
  return int64_t(std::ceil(planned * (1.0 + surplus)));
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

void GPTDataset::sample(int64_t index, int32_t* out) const {
  LOOM_CHECK(index >= 0 && index < size(), "[GPTDataset] sample ", index, " outside [0, ", size(), ") of ",
             data_->prefix(), " ", split_name(split_));
  const int64_t k = shuffle_index_[size_t(index)];
  const int64_t p0 = sample_index_[size_t(2 * k)], o0 = sample_index_[size_t(2 * k + 1)];
  const int64_t p1 = sample_index_[size_t(2 * k + 2)], o1 = sample_index_[size_t(2 * k + 3)];
  const auto lengths = data_->sequence_lengths();
  int64_t written = 0;
  for (int64_t p = p0; p <= p1; ++p) {
    const int32_t seq = document_index_[size_t(p)];
    const int64_t begin = (p == p0) ? o0 : 0;
    const int64_t end = (p == p1) ? o1 + 1 : lengths[size_t(seq)];
    LOOM_CHECK(written + end - begin <= seq_length_ + 1, "[GPTDataset] window ", k, " overflows");
    if (end > begin) data_->read(seq, begin, end - begin, out + written);
    written += end - begin;
  }
  LOOM_CHECK(written == seq_length_ + 1, "[GPTDataset] window ", k, " has ", written, " tokens, expected ",
             seq_length_ + 1);
}

std::string GPTDataset::description() const {
  std::ostringstream os;
  os << "GPTDataset(" << data_->prefix() << ", " << split_name(split_) << ", sequences [" << seq_begin_ << ", "
     << seq_end_ << "), " << size() << " samples, " << num_epochs_ << " epochs"
     << (separate_final_epoch_ ? ", separate final epoch" : "") << ")";
  return os.str();
}

// ---- BlendedDataset ---------------------------------------------------------------------------------

BlendedDataset::BlendedDataset(std::vector<std::shared_ptr<const SampleDataset>> datasets, std::vector<double> weights,
                               std::optional<int64_t> size)
    : datasets_(std::move(datasets)) {
  const auto n = int64_t(datasets_.size());
  LOOM_CHECK(n > 0 && n < 32767 && int64_t(weights.size()) == n, "[BlendedDataset] ", n, " datasets, ",
             weights.size(), " weights");
  for (const auto& d : datasets_) {
    LOOM_CHECK(d != nullptr && d->seq_length() == datasets_[0]->seq_length(), "[BlendedDataset] component mismatch");
  }
  weights_ = normalize_weights(weights);
  std::vector<int64_t> count(size_t(n), 0);
  if (size) {
    // helpers.cpp build_blending_indices: each sample goes to the dataset with the largest
    // weight * max(i, 1) - drawn so far (first one on ties).
    dataset_index_.resize(size_t(*size));
    dataset_sample_index_.resize(size_t(*size));
    for (int64_t i = 0; i < *size; ++i) {
      const double x = std::max(double(i), 1.0);
      int64_t best = 0;
      double best_err = mul_sub_unfused(weights_[0], x, double(count[0]));
      for (int64_t d = 1; d < n; ++d) {
        const double err = mul_sub_unfused(weights_[size_t(d)], x, double(count[size_t(d)]));
        if (err > best_err) best_err = err, best = d;
      }
      dataset_index_[size_t(i)] = int16_t(best);
      dataset_sample_index_[size_t(i)] = count[size_t(best)]++;
    }
  } else {
    // build_exhaustive_blending_indices: the same greedy rule with weights = lengths, each dataset
    // leaving the race once all its samples are drawn. (Empty components never enter it.)
    std::vector<int64_t> sizes(static_cast<size_t>(n));
    int64_t total = 0;
    for (int64_t d = 0; d < n; ++d) total += sizes[size_t(d)] = datasets_[size_t(d)]->size();
    std::vector<double> w(static_cast<size_t>(n));
    for (int64_t d = 0; d < n; ++d) w[size_t(d)] = double(sizes[size_t(d)]) / double(total);
    std::set<int64_t> unspent;
    for (int64_t d = 0; d < n; ++d)
      if (sizes[size_t(d)] > 0) unspent.insert(d);
    for (int64_t i = 0; !unspent.empty(); ++i) {
      const double x = std::max(double(i), 1.0);
      int64_t best = -1;
      double best_err = std::numeric_limits<double>::lowest();
      for (int64_t d : unspent) {
        const double err = mul_sub_unfused(w[size_t(d)], x, double(count[size_t(d)]));
        if (err > best_err) best_err = err, best = d;
      }
      dataset_index_.push_back(int16_t(best));
      dataset_sample_index_.push_back(count[size_t(best)]++);
      if (count[size_t(best)] == sizes[size_t(best)]) unspent.erase(best);
    }
  }
  for (int64_t d = 0; d < n; ++d)
    if (count[size_t(d)] > datasets_[size_t(d)]->size())
      user_error("--data-path: the blend draws ", count[size_t(d)], " samples from ",
                 datasets_[size_t(d)]->description(), " which has ", datasets_[size_t(d)]->size(),
                 "; raise --mid-level-dataset-surplus");
}

void BlendedDataset::sample(int64_t index, int32_t* out) const {
  LOOM_CHECK(index >= 0 && index < size(), "[BlendedDataset] sample ", index, " outside [0, ", size(), ")");
  datasets_[size_t(dataset_index_[size_t(index)])]->sample(dataset_sample_index_[size_t(index)], out);
}

std::string BlendedDataset::description() const {
  std::ostringstream os;
  os << "BlendedDataset(" << size() << " samples from";
  for (size_t d = 0; d < datasets_.size(); ++d) os << (d ? ", " : " ") << weights_[d] << " x " << datasets_[d]->description();
  os << ")";
  return os.str();
}

// ---- builder ----------------------------------------------------------------------------------------

std::array<std::shared_ptr<const SampleDataset>, 3> build_gpt_datasets(
    const std::vector<std::string>& data_path, const std::array<std::optional<int64_t>, 3>& num_samples,
    const GPTDatasetConfig& cfg, const IndexedDatasetOpener& open) {
  const DataBlend blend = parse_data_path(data_path);
  SplitMatrix matrix = parse_split(cfg.split);
  // A split nobody draws from (0 samples) is not built; the other splits keep their document ranges.
  for (size_t i = 0; i < 3; ++i)
    if (num_samples[i] && *num_samples[i] == 0) matrix[i].reset();
  std::map<std::string, std::shared_ptr<const IndexedDataset>> opened;
  auto get = [&](const std::string& prefix) {
    auto& slot = opened[prefix];
    if (!slot) slot = open ? open(prefix) : std::shared_ptr<const IndexedDataset>(IndexedDataset::open(prefix));
    LOOM_CHECK(slot != nullptr, "[build_gpt_datasets] opener returned null for ", prefix);
    return slot;
  };
  // One prefix's split datasets, each with its own sample count (nullopt: one epoch).
  auto build_splits = [&](const std::string& prefix, const std::array<std::optional<int64_t>, 3>& sizes) {
    std::array<std::shared_ptr<const GPTDataset>, 3> out;
    auto data = get(prefix);
    for (size_t i = 0; i < 3; ++i) {
      if (!matrix[i]) continue;
      const auto [b, e] = split_sequence_range(*matrix[i], data->num_sequences());
      out[i] = std::make_shared<GPTDataset>(data, Split(i), b, e, sizes[i], cfg);
    }
    return out;
  };

  std::array<std::shared_ptr<const SampleDataset>, 3> result;
  const size_t P = blend.prefixes.size();
  if (P == 1 && blend.weights.empty()) {
    const auto ds = build_splits(blend.prefixes[0], num_samples);
    for (size_t i = 0; i < 3; ++i) result[i] = ds[i];
    return result;
  }

  std::vector<double> weights;
  std::vector<std::array<std::optional<int64_t>, 3>> target(P), buffer(P);
  if (!blend.weights.empty()) {
    weights = normalize_weights(blend.weights);
    for (size_t i = 0; i < 3; ++i) {
      if (!matrix[i]) continue;
      if (!num_samples[i])
        user_error("--data-path with weights needs a sample count for the ", split_name(Split(i)), " split");
      for (size_t d = 0; d < P; ++d) {
        target[d][i] = int64_t(std::ceil(double(*num_samples[i]) * weights[d]));
        buffer[d][i] = blend_component_samples(*num_samples[i], weights[d], cfg.mid_level_dataset_surplus);
      }
    }
  }
  std::vector<std::array<std::shared_ptr<const GPTDataset>, 3>> parts;
  for (size_t d = 0; d < P; ++d) parts.push_back(build_splits(blend.prefixes[d], buffer[d]));

  for (size_t i = 0; i < 3; ++i) {
    if (!matrix[i]) continue;
    std::vector<std::shared_ptr<const SampleDataset>> comps;
    for (size_t d = 0; d < P; ++d) comps.push_back(parts[d][i]);
    std::optional<int64_t> size;
    std::vector<double> w = weights;
    if (!weights.empty()) {
      int64_t s = 0;
      for (size_t d = 0; d < P; ++d) s += *target[d][i];
      size = s;
    } else {
      // Unweighted: blend by component length, at most every sample once.
      int64_t total = 0;
      for (const auto& c : comps) {
        w.push_back(double(c->size()));
        total += c->size();
      }
      if (num_samples[i]) size = std::min(*num_samples[i], total);
    }
    result[i] = std::make_shared<BlendedDataset>(std::move(comps), std::move(w), size);
  }
  return result;
}

}  // namespace loom

// Megatron-Core's split and blend arguments, BlendedDataset and the dataset builder (see
// include/loom/data/gpt_dataset.h): --split into per-split fractions and sequence ranges, --data-path into
// prefixes and weights, the greedy blending indices, and build_gpt_datasets assembling the GPTDatasets
// (gpt_dataset.cpp) into each split's dataset. Every floating-point step mirrors the Python it replaces
// (numpy's pairwise sum in normalize, Python's round-half-even in the split boundaries, ceil of doubles in
// the blend sizes, the unfused w * x - c of helpers.cpp in the blending indices).
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "loom/core/check.h"
#include "loom/data/gpt_dataset.h"

namespace loom {

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

std::string BlendedDataset::locate(int64_t index, int64_t position) const {
  if (index < 0 || index >= size()) return {};
  return datasets_[size_t(dataset_index_[size_t(index)])]->locate(dataset_sample_index_[size_t(index)], position);
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

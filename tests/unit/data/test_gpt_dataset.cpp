// GPTDataset / BlendedDataset against independent references: numpy's RandomState itself for the
// shuffles, tests/golden/gpt_dataset_reference.py (numpy, written from Megatron's rules) for the split
// ranges, the three index arrays and the first 1000 token windows of single, separate-final-epoch and
// blended datasets; plus the on-disk cache (hit, stale, corrupt, numpy-readable) and the UserErrors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "data/numpy_random.h"
#include "loom/core/check.h"
#include "loom/data/gpt_dataset.h"

using namespace loom;
namespace fs = std::filesystem;

namespace {

// IndexedDataset over vectors; the same sequences are written as raw .lengths/.tokens for Python.
class MemIndexedDataset final : public IndexedDataset {
 public:
  MemIndexedDataset(std::string prefix, std::vector<std::vector<int32_t>> seqs) : prefix_(std::move(prefix)) {
    doc_.push_back(0);
    for (auto& s : seqs) {
      lengths_.push_back(int32_t(s.size()));
      starts_.push_back(int64_t(tokens_.size()));
      tokens_.insert(tokens_.end(), s.begin(), s.end());
      doc_.push_back(int64_t(lengths_.size()));
    }
  }
  IndexDType dtype() const override { return IndexDType::kI32; }
  int64_t num_sequences() const override { return int64_t(lengths_.size()); }
  std::span<const int32_t> sequence_lengths() const override { return lengths_; }
  std::span<const int64_t> document_indices() const override { return doc_; }
  void read(int64_t seq, int64_t offset, int64_t length, int32_t* out) const override {
    LOOM_CHECK(seq >= 0 && seq < num_sequences() && offset >= 0 && offset + length <= lengths_[size_t(seq)],
               "[MemIndexedDataset] bad read ", seq, " ", offset, " ", length);
    std::copy_n(tokens_.begin() + starts_[size_t(seq)] + offset, length, out);
  }
  const std::string& prefix() const override { return prefix_; }

  void write_raw() const {
    std::ofstream(prefix_ + ".lengths", std::ios::binary)
        .write(reinterpret_cast<const char*>(lengths_.data()), std::streamsize(lengths_.size() * 4));
    std::ofstream(prefix_ + ".tokens", std::ios::binary)
        .write(reinterpret_cast<const char*>(tokens_.data()), std::streamsize(tokens_.size() * 4));
  }

 private:
  std::string prefix_;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> starts_, doc_;
  std::vector<int32_t> tokens_;
};

std::shared_ptr<MemIndexedDataset> random_corpus(const std::string& prefix, int n_seq, int min_len, int max_len,
                                                 uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<std::vector<int32_t>> seqs(static_cast<size_t>(n_seq));
  for (auto& s : seqs) {
    s.resize(size_t(min_len + int(g() % uint32_t(max_len - min_len + 1))));
    for (auto& t : s) t = int32_t(g() % 50000u);
  }
  return std::make_shared<MemIndexedDataset>(prefix, std::move(seqs));
}

std::string make_temp_dir() {
  char name[] = "/tmp/loom_gptds_XXXXXX";
  EXPECT_NE(mkdtemp(name), nullptr);
  return name;
}

int run(const std::string& cmd) { return std::system(cmd.c_str()); }

template <typename T>
std::vector<T> read_raw(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(bool(in)) << path;
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<T> v(bytes.size() / sizeof(T));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(T));
  return v;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

std::vector<int32_t> window(const SampleDataset& ds, int64_t i) {
  std::vector<int32_t> w(size_t(ds.seq_length() + 1));
  ds.sample(i, w.data());
  return w;
}

template <typename F>
std::string user_error_text(F&& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "<no UserError>";
}

}  // namespace

// ---- numpy RandomState ----------------------------------------------------------------------------

TEST(NumpyRandom, RawDrawsShuffleAndIntervalMatchNumpy) {
  const std::string dir = make_temp_dir();
  const std::vector<uint32_t> seeds = {0, 1, 42, 1234, 4294967295u};
  const std::vector<int64_t> sizes = {1, 2, 3, 10, 1000, 100003};
  const std::vector<uint64_t> maxes = {1, 5, 1000, 0xfffffffeULL, 0xffffffffULL, 0x100000000ULL,
                                       (1ULL << 40) + 12345, 0xfffffffffffffffeULL};
  std::ostringstream py;
  py << "import numpy as np\nout=open('" << dir << "/np.txt','w')\n"
     << "for s in [0,1,42,1234,4294967295]:\n"
     << "  out.write(' '.join(map(str, np.random.RandomState(s).randint(0, 2**32, size=50, dtype=np.uint32))) + '\\n')\n"
     << "  for n in [1,2,3,10,1000,100003]:\n"
     << "    a = np.arange(n, dtype=np.int64); np.random.RandomState(s).shuffle(a)\n"
     << "    out.write(' '.join(map(str, a[:200])) + ' ' + str(int((a * np.arange(n)).sum())) + '\\n')\n"
     << "  rs = np.random.RandomState(s)\n"
     << "  for m in [1,5,1000,0xfffffffe,0xffffffff,0x100000000,(1<<40)+12345,0xfffffffffffffffe]:\n"
     << "    out.write(' '.join(map(str, rs.randint(0, m + 1, size=20, dtype=np.uint64))) + '\\n')\n";
  std::ofstream(dir + "/np.py") << py.str();
  ASSERT_EQ(run("/usr/bin/python3 " + dir + "/np.py"), 0);
  std::ifstream in(dir + "/np.txt");
  int checked = 0;
  for (uint32_t seed : seeds) {
    std::string line;
    std::getline(in, line);
    std::istringstream raw(line);
    detail::NumpyRandomState r(seed);
    for (int i = 0; i < 50; ++i) {
      uint64_t expect;
      raw >> expect;
      ASSERT_EQ(r.next_uint32(), expect) << "seed " << seed << " draw " << i;
      ++checked;
    }
    for (int64_t n : sizes) {
      std::getline(in, line);
      std::istringstream ref(line);
      std::vector<int64_t> a(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) a[size_t(i)] = i;
      detail::NumpyRandomState rs(seed);
      rs.shuffle(std::span<int64_t>(a));
      for (int64_t i = 0; i < std::min<int64_t>(n, 200); ++i) {
        int64_t expect;
        ref >> expect;
        ASSERT_EQ(a[size_t(i)], expect) << "seed " << seed << " n " << n << " position " << i;
        ++checked;
      }
      int64_t weighted = 0, expect_weighted;
      for (int64_t i = 0; i < n; ++i) weighted += a[size_t(i)] * i;
      ref >> expect_weighted;
      EXPECT_EQ(weighted, expect_weighted) << "whole permutation, seed " << seed << " n " << n;
    }
    detail::NumpyRandomState rs(seed);
    for (uint64_t m : maxes) {
      std::getline(in, line);
      std::istringstream ref(line);
      for (int i = 0; i < 20; ++i) {
        uint64_t expect;
        ref >> expect;
        ASSERT_EQ(rs.random_interval(m), expect) << "seed " << seed << " max " << m;
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 5 * (50 + (1 + 2 + 3 + 10 + 200 + 200) + 8 * 20));
  fs::remove_all(dir);
}

// ---- split / data-path arguments --------------------------------------------------------------------

TEST(GPTDatasetArgs, SplitRangesMatchPython) {
  const std::string dir = make_temp_dir();
  const std::vector<std::string> splits = {"949,50,1", "969, 30, 1", "98,2", "1,1", "1,1,2", "0.9,0.1,0",
                                           "100,0,0", "3 2 1", "1,1,1"};
  const std::vector<int64_t> sizes = {1, 2, 3, 5, 7, 100, 500, 1000, 2000, 12345, 1000003};
  nlohmann::json spec;
  spec["split_checks"] = nlohmann::json::array();
  for (const auto& s : splits) spec["split_checks"].push_back({{"split", s}, {"sizes", sizes}});
  std::ofstream(dir + "/spec.json") << spec.dump();
  ASSERT_EQ(run("/usr/bin/python3 " LOOM_SOURCE_DIR "/tests/golden/gpt_dataset_reference.py " + dir + "/spec.json " +
                dir),
            0);
  const auto ref = read_json(dir + "/split_checks.json");
  ASSERT_EQ(ref.size(), splits.size());
  for (size_t k = 0; k < splits.size(); ++k) {
    const SplitMatrix m = parse_split(splits[k]);
    for (size_t j = 0; j < sizes.size(); ++j) {
      for (size_t i = 0; i < 3; ++i) {
        const auto& r = ref[k]["ranges"][j][i];
        ASSERT_EQ(r.is_null(), !m[i].has_value()) << splits[k] << " split " << i;
        if (r.is_null()) continue;
        const auto [b, e] = split_sequence_range(*m[i], sizes[j]);
        EXPECT_EQ(b, r[0].get<int64_t>()) << splits[k] << " S=" << sizes[j] << " split " << i;
        EXPECT_EQ(e, r[1].get<int64_t>()) << splits[k] << " S=" << sizes[j] << " split " << i;
      }
    }
  }
  // Python's round() ties to even: "1,1" over 5 sequences puts 2.5 -> 2 in train, not 3.
  EXPECT_EQ(split_sequence_range(*parse_split("1,1")[0], 5).second, 2);
  EXPECT_EQ(split_sequence_range(*parse_split("1,1")[0], 3).second, 2);
  EXPECT_FALSE(parse_split("100,0,0")[1].has_value());
  fs::remove_all(dir);
}

TEST(GPTDatasetArgs, ParseErrorsNameTheFlag) {
  EXPECT_NE(user_error_text([] { parse_split("0,0,0"); }).find("--split"), std::string::npos);
  EXPECT_NE(user_error_text([] { parse_split("1,2,3,4"); }).find("--split"), std::string::npos);
  EXPECT_NE(user_error_text([] { parse_split("1..2,3"); }).find("--split"), std::string::npos);
  EXPECT_NE(user_error_text([] { parse_data_path({"0.5", "a", "b", "0.5"}); }).find("--data-path"), std::string::npos);
  EXPECT_NE(user_error_text([] { parse_data_path({"-1", "a", "2", "b"}); }).find("--data-path"), std::string::npos);
  EXPECT_NE(user_error_text([] { parse_data_path({"0", "a", "0", "b"}); }).find("--data-path"), std::string::npos);
  EXPECT_NE(user_error_text([] { parse_data_path({}); }).find("--data-path"), std::string::npos);

  const DataBlend w = parse_data_path(split_whitespace("  30 /d/a\t70 /d/b "));
  EXPECT_EQ(w.prefixes, (std::vector<std::string>{"/d/a", "/d/b"}));
  EXPECT_EQ(w.weights, (std::vector<double>{30, 70}));
  const DataBlend u = parse_data_path({"/d/a", "/d/b"});  // even count but no numbers: plain prefixes
  EXPECT_EQ(u.prefixes.size(), 2u);
  EXPECT_TRUE(u.weights.empty());
  EXPECT_TRUE(parse_data_path({"/d/a", "/d/b", "/d/c"}).weights.empty());
  // numpy.sum is pairwise; (a + b) + c here, so 1e16 + 1 + 1 normalises with the sum 1e16.
  EXPECT_EQ(normalize_weights({1e16, 1, 1})[0], 1.0);
  EXPECT_EQ(blend_component_samples(1000, 0.3, 0.005), 302);  // ceil(ceil(300.0) * 1.005) = 302
  EXPECT_EQ(blend_component_samples(7, 0.5, 0.005), 5);       // ceil(ceil(3.5) * 1.005) = ceil(4.02)
}

// ---- golden comparison with the Python reference ---------------------------------------------------

class GPTDatasetGolden : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = make_temp_dir();
    // Three corpora; sizes chosen so that 949,50,1 leaves every split at least one sequence.
    corpora_["ds0"] = random_corpus(dir_ + "/ds0", 2000, 2, 60, 11);
    corpora_["ds1"] = random_corpus(dir_ + "/ds1", 1500, 2, 120, 12);
    corpora_["ds2"] = random_corpus(dir_ + "/ds2", 900, 2, 30, 13);
    for (auto& [_, c] : corpora_) c->write_raw();
  }
  void TearDown() override { fs::remove_all(dir_); }

  IndexedDatasetOpener opener() {
    return [this](const std::string& prefix) -> std::shared_ptr<const IndexedDataset> {
      for (auto& [_, c] : corpora_)
        if (c->prefix() == prefix) return c;
      return nullptr;
    };
  }
  std::string p(const std::string& name) const { return dir_ + "/" + name; }

  struct Case {
    std::string name;
    std::vector<std::string> data_path;
    std::string split;
    std::array<int64_t, 3> num_samples;
    Split which;
  };

  // Tokens per epoch of the train split of ds0 under 949,50,1 (for picking sample counts).
  int64_t train_tokens_ds0() {
    const auto [b, e] = split_sequence_range(*parse_split("949,50,1")[0], 2000);
    int64_t t = 0;
    for (int64_t s = b; s < e; ++s) t += corpora_["ds0"]->sequence_lengths()[size_t(s)];
    return t;
  }

  void run_reference(const std::vector<Case>& cases) {
    nlohmann::json spec;
    spec["cases"] = nlohmann::json::array();
    for (const auto& c : cases)
      spec["cases"].push_back({{"name", c.name}, {"data_path", c.data_path}, {"split", c.split},
                               {"seq_length", kT}, {"seed", kSeed}, {"num_samples", c.num_samples},
                               {"which", split_name(c.which)}, {"count", 1000}, {"surplus", 0.005}});
    std::ofstream(dir_ + "/spec.json") << spec.dump();
    ASSERT_EQ(run("/usr/bin/python3 " LOOM_SOURCE_DIR "/tests/golden/gpt_dataset_reference.py " + dir_ +
                  "/spec.json " + dir_),
              0);
  }

  std::shared_ptr<const SampleDataset> build(const Case& c, const std::string& cache = "") {
    GPTDatasetConfig cfg;
    cfg.seq_length = kT;
    cfg.seed = kSeed;
    cfg.split = c.split;
    cfg.use_cache = !cache.empty();
    cfg.data_cache_path = cache;
    const auto all = build_gpt_datasets(c.data_path, {c.num_samples[0], c.num_samples[1], c.num_samples[2]}, cfg,
                                        opener());
    return all[size_t(c.which)];
  }

  // Compares one case with the reference output; returns the number of windows compared.
  int64_t compare(const Case& c, const SampleDataset& ds) {
    const auto meta = read_json(dir_ + "/" + c.name + ".json");
    EXPECT_EQ(ds.size(), meta["size"].get<int64_t>()) << c.name;
    const int64_t count = meta["count"].get<int64_t>();
    EXPECT_EQ(count, 1000) << c.name << ": fewer than 1000 samples";
    const auto windows = read_raw<int32_t>(dir_ + "/" + c.name + ".windows");
    EXPECT_EQ(int64_t(windows.size()), count * (kT + 1));
    for (int64_t i = 0; i < count; ++i) {
      const auto w = window(ds, i);
      if (!std::equal(w.begin(), w.end(), windows.begin() + i * (kT + 1))) {
        ADD_FAILURE() << c.name << ": window " << i << " differs";
        return i;
      }
    }
    const std::string base = dir_ + "/" + c.name;
    if (const auto* g = dynamic_cast<const GPTDataset*>(&ds)) {
      EXPECT_EQ(g->num_epochs(), meta["epochs"][0].get<int64_t>()) << c.name;
      EXPECT_EQ(g->separate_final_epoch(), meta["separate"][0].get<bool>()) << c.name;
      const auto doc = read_raw<int64_t>(base + ".document_index");
      EXPECT_TRUE(std::equal(doc.begin(), doc.end(), g->document_index().begin(), g->document_index().end()))
          << c.name << " document_index";
      const auto smp = read_raw<int64_t>(base + ".sample_index");
      EXPECT_TRUE(std::equal(smp.begin(), smp.end(), g->sample_index().begin(), g->sample_index().end()))
          << c.name << " sample_index";
      const auto shf = read_raw<int64_t>(base + ".shuffle_index");
      EXPECT_TRUE(std::equal(shf.begin(), shf.end(), g->shuffle_index().begin(), g->shuffle_index().end()))
          << c.name << " shuffle_index";
    } else {
      const auto& b = dynamic_cast<const BlendedDataset&>(ds);
      const auto di = read_raw<int64_t>(base + ".dataset_index");
      const auto dsi = read_raw<int64_t>(base + ".dataset_sample_index");
      for (int64_t i = 0; i < count; ++i) {
        EXPECT_EQ(b.dataset_index()[size_t(i)], di[size_t(i)]) << c.name << " dataset_index " << i;
        EXPECT_EQ(b.dataset_sample_index()[size_t(i)], dsi[size_t(i)]) << c.name << " dataset_sample_index " << i;
      }
      for (size_t d = 0; d < b.datasets().size(); ++d) {
        const auto& g = dynamic_cast<const GPTDataset&>(*b.datasets()[d]);
        EXPECT_EQ(g.num_epochs(), meta["epochs"][d].get<int64_t>()) << c.name << " part " << d;
        EXPECT_EQ(g.separate_final_epoch(), meta["separate"][d].get<bool>()) << c.name << " part " << d;
        EXPECT_EQ(g.size(), meta["part_sizes"][d].get<int64_t>()) << c.name << " part " << d;
      }
    }
    return count;
  }

  static constexpr int64_t kT = 32;
  static constexpr uint64_t kSeed = 1234;
  std::string dir_;
  std::map<std::string, std::shared_ptr<MemIndexedDataset>> corpora_;
};

TEST_F(GPTDatasetGolden, FirstThousandSamplesMatchReference) {
  // Sample counts that land the final (3rd) epoch above and below Megatron's 80% threshold.
  const int64_t tpe = train_tokens_ds0();
  const int64_t per_epoch = (tpe - 1) / kT, sans = (2 * tpe - 1) / kT;
  const int64_t n_joint = sans + per_epoch * 95 / 100, n_separate = sans + per_epoch * 30 / 100;
  const std::vector<Case> cases = {
      {"single_train", {p("ds0")}, "949,50,1", {n_joint, 1000, 50}, Split::kTrain},
      {"single_valid", {p("ds0")}, "949,50,1", {n_joint, 1000, 50}, Split::kValid},
      {"single_separate", {p("ds0")}, "949,50,1", {n_separate, 1000, 50}, Split::kTrain},
      {"blend3_train", {"0.5", p("ds0"), "0.3", p("ds1"), "0.2", p("ds2")}, "949,50,1", {6000, 1200, 100},
       Split::kTrain},
      {"blend3_valid", {"0.5", p("ds0"), "0.3", p("ds1"), "0.2", p("ds2")}, "949,50,1", {6000, 1200, 100},
       Split::kValid},
      {"weighted1_train", {"1", p("ds1")}, "98,2", {1500, 1000, 0}, Split::kTrain},
      // Weights from lengths: a component with 0 windows would still be picked once the others run
      // ahead (Megatron then fails too), so this blend has no tiny test split.
      {"unweighted3_train", {p("ds0"), p("ds1"), p("ds2")}, "90,10", {2500, 1000, 0}, Split::kTrain},
  };
  run_reference(cases);
  int64_t compared = 0;
  for (const auto& c : cases) {
    const auto ds = build(c);
    ASSERT_NE(ds, nullptr) << c.name;
    compared += compare(c, *ds);
  }
  EXPECT_EQ(compared, 1000 * int64_t(cases.size()));

  // Both branches of the final-epoch rule were exercised, with 3 epochs each.
  const auto joint = std::dynamic_pointer_cast<const GPTDataset>(build(cases[0]));
  const auto separate = std::dynamic_pointer_cast<const GPTDataset>(build(cases[2]));
  EXPECT_EQ(joint->num_epochs(), 3);
  EXPECT_FALSE(joint->separate_final_epoch());
  EXPECT_EQ(separate->num_epochs(), 3);
  EXPECT_TRUE(separate->separate_final_epoch());
  // Separate final epoch: the first `sans` shuffled positions never reach into the last epoch.
  for (int64_t i = 0; i < sans; ++i) ASSERT_LT(separate->shuffle_index()[size_t(i)], sans);
}

TEST_F(GPTDatasetGolden, WindowsAreTheShuffledFlatStream) {
  // Implementation-independent view of the sample index: window k = stream[k*T, k*T + T], where the
  // stream is the documents in document_index order.
  const Case c{"x", {p("ds2")}, "1", {700, 0, 0}, Split::kTrain};
  const auto ds = std::dynamic_pointer_cast<const GPTDataset>(build(c));
  ASSERT_NE(ds, nullptr);
  std::vector<int32_t> stream;
  for (int32_t d : ds->document_index()) {
    std::vector<int32_t> seq(size_t(corpora_["ds2"]->sequence_lengths()[size_t(d)]));
    corpora_["ds2"]->read(d, 0, int64_t(seq.size()), seq.data());
    stream.insert(stream.end(), seq.begin(), seq.end());
  }
  EXPECT_EQ(int64_t(stream.size()), ds->num_epochs() * ds->tokens_per_epoch());
  EXPECT_EQ(ds->size(), (int64_t(stream.size()) - 1) / kT);
  EXPECT_GE(ds->size(), 700);
  std::vector<bool> seen(size_t(ds->size()), false);
  for (int64_t i = 0; i < ds->size(); ++i) {
    const int64_t k = ds->shuffle_index()[size_t(i)];
    ASSERT_FALSE(seen[size_t(k)]);
    seen[size_t(k)] = true;
    const auto w = window(*ds, i);
    ASSERT_TRUE(std::equal(w.begin(), w.end(), stream.begin() + k * kT)) << "window " << i;
  }
}

TEST_F(GPTDatasetGolden, RealIndexedFilesGiveTheSameSamples) {
  // The same sequences written as Megatron .bin/.idx and opened by the default opener.
  const auto& mem = *corpora_["ds2"];
  {
    IndexedDatasetWriter w(p("real"), IndexDType::kU16);
    for (int64_t s = 0; s < mem.num_sequences(); ++s) {
      std::vector<int32_t> seq(size_t(mem.sequence_lengths()[size_t(s)]));
      mem.read(s, 0, int64_t(seq.size()), seq.data());
      w.add_sequence(seq);
      w.end_document();
    }
    w.finalize();
  }
  GPTDatasetConfig cfg;
  cfg.seq_length = kT;
  cfg.split = "949,50,1";
  cfg.data_cache_path = dir_ + "/real_cache";
  const auto real = build_gpt_datasets({p("real")}, {800, 100, 10}, cfg);
  const auto ref = build(Case{"m", {p("ds2")}, "949,50,1", {800, 100, 10}, Split::kTrain});
  ASSERT_EQ(real[0]->size(), ref->size());
  for (int64_t i = 0; i < ref->size(); ++i) ASSERT_EQ(window(*real[0], i), window(*ref, i)) << "sample " << i;
  EXPECT_TRUE(std::dynamic_pointer_cast<const GPTDataset>(build_gpt_datasets({p("real")}, {800, 100, 10}, cfg)[0])
                  ->loaded_from_cache());
}

TEST_F(GPTDatasetGolden, CacheHitStaleCorruptAndNumpyReadable) {
  const std::string cache = dir_ + "/cache";
  const Case c{"cached", {p("ds0")}, "949,50,1", {3000, 200, 10}, Split::kTrain};
  const auto first = std::dynamic_pointer_cast<const GPTDataset>(build(c, cache));
  ASSERT_NE(first, nullptr);
  EXPECT_FALSE(first->loaded_from_cache());
  EXPECT_EQ(first->cache_dir(), cache);
  std::vector<std::string> npy;
  int descriptions = 0;
  for (const auto& e : fs::directory_iterator(cache)) {
    const std::string f = e.path().string();
    ASSERT_EQ(f.find(".tmp."), std::string::npos) << "temporary left behind: " << f;
    if (f.ends_with("-description.txt")) ++descriptions;
    if (f.find("-GPTDataset-train-") != std::string::npos && f.ends_with(".npy")) npy.push_back(f);
  }
  EXPECT_EQ(descriptions, 3);  // train, valid, test
  ASSERT_EQ(npy.size(), 3u);

  auto same_as_first = [&](const GPTDataset& g) {
    return std::ranges::equal(g.document_index(), first->document_index()) &&
           std::ranges::equal(g.sample_index(), first->sample_index()) &&
           std::ranges::equal(g.shuffle_index(), first->shuffle_index());
  };
  const auto second = std::dynamic_pointer_cast<const GPTDataset>(build(c, cache));
  EXPECT_TRUE(second->loaded_from_cache());
  EXPECT_TRUE(same_as_first(*second));
  EXPECT_EQ(window(*second, 17), window(*first, 17));

  // numpy reads the files and sees the same arrays.
  const std::string base = npy[0].substr(0, npy[0].rfind('-'));
  ASSERT_EQ(run("/usr/bin/python3 -c \"import numpy as np; b='" + base + "'; "
                "[np.load(b + '-' + k + '.npy').astype(np.int64).tofile(b + '.' + k) "
                "for k in ['document_index', 'sample_index', 'shuffle_index']]\""),
            0);
  EXPECT_TRUE(std::ranges::equal(read_raw<int64_t>(base + ".document_index"),
                                 std::vector<int64_t>(first->document_index().begin(), first->document_index().end())));
  EXPECT_TRUE(std::ranges::equal(read_raw<int64_t>(base + ".sample_index"), first->sample_index()));
  EXPECT_TRUE(std::ranges::equal(read_raw<int64_t>(base + ".shuffle_index"), first->shuffle_index()));

  // Corrupt: a duplicated shuffle entry (right size, wrong content) is detected and rebuilt.
  const std::string shuffle_file = base + "-shuffle_index.npy";
  {
    std::fstream f(shuffle_file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-8, std::ios::end);
    const int64_t dup = first->shuffle_index()[0];
    f.write(reinterpret_cast<const char*>(&dup), 8);
  }
  const auto third = std::dynamic_pointer_cast<const GPTDataset>(build(c, cache));
  EXPECT_FALSE(third->loaded_from_cache());
  EXPECT_TRUE(same_as_first(*third));
  EXPECT_TRUE(std::dynamic_pointer_cast<const GPTDataset>(build(c, cache))->loaded_from_cache());  // rewritten
  // Truncated.
  fs::resize_file(base + "-sample_index.npy", fs::file_size(base + "-sample_index.npy") - 16);
  const auto fourth = std::dynamic_pointer_cast<const GPTDataset>(build(c, cache));
  EXPECT_FALSE(fourth->loaded_from_cache());
  EXPECT_TRUE(same_as_first(*fourth));
  // Stale: another sample count or another corpus under the same prefix is a different key.
  const Case more{"cached", {p("ds0")}, "949,50,1", {3001, 200, 10}, Split::kTrain};
  EXPECT_FALSE(std::dynamic_pointer_cast<const GPTDataset>(build(more, cache))->loaded_from_cache());
  corpora_["ds0"] = random_corpus(p("ds0"), 2000, 2, 60, 99);
  const auto regenerated = std::dynamic_pointer_cast<const GPTDataset>(build(c, cache));
  EXPECT_FALSE(regenerated->loaded_from_cache());
  EXPECT_NE(regenerated->unique_description(), first->unique_description());
}

TEST_F(GPTDatasetGolden, DefaultCacheDirNextToPrefixOrOff) {
  GPTDatasetConfig cfg;
  cfg.seq_length = kT;
  const auto data = corpora_["ds2"];
  GPTDataset a(data, Split::kTrain, 0, 900, 100, cfg);
  EXPECT_EQ(a.cache_dir(), p("ds2") + "/cache/GPTDataset_indices");
  EXPECT_TRUE(fs::is_directory(a.cache_dir()));
  GPTDataset b(data, Split::kTrain, 0, 900, 100, cfg);
  EXPECT_TRUE(b.loaded_from_cache());
  // Not creatable: silently no cache. An explicit --data-cache-path that cannot be used is an error.
  const auto elsewhere = std::make_shared<MemIndexedDataset>("/proc/loom_no_such_dir/ds", std::vector<std::vector<int32_t>>{
                                                                                              {1, 2, 3, 4, 5, 6}});
  GPTDataset c(elsewhere, Split::kTrain, 0, 1, 2, cfg);
  EXPECT_TRUE(c.cache_dir().empty());
  EXPECT_EQ(c.size(), 2);
  cfg.data_cache_path = "/proc/loom_no_such_dir";
  EXPECT_NE(user_error_text([&] { GPTDataset(elsewhere, Split::kTrain, 0, 1, 2, cfg); }).find("--data-cache-path"),
            std::string::npos);
}

TEST_F(GPTDatasetGolden, ImpossibleCountsAreUserErrors) {
  GPTDatasetConfig cfg;
  cfg.seq_length = kT;
  cfg.use_cache = false;
  cfg.split = "949,50,1";
  // 10 sequences: the test split gets [10, 10).
  const auto tiny = random_corpus(p("tiny"), 10, 5, 9, 3);
  const auto err = user_error_text([&] {
    build_gpt_datasets({tiny->prefix()}, {100, 10, 10}, cfg, [&](const std::string&) { return tiny; });
  });
  EXPECT_NE(err.find("--split"), std::string::npos) << err;
  EXPECT_NE(err.find("test"), std::string::npos) << err;
  const auto empty = std::make_shared<MemIndexedDataset>(p("empty"), std::vector<std::vector<int32_t>>{{}, {}});
  EXPECT_NE(user_error_text([&] { GPTDataset(empty, Split::kTrain, 0, 2, 10, cfg); }).find("--split"),
            std::string::npos);
  cfg.split = "1";
  EXPECT_NE(user_error_text([&] {
              build_gpt_datasets({"1", tiny->prefix(), "1", tiny->prefix()}, {std::nullopt, 5, 5}, cfg,
                                 [&](const std::string&) { return tiny; });
            }).find("--data-path"),
            std::string::npos);
  cfg.seed = 1ULL << 32;
  EXPECT_NE(user_error_text([&] { GPTDataset(tiny, Split::kTrain, 0, 10, 10, cfg); }).find("--seed"),
            std::string::npos);
}

// ---- BlendedDataset on synthetic components --------------------------------------------------------

namespace {
class CountingDataset final : public SampleDataset {
 public:
  CountingDataset(int64_t n, int32_t tag) : n_(n), tag_(tag) {}
  int64_t size() const override { return n_; }
  int64_t seq_length() const override { return 3; }
  void sample(int64_t i, int32_t* out) const override {
    for (int t = 0; t < 4; ++t) out[t] = tag_ * 1000 + int32_t(i);
  }
  std::string description() const override { return "counting"; }

 private:
  int64_t n_;
  int32_t tag_;
};
}  // namespace

TEST(BlendedDataset, GreedyOrderExhaustiveAndOverdraw) {
  std::vector<std::shared_ptr<const SampleDataset>> parts = {std::make_shared<CountingDataset>(1000, 1),
                                                             std::make_shared<CountingDataset>(1000, 2),
                                                             std::make_shared<CountingDataset>(1000, 3)};
  BlendedDataset b(parts, {5, 3, 2}, 1000);
  // By hand: i=0 (x=1) errors .5/.3/.2 -> 0; i=1 (x=1) -.5/.3/.2 -> 1; i=2 (x=2) 0/-.4/.4 -> 2;
  // i=3 (x=3) .5/-.1/-.4 -> 0.
  EXPECT_EQ(std::vector<int16_t>(b.dataset_index().begin(), b.dataset_index().begin() + 4),
            (std::vector<int16_t>{0, 1, 2, 0}));
  std::array<int64_t, 3> count{};
  for (int64_t i = 0; i < 1000; ++i) {
    const int d = b.dataset_index()[size_t(i)];
    EXPECT_EQ(b.dataset_sample_index()[size_t(i)], count[size_t(d)]++);
    if (i > 0) {
      for (int k = 0; k < 3; ++k) EXPECT_LE(std::abs(double(count[size_t(k)]) - b.weights()[size_t(k)] * double(i + 1)), 1.0);
    }
  }
  EXPECT_EQ(count, (std::array<int64_t, 3>{500, 300, 200}));
  std::array<int32_t, 4> w{};
  b.sample(3, w.data());
  EXPECT_EQ(w[0], 1001);  // dataset 0, its second sample

  // Exhaustive (no size): every sample of every component exactly once.
  std::vector<std::shared_ptr<const SampleDataset>> uneven = {std::make_shared<CountingDataset>(7, 1),
                                                              std::make_shared<CountingDataset>(0, 2),
                                                              std::make_shared<CountingDataset>(20, 3)};
  BlendedDataset e(uneven, {7, 0, 20}, std::nullopt);
  ASSERT_EQ(e.size(), 27);
  std::array<int64_t, 3> ec{};
  for (int64_t i = 0; i < e.size(); ++i) {
    const int d = e.dataset_index()[size_t(i)];
    EXPECT_EQ(e.dataset_sample_index()[size_t(i)], ec[size_t(d)]++);
  }
  EXPECT_EQ(ec, (std::array<int64_t, 3>{7, 0, 20}));

  std::vector<std::shared_ptr<const SampleDataset>> small = {std::make_shared<CountingDataset>(10, 1),
                                                             std::make_shared<CountingDataset>(10, 2)};
  EXPECT_NE(user_error_text([&] { BlendedDataset(small, {1, 1}, 30); }).find("--data-path"), std::string::npos);
}

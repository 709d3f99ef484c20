// SftDataset (loom/data/sft_dataset.h) on small token/mask datasets written here: first-fit-decreasing
// packing against a plain reference, the per-position loss mask (answer labels of the same sample only),
// positions restarting and segments per sample, padding, the overlong policies, per-epoch shuffles,
// padded mode, the split, and errors for a mask that does not match the tokens.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "loom/core/check.h"
#include "loom/data/indexed_dataset.h"
#include "loom/data/sft_dataset.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

struct Sample {
  int prompt = 0, answer = 0;  // token counts
};

class SftFiles {
 public:
  explicit SftFiles(const std::vector<Sample>& samples) {
    dir_ = (fs::temp_directory_path() / ("loom_sft_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++))).string();
    fs::create_directories(dir_);
    prefix_ = dir_ + "/s_sft_document";
    IndexedDatasetWriter tok(prefix_, IndexDType::kI32), mask(sft_loss_mask_prefix(prefix_), IndexDType::kU8);
    for (size_t d = 0; d < samples.size(); ++d) {
      std::vector<int32_t> t, m;
      for (int i = 0; i < samples[d].prompt + samples[d].answer; ++i) {
        t.push_back(int32_t(1000 * (d + 1)) + i);  // sample d's tokens: 1000 (d + 1) + position
        m.push_back(i >= samples[d].prompt ? 1 : 0);
      }
      tok.add_sequence(t);
      tok.end_document();
      mask.add_sequence(m);
      mask.end_document();
    }
    tok.finalize();
    mask.finalize();
  }
  ~SftFiles() { fs::remove_all(dir_); }
  std::shared_ptr<const IndexedDataset> tokens() const { return IndexedDataset::open(prefix_); }
  std::shared_ptr<const IndexedDataset> mask() const { return IndexedDataset::open(sft_loss_mask_prefix(prefix_)); }
  const std::string& prefix() const { return prefix_; }

 private:
  static inline int counter_ = 0;
  std::string dir_, prefix_;
};

SftConfig config(int64_t T, bool packing = true, SftOverlong o = SftOverlong::kTruncate) {
  SftConfig c;
  c.seq_length = T;
  c.packing = packing;
  c.overlong = o;
  c.seed = 7;
  c.pad_id = 9;
  return c;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "no error";
}

TEST(SftDataset, FirstFitDecreasingMatchesAPlainReference) {
  // Lengths 2..24 in a scrambled order; capacity T + 1 = 32.
  std::vector<Sample> s;
  for (int k = 0; k < 40; ++k) s.push_back({1 + (k * 7) % 5, 1 + (k * 11) % 19});
  SftFiles f(s);
  const SftDataset ds(f.tokens(), f.mask(), 0, int64_t(s.size()), std::nullopt, config(31), "train");
  // Reference FFD: longest first (ties by document order), first sequence with room.
  std::vector<int64_t> order(s.size());
  std::iota(order.begin(), order.end(), 0);
  auto len = [&](int64_t d) { return int64_t(s[size_t(d)].prompt + s[size_t(d)].answer); };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return len(a) > len(b); });
  std::vector<std::vector<int64_t>> bins;
  std::vector<int64_t> room;
  for (int64_t d : order) {
    size_t b = 0;
    while (b < bins.size() && room[b] < len(d)) ++b;
    if (b == bins.size()) {
      bins.emplace_back();
      room.push_back(32);
    }
    bins[b].push_back(d);
    room[b] -= len(d);
  }
  ASSERT_EQ(ds.stats().sequences, int64_t(bins.size()));
  for (size_t b = 0; b < bins.size(); ++b) EXPECT_EQ(ds.sequence_documents(int64_t(b)), bins[b]) << "sequence " << b;
  EXPECT_EQ(ds.size(), int64_t(bins.size()));  // one epoch
}

TEST(SftDataset, LossMaskPositionsAndSegmentsOfAPackedSequence) {
  // Two samples fit one sequence of 16 + 1: (prompt 3, answer 4) and (prompt 2, answer 5); 3 pads.
  SftFiles f({{3, 4}, {2, 5}});
  const SftDataset ds(f.tokens(), f.mask(), 0, 2, std::nullopt, config(16), "train");
  ASSERT_EQ(ds.stats().sequences, 1);
  ASSERT_EQ(ds.sequence_documents(0), (std::vector<int64_t>{0, 1}));  // equal lengths: document order
  std::vector<int32_t> tok(17);
  ds.sample(0, tok.data());
  const std::vector<int32_t> want_tok = {1000, 1001, 1002, 1003, 1004, 1005, 1006, 2000, 2001, 2002, 2003, 2004,
                                         2005, 2006, 9, 9, 9};
  EXPECT_EQ(tok, want_tok);
  std::vector<float> mask(16);
  std::vector<int32_t> pos(16), seg(16);
  ASSERT_TRUE(ds.extras(0, mask.data(), pos.data(), seg.data()));
  // Label j is token j + 1: in the loss iff it is an answer token of the same sample. Sample 0's answer
  // is tokens 3..6 (labels at 2..5); the label at 6 is sample 1's first token; sample 1's answer is its
  // tokens 2..6 = positions 9..13 (labels at 8..12); the label at 13 is padding.
  const std::vector<float> want_mask = {0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0};
  EXPECT_EQ(mask, want_mask);
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 0, 1}));
  EXPECT_EQ(seg, (std::vector<int32_t>{0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2}));
  EXPECT_EQ(ds.stats().loss_tokens, 4 + 5);
}

TEST(SftDataset, PaddedModeAndOverlongPolicies) {
  SftFiles f({{2, 3}, {4, 20}, {1, 2}});  // sample 1 has 24 tokens > T + 1 = 9
  const SftDataset padded(f.tokens(), f.mask(), 0, 3, std::nullopt, config(8, false), "train");
  EXPECT_EQ(padded.stats().sequences, 3);  // one sample each
  EXPECT_EQ(padded.stats().truncated, 1);
  EXPECT_EQ(padded.sequence_documents(1), (std::vector<int64_t>{1}));
  std::vector<int32_t> tok(9);
  for (int64_t i = 0; i < 3; ++i) {  // find sample 1's sequence: truncated to its first 9 tokens
    padded.sample(i, tok.data());
    if (tok[0] == 2000) {
      EXPECT_EQ(tok.back(), 2008);
    }
  }
  const SftDataset skipped(f.tokens(), f.mask(), 0, 3, std::nullopt, config(8, true, SftOverlong::kSkip), "train");
  EXPECT_EQ(skipped.stats().skipped, 1);
  EXPECT_EQ(skipped.stats().sequences, 1);  // 5 + 3 tokens share one sequence
  const std::string err =
      error_of([&] { SftDataset(f.tokens(), f.mask(), 0, 3, std::nullopt, config(8, true, SftOverlong::kError), "train"); });
  EXPECT_NE(err.find("sample 1 has 24 tokens, more than --seq-length + 1 = 9"), std::string::npos) << err;
  EXPECT_NE(err.find(f.prefix()), std::string::npos) << err;
  EXPECT_THROW(parse_sft_overlong("drop"), UserError);
}

TEST(SftDataset, EpochsReshuffleDeterministicallyAndSplitsAreDisjoint) {
  std::vector<Sample> s(30, Sample{3, 3});
  SftFiles f(s);
  const SftDataset ds(f.tokens(), f.mask(), 0, 30, 45, config(11), "train");  // 2 samples per sequence
  ASSERT_EQ(ds.stats().sequences, 15);
  ASSERT_EQ(ds.size(), 45);  // three epochs
  std::vector<int32_t> tok(12);
  std::vector<std::set<int32_t>> epochs(3);
  std::vector<int32_t> order;
  for (int64_t i = 0; i < 45; ++i) {
    ds.sample(i, tok.data());
    epochs[size_t(i / 15)].insert(tok[0]);
    order.push_back(tok[0]);
  }
  for (const auto& e : epochs) EXPECT_EQ(e.size(), 15u);  // every sequence once per epoch
  EXPECT_NE(std::vector<int32_t>(order.begin(), order.begin() + 15), std::vector<int32_t>(order.begin() + 15, order.begin() + 30));
  const SftDataset again(f.tokens(), f.mask(), 0, 30, 45, config(11), "train");
  for (int64_t i = 0; i < 45; ++i) {
    again.sample(i, tok.data());
    EXPECT_EQ(tok[0], order[size_t(i)]);
  }
  const auto three = build_sft_datasets({f.prefix()}, {10, 5, 0}, "80,20,0", config(11));
  ASSERT_TRUE(three[0] && three[1]);
  EXPECT_FALSE(three[2]);
  EXPECT_NE(three[0]->description().find("24 samples"), std::string::npos) << three[0]->description();
  EXPECT_NE(three[1]->description().find("6 samples"), std::string::npos) << three[1]->description();
  EXPECT_NE(error_of([&] { build_sft_datasets({"1", f.prefix(), "1", f.prefix()}, {1, 0, 0}, "1", config(11)); })
                .find("--sft takes one --data-path prefix"),
            std::string::npos);
}

// The packing is cached like the GPT indices: a second dataset of the same split loads it (same
// sequences), a corrupted file is rebuilt, and another --seq-length is another cache entry.
TEST(SftDataset, PackingIsCachedAndValidatedOnLoad) {
  std::vector<Sample> s;
  for (int k = 0; k < 25; ++k) s.push_back({1 + k % 4, 2 + (k * 5) % 9});
  SftFiles f(s);
  const SftDataset first(f.tokens(), f.mask(), 0, 25, std::nullopt, config(20), "train");
  EXPECT_FALSE(first.loaded_from_cache());
  ASSERT_FALSE(first.cache_dir().empty());
  const SftDataset second(f.tokens(), f.mask(), 0, 25, std::nullopt, config(20), "train");
  EXPECT_TRUE(second.loaded_from_cache());
  ASSERT_EQ(second.stats().sequences, first.stats().sequences);
  EXPECT_EQ(second.stats().loss_tokens, first.stats().loss_tokens);
  for (int64_t q = 0; q < first.stats().sequences; ++q) EXPECT_EQ(second.sequence_documents(q), first.sequence_documents(q));
  // Corrupt every cached bin list: the load is refused and the packing rebuilt (and rewritten).
  for (const auto& e : fs::directory_iterator(first.cache_dir()))
    if (e.path().string().ends_with("-bin_docs.npy")) {
      std::string bytes;
      {
        std::ifstream in(e.path(), std::ios::binary);
        bytes.assign(std::istreambuf_iterator<char>(in), {});
      }
      bytes[bytes.size() - 8] = 0x7f;  // an index out of range
      std::ofstream(e.path(), std::ios::binary) << bytes;
    }
  const SftDataset third(f.tokens(), f.mask(), 0, 25, std::nullopt, config(20), "train");
  EXPECT_FALSE(third.loaded_from_cache());
  EXPECT_EQ(third.sequence_documents(0), first.sequence_documents(0));
  EXPECT_TRUE(SftDataset(f.tokens(), f.mask(), 0, 25, std::nullopt, config(20), "train").loaded_from_cache());
  EXPECT_FALSE(SftDataset(f.tokens(), f.mask(), 0, 25, std::nullopt, config(24), "train").loaded_from_cache());
}

TEST(SftDataset, AMaskThatDoesNotMatchTheTokensIsAnError) {
  SftFiles a({{2, 3}, {1, 4}});
  SftFiles b({{2, 3}, {1, 5}});
  const std::string err = error_of([&] { SftDataset(a.tokens(), b.mask(), 0, 2, std::nullopt, config(8), "train"); });
  EXPECT_NE(err.find("sample 1 has 6 mask entries for 5 tokens"), std::string::npos) << err;
  SftFiles c({{2, 3}});
  EXPECT_NE(error_of([&] { SftDataset(a.tokens(), c.mask(), 0, 2, std::nullopt, config(8), "train"); })
                .find("the loss mask does not belong to these tokens"),
            std::string::npos);
}

}  // namespace
}  // namespace loom

// Checking data before training on it: where a sample's token comes from (locate_token and the datasets'
// locate(), checked against the files' own tokens), IndexedDataset::inspect listing every structural
// problem, and check_indexed_dataset's figures (documents, tokens, id range, length histogram) and problems
// (ids outside the vocabulary with file, document and offset; negative ids; empty documents; SFT masks).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>

#include "loom/core/check.h"
#include "loom/data/data_check.h"
#include "loom/data/gpt_dataset.h"
#include "loom/data/indexed_dataset.h"
#include "loom/data/sft_dataset.h"

using namespace loom;
namespace fs = std::filesystem;

namespace {

using Doc = std::vector<std::vector<int32_t>>;  // sequences of one document

class DataCheck : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("loom_datacheck_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  static void write(const std::string& prefix, IndexDType dt, const std::vector<Doc>& docs) {
    IndexedDatasetWriter w(prefix, dt);
    for (const Doc& d : docs) {
      for (const auto& s : d) w.add_sequence(s);
      w.end_document();
    }
    w.finalize();
  }
  fs::path dir_;
};

// (document, token of the document, token of the file) from a locate() text.
struct Place {
  int64_t doc = -1, in_doc = -1, in_file = -1;
};
Place parse_place(const std::string& s) {
  static const std::regex re(R"(\.bin: document (\d+), token (\d+) of the document \(token (\d+) of the file\))");
  std::smatch m;
  if (!std::regex_search(s, m, re)) return {};
  return {std::stoll(m[1]), std::stoll(m[2]), std::stoll(m[3])};
}

// Documents of several sequences, empty documents and empty-free sequences, random lengths.
std::vector<Doc> random_docs(uint32_t seed, int n) {
  std::mt19937 g(seed);
  std::vector<Doc> docs(static_cast<size_t>(n));
  for (Doc& d : docs) {
    const int seqs = int(g() % 4);  // 0: an empty document
    for (int s = 0; s < seqs; ++s) {
      std::vector<int32_t> t(1 + g() % 9);
      for (auto& x : t) x = int32_t(g() % 30000);
      d.push_back(t);
    }
  }
  return docs;
}

}  // namespace

TEST_F(DataCheck, GptDatasetLocatePointsAtTheSampleToken) {
  const std::vector<Doc> docs = random_docs(7, 60);
  write(path("d"), IndexDType::kU16, docs);
  std::shared_ptr<const IndexedDataset> ds = IndexedDataset::open(path("d"));
  // The file's tokens in order, and each document's.
  std::vector<int32_t> file;
  std::vector<std::vector<int32_t>> by_doc;
  for (const Doc& d : docs) {
    by_doc.emplace_back();
    for (const auto& s : d) {
      file.insert(file.end(), s.begin(), s.end());
      by_doc.back().insert(by_doc.back().end(), s.begin(), s.end());
    }
  }
  GPTDatasetConfig cfg;
  cfg.seq_length = 7;
  cfg.use_cache = false;
  auto gpt = std::make_shared<GPTDataset>(ds, Split::kTrain, 0, ds->num_sequences(), 40, cfg);
  std::vector<int32_t> w(8);
  for (int64_t i = 0; i < gpt->size(); ++i) {
    gpt->sample(i, w.data());
    for (int64_t t = 0; t <= 7; ++t) {
      const std::string where = gpt->locate(i, t);
      const Place p = parse_place(where);
      ASSERT_GE(p.doc, 0) << where;
      EXPECT_EQ(where.rfind(path("d") + ".bin: ", 0), 0u) << where;
      ASSERT_LT(size_t(p.in_file), file.size());
      EXPECT_EQ(file[size_t(p.in_file)], w[size_t(t)]) << "sample " << i << " position " << t << ": " << where;
      ASSERT_LT(size_t(p.doc), by_doc.size());
      ASSERT_LT(size_t(p.in_doc), by_doc[size_t(p.doc)].size()) << where;
      EXPECT_EQ(by_doc[size_t(p.doc)][size_t(p.in_doc)], w[size_t(t)]) << where;
    }
  }
  EXPECT_EQ(gpt->locate(0, 8), "");  // past the window
  EXPECT_EQ(gpt->locate(gpt->size(), 0), "");

  // A blend names the component the sample came from.
  auto other = std::make_shared<GPTDataset>(ds, Split::kTrain, 0, ds->num_sequences(), 40, cfg);
  BlendedDataset blend({gpt, other}, {0.5, 0.5}, 20);
  for (int64_t i = 0; i < blend.size(); ++i) {
    blend.sample(i, w.data());
    const Place p = parse_place(blend.locate(i, 5));
    ASSERT_GE(p.in_file, 0);
    EXPECT_EQ(file[size_t(p.in_file)], w[5]);
  }
}

TEST_F(DataCheck, SftDatasetLocateNamesTheSampleOrThePadding) {
  write(path("s"), IndexDType::kU16, {{{1, 2, 3}}, {{4, 5}}, {{6, 7, 8, 9}}});
  write(path("s_loss_mask"), IndexDType::kU8, {{{0, 1, 1}}, {{0, 1}}, {{0, 0, 1, 1}}});
  SftConfig cfg;
  cfg.seq_length = 9;
  cfg.use_cache = false;
  SftDataset sft(IndexedDataset::open(path("s")), IndexedDataset::open(path("s_loss_mask")), 0, 3, std::nullopt, cfg,
                 "train");
  ASSERT_EQ(sft.size(), 1);  // 9 tokens packed into one sequence of 10
  std::vector<int32_t> w(10);
  sft.sample(0, w.data());
  std::vector<int32_t> file = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  for (int64_t t = 0; t < 9; ++t) {
    const Place p = parse_place(sft.locate(0, t));
    ASSERT_GE(p.in_file, 0) << sft.locate(0, t);
    EXPECT_EQ(file[size_t(p.in_file)], w[size_t(t)]);
  }
  EXPECT_NE(sft.locate(0, 9).find("padding"), std::string::npos) << sft.locate(0, 9);
}

TEST_F(DataCheck, LocateTokenCountsEarlierSequencesOfTheDocument) {
  write(path("l"), IndexDType::kI32, {{{1, 2}}, {}, {{3}, {4, 5, 6}}, {{7}}});
  const auto ds = IndexedDataset::open(path("l"));
  // Sequence 2 = the second sequence of document 2; its token 1 is the document's token 2, the file's 4.
  EXPECT_EQ(locate_token(*ds, 2, 1), path("l") + ".bin: document 2, token 2 of the document (token 4 of the file)");
  EXPECT_EQ(locate_token(*ds, 3, 0), path("l") + ".bin: document 3, token 0 of the document (token 6 of the file)");
  EXPECT_EQ(locate_token(*ds, 0, 1), path("l") + ".bin: document 0, token 1 of the document (token 1 of the file)");
}

TEST_F(DataCheck, FiguresOfAGoodDataset) {
  // Document lengths 3, 0, 5, 1, 16: buckets [0] 1, [1] 1, [2..3] 1, [4..7] 1, [8..15] 0, [16..31] 1.
  std::vector<int32_t> sixteen(16);
  for (int i = 0; i < 16; ++i) sixteen[size_t(i)] = 100 + i;
  write(path("g"), IndexDType::kU16, {{{5, 6, 7}}, {}, {{1, 2}, {3, 4, 9}}, {{0}}, {sixteen}});
  DataCheckOptions opt;
  opt.vocab_size = 116;
  const DataCheckReport r = check_indexed_dataset(path("g") + ".bin", opt);  // a file name works too
  EXPECT_EQ(r.prefix, path("g"));
  EXPECT_TRUE(r.ok()) << (r.problems.empty() ? "" : r.problems[0]);
  EXPECT_TRUE(r.scanned);
  EXPECT_EQ(r.dtype, "uint16");
  EXPECT_EQ(r.documents, 5);
  EXPECT_EQ(r.sequences, 5);
  EXPECT_EQ(r.tokens, 25);
  EXPECT_EQ(r.min_id, 0);
  EXPECT_EQ(r.max_id, 115);
  EXPECT_EQ(r.ids_outside, 0);
  EXPECT_EQ(r.longest_document, 16);
  EXPECT_EQ(r.length_histogram, (std::vector<int64_t>{1, 1, 1, 1, 0, 1}));
  EXPECT_EQ(r.empty_documents, 1);
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_NE(r.warnings[0].find("1 empty document (no tokens): 1"), std::string::npos) << r.warnings[0];

  std::ostringstream os;
  print_data_check(r, opt, os);
  const std::string out = os.str();
  for (const char* needle : {"documents: 5\n", "tokens:    25 (uint16)", "ids:       min 0, max 115",
                             "vocabulary: ids < 116, all inside", "16 .. 31", "  ok\n"})
    EXPECT_NE(out.find(needle), std::string::npos) << needle << " not in:\n" << out;

  opt.strict = true;  // the empty document becomes a problem
  EXPECT_FALSE(check_indexed_dataset(path("g"), opt).ok());
}

TEST_F(DataCheck, IdsOutsideTheVocabularyAreListedWithTheirPlace) {
  std::vector<Doc> docs = random_docs(11, 200);
  docs[150] = {{1, 2}, {3, 50300, 4}};  // document 150, token 3 of it
  docs[170] = {{60000}};
  write(path("b"), IndexDType::kU16, docs);
  int64_t before = 0;
  for (size_t d = 0; d < 150; ++d)
    for (const auto& s : docs[d]) before += int64_t(s.size());
  DataCheckOptions opt;
  opt.vocab_size = 50257;
  opt.vocab_source = "GPT2BPETokenizer";
  DataCheckReport r = check_indexed_dataset(path("b"), opt);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.ids_outside, 2);
  EXPECT_EQ(r.max_id, 60000);
  ASSERT_EQ(r.problems.size(), 2u);
  EXPECT_EQ(r.problems[0], path("b") + ".bin: document 150, token 3 of the document (token " +
                               std::to_string(before + 3) + " of the file): id 50300 >= 50257, outside the "
                               "vocabulary of GPT2BPETokenizer");
  EXPECT_NE(r.problems[1].find("document 170, token 0 of the document"), std::string::npos) << r.problems[1];

  opt.max_listed = 1;  // the rest are counted
  r = check_indexed_dataset(path("b"), opt);
  ASSERT_EQ(r.problems.size(), 2u);
  EXPECT_NE(r.problems[1].find("1 more ids outside the vocabulary"), std::string::npos) << r.problems[1];

  opt.vocab_size = 0;  // no vocabulary: only negative ids are wrong
  EXPECT_TRUE(check_indexed_dataset(path("b"), opt).ok());
  write(path("n"), IndexDType::kI16, {{{1, -3, 2}}});
  r = check_indexed_dataset(path("n"), opt);
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_NE(r.problems[0].find("document 0, token 1 of the document (token 1 of the file): id -3 is negative"),
            std::string::npos)
      << r.problems[0];
}

TEST_F(DataCheck, StructuralProblemsAreAllListed) {
  write(path("c"), IndexDType::kU16, {{{1, 2, 3}}, {{4, 5}}, {{6}}, {{7, 8, 9}}});
  // Corrupt two fields: a pointer and the last document index (layout: 34-byte header, 4 lengths,
  // 4 pointers, 5 document indices).
  std::fstream f(path("c") + ".idx", std::ios::in | std::ios::out | std::ios::binary);
  const int64_t bad_ptr = 2, bad_doc = 3;
  f.seekp(34 + 4 * 4 + 2 * 8);
  f.write(reinterpret_cast<const char*>(&bad_ptr), 8);
  f.seekp(34 + 4 * 4 + 4 * 8 + 4 * 8);
  f.write(reinterpret_cast<const char*>(&bad_doc), 8);
  f.close();
  EXPECT_THROW(IndexedDataset::open(path("c")), UserError);
  const IndexInspection in = IndexedDataset::inspect(path("c"));
  EXPECT_EQ(in.dataset, nullptr);
  ASSERT_EQ(in.problems.size(), 2u);
  EXPECT_NE(in.problems[0].find("sequence_pointers[2]' = 2, expected 10"), std::string::npos) << in.problems[0];
  EXPECT_NE(in.problems[1].find("document_indices[4]' (the last) is 3"), std::string::npos) << in.problems[1];

  const DataCheckReport r = check_indexed_dataset(path("c"), {});
  EXPECT_FALSE(r.scanned);
  EXPECT_EQ(r.problems.size(), 2u);

  // A truncated .bin: the size problem; a missing file: one problem naming it.
  write(path("t"), IndexDType::kU16, {{{1, 2, 3}}});
  fs::resize_file(path("t") + ".bin", 5);
  EXPECT_FALSE(check_indexed_dataset(path("t"), {}).ok());
  const DataCheckReport missing = check_indexed_dataset(path("nothing"), {});
  ASSERT_EQ(missing.problems.size(), 1u);
  EXPECT_NE(missing.problems[0].find(path("nothing") + ".idx"), std::string::npos) << missing.problems[0];
}

TEST_F(DataCheck, ManyBadLengthsAreCappedPerField) {
  std::vector<Doc> docs(40, Doc{{1, 2}});
  write(path("m"), IndexDType::kU16, docs);
  fs::resize_file(path("m") + ".bin", 2);  // every pointer after the first now points past the end
  const IndexInspection in = IndexedDataset::inspect(path("m"));
  // 5 listed for the pointers, the bin size, then the count of the other pointer problems.
  ASSERT_EQ(in.problems.size(), 7u);
  EXPECT_NE(in.problems.back().find("35 more problems with field 'sequence_pointers'"), std::string::npos)
      << in.problems.back();
}

TEST_F(DataCheck, EmptyDatasetAndSftLossMask) {
  write(path("e"), IndexDType::kU16, {});
  const DataCheckReport e = check_indexed_dataset(path("e"), {});
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.problems[0].find("holds no tokens"), std::string::npos) << e.problems[0];

  write(path("s_sft_document"), IndexDType::kU16, {{{1, 2, 3}}, {{4, 5}}});
  write(path("s_sft_document_loss_mask"), IndexDType::kU8, {{{0, 1, 1}}, {{0, 1}}});
  DataCheckReport r = check_indexed_dataset(path("s_sft_document"), {});
  EXPECT_TRUE(r.ok());
  EXPECT_TRUE(r.loss_mask_checked);
  write(path("s_sft_document_loss_mask"), IndexDType::kU8, {{{0, 1, 2}}, {{0}}});
  r = check_indexed_dataset(path("s_sft_document"), {});
  ASSERT_EQ(r.problems.size(), 2u);
  EXPECT_NE(r.problems[0].find("entry 2 is 2"), std::string::npos) << r.problems[0];
  EXPECT_NE(r.problems[1].find("sequence 1 has 1 mask entries for 2 tokens"), std::string::npos) << r.problems[1];
}

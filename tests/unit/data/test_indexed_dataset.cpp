// Indexed dataset (.bin/.idx): Loom's writer must match the independent Python reference writer
// (tests/golden/idx_reference.py) byte for byte, Loom's reader must return the reference files' tokens,
// and every kind of corruption must be a UserError naming the file and the field.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "loom/core/check.h"
#include "loom/data/indexed_dataset.h"

namespace fs = std::filesystem;
using loom::IndexDType;

namespace {

using Doc = std::vector<std::vector<int32_t>>;  // sequences of one document

class IndexedDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("loom_idx_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  static void write_loom(const std::string& prefix, IndexDType dt, const std::vector<Doc>& docs) {
    loom::IndexedDatasetWriter w(prefix, dt);
    for (const Doc& d : docs) {
      for (const auto& s : d) w.add_sequence(s);
      w.end_document();
    }
    w.finalize();
  }

  // Runs the Python reference writer; dtype_field is e.g. "\"dtype\": \"uint16\"" or "\"vocab_size\": 70000".
  void write_python(const std::string& prefix, const std::string& dtype_field, const std::vector<Doc>& docs) {
    nlohmann::json spec;
    spec["prefix"] = prefix;
    spec["documents"] = docs;
    std::string text = spec.dump();
    text.insert(1, dtype_field + ", ");
    const std::string spec_path = prefix + ".spec.json";
    std::ofstream(spec_path) << text;
    const std::string cmd = "/usr/bin/python3 " LOOM_SOURCE_DIR "/tests/golden/idx_reference.py write " + spec_path;
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    fs::remove(spec_path);
  }

  static std::string slurp(const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  static void spit(const std::string& p, const std::string& bytes) {
    std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
  }

  static std::vector<Doc> read_all(const loom::IndexedDataset& ds) {
    std::vector<Doc> docs;
    const auto di = ds.document_indices();
    const auto lens = ds.sequence_lengths();
    for (size_t k = 0; k + 1 < di.size(); ++k) {
      Doc d;
      for (int64_t s = di[k]; s < di[k + 1]; ++s) {
        std::vector<int32_t> toks(size_t(lens[s]));
        ds.read(s, 0, lens[s], toks.data());
        d.push_back(toks);
      }
      docs.push_back(d);
    }
    return docs;
  }

  fs::path dir_;
};

// doc0 = two sequences, doc1 empty, doc2 = two sequences: S = 4, doc_idx = [0, 2, 2, 4], 9 uint16 tokens.
const std::vector<Doc> kSmall = {{{10, 11, 12}, {13, 14}}, {}, {{15}, {16, 17, 18}}};
constexpr size_t kLen = 34, kPtr = 34 + 4 * 4, kDoc = 34 + 12 * 4;  // array offsets in kSmall's .idx

std::vector<Doc> random_docs(uint32_t seed, int n_docs, int32_t lo, int32_t hi) {
  std::mt19937 rng(seed);
  std::vector<Doc> docs(n_docs);
  for (Doc& d : docs) {
    const int n_seq = int(rng() % 4);  // includes empty documents
    for (int s = 0; s < n_seq; ++s) {
      std::vector<int32_t> seq(rng() % 50);  // includes zero-length sequences
      for (auto& t : seq) t = int32_t(lo + int64_t(rng() % uint64_t(int64_t(hi) - lo + 1)));
      d.push_back(seq);
    }
  }
  return docs;
}

TEST(IndexDType, MegatronVocabRule) {
  EXPECT_EQ(loom::index_dtype_for_vocab(50257), IndexDType::kU16);
  EXPECT_EQ(loom::index_dtype_for_vocab(65499), IndexDType::kU16);
  EXPECT_EQ(loom::index_dtype_for_vocab(65500), IndexDType::kI32);
  EXPECT_EQ(loom::index_dtype_for_vocab(128256), IndexDType::kI32);
  EXPECT_EQ(loom::index_dtype_size(IndexDType::kU16), 2u);
  EXPECT_EQ(loom::index_dtype_size(IndexDType::kI64), 8u);
  EXPECT_EQ(loom::index_dtype_size(IndexDType::kU8), 1u);
}

TEST_F(IndexedDatasetTest, ByteIdenticalToPythonReference) {
  struct Case {
    IndexDType dt;
    std::string field;
    std::vector<Doc> docs;
  };
  const std::vector<Case> cases = {
      {IndexDType::kU16, "\"dtype\": \"uint16\"", kSmall},
      {IndexDType::kU16, "\"vocab_size\": 50257", random_docs(1, 200, 0, 50256)},
      {IndexDType::kI32, "\"vocab_size\": 128256", random_docs(2, 100, 0, 128255)},
      {IndexDType::kI32, "\"dtype\": \"int32\"", random_docs(3, 50, -2147483647 - 1, 2147483647)},
      {IndexDType::kU8, "\"dtype\": \"uint8\"", random_docs(4, 30, 0, 255)},
      {IndexDType::kI8, "\"dtype\": \"int8\"", random_docs(5, 30, -128, 127)},
      {IndexDType::kI16, "\"dtype\": \"int16\"", random_docs(6, 30, -32768, 32767)},
      {IndexDType::kI64, "\"dtype\": \"int64\"", random_docs(7, 30, -5, 1 << 30)},
      {IndexDType::kU16, "\"dtype\": \"uint16\"", {}},        // no documents at all
      {IndexDType::kU16, "\"dtype\": \"uint16\"", {{}, {}}},  // only empty documents
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string a = path("loom" + std::to_string(i)), b = path("py" + std::to_string(i));
    write_loom(a, cases[i].dt, cases[i].docs);
    write_python(b, cases[i].field, cases[i].docs);
    EXPECT_EQ(slurp(a + ".idx"), slurp(b + ".idx")) << "case " << i;
    EXPECT_EQ(slurp(a + ".bin"), slurp(b + ".bin")) << "case " << i;
    EXPECT_GT(slurp(a + ".idx").size(), 33u);
  }
}

TEST_F(IndexedDatasetTest, ReadsPythonWrittenFilesTokenForToken) {
  const auto docs = random_docs(11, 300, 0, 50256);
  write_python(path("py"), "\"dtype\": \"uint16\"", docs);
  const auto ds = loom::IndexedDataset::open(path("py"));
  EXPECT_EQ(ds->dtype(), IndexDType::kU16);
  EXPECT_EQ(ds->prefix(), path("py"));
  EXPECT_EQ(ds->document_indices().size(), docs.size() + 1);
  int64_t n_seq = 0;
  for (const Doc& d : docs) n_seq += int64_t(d.size());
  EXPECT_EQ(ds->num_sequences(), n_seq);
  EXPECT_EQ(read_all(*ds), docs);

  // Partial reads: a window in the middle of a sequence.
  const auto big = std::vector<Doc>{{{1, 2, 3, 4, 5, 6, 7, 8}}, {{9, 10}}};
  write_python(path("py2"), "\"vocab_size\": 200000", big);
  const auto ds2 = loom::IndexedDataset::open(path("py2"));
  EXPECT_EQ(ds2->dtype(), IndexDType::kI32);
  int32_t out[3] = {0, 0, 0};
  ds2->read(0, 2, 3, out);
  EXPECT_EQ(std::vector<int32_t>(out, out + 3), (std::vector<int32_t>{3, 4, 5}));
  ds2->read(1, 1, 1, out);
  EXPECT_EQ(out[0], 10);
  EXPECT_THROW(ds2->read(1, 1, 2, out), loom::Error);  // past the end of the sequence
  EXPECT_THROW(ds2->read(2, 0, 1, out), loom::Error);  // no such sequence
}

TEST_F(IndexedDatasetTest, PythonReadsLoomWrittenFiles) {
  const auto docs = random_docs(21, 100, -1000, 1000);
  write_loom(path("loom"), IndexDType::kI16, docs);
  const std::string cmd = "/usr/bin/python3 " LOOM_SOURCE_DIR "/tests/golden/idx_reference.py dump " +
                          path("loom") + " " + path("dump.json");
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  const auto j = nlohmann::json::parse(slurp(path("dump.json")));
  EXPECT_EQ(j["dtype"].get<int>(), 3);
  EXPECT_EQ(j["documents"].get<std::vector<Doc>>(), docs);
}

TEST_F(IndexedDatasetTest, LoomRoundTripAllIntegerDtypes) {
  for (IndexDType dt : {IndexDType::kU8, IndexDType::kI8, IndexDType::kI16, IndexDType::kU16, IndexDType::kI32,
                        IndexDType::kI64}) {
    const auto docs = random_docs(uint32_t(dt), 40, 0, 100);
    write_loom(path("rt"), dt, docs);
    const auto ds = loom::IndexedDataset::open(path("rt"));
    EXPECT_EQ(ds->dtype(), dt);
    EXPECT_EQ(read_all(*ds), docs);
  }
}

TEST_F(IndexedDatasetTest, WriterUsesTemporariesUntilFinalize) {
  {
    loom::IndexedDatasetWriter w(path("t"), IndexDType::kU16);
    w.add_sequence(std::vector<int32_t>{1, 2});
    w.end_document();
    EXPECT_FALSE(fs::exists(path("t.bin")));
    EXPECT_FALSE(fs::exists(path("t.idx")));
    EXPECT_FALSE(fs::is_empty(dir_));  // the temporary .bin
  }  // destroyed without finalize: temporaries removed
  EXPECT_TRUE(fs::is_empty(dir_));
  write_loom(path("t"), IndexDType::kU16, kSmall);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 2);  // only t.bin, t.idx
}

TEST_F(IndexedDatasetTest, WriterRejectsTokensOutsideDtype) {
  loom::IndexedDatasetWriter w(path("t"), IndexDType::kU16);
  EXPECT_THROW(w.add_sequence(std::vector<int32_t>{1, 65536}), loom::UserError);
  EXPECT_THROW(w.add_sequence(std::vector<int32_t>{-1}), loom::UserError);
  w.add_sequence(std::vector<int32_t>{65535, 0});
  // finalize with sequences after the last end_document() is a caller bug
  EXPECT_THROW(w.finalize(), loom::Error);
}

TEST_F(IndexedDatasetTest, WriterNamesMissingDirectory) {
  try {
    loom::IndexedDatasetWriter w(path("no/such/dir/x"), IndexDType::kU16);
    FAIL() << "expected UserError";
  } catch (const loom::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("no/such/dir/x.bin"), std::string::npos) << e.what();
  }
}

// ---- corruption: one test per field --------------------------------------------------------------

class CorruptIdx : public IndexedDatasetTest {
 protected:
  void SetUp() override {
    IndexedDatasetTest::SetUp();
    prefix_ = path("c");
    write_loom(prefix_, IndexDType::kU16, kSmall);
    idx_ = slurp(prefix_ + ".idx");
    ASSERT_EQ(idx_.size(), kDoc + 4 * 8);
    ASSERT_EQ(slurp(prefix_ + ".bin").size(), 18u);
    ASSERT_NO_THROW(loom::IndexedDataset::open(prefix_));
  }
  template <typename T>
  void put(size_t off, T v) {
    std::memcpy(idx_.data() + off, &v, sizeof(T));
  }
  // Writes the patched .idx and expects open() to fail naming `file` and every needle.
  void expect_error(const std::string& file, std::initializer_list<std::string> needles) {
    spit(prefix_ + ".idx", idx_);
    try {
      loom::IndexedDataset::open(prefix_);
      ADD_FAILURE() << "expected UserError";
    } catch (const loom::UserError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(prefix_ + file), std::string::npos) << msg;
      for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
    }
  }
  std::string prefix_, idx_;
};

TEST_F(CorruptIdx, WrongMagic) {
  idx_[3] = 'X';
  expect_error(".idx", {"magic"});
}
TEST_F(CorruptIdx, UnsupportedVersion) {
  put<uint64_t>(9, 2);
  expect_error(".idx", {"version", "2"});
}
TEST_F(CorruptIdx, UnknownDtypeCode) {
  idx_[17] = 9;
  expect_error(".idx", {"dtype", "9"});
}
TEST_F(CorruptIdx, FloatDtypeCode) {
  idx_[17] = 6;
  expect_error(".idx", {"dtype", "6"});
}
TEST_F(CorruptIdx, TruncatedHeader) {
  idx_.resize(20);
  expect_error(".idx", {"truncated header"});
}
TEST_F(CorruptIdx, TruncatedArrays) {
  idx_.resize(idx_.size() - 8);
  expect_error(".idx", {"document_count", "truncated"});
}
TEST_F(CorruptIdx, HugeSequenceCount) {
  put<uint64_t>(18, uint64_t(1) << 62);
  expect_error(".idx", {"sequence_count", "truncated"});
}
TEST_F(CorruptIdx, TrailingBytes) {
  idx_ += "xyz";
  expect_error(".idx", {"sequence_count 4", "document_count 4"});
}
TEST_F(CorruptIdx, ZeroDocumentCount) {
  put<uint64_t>(26, 0);
  idx_.resize(kDoc);
  expect_error(".idx", {"document_count"});
}
TEST_F(CorruptIdx, NegativeLength) {
  put<int32_t>(kLen + 4, -1);
  expect_error(".idx", {"sequence_lengths[1]", "negative"});
}
TEST_F(CorruptIdx, PointerNotRunningOffset) {
  put<int64_t>(kPtr + 2 * 8, 8);  // sequence 2 starts at byte 10 (5 tokens * 2)
  expect_error(".idx", {"sequence_pointers[2]", "expected 10"});
}
TEST_F(CorruptIdx, PointerPastEndOfBin) {
  put<int64_t>(kPtr + 3 * 8, 1000);
  expect_error(".idx", {"sequence_pointers[3]", "past the end", prefix_ + ".bin"});
}
TEST_F(CorruptIdx, NegativePointer) {
  put<int64_t>(kPtr + 1 * 8, -4);
  expect_error(".idx", {"sequence_pointers[1]"});
}
TEST_F(CorruptIdx, LengthPastEndOfBin) {
  put<int32_t>(kLen + 3 * 4, 0x7fffffff);
  expect_error(".idx", {"sequence_pointers[3]", "past the end"});
}
TEST_F(CorruptIdx, BinLargerThanLengths) {
  spit(prefix_ + ".bin", slurp(prefix_ + ".bin") + std::string("\x01\x00", 2));
  expect_error(".bin", {"size is 20 bytes", "9 tokens"});
}
TEST_F(CorruptIdx, BinTruncated) {
  spit(prefix_ + ".bin", slurp(prefix_ + ".bin").substr(0, 16));
  expect_error(".idx", {"sequence_pointers[3]", "past the end"});
}
TEST_F(CorruptIdx, BinMissing) {
  fs::remove(prefix_ + ".bin");
  expect_error(".bin", {"cannot open"});
}
TEST_F(CorruptIdx, DocumentIndicesNotStartingAtZero) {
  put<int64_t>(kDoc, 1);
  expect_error(".idx", {"document_indices[0]", "expected 0"});
}
TEST_F(CorruptIdx, DocumentIndicesDecreasing) {
  put<int64_t>(kDoc + 2 * 8, 1);  // [0, 2, 1, 4]
  expect_error(".idx", {"document_indices[2]", "non-decreasing"});
}
TEST_F(CorruptIdx, LastDocumentIndexNotSequenceCount) {
  put<int64_t>(kDoc + 3 * 8, 3);
  expect_error(".idx", {"document_indices[3]", "sequence count 4"});
}

TEST_F(IndexedDatasetTest, Int64TokensOutsideInt32AreAnErrorOnRead) {
  write_python(path("big"), "\"dtype\": \"int64\"", {{{1, 7}}});
  // Patch the second token to 2^32 directly in the .bin.
  std::string bin = slurp(path("big.bin"));
  const int64_t v = int64_t(1) << 32;
  std::memcpy(bin.data() + 8, &v, 8);
  spit(path("big.bin"), bin);
  const auto ds = loom::IndexedDataset::open(path("big"));
  int32_t out[2];
  ds->read(0, 0, 1, out);
  EXPECT_EQ(out[0], 1);
  EXPECT_THROW(ds->read(0, 0, 2, out), loom::UserError);
}

}  // namespace

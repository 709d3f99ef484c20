// Data checked before it is trained on, through the `loom` binary: a token id outside the tokenizer's
// vocabulary in a late document stops `loom train` before the iteration that would use it (exit 2, one line
// naming the .bin, the document, the offsets, the id and the valid range; no checkpoint of that iteration or
// later), including ids that only the padded embedding rows would have taken; `loom data check` prints a
// dataset's figures and every problem (exit 1) or "ok" (exit 0).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include "e2e_util.h"
#include "loom/data/gpt_dataset.h"
#include "loom/data/indexed_dataset.h"

namespace fs = std::filesystem;
using namespace loom;
using namespace loom::e2e;

namespace {

constexpr int kDocs = 120;

// kDocs documents of NullTokenizer ids (--vocab-size 100: ids 0..99, EOD 100), 20 + d % 13 tokens each,
// the last one the EOD.
void write_corpus(const std::string& prefix) {
  IndexedDatasetWriter w(prefix, IndexDType::kU16);
  for (int d = 0; d < kDocs; ++d) {
    std::vector<int32_t> ids;
    for (int i = 0; i < 19 + d % 13; ++i) ids.push_back((d * 31 + i * 7) % 100);
    ids.push_back(100);
    w.add_sequence(ids);
    w.end_document();
  }
  w.finalize();
}

const Args kModel = {"--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                     "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
                     "--train-iters", "6", "--lr", "3e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                     "--eval-iters", "0", "--log-interval", "1", "--save-interval", "1", "--device", "cpu"};

std::string words(const Args& a) {
  std::string s;
  for (const std::string& w : a) s += (s.empty() ? "" : " ") + w;
  return s;
}

struct BadToken {
  int64_t iteration = 0;  // the first iteration whose batch holds it
  int64_t document = 0, in_document = 0, in_file = 0;
};

// Where a token of a sample of iteration `iteration` (micro-batch 1, row 1, position 5) comes from, in a
// document of the second half of the file: the training run draws its samples from the same GPTDataset.
BadToken pick_late_token(const std::string& prefix, int64_t iteration) {
  GPTDatasetConfig c;
  c.seq_length = 16;
  c.split = "1,0,0";
  c.use_cache = false;
  const auto ds = build_gpt_datasets({prefix}, {6 * 4, 0, 0}, c)[0];
  static const std::regex re(R"(document (\d+), token (\d+) of the document \(token (\d+) of the file\))");
  for (int64_t s = (iteration - 1) * 4; s < iteration * 4; ++s)
    for (int64_t t = 0; t <= 16; ++t) {
      const std::string where = ds->locate(s, t);
      std::smatch m;
      if (!std::regex_search(where, m, re) || std::stoll(m[1]) < kDocs / 2) continue;
      // Samples overlap by one token: the token must not appear in an earlier sample as well.
      bool earlier = false;
      for (int64_t e = 0; e < (iteration - 1) * 4 && !earlier; ++e)
        for (int64_t u = 0; u <= 16 && !earlier; ++u) earlier = ds->locate(e, u) == where;
      if (!earlier) return {iteration, std::stoll(m[1]), std::stoll(m[2]), std::stoll(m[3])};
    }
  ADD_FAILURE() << "no late document in iteration " << iteration;
  return {};
}

void patch_token(const std::string& prefix, int64_t in_file, uint16_t id) {
  std::fstream f(prefix + ".bin", std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(in_file * 2);
  f.write(reinterpret_cast<const char*>(&id), 2);
}

bool has_checkpoint(const std::string& root, int64_t it) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "/iter_%07lld", (long long)it);
  return fs::exists(root + buf);
}

}  // namespace

// A bad id in a late document, first used by iteration 3: iterations 1 and 2 train and save, then the run
// stops with the place of the id; iteration 3 never runs or saves.
TEST(DataTrain, IdOutsideTheVocabularyStopsBeforeTheIterationThatUsesIt) {
  const TempDir tmp("baddata");
  const std::string prefix = tmp / "corpus";
  write_corpus(prefix);
  const BadToken bad = pick_late_token(prefix, 3);
  patch_token(prefix, bad.in_file, 65535);
  const CliResult r = run_loom("train " + words(kModel) + " --train-data-path " + prefix + " --data-cache-path " +
                               (tmp / "cache") + " --save " + (tmp / "ckpt"));
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  const std::string place = prefix + ".bin: document " + std::to_string(bad.document) + ", token " +
                            std::to_string(bad.in_document) + " of the document (token " +
                            std::to_string(bad.in_file) + " of the file)";
  for (const std::string& needle :
       {std::string("loom train: error: the training batch of iteration 3 "), place,
        std::string("token id 65535 at position "),
        std::string("is outside the vocabulary [0, 101) of NullTokenizer (--vocab-size 100 and its end-of-document "
                    "id 100): valid ids are 0 .. 100"),
        std::string("loom data check")})
    EXPECT_NE(r.err.find(needle), std::string::npos) << needle << "\nnot in: " << r.err;
  // Iterations 1 and 2 ran and saved; 3 did not.
  int64_t last = 0;
  for (const std::string& line : lines_of(r.out)) last = std::max(last, iteration_of(line));
  EXPECT_EQ(last, 2) << r.out;
  EXPECT_TRUE(has_checkpoint(tmp / "ckpt", 2));
  EXPECT_FALSE(has_checkpoint(tmp / "ckpt", 3));
}

// An id the padded embedding would take (101 <= id < 128 with --make-vocab-size-divisible-by 128) but the
// tokenizer never produces, in the first batch: caught as well, before any step or checkpoint.
TEST(DataTrain, IdInThePaddedRowsIsAnErrorBeforeAnyCheckpoint) {
  const TempDir tmp("padrows");
  const std::string prefix = tmp / "corpus";
  write_corpus(prefix);
  const BadToken bad = pick_late_token(prefix, 1);
  patch_token(prefix, bad.in_file, 110);
  const CliResult r = run_loom("train " + words(kModel) + " --train-data-path " + prefix + " --data-cache-path " +
                               (tmp / "cache") + " --save " + (tmp / "ckpt"));
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("the training batch of iteration 1 "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("token id 110 at position"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("document " + std::to_string(bad.document) + ", token " + std::to_string(bad.in_document)),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.out.find("dummy tokens (new size: 128)"), std::string::npos) << r.out;  // 110 is a padded row
  EXPECT_EQ(r.out.find("] iteration "), std::string::npos) << r.out;
  EXPECT_FALSE(has_checkpoint(tmp / "ckpt", 1));
  EXPECT_FALSE(fs::exists(tmp / "ckpt/latest_checkpointed_iteration.txt"));
}

// `loom data check` on `loom preprocess` output: the figures, then the same data with two bad ids.
TEST(DataCheckCli, FiguresOfAGoodDatasetAndProblemsOfABadOne) {
  const TempDir tmp("datacheck");
  {
    std::ofstream f(tmp / "in.jsonl");
    f << "{\"text\": \"1 2 3\"}\n{\"text\": \"\"}\n{\"text\": \"4 5 6 7 8\"}\n{\"text\": [\"9\", \"10 11\"]}\n";
  }
  CliResult r = run_loom("preprocess --input in.jsonl --output-prefix p --tokenizer-type NullTokenizer "
                         "--vocab-size 100 --append-eod", tmp.str());
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string prefix = tmp / "p_text_document";
  r = run_loom("data check " + prefix + " --tokenizer-type NullTokenizer --vocab-size 100");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  // Lengths with the EOD: 4, 0, 6, 4 (two sequences: 1, then 2 + EOD).
  for (const char* needle : {"documents: 4\n", "sequences: 4\n", "tokens:    14 (uint16)", "ids:       min 1, max 100",
                             "vocabulary: NullTokenizer (--vocab-size 100 and its end-of-document id 100): ids < 101, "
                             "all inside",
                             "1 empty document (no tokens): 1", "  ok\n"})
    EXPECT_NE(r.out.find(needle), std::string::npos) << needle << "\nnot in:\n" << r.out;
  EXPECT_NE(r.out.find("    0                       1\n    1                       0\n    2 .. 3                  0\n"
                       "    4 .. 7                  3\n"),
            std::string::npos)
      << r.out;
  // --strict: the empty document fails the check.
  EXPECT_EQ(run_loom("data check " + prefix + " --vocab-size 101 --strict").code, 1);

  // Two ids past the vocabulary: token 2 of document 2 (token 6 of the file) and the last token.
  patch_token(prefix, 6, 300);
  patch_token(prefix, 13, 65535);
  r = run_loom("data check " + prefix + ".bin --vocab-size 101");
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  for (const std::string& needle :
       {prefix + ".bin: document 2, token 2 of the document (token 6 of the file): id 300 >= 101",
        prefix + ".bin: document 3, token 3 of the document (token 13 of the file): id 65535 >= 101",
        std::string("vocabulary: --vocab-size: ids < 101, 2 outside"), std::string("max 65535"),
        std::string("  2 problems\n")})
    EXPECT_NE(r.out.find(needle), std::string::npos) << needle << "\nnot in:\n" << r.out;

  // Several prefixes: a summary; a missing one is a problem, not a crash.
  r = run_loom("data check " + prefix + " " + (tmp / "missing") + " --vocab-size 70000");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("cannot open " + (tmp / "missing") + ".idx"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("2 datasets checked, 1 with problems"), std::string::npos) << r.out;

  // A corrupt index: every structural problem, no token scan.
  std::string idx = read_file(prefix + ".idx");
  idx[17] = 9;  // dtype code
  std::ofstream(prefix + ".idx", std::ios::binary) << idx;
  r = run_loom("data check " + prefix);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("field 'dtype' has code 9"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tokens not scanned"), std::string::npos) << r.out;
}

TEST(DataCheckCli, UsageErrors) {
  expect_one_line_error(run_loom("data check"), "needs at least one dataset prefix");
  expect_one_line_error(run_loom("data check x --vocab-sise 5"), "did you mean --vocab-size?");
  expect_one_line_error(run_loom("data check x --vocab-size 5 y"), "give the dataset prefixes first");
  expect_one_line_error(run_loom("data inspect x"), "unknown `loom data` command 'inspect' (valid: check)");
  expect_one_line_error(run_loom("data check x --tokenizer-type NullTokenizer"), "--vocab-size");
  const CliResult help = run_loom("data check --help");
  EXPECT_EQ(help.code, 0);
  EXPECT_NE(help.out.find("usage: loom data check PREFIX"), std::string::npos) << help.out;
}

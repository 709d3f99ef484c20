// `loom preprocess` end to end: runs the binary on JSONL files and reads the output back with
// IndexedDataset. Output must not depend on --workers; bad lines are errors naming file:line (or are
// skipped and counted); a failed run leaves no files; each --json-keys key gets its own .bin/.idx.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "e2e_util.h"
#include "loom/data/indexed_dataset.h"
#include "loom/data/tokenizer.h"

namespace fs = std::filesystem;
using namespace loom::e2e;

namespace {

using Doc = std::vector<std::vector<int32_t>>;

class Preprocess : public ::testing::Test {
 protected:
  void write_input(const std::string& text, const std::string& name = "in.jsonl") {
    std::ofstream(dir_ / name, std::ios::binary) << text;
  }

  // Runs `loom preprocess <args>` inside the test directory.
  CliResult loom(const std::string& args) { return run_loom("preprocess " + args, dir_.str()); }

  // Files in the test directory other than the inputs (*.jsonl).
  std::vector<std::string> outputs() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_.str()))
      if (e.path().extension() != ".jsonl") names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

  std::vector<Doc> read_docs(const std::string& prefix, loom::IndexDType expect_dtype = loom::IndexDType::kU16) {
    const auto ds = loom::IndexedDataset::open(dir_ / prefix);
    EXPECT_EQ(ds->dtype(), expect_dtype);
    std::vector<Doc> docs;
    const auto di = ds->document_indices();
    const auto lens = ds->sequence_lengths();
    for (size_t k = 0; k + 1 < di.size(); ++k) {
      Doc d;
      for (int64_t s = di[k]; s < di[k + 1]; ++s) {
        std::vector<int32_t> t(size_t(lens[s]));
        ds->read(s, 0, lens[s], t.data());
        d.push_back(t);
      }
      docs.push_back(d);
    }
    return docs;
  }

  const TempDir dir_{"preprocess"};
};

const std::string kNull = " --tokenizer-type NullTokenizer --vocab-size 1000";
// The EOD id of that tokenizer (Megatron's NullTokenizer: the id just past the --vocab-size ids).
const int32_t kEod = [] {
  loom::TokenizerConfig c;
  c.type = "NullTokenizer";
  c.vocab_size = 1000;
  return loom::make_tokenizer(c)->eod();
}();

TEST_F(Preprocess, DocumentsSentencesEmptyDocumentsAndEod) {
  write_input(
      "{\"text\": \"1 2 3\"}\n"
      "{\"text\": \"\"}\n"                        // empty document: kept, zero sequences, no EOD
      "{\"text\": [\"4 5\", \"\", \" 6 \"]}\n"    // list = sentences; the empty one is dropped
      "{\"text\": \"  7\\n8 \", \"other\": 1}\n"  // extra keys ignored; last line without newline
      "{\"text\": []}");
  CliResult r = loom("--input in.jsonl --output-prefix out" + kNull);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(read_docs("out_text_document"),
            (std::vector<Doc>{{{1, 2, 3}}, {}, {{4, 5}, {6}}, {{7, 8}}, {}}));
  EXPECT_EQ(outputs(), (std::vector<std::string>{"out_text_document.bin", "out_text_document.idx"}));

  r = loom("--input in.jsonl --output-prefix eod --append-eod" + kNull);
  ASSERT_EQ(r.code, 0) << r.err;
  // EOD (NullTokenizer: the id --vocab-size, as Megatron) extends the last sequence of every non-empty document.
  EXPECT_EQ(read_docs("eod_text_document"),
            (std::vector<Doc>{{{1, 2, 3, 1000}}, {}, {{4, 5}, {6, 1000}}, {{7, 8, 1000}}, {}}));
  EXPECT_NE(r.out.find("Processed 5 documents"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("eod_text_document.bin/.idx: 5 documents, 4 sequences, 11 tokens (uint16)"),
            std::string::npos)
      << r.out;
}

// Lines longer than the reader's 1 MiB chunks and 64 KiB reads, CRLF line ends.
TEST_F(Preprocess, LongLinesAndCrlf) {
  std::vector<int32_t> big;
  std::string text = "{\"text\": \"";
  for (int i = 0; i < 700000; ++i) {  // ~2.7 MB of text
    big.push_back(i % 997);
    text += std::to_string(i % 997) + " ";
  }
  write_input("{\"text\": \"1\"}\r\n" + text + "\"}\r\n{\"text\": \"2 3\"}\r\n");
  CliResult r = loom("--input in.jsonl --output-prefix out --workers 3" + kNull);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(read_docs("out_text_document"), (std::vector<Doc>{{{1}}, {big}, {{2, 3}}}));

}

// An input that would give an empty dataset is an error naming the input, and writes nothing: no
// documents at all, documents that all tokenize to nothing, only bad lines skipped, or one --json-keys key
// that is empty everywhere.
TEST_F(Preprocess, EmptyInputIsAnErrorAndWritesNothing) {
  struct Case {
    std::string input, args, needle;
  };
  const std::vector<Case> cases = {
      {"", "", "empty.jsonl holds no documents (the file is empty); nothing was written"},
      {"{\"text\": \"\"}\n{\"text\": []}\n{\"text\": [\"\", \" \"]}\n", " --append-eod",
       "empty.jsonl: all 3 documents are empty after tokenization (key 'text' holds no text); nothing was written"},
      {"[1]\n{\"txt\": \"1\"}\n", " --skip-bad-lines", "empty.jsonl holds no documents (2 bad lines skipped"},
      {"{\"text\": \"1\", \"title\": \"\"}\n", " --json-keys text title", "(key 'title' holds no text)"},
  };
  for (const Case& c : cases) {
    write_input(c.input, "empty.jsonl");
    const CliResult r = loom("--input empty.jsonl --output-prefix e" + c.args + kNull);
    EXPECT_EQ(r.code, 2) << c.needle << ": " << r.out;
    EXPECT_NE(r.err.find("--input empty.jsonl"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_TRUE(outputs().empty()) << "files left after " << c.needle;
  }
}

TEST_F(Preprocess, VocabSizeChoosesInt32) {
  write_input("{\"text\": \"70000 3\"}\n");
  const CliResult r = loom("--input in.jsonl --output-prefix big --tokenizer-type NullTokenizer --vocab-size 70001");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(read_docs("big_text_document", loom::IndexDType::kI32), (std::vector<Doc>{{{70000, 3}}}));
}

// Many chunks of lines with random documents, sentence lists and empty documents.
std::string random_jsonl(int lines, std::vector<Doc>* expect, std::vector<Doc>* expect_title) {
  std::mt19937 rng(7);
  std::string s;
  auto sentence = [&](std::vector<int32_t>& toks) {
    std::string t;
    const int n = int(rng() % 12);
    for (int i = 0; i < n; ++i) {
      const int32_t id = int32_t(rng() % 998);
      toks.push_back(id);
      t += (rng() % 3 ? " " : "\\n") + std::to_string(id);
    }
    return t;
  };
  for (int i = 0; i < lines; ++i) {
    Doc d, dt;
    std::vector<int32_t> toks, title;
    std::string text;
    if (rng() % 4 == 0) {
      text = "[";
      const int n = int(rng() % 4);
      for (int k = 0; k < n; ++k) {
        toks.clear();
        text += (k ? ", \"" : "\"") + sentence(toks) + "\"";
        if (!toks.empty()) d.push_back(toks);
      }
      text += "]";
    } else {
      text = "\"" + sentence(toks) + "\"";
      if (!toks.empty()) d.push_back(toks);
    }
    if (!d.empty()) d.back().push_back(1000);  // --append-eod
    const std::string t = sentence(title);
    if (!title.empty()) dt.push_back(title), dt.back().push_back(1000);
    s += "{\"title\": \"" + t + "\", \"text\": " + text + "}\n";
    expect->push_back(d);
    expect_title->push_back(dt);
  }
  return s;
}

TEST_F(Preprocess, OutputIndependentOfWorkersAndMultipleKeys) {
  std::vector<Doc> expect, expect_title;
  write_input(random_jsonl(3000, &expect, &expect_title));
  const std::string common = " --input in.jsonl --append-eod --json-keys text title" + kNull;
  CliResult r1 = loom("--workers 1 --output-prefix w1" + common);
  ASSERT_EQ(r1.code, 0) << r1.err;
  CliResult r4 = loom("--workers 4 --log-interval 1000 --output-prefix w4" + common);
  ASSERT_EQ(r4.code, 0) << r4.err;
  for (const std::string key : {"text", "title"})
    for (const std::string ext : {".bin", ".idx"}) {
      const std::string a = read_file(dir_ / ("w1_" + key + "_document" + ext));
      EXPECT_FALSE(a.empty());
      EXPECT_EQ(a, read_file(dir_ / ("w4_" + key + "_document" + ext))) << key << ext;
    }
  EXPECT_EQ(read_docs("w4_text_document"), expect);
  EXPECT_EQ(read_docs("w4_title_document"), expect_title);
  // Megatron's progress line every --log-interval documents.
  EXPECT_NE(r4.out.find("Processed 1000 documents ("), std::string::npos) << r4.out;
  EXPECT_NE(r4.out.find("Processed 3000 documents ("), std::string::npos) << r4.out;
  EXPECT_EQ(r4.out.find("Processed 1500 documents"), std::string::npos) << r4.out;
  EXPECT_NE(r4.out.find(" docs/s, "), std::string::npos) << r4.out;
  EXPECT_NE(r4.out.find(" MB/s)."), std::string::npos) << r4.out;
}

const std::string kBad =
    "{\"text\": \"1 2\"}\n"
    "{\"txt\": \"3\"}\n"         // line 2: missing key
    "{\"text\": \"4\"\n"         // line 3: malformed JSON
    "{\"text\": 5}\n"            // line 4: not a string
    "{\"text\": \"6 x\"}\n"      // line 5: the tokenizer rejects it
    "\n"                         // line 6: empty line
    "[1, 2]\n"                   // line 7: not an object
    "{\"text\": [\"7\", 8]}\n"   // line 8: list with a non-string
    "{\"text\": \"9\"}\n";

TEST_F(Preprocess, BadLinesAreErrorsWithLineNumbers) {
  struct Case {
    int line;
    std::string needle;
  };
  const std::vector<Case> cases = {{2, "missing key 'text'"}, {3, "invalid JSON"}, {4, "is a JSON number"},
                                   {5, "NullTokenizer"},      {6, "empty line"},   {7, "expected a JSON object"},
                                   {8, "list holding a JSON number"}};
  const std::vector<std::string> lines = [] {
    std::vector<std::string> v;
    std::istringstream is(kBad);
    for (std::string l; std::getline(is, l);) v.push_back(l + "\n");
    return v;
  }();
  for (const Case& c : cases) {
    // Good lines, then the one bad line at its original line number.
    std::string text;
    for (int i = 1; i < c.line; ++i) text += "{\"text\": \"" + std::to_string(i) + "\"}\n";
    text += lines[size_t(c.line - 1)];
    text += "{\"text\": \"1\"}\n";
    write_input(text);
    const CliResult r = loom("--input in.jsonl --output-prefix out --workers 2" + kNull);
    EXPECT_EQ(r.code, 2) << c.needle;
    EXPECT_NE(r.err.find("in.jsonl:" + std::to_string(c.line) + ": "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("--skip-bad-lines"), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_TRUE(outputs().empty()) << "files left after a failed run, case " << c.line;
  }
}

TEST_F(Preprocess, SkipBadLinesCountsThem) {
  write_input(kBad);
  const CliResult r = loom("--input in.jsonl --output-prefix out --skip-bad-lines --append-eod" + kNull);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("Processed 2 documents"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("skipped 7 bad lines"), std::string::npos) << r.out;
  EXPECT_EQ(read_docs("out_text_document"), (std::vector<Doc>{{{1, 2, kEod}}, {{9, kEod}}}));
}

TEST_F(Preprocess, FailureLateInALargeInputLeavesNoFiles) {
  std::vector<Doc> e1, e2;
  std::string text = random_jsonl(2000, &e1, &e2);
  text += "{\"text\": \"oops\"}\n";
  write_input(text);
  const CliResult r = loom("--input in.jsonl --output-prefix sub_out --json-keys text title --workers 3" + kNull);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("in.jsonl:2001: "), std::string::npos) << r.err;
  EXPECT_TRUE(outputs().empty());
}

TEST_F(Preprocess, FlagErrors) {
  write_input("{\"text\": \"1\"}\n");
  struct Case {
    std::string args, needle;
  };
  const std::vector<Case> cases = {
      {"--input in.jsonl --output-prefx o" + kNull, "unknown flag --output-prefx (did you mean --output-prefix?)"},
      {"--input in.jsonl --output-prefix o --json-keys text text" + kNull, "key 'text' given twice"},
      {"--output-prefix o" + kNull, "--input is required"},
      {"--input in.jsonl" + kNull, "--output-prefix is required"},
      {"--input missing.jsonl --output-prefix o" + kNull, "cannot open missing.jsonl"},
      {"--input in.jsonl --output-prefix o --workers 0" + kNull, "--workers"},
      {"--input in.jsonl --output-prefix o --split-sentences" + kNull, "not supported"},
      {"--input in.jsonl --output-prefix o --tokenizer-type NullTokenizer", "--vocab-size"},
      {"--input in.jsonl --output-prefix nodir/o" + kNull, "nodir/o_text_document.bin"},
      {"--input in.jsonl --output-prefix o --vocab x" + kNull, "ambiguous"},
  };
  for (const Case& c : cases) {
    const CliResult r = loom(c.args);
    EXPECT_EQ(r.code, 2) << c.args;
    EXPECT_TRUE(r.err.find(c.needle) != std::string::npos) << c.args << " -> " << r.err;
    EXPECT_TRUE(outputs().empty()) << c.args;
  }
  // argparse-style abbreviations and --flag=value work.
  const CliResult ok = loom("--input=in.jsonl --output o --tokenizer-type=NullTokenizer --vocab-size 10 --json-keys=text");
  EXPECT_EQ(ok.code, 0) << ok.err;
  EXPECT_EQ(read_docs("o_text_document"), (std::vector<Doc>{{{1}}}));
}

TEST_F(Preprocess, Gpt2Tokenizer) {
  const std::string data = std::string(LOOM_SOURCE_DIR) + "/data/";
  if (!fs::exists(data + "encoder.json")) GTEST_SKIP() << "data/encoder.json missing (scripts/setup.sh)";
  write_input("{\"text\": \"Hello world\"}\n{\"text\": \"\"}\n");
  const CliResult r = loom("--input in.jsonl --output-prefix g --tokenizer-type GPT2BPETokenizer --vocab-file " + data +
                     "encoder.json --merge-file " + data + "vocab.bpe --append-eod --workers 2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(read_docs("g_text_document"), (std::vector<Doc>{{{15496, 995, 50256}}, {}}));
}

}  // namespace

namespace {

// --sft: prompt then answer as one sample, the answer mask beside it (uint8), NeMo's default keys.
TEST_F(Preprocess, SftSamplesAndAnswerMask) {
  write_input(
      "{\"input\": \"1 2 3\", \"output\": \"4 5\"}\n"
      "{\"input\": \"\", \"output\": \"6\", \"extra\": 1}\n");
  const CliResult r = loom("--sft --input in.jsonl --output-prefix s --append-eod --workers 2" + kNull);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("s_sft_document_loss_mask.bin/.idx: the loss mask (uint8), 5 of 8 tokens in the loss (answer only)"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(read_docs("s_sft_document"), (std::vector<Doc>{{{1, 2, 3, 4, 5, kEod}}, {{6, kEod}}}));
  EXPECT_EQ(read_docs("s_sft_document_loss_mask", loom::IndexDType::kU8),
            (std::vector<Doc>{{{0, 0, 0, 1, 1, 1}}, {{1, 1}}}));
  // --answer-only-loss false: every token; --json-keys names other fields.
  write_input("{\"q\": \"7 8\", \"a\": \"9\"}\n", "qa.jsonl");
  ASSERT_EQ(loom("--sft --input qa.jsonl --output-prefix q --json-keys q a --answer-only-loss false" + kNull).code, 0);
  EXPECT_EQ(read_docs("q_sft_document_loss_mask", loom::IndexDType::kU8), (std::vector<Doc>{{{1, 1, 1}}}));
}

TEST_F(Preprocess, SftBadLinesNameTheLine) {
  // Errors found while reading come after the "Opening" line: exit 2, one stderr line, no output files.
  auto expect_error = [&](const CliResult& r, const std::string& needle) {
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  };
  write_input("{\"input\": \"1\", \"output\": \"2\"}\n{\"input\": \"1\", \"output\": \"\"}\n");
  expect_error(loom("--sft --input in.jsonl --output-prefix s" + kNull),
               "in.jsonl:2: key 'output' has no tokens (an SFT sample needs an answer)");
  EXPECT_TRUE(outputs().empty());
  write_input("{\"input\": \"1\", \"output\": [\"2\"]}\n", "list.jsonl");
  expect_error(loom("--sft --input list.jsonl --output-prefix s" + kNull), "key 'output' is a JSON array, expected a string");
  expect_one_line_error(loom("--sft --input in.jsonl --output-prefix s --json-keys a b c" + kNull),
                        "--sft takes --json-keys PROMPT ANSWER");
  expect_one_line_error(loom("--input in.jsonl --output-prefix s --answer-only-loss true" + kNull),
                        "--answer-only-loss applies to --sft data");
  const CliResult skipped = loom("--sft --input in.jsonl --output-prefix s --skip-bad-lines" + kNull);
  ASSERT_EQ(skipped.code, 0) << skipped.err;
  EXPECT_EQ(read_docs("s_sft_document").size(), 1u);
}

}  // namespace

namespace {

// --sft --chat-template with a SentencePiece model trained here (spm_train) whose control symbols are the
// templates' special tokens: the rendered ids are the template's, piece by piece, and the mask covers
// the assistant's content and its end-of-turn token only. Without the tokens, an error naming them.
TEST_F(Preprocess, SftChatTemplates) {
  if (std::system("command -v spm_train >/dev/null 2>&1") != 0) GTEST_SKIP() << "spm_train not installed";
  std::ofstream(dir_ / "text.txt") << "the quick brown fox jumps over the lazy dog\nhello world how are you\n"
                                      "I am fine thank you and you\nwhat is the answer to the question\n";
  ASSERT_EQ(std::system(("cd " + dir_.str() + " && spm_train --input=text.txt --model_prefix=m --vocab_size=60 "
                         "--model_type=bpe --minloglevel=2 "
                         "'--control_symbols=<|im_start|>,<|im_end|>,<|begin_of_text|>,<|start_header_id|>,"
                         "<|end_header_id|>,<|eot_id|>' >spm.log 2>&1")
                            .c_str()),
            0);
  loom::TokenizerConfig tc;
  tc.type = "Llama2Tokenizer";
  tc.tokenizer_model = dir_ / "m.model";
  const auto tok = loom::make_tokenizer(tc);
  write_input(R"({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},)"
              R"( {"role": "assistant", "content": "world"}]})" "\n");
  const std::string spm = " --tokenizer-type Llama2Tokenizer --tokenizer-model m.model";
  auto enc = [&](const std::string& s) { return tok->encode(s); };
  for (const std::string name : {"chatml", "llama3", "llama2"}) {
    SCOPED_TRACE(name);
    const CliResult r = loom("--sft --chat-template " + name + " --input in.jsonl --output-prefix " + name + spm);
    ASSERT_EQ(r.code, 0) << r.err;
    std::vector<int32_t> want, mask;
    auto text = [&](const std::string& s, int m) {
      for (int32_t id : enc(s)) want.push_back(id), mask.push_back(m);
    };
    auto sp = [&](const char* t, int m) { want.push_back(tok->special_token(t)), mask.push_back(m); };
    if (name == "chatml") {
      for (auto [role, content, m] : {std::tuple{"system", "be brief", 0}, {"user", "hello", 0}, {"assistant", "world", 1}}) {
        sp("<|im_start|>", 0), text(std::string(role) + "\n", 0), text(content, m), sp("<|im_end|>", m), text("\n", 0);
      }
    } else if (name == "llama3") {
      sp("<|begin_of_text|>", 0);
      for (auto [role, content, m] : {std::tuple{"system", "be brief", 0}, {"user", "hello", 0}, {"assistant", "world", 1}}) {
        sp("<|start_header_id|>", 0), text(role, 0), sp("<|end_header_id|>", 0), text("\n\n", 0), text(content, m),
            sp("<|eot_id|>", m);
      }
    } else {
      sp("<s>", 0), text("[INST] <<SYS>>\nbe brief\n<</SYS>>\n\nhello [/INST]", 0), text(" world ", 1), sp("</s>", 1);
    }
    const auto docs = read_docs(name + "_sft_document");
    ASSERT_EQ(docs.size(), 1u);
    EXPECT_EQ(docs[0][0], want);
    EXPECT_EQ(read_docs(name + "_sft_document_loss_mask", loom::IndexDType::kU8)[0][0], mask);
  }
  // Roles out of order, no answer: bad lines naming the reason.
  write_input(R"({"messages": [{"role": "assistant", "content": "x"}]})" "\n", "bad.jsonl");
  const CliResult bad = loom("--sft --chat-template chatml --input bad.jsonl --output-prefix b" + spm);
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("bad.jsonl:1: key 'messages': message 0: expected a user message"), std::string::npos) << bad.err;
  write_input(R"({"messages": [{"role": "user", "content": "x"}]})" "\n", "noanswer.jsonl");
  EXPECT_NE(loom("--sft --chat-template chatml --input noanswer.jsonl --output-prefix b" + spm)
                .err.find("must end with an assistant message"),
            std::string::npos);
  // GPT-2's vocabulary has none of ChatML's tokens.
  const CliResult none = loom("--sft --chat-template chatml --input in.jsonl --output-prefix g" + kNull);
  EXPECT_EQ(none.code, 2);
  EXPECT_NE(none.err.find("--chat-template chatml needs the special tokens <|im_start|> <|im_end|> in the tokenizer"),
            std::string::npos)
      << none.err;
  expect_one_line_error(loom("--chat-template chatml --input in.jsonl --output-prefix g" + kNull), "add --sft");
}

}  // namespace

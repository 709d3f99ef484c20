// GPT2BPETokenizer: ids equal the npm gpt-3-encoder (OpenAI's encoder ported to JavaScript, run with
// node) on 2 MB of data/sotu.txt and on adversarial text; GPT-2's pre-tokenizer equals the original regex
// (tests/golden/regex_split.js); decode(encode(x)) == x for any bytes; cache, threads and the heap merge
// path change nothing; bad vocab/merge files fail with UserError naming the file and line.
// The reference comparisons skip only when node or the files of scripts/setup.sh are missing.
#include <gtest/gtest.h>

#include <climits>
#include <random>
#include <thread>

#include "data/bpe.h"
#include "loom/core/check.h"
#include "tokenizer_test_util.h"

using namespace loom;
using namespace loom::test;

namespace {

const std::string kVocab = source_path("data/encoder.json");
const std::string kMerges = source_path("data/vocab.bpe");

bool have_gpt2_files() { return file_exists(kVocab) && file_exists(kMerges); }

#define REQUIRE_GPT2_FILES()                                                                   \
  if (!have_gpt2_files()) GTEST_SKIP() << "data/encoder.json, data/vocab.bpe missing (run scripts/setup.sh)"
#define REQUIRE_NODE()                                                                         \
  if (!have_node() || !file_exists(npm_modules() + "/gpt-3-encoder"))                          \
  GTEST_SKIP() << "node or data/npm/node_modules/gpt-3-encoder missing (run scripts/setup.sh)"

TokenizerConfig gpt2_config(const std::string& vocab = kVocab, const std::string& merges = kMerges) {
  TokenizerConfig cfg;
  cfg.type = "GPT2BPETokenizer";
  cfg.vocab_file = vocab;
  cfg.merge_file = merges;
  return cfg;
}

const Tokenizer& gpt2() {
  static const std::unique_ptr<Tokenizer> tok = make_tokenizer(gpt2_config());
  return *tok;
}

std::vector<std::vector<int64_t>> js_gpt2_ids(const std::vector<std::string>& texts) {
  return run_node("gpt2_encode.js", "", texts);
}

std::vector<int64_t> widen(const std::vector<int32_t>& v) { return {v.begin(), v.end()}; }

// Index of the first difference, for a readable failure.
void expect_same_ids(const std::vector<int64_t>& want, const std::vector<int64_t>& got, const std::string& text) {
  ASSERT_FALSE(want.empty());
  size_t i = 0;
  while (i < want.size() && i < got.size() && want[i] == got[i]) ++i;
  if (i == want.size() && i == got.size()) return;
  ADD_FAILURE() << "ids differ at index " << i << " of " << want.size() << " (ours: " << got.size()
                << " ids); reference " << (i < want.size() ? std::to_string(want[i]) : "<end>") << ", ours "
                << (i < got.size() ? std::to_string(got[i]) : "<end>") << "; decoded context: \""
                << gpt2().decode(std::vector<int32_t>(got.begin() + ptrdiff_t(i > 5 ? i - 5 : 0),
                                                       got.begin() + ptrdiff_t(std::min(got.size(), i + 5))))
                << "\" (text bytes " << text.size() << ")";
}

std::vector<size_t> piece_lengths(std::string_view text, PretokenPattern p) {
  std::vector<std::string_view> pieces;
  pretokenize(text, p, pieces);
  std::vector<size_t> lens;
  size_t total = 0;
  for (auto s : pieces) {
    EXPECT_FALSE(s.empty());
    EXPECT_EQ(s.data(), text.data() + total) << "pieces must tile the text in order";
    total += s.size();
    lens.push_back(s.size());
  }
  EXPECT_EQ(total, text.size());
  return lens;
}

std::vector<std::string> pieces_of(std::string_view text, PretokenPattern p) {
  std::vector<std::string_view> v;
  pretokenize(text, p, v);
  return {v.begin(), v.end()};
}

}  // namespace

// ---- pre-tokenizer ---------------------------------------------------------------------------------

TEST(PretokenizeGpt2, HandWorkedCases) {
  using V = std::vector<std::string>;
  const auto p = PretokenPattern::kGpt2;
  EXPECT_EQ(pieces_of("Hello world", p), (V{"Hello", " world"}));
  // \s+(?!\S): a run of spaces gives all but its last to the run, the last starts the next word.
  EXPECT_EQ(pieces_of("a   b", p), (V{"a", "  ", " b"}));
  EXPECT_EQ(pieces_of("a\n\nb", p), (V{"a", "\n", "\n", "b"}));
  EXPECT_EQ(pieces_of("a \n b  ", p), (V{"a", " \n", " b", "  "}));
  EXPECT_EQ(pieces_of("it's I'M you'll", p), (V{"it", "'s", " I", "'", "M", " you", "'ll"}));
  EXPECT_EQ(pieces_of("x123 45", p), (V{"x", "123", " 45"}));
  EXPECT_EQ(pieces_of("..., !?", p), (V{"...,", " !?"}));
  EXPECT_EQ(pieces_of("caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac", p), (V{"caf\xc3\xa9", " \xe6\x97\xa5\xe6\x9c\xac"}));
  // Invalid UTF-8 bytes are "other" code points of one byte; a truncated sequence too.
  EXPECT_EQ(pieces_of("a\xff" "b \xfe\xfd\xe6\x97", p), (V{"a", "\xff", "b", " \xfe\xfd\xe6\x97"}));
  // U+0085 is White_Space (Python `regex`), U+FEFF is not.
  EXPECT_EQ(pieces_of("a\xc2\x85\xc2\x85" "b\xef\xbb\xbf", p), (V{"a", "\xc2\x85", "\xc2\x85", "b", "\xef\xbb\xbf"}));
}

TEST(PretokenizeGpt2, MatchesTheRegexOnAdversarialAndRandomText) {
  if (!have_node()) GTEST_SKIP() << "node missing (run scripts/setup.sh)";
  std::vector<std::string> texts = {adversarial_text(), "\xc2\x85 x\xc2\x85\xc2\x85y \xef\xbb\xbf z  \xc2\x85"};
  for (uint32_t seed = 1; seed <= 4; ++seed) texts.push_back(random_unicode_text(6000, seed, true));
  const auto want = run_node("regex_split.js", "gpt2", texts);
  for (size_t k = 0; k < texts.size(); ++k) {
    const auto got = piece_lengths(texts[k], PretokenPattern::kGpt2);
    ASSERT_EQ(std::vector<int64_t>(got.begin(), got.end()), want[k]) << "text " << k;
  }
}

// ---- encoding against OpenAI's encoder ---------------------------------------------------------------

TEST(Gpt2Tokenizer, KnownIdsAndMetadata) {
  REQUIRE_GPT2_FILES();
  const Tokenizer& tok = gpt2();
  EXPECT_EQ(tok.name(), "GPT2BPETokenizer");
  EXPECT_EQ(tok.vocab_size(), 50257);
  EXPECT_EQ(tok.eod(), 50256);
  EXPECT_EQ(tok.encode("Hello world"), (std::vector<int32_t>{15496, 995}));
  EXPECT_EQ(tok.encode(" the"), (std::vector<int32_t>{262}));
  // "<|endoftext|>" in text is ordinary text, not the EOD token.
  EXPECT_EQ(tok.encode("<|endoftext|>"), (std::vector<int32_t>{27, 91, 437, 1659, 5239, 91, 29}));
  EXPECT_EQ(tok.decode(std::vector<int32_t>{50256}), "<|endoftext|>");
  EXPECT_TRUE(tok.encode("").empty());
}

TEST(Gpt2Tokenizer, MatchesGpt3EncoderOnTwoMegabytesOfSotu) {
  REQUIRE_GPT2_FILES();
  REQUIRE_NODE();
  if (!file_exists(source_path("data/sotu.txt"))) GTEST_SKIP() << "data/sotu.txt missing (run scripts/setup.sh)";
  const std::string text = sotu_prefix(2'000'000);
  ASSERT_GE(text.size(), 1'900'000u);
  const auto ours = widen(gpt2().encode(text));
  expect_same_ids(js_gpt2_ids({text})[0], ours, text);
  EXPECT_EQ(gpt2().decode(std::vector<int32_t>(ours.begin(), ours.end())), text);
}

TEST(Gpt2Tokenizer, MatchesGpt3EncoderOnAdversarialText) {
  REQUIRE_GPT2_FILES();
  REQUIRE_NODE();
  std::vector<std::string> texts = {adversarial_text(), "   leading spaces", "trailing\n\n\n", " ", "\n",
                                    "a", "'s", "  \t \n"};
  for (uint32_t seed = 10; seed < 13; ++seed) texts.push_back(random_unicode_text(2500, seed, false));
  const auto want = js_gpt2_ids(texts);
  for (size_t k = 0; k < texts.size(); ++k) expect_same_ids(want[k], widen(gpt2().encode(texts[k])), texts[k]);
}

// ---- round trip, cache, threads, merge paths ------------------------------------------------------

TEST(Gpt2Tokenizer, DecodeInvertsEncodeOnArbitraryBytes) {
  REQUIRE_GPT2_FILES();
  const Tokenizer& tok = gpt2();
  std::vector<std::string> texts = {adversarial_text(), "\xff\xfe\xfd", "a\xc3(b\xed\xa0\x80z\xf4\x90\x80\x80!",
                                    std::string("nul\0byte", 8), "\xc0\xaf overlong"};
  std::mt19937 rng(7);
  for (int k = 0; k < 50; ++k) {
    std::string s(size_t(rng() % 300), '\0');
    for (char& c : s) c = char(rng() % 256);
    texts.push_back(s);
  }
  for (const std::string& t : texts) {
    const auto ids = tok.encode(t);
    for (const int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok.vocab_size());
    ASSERT_EQ(tok.decode(ids), t);
  }
  EXPECT_THROW(tok.decode(std::vector<int32_t>{50257}), UserError);
  EXPECT_THROW(tok.decode(std::vector<int32_t>{-1}), UserError);
}

TEST(Gpt2Tokenizer, CacheAndThreadsDoNotChangeIds) {
  REQUIRE_GPT2_FILES();
  const auto uncached = bpe::make_gpt2_bpe_tokenizer(gpt2_config(), bpe::BpeOptions{.cache = false});
  std::string text = adversarial_text();
  if (file_exists(source_path("data/sotu.txt"))) text += sotu_prefix(200'000);
  const auto want = uncached->encode(text);
  EXPECT_EQ(gpt2().encode(text), want);
  EXPECT_EQ(gpt2().encode(text), want);  // now mostly from the cache
  const auto fresh = make_tokenizer(gpt2_config());
  std::vector<std::vector<int32_t>> got(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back([&, t] { for (int r = 0; r < 3; ++r) got[size_t(t)] = fresh->encode(text); });
  for (auto& th : threads) th.join();
  for (const auto& g : got) EXPECT_EQ(g, want);
}

// The heap merge (long words) and the scan merge (short words) agree, in both merge orders, on a
// synthetic table with rank ties, overlapping pairs and repeated symbols.
TEST(BpeMerge, HeapAndScanAgree) {
  // GPT-2 tables have one rank per pair; tiktoken tables share a rank among the splits of a token,
  // imitated here by giving pairs of merges one rank (r / 2).
  bpe::PairTable unique_ranks, shared_ranks;
  std::mt19937 rng(3);
  const int32_t kBase = 6;  // symbols 0..5 are "bytes"; merges create 6, 7, ...
  int32_t next_id = kBase;
  for (int r = 0; r < 60; ++r) {
    const int32_t a = int32_t(rng() % uint32_t(next_id)), b = int32_t(rng() % uint32_t(next_id));
    unique_ranks.insert(a, b, r, next_id);
    shared_ranks.insert(a, b, r / 2, next_id++);
  }
  bpe::MergeScratch scratch;
  int merged_something = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<int32_t> word(size_t(2 + rng() % (bpe::kHeapThreshold - 1)));
    for (auto& s : word) s = int32_t(rng() % uint32_t(trial % 2 ? 2 : kBase));  // few symbols -> repeats
    for (const auto order : {bpe::MergeOrder::kAllOccurrences, bpe::MergeOrder::kLeftmostSingle}) {
      const bpe::PairTable& table = order == bpe::MergeOrder::kAllOccurrences ? unique_ranks : shared_ranks;
      std::vector<int32_t> scan = word, heap = word;
      bpe::merge(scan, table, order, scratch, false);
      bpe::merge(heap, table, order, scratch, true);
      ASSERT_EQ(scan, heap) << "trial " << trial << " order " << int(order);
      merged_something += scan.size() < word.size();
    }
  }
  EXPECT_GT(merged_something, 3000);  // the table is dense enough to exercise long merge chains
}

// OpenAI's order (all occurrences of the best pair per round) and tiktoken's (one at a time) differ
// when a merge creates a pair ranked below the round's pair; check that case by hand.
TEST(BpeMerge, RoundSemanticsOfTheGpt2Encoder) {
  bpe::PairTable table;
  table.insert(0, 1, 5, 2);  // a b -> X (rank 5)
  table.insert(2, 0, 1, 3);  // X a -> Y (rank 1, lower than the pair that creates it)
  bpe::MergeScratch scratch;
  for (const bool heap : {false, true}) {
    std::vector<int32_t> w = {0, 1, 0, 1};  // a b a b
    bpe::merge(w, table, bpe::MergeOrder::kAllOccurrences, scratch, heap);
    EXPECT_EQ(w, (std::vector<int32_t>{2, 2})) << "round merges both (a b) before looking at (X a)";
    w = {0, 1, 0, 1};
    bpe::merge(w, table, bpe::MergeOrder::kLeftmostSingle, scratch, heap);
    EXPECT_EQ(w, (std::vector<int32_t>{3, 1})) << "one merge at a time takes (X a) next";
  }
}

// ---- file errors ----------------------------------------------------------------------------------

namespace {

// A tiny valid vocabulary: the 256 byte tokens (ids 0..255), "ab" (256), "<|endoftext|>" (257).
std::string tiny_vocab_json(const std::string& extra = "") {
  std::string j = "{";
  for (int b = 0; b < 256; ++b) {
    std::string s;
    bpe::append_utf8(bpe::byte_to_unicode(uint8_t(b)), s);
    if (s == "\"" || s == "\\") s = "\\" + s;
    j += "\"" + s + "\": " + std::to_string(b) + ",\n";
  }
  j += "\"ab\": 256,\n\"<|endoftext|>\": 257" + extra + "}";
  return j;
}

std::string error_of(const TokenizerConfig& cfg) {
  try {
    make_tokenizer(cfg);
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(Gpt2Tokenizer, TinyVocabularyWorks) {
  const std::string v = write_temp(tiny_vocab_json()), m = write_temp("#version: 0.2\na b\n");
  const auto tok = make_tokenizer(gpt2_config(v, m));
  EXPECT_EQ(tok->vocab_size(), 258);
  EXPECT_EQ(tok->eod(), 257);
  EXPECT_EQ(tok->encode("abab"), (std::vector<int32_t>{256, 256}));
  EXPECT_EQ(tok->encode("aab"), (std::vector<int32_t>{'a', 256}));  // byte b has id b here
  // As in Megatron's reader, a last merge line without a newline is not read.
  const std::string m2 = write_temp("#version: 0.2\na b");
  EXPECT_EQ(make_tokenizer(gpt2_config(v, m2))->encode("ab").size(), 2u);
}

TEST(Gpt2Tokenizer, BadFilesNameTheFileAndLine) {
  const std::string good_v = write_temp(tiny_vocab_json()), good_m = write_temp("#version: 0.2\na b\n");
  auto expect_error = [&](const std::string& v, const std::string& m, const std::vector<std::string>& parts) {
    const std::string msg = error_of(gpt2_config(v, m));
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  };
  expect_error("/nonexistent/encoder.json", good_m, {"--vocab-file", "/nonexistent/encoder.json", "cannot open"});
  expect_error(good_v, "/nonexistent/vocab.bpe", {"--merge-file", "/nonexistent/vocab.bpe", "cannot open"});
  TokenizerConfig no_merges = gpt2_config(good_v, "");
  EXPECT_NE(error_of(no_merges).find("--merge-file"), std::string::npos);

  std::string garbled = tiny_vocab_json();
  garbled.replace(garbled.find("\"ab\": 256"), 9, "\"ab\" 256");
  const std::string gv = write_temp(garbled);
  expect_error(gv, good_m, {gv, "line 257", "expected ':'"});
  expect_error(write_temp(tiny_vocab_json(",\n\"zz\": 1.5")), good_m, {"line 259", "not an integer"});
  expect_error(write_temp(tiny_vocab_json(",\n\"zz\": 7")), good_m, {"line 259", "\"zz\" has id 7, already used"});
  expect_error(write_temp(tiny_vocab_json(",\n\"zz\": 999")), good_m, {"line 259", "ids must be in [0, 259)"});
  expect_error(write_temp(tiny_vocab_json(",\n\"ab\": 258")), good_m, {"line 259", "appears twice"});
  expect_error(write_temp("[1, 2]"), good_m, {"line 1, column 1", "expected '{'"});
  expect_error(write_temp("{\"a\": 0"), good_m, {"expected ',' or '}'"});
  std::string no_eot = tiny_vocab_json();
  const std::string eot_entry = ",\n\"<|endoftext|>\": 257";
  no_eot.replace(no_eot.find(eot_entry), eot_entry.size(), "");
  expect_error(write_temp(no_eot), good_m, {"<|endoftext|>"});
  std::string no_byte = tiny_vocab_json();
  const std::string byte0_entry = "\"\xc4\x80\": 0,";  // byte 0x00 is U+0100 in GPT-2's byte alphabet
  no_byte.replace(no_byte.find(byte0_entry), byte0_entry.size(), "\"zz\": 0,");
  expect_error(write_temp(no_byte), good_m, {"no token for byte 0x00"});

  expect_error(good_v, write_temp("a b\n"), {"line 1", "#version"});
  const std::string three = write_temp("#version: 0.2\na b\nc d e\n");
  expect_error(good_v, three, {three, "line 3", "expected two tokens"});
  expect_error(good_v, write_temp("#version: 0.2\na b\n\nab zz\n"), {"line 4", "token \"zz\" is not in the --vocab-file"});
  expect_error(good_v, write_temp("#version: 0.2\nb c\n"), {"line 2", "merged token \"bc\""});
}

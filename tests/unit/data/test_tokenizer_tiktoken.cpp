// TikTokenizer: ranks equal the npm gpt-tokenizer (tiktoken ported to JavaScript, run with node) for
// cl100k_base and r50k_base on 1 MB of data/sotu.txt and adversarial text, shifted by the special-token
// count; Megatron's layout (special tokens, EOD, --vocab-size cut, its JSON rank format); the
// cl100k / Megatron v1 / v2 pre-tokenizers equal the original regexes (tests/golden/regex_split.js);
// r50k through TikTokenizer equals GPT2BPETokenizer; bad rank files fail naming the file and line.
// The reference comparisons skip only when node or the files of scripts/setup.sh are missing.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "data/bpe.h"
#include "loom/core/check.h"
#include "tokenizer_test_util.h"

using namespace loom;
using namespace loom::test;

namespace {

std::string rank_file(const std::string& encoding) {
  return npm_modules() + "/gpt-tokenizer/data/" + encoding + ".tiktoken";
}

#define REQUIRE_RANKS(enc) \
  if (!file_exists(rank_file(enc))) GTEST_SKIP() << rank_file(enc) << " missing (run scripts/setup.sh)"
#define REQUIRE_NODE() \
  if (!have_node()) GTEST_SKIP() << "node missing (run scripts/setup.sh)"

TokenizerConfig tik_config(const std::string& model, const std::string& pattern, int64_t num_special = 1000) {
  TokenizerConfig cfg;
  cfg.type = "TikTokenizer";
  cfg.tokenizer_model = model;
  cfg.tiktoken_pattern = pattern;
  cfg.tiktoken_num_special_tokens = num_special;
  return cfg;
}

const Tokenizer& cl100k() {
  static const std::unique_ptr<Tokenizer> tok = make_tokenizer(tik_config(rank_file("cl100k_base"), "cl100k"));
  return *tok;
}
const Tokenizer& r50k() {
  static const std::unique_ptr<Tokenizer> tok = make_tokenizer(tik_config(rank_file("r50k_base"), "gpt2"));
  return *tok;
}

// Our ids minus the 1000 special tokens, against gpt-tokenizer's ranks; reports the first difference.
void compare_with_js(const Tokenizer& tok, const std::string& encoding, const std::vector<std::string>& texts) {
  const auto want = run_node("tiktoken_encode.js", encoding, texts);
  for (size_t k = 0; k < texts.size(); ++k) {
    const auto ids = tok.encode(texts[k]);
    std::vector<int64_t> got;
    for (const int32_t id : ids) got.push_back(int64_t(id) - 1000);
    ASSERT_FALSE(want[k].empty());
    size_t i = 0;
    while (i < want[k].size() && i < got.size() && want[k][i] == got[i]) ++i;
    EXPECT_TRUE(i == want[k].size() && i == got.size())
        << encoding << " text " << k << ": ranks differ at index " << i << " of " << want[k].size()
        << "; decoded context: \""
        << tok.decode(std::vector<int32_t>(ids.begin() + ptrdiff_t(i > 5 ? i - 5 : 0),
                                           ids.begin() + ptrdiff_t(std::min(ids.size(), i + 5))))
        << "\"";
    EXPECT_EQ(tok.decode(ids), texts[k]);
  }
}

std::vector<int64_t> piece_lengths(std::string_view text, PretokenPattern p) {
  std::vector<std::string_view> pieces;
  pretokenize(text, p, pieces);
  std::vector<int64_t> lens;
  size_t total = 0;
  for (auto s : pieces) {
    EXPECT_EQ(s.data(), text.data() + total) << "pieces must tile the text in order";
    total += s.size();
    lens.push_back(int64_t(s.size()));
  }
  EXPECT_EQ(total, text.size());
  return lens;
}

std::vector<std::string> pieces_of(std::string_view text, PretokenPattern p) {
  std::vector<std::string_view> v;
  pretokenize(text, p, v);
  return {v.begin(), v.end()};
}

std::string error_of(const TokenizerConfig& cfg) {
  try {
    make_tokenizer(cfg);
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no error)";
}

std::string b64(std::string_view bytes) {
  static const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < bytes.size(); i += 3) {
    uint32_t x = uint32_t(uint8_t(bytes[i])) << 16;
    if (i + 1 < bytes.size()) x |= uint32_t(uint8_t(bytes[i + 1])) << 8;
    if (i + 2 < bytes.size()) x |= uint32_t(uint8_t(bytes[i + 2]));
    out += a[x >> 18];
    out += a[(x >> 12) & 63];
    out += i + 1 < bytes.size() ? a[(x >> 6) & 63] : '=';
    out += i + 2 < bytes.size() ? a[x & 63] : '=';
  }
  return out;
}

// All 256 bytes in byte order, then "ab", "abc", " t", " th" (ranks 256..259).
std::string small_rank_text(const std::string& extra = "") {
  std::string t;
  for (int b = 0; b < 256; ++b) t += b64(std::string(1, char(b))) + " " + std::to_string(b) + "\n";
  t += b64("ab") + " 256\n" + b64("abc") + " 257\n" + b64(" t") + " 258\n" + b64(" th") + " 259\n";
  return t + extra;
}

}  // namespace

// ---- pre-tokenizers --------------------------------------------------------------------------------

TEST(PretokenizeTiktoken, HandWorkedCases) {
  using V = std::vector<std::string>;
  const auto cl = PretokenPattern::kCl100k, v1 = PretokenPattern::kMegatronV1, v2 = PretokenPattern::kMegatronV2;
  // cl100k: case-insensitive contractions (with U+017F), one-character prefixes, 1-3 digit groups.
  EXPECT_EQ(pieces_of("I'M they'RE it'\xc5\xbf", cl), (V{"I", "'M", " they", "'RE", " it", "'\xc5\xbf"}));
  EXPECT_EQ(pieces_of("(word \tx 1234567", cl), (V{"(word", " ", "\tx", " ", "123", "456", "7"}));
  EXPECT_EQ(pieces_of("a.\n\nb  \n  c", cl), (V{"a", ".\n\n", "b", "  \n", " ", " c"}));
  EXPECT_EQ(pieces_of("x\r\n", cl), (V{"x", "\r\n"}));
  // Megatron v1: single digits, no contractions.
  EXPECT_EQ(pieces_of("it's 123", v1), (V{"it", "'s", " ", "1", "2", "3"}));
  // Megatron v2: case runs split camel case; marks join letters; '/' trails punctuation.
  EXPECT_EQ(pieces_of("HelloWorld HTTPServer", v2), (V{"Hello", "World", " HTTPServer"}));
  EXPECT_EQ(pieces_of("ABC def", v2), (V{"ABC", " def"}));
  EXPECT_EQ(pieces_of("e\xcc\x81t\xc3\xa9 a.//b", v2), (V{"e\xcc\x81t\xc3\xa9", " a", ".//", "b"}));
  EXPECT_EQ(pieces_of("\xcc\x81" "A", v2), (V{"\xcc\x81", "A"}));
}

TEST(PretokenizeTiktoken, MatchesTheRegexesOnAdversarialAndRandomText) {
  REQUIRE_NODE();
  std::vector<std::string> texts = {adversarial_text(), "\xc2\x85 x\xc2\x85\xc2\x85y \xef\xbb\xbf z  \xc2\x85",
                                    "it'\xc5\xbf IT'\xc5\xbf \xcc\x81\xcc\x81" "A\xcc\x81" "B \xcc\x81" "a"};
  for (uint32_t seed = 1; seed <= 4; ++seed) texts.push_back(random_unicode_text(6000, seed, true));
  const std::pair<const char*, PretokenPattern> patterns[] = {{"cl100k", PretokenPattern::kCl100k},
                                                              {"megatron_v1", PretokenPattern::kMegatronV1},
                                                              {"megatron_v2", PretokenPattern::kMegatronV2}};
  for (const auto& [name, pattern] : patterns) {
    const auto want = run_node("regex_split.js", name, texts);
    for (size_t k = 0; k < texts.size(); ++k) ASSERT_EQ(piece_lengths(texts[k], pattern), want[k]) << name << " text " << k;
  }
}

// ---- encodings against tiktoken ---------------------------------------------------------------------

TEST(TikTokenizer, Cl100kMatchesGptTokenizer) {
  REQUIRE_RANKS("cl100k_base");
  REQUIRE_NODE();
  std::vector<std::string> texts = {adversarial_text(), "hello world", "   x", "a\n\n\nb", "1234567 89"};
  for (uint32_t seed = 20; seed < 23; ++seed) texts.push_back(random_unicode_text(3000, seed, false) + " \n");
  if (file_exists(source_path("data/sotu.txt"))) texts.push_back(sotu_prefix(1'000'000));
  compare_with_js(cl100k(), "cl100k_base", texts);
}

TEST(TikTokenizer, R50kMatchesGptTokenizer) {
  REQUIRE_RANKS("r50k_base");
  REQUIRE_NODE();
  std::vector<std::string> texts = {adversarial_text(), "trailing  \n  "};
  for (uint32_t seed = 30; seed < 33; ++seed) texts.push_back(random_unicode_text(3000, seed, false));
  if (file_exists(source_path("data/sotu.txt"))) texts.push_back(sotu_prefix(1'000'000));
  compare_with_js(r50k(), "r50k_base", texts);
}

// tiktoken's r50k_base is GPT-2's vocabulary: the two tokenizers agree (ranks = GPT-2 ids).
TEST(TikTokenizer, R50kEqualsGpt2BpeTokenizer) {
  REQUIRE_RANKS("r50k_base");
  const std::string vocab = source_path("data/encoder.json"), merges = source_path("data/vocab.bpe");
  if (!file_exists(vocab) || !file_exists(merges)) GTEST_SKIP() << "data/encoder.json missing (run scripts/setup.sh)";
  TokenizerConfig cfg;
  cfg.type = "GPT2BPETokenizer";
  cfg.vocab_file = vocab;
  cfg.merge_file = merges;
  const auto gpt2 = make_tokenizer(cfg);
  std::string text = adversarial_text() + random_unicode_text(5000, 5, true);
  if (file_exists(source_path("data/sotu.txt"))) text += sotu_prefix(3'000'000);
  const auto a = gpt2->encode(text), b = r50k().encode(text);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i] + 1000, b[i]) << "at " << i;
}

// ---- Megatron's layout ------------------------------------------------------------------------------

TEST(TikTokenizer, SpecialTokensEodAndIdShift) {
  const std::string path = write_temp(small_rank_text());
  const auto tok = make_tokenizer(tik_config(path, "v2", 1000));
  EXPECT_EQ(tok->name(), "TikTokenizer");
  EXPECT_EQ(tok->vocab_size(), 1260);
  EXPECT_EQ(tok->eod(), 2);
  EXPECT_EQ(tok->decode(std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 999}),
            "<unk><s></s><mask><pad><cls><sep><SPECIAL_7><SPECIAL_999>");
  EXPECT_EQ(tok->encode("abc"), (std::vector<int32_t>{1257}));  // a whole-piece token: rank 257
  EXPECT_EQ(tok->encode("abab"), (std::vector<int32_t>{1256, 1256}));
  EXPECT_EQ(tok->encode(" the"), (std::vector<int32_t>{1259, 1000 + 'e'}));
  EXPECT_EQ(tok->encode("</s>"), (std::vector<int32_t>{1000 + '<', 1000 + '/', 1000 + 's', 1000 + '>'}));
  const auto tok7 = make_tokenizer(tik_config(path, "v2", 7));
  EXPECT_EQ(tok7->vocab_size(), 267);
  EXPECT_EQ(tok7->encode("abab"), (std::vector<int32_t>{263, 263}));
  EXPECT_THROW(tok->decode(std::vector<int32_t>{1260}), UserError);
}

TEST(TikTokenizer, VocabSizeKeepsTheLowestRanks) {
  REQUIRE_RANKS("cl100k_base");
  TokenizerConfig cfg = tik_config(rank_file("cl100k_base"), "cl100k");
  cfg.vocab_size = 1000 + 5000;
  const auto tok = make_tokenizer(cfg);
  EXPECT_EQ(tok->vocab_size(), 6000);
  const std::string text = adversarial_text();
  const auto ids = tok->encode(text);
  for (const int32_t id : ids) ASSERT_TRUE(id >= 1000 && id < 6000);
  EXPECT_GT(ids.size(), cl100k().encode(text).size());  // fewer merges available
  EXPECT_EQ(tok->decode(ids), text);
  cfg.vocab_size = 1000 + 100256 + 1;
  EXPECT_NE(error_of(cfg).find("has 100256 ranks"), std::string::npos) << error_of(cfg);
}

// Megatron's JSON rank format and tiktoken's text format give the same tokenizer.
TEST(TikTokenizer, MegatronJsonFormatEqualsTextFormat) {
  REQUIRE_RANKS("cl100k_base");
  // Bytes first in byte order (Megatron's rule), then cl100k's multi-byte tokens in rank order.
  const std::string cl = read_all(rank_file("cl100k_base"));
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(std::string(1, char(b)));
  std::istringstream is(cl);
  std::string tok_b64, rank;
  std::string decoded;
  while (is >> tok_b64 >> rank) {
    ASSERT_TRUE(bpe::base64_decode(tok_b64, decoded));
    if (decoded.size() > 1) tokens.push_back(decoded);
    if (tokens.size() == 20000) break;
  }
  std::string text_fmt, json = "[";
  for (size_t r = 0; r < tokens.size(); ++r) {
    text_fmt += b64(tokens[r]) + " " + std::to_string(r) + "\n";
    json += std::string(r ? ",\n" : "") + "{\"rank\": " + std::to_string(r) + ", \"token_bytes\": \"" +
            b64(tokens[r]) + "\", \"token_str\": \"\"}";
  }
  json += "]";
  const auto a = make_tokenizer(tik_config(write_temp(text_fmt), "v2"));
  const auto b = make_tokenizer(tik_config(write_temp(json, ".json"), "v2"));
  EXPECT_EQ(a->vocab_size(), 21000);
  EXPECT_EQ(b->vocab_size(), 21000);
  const std::string text = adversarial_text() + random_unicode_text(3000, 9, true);
  const auto ids = a->encode(text);
  EXPECT_EQ(b->encode(text), ids);
  EXPECT_EQ(a->decode(ids), text);
}

TEST(TikTokenizer, DecodeInvertsEncodeOnArbitraryBytesForEveryPattern) {
  REQUIRE_RANKS("cl100k_base");
  std::vector<std::string> texts = {adversarial_text(), "\xff\xfe", "a\xc3(b\xed\xa0\x80z\xf4\x90\x80\x80!",
                                    std::string("nul\0byte", 8)};
  std::mt19937 rng(11);
  for (int k = 0; k < 40; ++k) {
    std::string s(size_t(rng() % 400), '\0');
    for (char& c : s) c = char(rng() % 256);
    texts.push_back(s);
  }
  for (const char* pattern : {"v1", "v2", "gpt2", "cl100k"}) {
    const auto tok = make_tokenizer(tik_config(rank_file("cl100k_base"), pattern));
    const auto uncached = bpe::make_tiktoken_tokenizer(tik_config(rank_file("cl100k_base"), pattern),
                                                       bpe::BpeOptions{.cache = false});
    for (const auto& t : texts) {
      const auto ids = tok->encode(t);
      for (const int32_t id : ids) ASSERT_TRUE(id >= 1000 && id < tok->vocab_size());
      ASSERT_EQ(tok->decode(ids), t) << pattern;
      ASSERT_EQ(uncached->encode(t), ids) << pattern;
    }
  }
}

// ---- file and flag errors ---------------------------------------------------------------------------

TEST(TikTokenizer, BadFilesAndFlagsNameTheFileAndLine) {
  auto expect_error = [](const TokenizerConfig& cfg, const std::vector<std::string>& parts) {
    const std::string msg = error_of(cfg);
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  };
  const std::string good = write_temp(small_rank_text());
  expect_error(tik_config("/nonexistent/x.tiktoken", "v2"), {"--tokenizer-model", "/nonexistent/x.tiktoken"});
  expect_error(tik_config("", "v2"), {"--tokenizer-model"});
  expect_error(tik_config(good, "v3"), {"--tiktoken-pattern", "'v3'"});
  expect_error(tik_config(good, "v2", 5), {"--tiktoken-num-special-tokens", "got 5"});

  const std::string bad64 = write_temp(small_rank_text("YW*= 260\n"));
  expect_error(tik_config(bad64, "v2"), {bad64, "line 261", "is not base64"});
  expect_error(tik_config(write_temp(small_rank_text("YWJj\n")), "v2"), {"line 261", "no space"});
  expect_error(tik_config(write_temp(small_rank_text("YWJjZA== x7\n")), "v2"), {"line 261", "rank \"x7\""});
  expect_error(tik_config(write_temp(small_rank_text("YWJjZA== 259\n")), "v2"), {"line 261", "rank 259 appears twice"});
  expect_error(tik_config(write_temp(small_rank_text("YWJj 260\n")), "v2"), {"line 261", "same token appears twice"});
  expect_error(tik_config(write_temp(small_rank_text("YWJjZA== 262\n")), "v2"), {"rank 260 is missing"});
  std::string no_byte = small_rank_text();
  no_byte.replace(0, no_byte.find('\n') + 1, b64("zz") + " 0\n");  // byte 0 missing
  expect_error(tik_config(write_temp(no_byte), "v2"), {"single byte 0"});

  const std::string json_bad = write_temp("[{\"rank\": 0, \"token_bytes\": \"AA==\"},\n {\"rank\": 5}]", ".json");
  expect_error(tik_config(json_bad, "v2"), {json_bad, "entry 1"});
  expect_error(tik_config(write_temp("[{\"rank\": 0, \"token_bytes\": \"AQ==\"}]"), "v2"), {"entry 0", "single bytes"});
  expect_error(tik_config(write_temp("[\n{\"rank\": 0,,}]"), "v2"), {"line 2", "invalid JSON"});
  // A number too large for a double is nlohmann's out_of_range, not a parse_error: still the file's
  // UserError (fuzz_tiktoken_ranks found it escaping as an internal error).
  const std::string overflow = write_temp("[{\"rank\": 1022e222222}]", ".json");
  expect_error(tik_config(overflow, "v2"), {overflow, "invalid JSON", "number overflow"});
  TokenizerConfig small = tik_config(good, "v2");
  small.vocab_size = 1000;
  expect_error(small, {"--vocab-size 1000"});
}

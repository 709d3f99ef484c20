// Helpers shared by the byte-level BPE tokenizer tests: temp files, running the node reference scripts
// in tests/golden, the data files scripts/setup.sh installs, and adversarial text samples.
#pragma once
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

namespace loom::test {

inline std::string source_path(const std::string& rel) { return std::string(LOOM_SOURCE_DIR) + "/" + rel; }
inline std::string npm_modules() { return source_path("data/npm/node_modules"); }
inline bool file_exists(const std::string& p) { return std::filesystem::exists(p); }

inline bool have_node() {
  static const bool ok = std::system("node --version > /dev/null 2>&1") == 0;
  return ok;
}

// Temp files live until the test program exits.
struct TempFiles {
  std::vector<std::string> paths;
  ~TempFiles() {
    std::error_code ec;
    for (const auto& p : paths) std::filesystem::remove(p, ec);
  }
};
inline TempFiles temp_files;

inline std::string write_temp(const std::string& content, const std::string& suffix = "") {
  static int counter = 0;
  const auto dir = std::filesystem::temp_directory_path();
  const std::string path = (dir / ("loom_tok_" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + suffix)).string();
  std::ofstream f(path, std::ios::binary);
  f.write(content.data(), std::streamsize(content.size()));
  temp_files.paths.push_back(path);
  return path;
}

inline std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Runs a shell command and returns its stdout; fails the test on a non-zero exit.
inline std::string run_capture(const std::string& cmd) {
  const std::string out_path = write_temp("", ".out");
  const int rc = std::system((cmd + " > '" + out_path + "'").c_str());
  EXPECT_EQ(rc, 0) << "command failed: " << cmd;
  std::string out = read_all(out_path);
  std::filesystem::remove(out_path);
  return out;
}

inline std::vector<int64_t> parse_ints(const std::string& s) {
  std::vector<int64_t> v;
  std::istringstream is(s);
  int64_t x;
  while (is >> x) v.push_back(x);
  return v;
}

// Runs `node tests/golden/<script> <args> FILE...` with each text in a temp file; one int list per text.
inline std::vector<std::vector<int64_t>> run_node(const std::string& script, const std::string& args,
                                                  const std::vector<std::string>& texts) {
  std::string cmd = "node '" + source_path("tests/golden/" + script) + "' " + args;
  std::vector<std::string> paths;
  for (const auto& t : texts) {
    paths.push_back(write_temp(t, ".txt"));
    cmd += " '" + paths.back() + "'";
  }
  const std::string out = run_capture(cmd);
  for (const auto& p : paths) std::filesystem::remove(p);
  std::vector<std::vector<int64_t>> lists;
  size_t start = 0;
  for (size_t nl; (nl = out.find('\n', start)) != std::string::npos; start = nl + 1)
    lists.push_back(parse_ints(out.substr(start, nl - start)));
  EXPECT_EQ(lists.size(), texts.size()) << "node output: " << out.substr(0, 300);
  lists.resize(texts.size());
  return lists;
}

// The first `bytes` bytes of data/sotu.txt, cut back to the end of a line.
inline std::string sotu_prefix(size_t bytes) {
  std::string t = read_all(source_path("data/sotu.txt"));
  if (t.size() > bytes) t.resize(t.rfind('\n', bytes) + 1);
  return t;
}

// Text a tokenizer should survive: scripts, emoji, combining marks, RTL, digits, contractions in both
// cases, runs of spaces/tabs/newlines, CRLF, control characters, a long unbroken word. All valid UTF-8,
// no U+0085 / U+FEFF (JavaScript's \s disagrees with Unicode White_Space on those) and no 'ſ, so the
// JavaScript references apply; it ends in " \n" (gpt-tokenizer's cl100k regex splits some other
// trailing whitespace differently from tiktoken).
inline std::string adversarial_text() {
  std::string t;
  t += "Hello world! The quick brown fox. GPT-2's tokenizer, isn't it? I'M SURE THEY'RE HERE; WE'VE GOT IT.\n";
  t += "don't won't y'all 's 'S 't 'T 're 'RE 've 'Ve 'm 'M 'll 'LL 'Ll 'd 'D '' '''s ''x 'x a's\n";
  t += "Emoji: 😀😃😄 👨‍👩‍👧‍👦 👍🏽 🇺🇸🇫🇷 ❤️ ☃ ✈︎ 🧑🏿‍🚀\n";
  t += "CJK: 日本語のテキストです。中文字符和标点，한국어 텍스트입니다. ｶﾀｶﾅ ＡＢＣ１２３\n";
  t += "Combining: e\xcc\x81 a\xcc\x80\xcc\x80 Z\xcd\x91\xcc\x80\xcc\x80o n\xcc\x83 \xcc\x81" "alone \xe0\xa4\xa8\xe0\xa4\xae\xe0\xa4\xb8\xe0\xa5\x8d\xe0\xa4\xa4\xe0\xa5\x87 \xe0\xb8\xaa\xe0\xb8\xa7\xe0\xb8\xb1\xe0\xb8\xaa\xe0\xb8\x94\xe0\xb8\xb5\n";
  t += "Accents: café naïve Ångström Straße ÉCOLE façade Œuvre ǅungla ʰaspirated ĳ ﬁne\n";
  t += "RTL: مرحبا بالعالم שָׁלוֹם עולם ١٢٣٤٥\n";
  t += "Numbers: abc123def 4567890 3.14159 1,000,000 12a34b56 ²³ ½ Ⅻ ⅷ 0x1F 007 1e10 -42 +7\n";
  t += "Spaces:  two   three    four\t\ttabs \t mixed\n\n\nthree newlines \n \n spaced\n";
  t += "CRLF line\r\nnext\r\n\r\nafter blank\r\n  indented\r\n";
  t += "Trailing   \nwhitespace\t\n   \n";
  t += "Controls: \x01\x02\x1b[31mred\x1b[0m \x7f \x1c\x1d\x1e\x1f end\x0b\x0c.\n";
  t += "Unicode spaces: a\xc2\xa0" "b c\xe3\x80\x80" "d e\xe2\x80\xa8" "f g\xe2\x80\x83h\n";
  t += "Code: for(i=0;i<10;i++){x+=y[i];} // comment /* c */ #include <a.h> https://example.com/a/b?c=d&e=f\n";
  t += "Symbols: ∑∫√∞ ≠≤≥ ©®™ §¶ •… “quoted” ‘single’ — – ‐ «»\n";
  t += "<|endoftext|> is plain text here <|endoftext|>\n";
  t += "Long: ";
  for (int i = 0; i < 40; ++i) t += "supercalifragilistic";
  t += " ";
  for (int i = 0; i < 30; ++i) t += "漢字";
  t += " aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\n";
  t += "The end, with trailing spaces  \n";
  return t;
}

// Deterministic random text drawn from characters of every class the pre-tokenizers distinguish
// (letters of each case class, marks, numbers, each kind of whitespace, punctuation, quotes, '/').
// `full` adds U+0085, U+FEFF and U+017F (long s), on which the JavaScript encoders' regexes differ from
// Python's / Rust's (White_Space, case folding); regex_split.js handles them.
inline std::string random_unicode_text(size_t n_chars, uint32_t seed, bool full) {
  static const std::vector<std::string> pool = {
      "a", "b", "s", "t", "r", "e", "v", "m", "l", "d", "S", "T", "R", "E", "V", "M", "L", "D", "Q", "z",
      "'", "'", "'", " ", " ", " ", " ", "\t", "\n", "\n", "\r", "\r\n", "\x0b", "\x0c", "\xc2\xa0",
      "\xe3\x80\x80", "\xe2\x80\xa8", "1", "2", "9", "\xd9\xa3", "\xc2\xb2", "\xe2\x85\xab", ".", ",", "!",
      "/", "/", "-", "(", "\"", "\xc7\x85", "\xca\xb0", "\xe6\x97\xa5", "\xe3\x81\xae",
      "\xcc\x81", "\xcc\x80", "\xe0\xa5\x8d", "\xe0\xa4\xbe", "\xc3\xa9", "\xc3\x89", "\xce\xa3",
      "\xcf\x83", "\xf0\x9f\x98\x80", "\xe2\x80\x8d", "\xef\xb8\x8f", "\x01", "\x1c", "\xe2\x88\x91"};
  static const std::vector<std::string> extra = {"\xc2\x85", "\xef\xbb\xbf", "\xc5\xbf"};
  std::mt19937 rng(seed);
  std::string t;
  for (size_t i = 0; i < n_chars; ++i) {
    if (full && rng() % 30 == 0)
      t += extra[rng() % extra.size()];
    else
      t += pool[rng() % pool.size()];
  }
  return t;
}

}  // namespace loom::test

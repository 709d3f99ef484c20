// GPT2BPETokenizer (Megatron's _GPT2BPETokenizer = OpenAI's GPT-2 encoder): --vocab-file encoder.json
// maps byte-level token strings to ids, --merge-file vocab.bpe lists merges in rank order after a
// "#version" line. Text is split with GPT-2's pattern, each piece's bytes become byte-level symbols, and
// merges run in OpenAI's order (lowest-ranked pair, every occurrence, repeat). "<|endoftext|>" in the
// text is ordinary text, as in OpenAI's encode(); its id is the EOD. vocab_size = entries of encoder.json.
// Invariants: ids are dense in [0, vocab_size); every byte, merge part and merge result is a vocabulary
// token (checked at load, so encode cannot fail); decode maps each token back to its bytes, so
// decode(encode(x)) == x for any bytes x.
// Like Megatron's reader (read().split('\n')[1:-1]), the merge file's last line counts only when it ends
// with a newline, and a repeated merge keeps its later rank.
#include <charconv>
#include <unordered_map>

#include "data/bpe.h"
#include "loom/core/check.h"
#include "loom/core/file_io.h"

namespace loom {

namespace {

constexpr std::string_view kEndOfText = "<|endoftext|>";

// Reader for encoder.json: one JSON object of string -> integer, errors with line and column.
class VocabJsonReader {
 public:
  VocabJsonReader(const std::string& path, std::string_view text) : path_(path), t_(text) {}

  std::vector<std::pair<std::string, int64_t>> read() {
    std::vector<std::pair<std::string, int64_t>> out;
    ws();
    expect('{', "'{' (encoder.json is one JSON object of token -> id)");
    ws();
    if (peek() == '}') {
      ++i_;
    } else {
      for (;;) {
        ws();
        const size_t key_at = i_;
        std::string key = string();
        ws();
        expect(':', "':'");
        ws();
        const int64_t id = integer(key);
        out.emplace_back(std::move(key), id);
        key_offsets_.push_back(key_at);
        ws();
        if (peek() == ',') {
          ++i_;
          continue;
        }
        expect('}', "',' or '}'");
        break;
      }
    }
    ws();
    if (i_ != t_.size()) fail(i_, "unexpected text after the closing '}'");
    return out;
  }
  size_t key_offset(size_t k) const { return key_offsets_[k]; }

  [[noreturn]] void fail(size_t at, const std::string& msg) const {
    const auto [line, col] = bpe::line_col(t_, at);
    user_error("--vocab-file '", path_, "' line ", line, ", column ", col, ": ", msg);
  }

 private:
  int peek() const { return i_ < t_.size() ? static_cast<unsigned char>(t_[i_]) : -1; }
  void ws() {
    while (i_ < t_.size() && (t_[i_] == ' ' || t_[i_] == '\t' || t_[i_] == '\n' || t_[i_] == '\r')) ++i_;
  }
  void expect(char c, const char* what) {
    if (peek() != static_cast<unsigned char>(c)) fail(i_, std::string("expected ") + what);
    ++i_;
  }
  uint32_t hex4() {
    if (i_ + 4 > t_.size()) fail(i_, "truncated \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = t_[i_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= uint32_t(c - '0');
      else if (c >= 'a' && c <= 'f') v |= uint32_t(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= uint32_t(c - 'A' + 10);
      else fail(i_ - 1, "bad hex digit in \\u escape");
    }
    return v;
  }
  std::string string() {
    expect('"', "a string");
    std::string s;
    for (;;) {
      if (i_ >= t_.size()) fail(i_, "unterminated string");
      const unsigned char c = static_cast<unsigned char>(t_[i_]);
      if (c == '"') {
        ++i_;
        return s;
      }
      if (c < 0x20) fail(i_, "control character in a string");
      if (c != '\\') {
        const size_t len = utf8_len(i_);
        if (len == 0) fail(i_, "invalid UTF-8");
        s.append(t_.substr(i_, len));
        i_ += len;
        continue;
      }
      ++i_;
      if (i_ >= t_.size()) fail(i_, "unterminated string");
      const char e = t_[i_++];
      switch (e) {
        case '"': s += '"'; break;
        case '\\': s += '\\'; break;
        case '/': s += '/'; break;
        case 'b': s += '\b'; break;
        case 'f': s += '\f'; break;
        case 'n': s += '\n'; break;
        case 'r': s += '\r'; break;
        case 't': s += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (i_ + 2 > t_.size() || t_[i_] != '\\' || t_[i_ + 1] != 'u') fail(i_, "unpaired surrogate escape");
            i_ += 2;
            const uint32_t lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail(i_, "unpaired surrogate escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail(i_, "unpaired surrogate escape");
          }
          bpe::append_utf8(cp, s);
          break;
        }
        default: fail(i_ - 1, std::string("bad escape '\\") + e + "'");
      }
    }
  }
  size_t utf8_len(size_t i) const {  // length of a valid UTF-8 sequence at i, 0 if invalid
    const auto b = [&](size_t k) { return static_cast<unsigned char>(t_[k]); };
    const unsigned char b0 = b(i);
    const size_t len = b0 < 0x80 ? 1 : (b0 >= 0xC2 && b0 <= 0xDF) ? 2 : (b0 >= 0xE0 && b0 <= 0xEF) ? 3
                                   : (b0 >= 0xF0 && b0 <= 0xF4) ? 4 : 0;
    if (len == 0 || i + len > t_.size()) return 0;
    for (size_t k = 1; k < len; ++k)
      if ((b(i + k) & 0xC0) != 0x80) return 0;
    if (len == 3 && ((b0 == 0xE0 && b(i + 1) < 0xA0) || (b0 == 0xED && b(i + 1) > 0x9F))) return 0;
    if (len == 4 && ((b0 == 0xF0 && b(i + 1) < 0x90) || (b0 == 0xF4 && b(i + 1) > 0x8F))) return 0;
    return len;
  }
  int64_t integer(const std::string& key) {
    const size_t start = i_;
    if (peek() == '-') ++i_;
    while (i_ < t_.size() && t_[i_] >= '0' && t_[i_] <= '9') ++i_;
    int64_t v = 0;
    const auto r = std::from_chars(t_.data() + start, t_.data() + i_, v);
    const int next = peek();
    if (r.ec != std::errc() || r.ptr != t_.data() + i_ || next == '.' || next == 'e' || next == 'E')
      fail(start, "the id of token \"" + key + "\" is not an integer");
    return v;
  }

  const std::string& path_;
  std::string_view t_;
  size_t i_ = 0;
  std::vector<size_t> key_offsets_;
};

class Gpt2BpeTokenizer final : public Tokenizer {
 public:
  Gpt2BpeTokenizer(const TokenizerConfig& cfg, const bpe::BpeOptions& opts) {
    if (cfg.vocab_file.empty()) user_error("--tokenizer-type GPT2BPETokenizer needs --vocab-file (encoder.json)");
    if (cfg.merge_file.empty()) user_error("--tokenizer-type GPT2BPETokenizer needs --merge-file (vocab.bpe)");
    std::unordered_map<std::string, int32_t> vocab = load_vocab(cfg.vocab_file);
    load_merges(cfg.merge_file, vocab);
    for (int b = 0; b < 256; ++b) {
      std::string s;
      bpe::append_utf8(bpe::byte_to_unicode(uint8_t(b)), s);
      const auto it = vocab.find(s);
      if (it == vocab.end())
        user_error("--vocab-file '", cfg.vocab_file, "' has no token for byte 0x", hex2(b), " (\"", s,
                   "\"); a byte-level BPE vocabulary needs all 256");
      byte_ids_[size_t(b)] = it->second;
    }
    const auto eod = vocab.find(std::string(kEndOfText));
    if (eod == vocab.end())
      user_error("--vocab-file '", cfg.vocab_file, "' has no \"<|endoftext|>\" token (GPT2BPETokenizer's EOD)");
    eod_ = eod->second;
    if (opts.cache) cache_ = std::make_unique<bpe::WordCache>();
  }

  std::string name() const override { return "GPT2BPETokenizer"; }
  int64_t vocab_size() const override { return int64_t(token_bytes_.size()); }
  int32_t eod() const override { return eod_; }
  int32_t special_token(std::string_view text) const override { return text == "<|endoftext|>" ? eod_ : -1; }

  void encode(std::string_view text, std::vector<int32_t>& out) const override {
    thread_local bpe::MergeScratch scratch;
    thread_local std::vector<int32_t> syms;
    size_t i = 0;
    while (i < text.size()) {
      const size_t e = bpe::next_piece_end(text, i, PretokenPattern::kGpt2);
      const std::string_view piece = text.substr(i, e - i);
      i = e;
      if (piece.size() == 1) {
        out.push_back(byte_ids_[static_cast<unsigned char>(piece[0])]);
        continue;
      }
      if (cache_ && cache_->find(piece, out)) continue;
      syms.clear();
      for (const char c : piece) syms.push_back(byte_ids_[static_cast<unsigned char>(c)]);
      bpe::merge(syms, pairs_, bpe::MergeOrder::kAllOccurrences, scratch);
      out.insert(out.end(), syms.begin(), syms.end());
      if (cache_) cache_->insert(piece, syms);
    }
  }

  std::string decode(std::span<const int32_t> ids) const override {
    std::string s;
    for (const int32_t id : ids) {
      if (id < 0 || size_t(id) >= token_bytes_.size())
        user_error("GPT2BPETokenizer: cannot decode id ", id, " (vocabulary size ", token_bytes_.size(), ")");
      s += token_bytes_[size_t(id)];
    }
    return s;
  }

 private:
  static std::string hex2(int b) {
    static const char* d = "0123456789abcdef";
    return {d[b >> 4], d[b & 15]};
  }

  // Fills token_bytes_ and returns token string -> id.
  std::unordered_map<std::string, int32_t> load_vocab(const std::string& path) {
    const std::string text = read_file(path, "--vocab-file");
    VocabJsonReader reader(path, text);
    const auto entries = reader.read();
    if (entries.empty()) user_error("--vocab-file '", path, "' is an empty JSON object");
    const int64_t n = int64_t(entries.size());
    std::unordered_map<std::string, int32_t> vocab;
    vocab.reserve(entries.size());
    token_bytes_.assign(size_t(n), std::string());
    std::vector<int32_t> owner(size_t(n), -1);  // entry index holding each id
    for (size_t k = 0; k < entries.size(); ++k) {
      const auto& [tok, id] = entries[k];
      if (id < 0 || id >= n)
        reader.fail(reader.key_offset(k), "token \"" + tok + "\" has id " + std::to_string(id) +
                                              "; ids must be in [0, " + std::to_string(n) +
                                              ") (the number of tokens)");
      if (owner[size_t(id)] >= 0)
        reader.fail(reader.key_offset(k), "token \"" + tok + "\" has id " + std::to_string(id) +
                                              ", already used by \"" + entries[size_t(owner[size_t(id)])].first +
                                              "\"");
      if (!vocab.emplace(tok, int32_t(id)).second)
        reader.fail(reader.key_offset(k), "token \"" + tok + "\" appears twice");
      owner[size_t(id)] = int32_t(k);
      token_bytes_[size_t(id)] = to_bytes(tok);
    }
    return vocab;
  }

  // Byte-level string -> raw bytes. A character outside GPT-2's byte alphabet (an added token such as
  // one with spaces) is kept as its UTF-8, which is what such a token stands for.
  static std::string to_bytes(std::string_view tok) {
    std::string out;
    size_t i = 0;
    while (i < tok.size()) {
      const unsigned char b0 = static_cast<unsigned char>(tok[i]);
      const size_t len = b0 < 0x80 ? 1 : b0 < 0xE0 ? 2 : b0 < 0xF0 ? 3 : 4;  // tok is valid UTF-8
      uint32_t cp = len == 1 ? b0 : b0 & (0xFF >> (len + 1));
      for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(tok[i + k]) & 0x3F);
      const int b = bpe::unicode_to_byte(cp);
      if (b >= 0) out += char(b);
      else out.append(tok.substr(i, len));
      i += len;
    }
    return out;
  }

  void load_merges(const std::string& path, const std::unordered_map<std::string, int32_t>& vocab) {
    const std::string text = read_file(path, "--merge-file");
    std::vector<std::string_view> lines;
    for (size_t start = 0; start <= text.size();) {
      const size_t nl = text.find('\n', start);
      if (nl == std::string::npos) {
        lines.push_back(std::string_view(text).substr(start));
        break;
      }
      lines.push_back(std::string_view(text).substr(start, nl - start));
      start = nl + 1;
    }
    // lines.back() is what follows the last '\n' (empty for a well-formed file); it is not a merge.
    if (lines[0].empty() || lines[0][0] != '#')
      user_error("--merge-file '", path, "' line 1: expected a \"#version\" header line, then one merge per line");
    pairs_.reserve(lines.size());
    auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f' || (c >= 0x1C && c <= 0x1F); };
    for (size_t ln = 1; ln + 1 < lines.size(); ++ln) {
      const std::string_view line = lines[ln];
      std::string_view fields[3];
      int nf = 0;
      for (size_t i = 0; i < line.size();) {
        while (i < line.size() && is_space(line[i])) ++i;
        if (i == line.size()) break;
        size_t j = i;
        while (j < line.size() && !is_space(line[j])) ++j;
        if (nf == 3) break;
        fields[nf++] = line.substr(i, j - i);
        i = j;
      }
      if (nf == 0) continue;  // blank line: Megatron's reader keeps it as an empty, never-matching merge
      if (nf != 2)
        user_error("--merge-file '", path, "' line ", ln + 1, ": expected two tokens separated by a space, got \"",
                   line, "\"");
      int32_t ids[3];
      const std::string merged = std::string(fields[0]) + std::string(fields[1]);
      const std::string_view parts[3] = {fields[0], fields[1], merged};
      for (int k = 0; k < 3; ++k) {
        const auto it = vocab.find(std::string(parts[k]));
        if (it == vocab.end())
          user_error("--merge-file '", path, "' line ", ln + 1, ": ", k < 2 ? "token" : "merged token", " \"",
                     parts[k], "\" is not in the --vocab-file");
        ids[k] = it->second;
      }
      pairs_.insert(ids[0], ids[1], int32_t(ln), ids[2]);
    }
  }

  std::vector<std::string> token_bytes_;  // id -> bytes
  int32_t byte_ids_[256] = {};
  bpe::PairTable pairs_;
  int32_t eod_ = -1;
  std::unique_ptr<bpe::WordCache> cache_;
};

}  // namespace

namespace bpe {
std::unique_ptr<Tokenizer> make_gpt2_bpe_tokenizer(const TokenizerConfig& cfg, const BpeOptions& opts) {
  return std::make_unique<Gpt2BpeTokenizer>(cfg, opts);
}
}  // namespace bpe

std::unique_ptr<Tokenizer> make_gpt2_bpe_tokenizer(const TokenizerConfig& cfg) {
  return bpe::make_gpt2_bpe_tokenizer(cfg, bpe::BpeOptions{});
}

}  // namespace loom

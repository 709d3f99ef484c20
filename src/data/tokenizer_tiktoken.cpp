// TikTokenizer (Megatron's CustomTikTokenizer / TikTokenTokenizer): a tiktoken rank file, with Megatron's
// id layout — ids [0, num_special) are special tokens (<unk> <s> </s> <mask> <pad> <cls> <sep>, then
// <SPECIAL_7> ...), and the token of rank r has id r + num_special. EOD is </s> (id 2). Encoding is
// tiktoken's encode_ordinary: special-token text in the input is plain text.
// --tokenizer-model is either tiktoken's text format (one "base64(token) rank" per line, as in
// cl100k_base.tiktoken) or Megatron's JSON (a list of {"rank", "token_bytes", "token_str"}, rank i at
// index i, the first 256 being the single bytes 0..255).
// --vocab-size V keeps the ranks below V - num_special, which must all be present; without it, the
// file's ranks up to Megatron's default V = 131072 are kept (Megatron itself then insists the file has
// at least V - num_special ranks; here a smaller file just gives a smaller vocabulary).
// --tiktoken-pattern: v1, v2 = Megatron's two patterns; gpt2 (r50k/p50k) and cl100k = OpenAI's (Loom
// extensions, so OpenAI's encodings reproduce exactly).
// Invariants: the kept ranks are dense and include all 256 single bytes, so every piece encodes; merges
// follow tiktoken (the leftmost lowest-ranked adjacent pair whose concatenation is a token, one at a time);
// a piece that is itself a token is that token.
#include <nlohmann/json.hpp>

#include <charconv>
#include <unordered_map>

#include "data/bpe.h"
#include "loom/core/check.h"
#include "loom/core/file_io.h"

namespace loom {

namespace {

constexpr int64_t kMegatronDefaultVocab = int64_t(1) << 17;
const char* const kNamedSpecials[] = {"<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"};
constexpr int64_t kNumNamedSpecials = 7;
constexpr int32_t kEodSpecial = 2;  // </s>

struct RankEntry {
  std::string bytes;
  int64_t rank;
  size_t where;  // line (text format) or list index (JSON)
};

struct SvHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
struct SvEq {
  using is_transparent = void;
  bool operator()(std::string_view a, std::string_view b) const { return a == b; }
};

PretokenPattern parse_pattern(const std::string& p) {
  if (p == "v1") return PretokenPattern::kMegatronV1;
  if (p == "v2") return PretokenPattern::kMegatronV2;
  if (p == "gpt2" || p == "r50k" || p == "p50k") return PretokenPattern::kGpt2;
  if (p == "cl100k") return PretokenPattern::kCl100k;
  user_error("--tiktoken-pattern: unknown pattern '", p,
             "' (valid: v1, v2 (Megatron's), gpt2 / r50k / p50k, cl100k (OpenAI's))");
}

class TikTokenizer final : public Tokenizer {
 public:
  TikTokenizer(const TokenizerConfig& cfg, const bpe::BpeOptions& opts) : pattern_(parse_pattern(cfg.tiktoken_pattern)) {
    const std::string& path = cfg.tokenizer_model;
    if (path.empty()) user_error("--tokenizer-type TikTokenizer needs --tokenizer-model (a tiktoken rank file)");
    num_special_ = cfg.tiktoken_num_special_tokens;
    if (num_special_ < kNumNamedSpecials || num_special_ > (int64_t(1) << 30))
      user_error("--tiktoken-num-special-tokens must be in [", kNumNamedSpecials, ", 2^30] (Megatron reserves ",
                 kNumNamedSpecials, " named special tokens), got ", num_special_);
    const std::string text = read_file(path, "--tokenizer-model");
    const bool json = text.find_first_not_of(" \t\r\n") != std::string::npos &&
                      text[text.find_first_not_of(" \t\r\n")] == '[';
    int64_t inner;  // number of ranks kept
    std::vector<RankEntry> entries;
    if (cfg.vocab_size) {
      if (*cfg.vocab_size <= num_special_ || *cfg.vocab_size > (int64_t(1) << 31) - 1)
        user_error("--vocab-size ", *cfg.vocab_size, " must exceed --tiktoken-num-special-tokens (", num_special_,
                   ") and fit in int32 for TikTokenizer");
      inner = *cfg.vocab_size - num_special_;
    } else {
      inner = kMegatronDefaultVocab - num_special_;
      if (inner <= 0)
        user_error("--tiktoken-num-special-tokens ", num_special_, " leaves no room for ranks in Megatron's default ",
                   "vocabulary of ", kMegatronDefaultVocab, "; set --vocab-size");
    }
    entries = json ? parse_json(path, text, inner) : parse_text(path, text);
    if (!cfg.vocab_size) inner = std::min<int64_t>(inner, int64_t(entries.size()));
    if (int64_t(entries.size()) < inner)
      user_error("--tokenizer-model '", path, "' has ", entries.size(), " ranks, but --vocab-size ", *cfg.vocab_size,
                 " with ", num_special_, " special tokens needs ", inner);
    build(path, entries, inner, json);
    if (opts.cache) cache_ = std::make_unique<bpe::WordCache>();
  }

  std::string name() const override { return "TikTokenizer"; }
  int64_t vocab_size() const override { return num_special_ + int64_t(token_bytes_.size()); }
  int32_t eod() const override { return kEodSpecial; }
  // Megatron's named specials and <SPECIAL_k> for the other reserved ids.
  int32_t special_token(std::string_view text) const override {
    for (int32_t id = 0; id < kNumNamedSpecials; ++id)
      if (text == kNamedSpecials[id]) return id;
    if (text.starts_with("<SPECIAL_") && text.ends_with(">")) {
      const std::string n(text.substr(9, text.size() - 10));
      if (!n.empty() && n.size() < 10 && n.find_first_not_of("0123456789") == std::string::npos) {
        const int64_t id = std::stoll(n);
        if (id >= kNumNamedSpecials && id < num_special_) return int32_t(id);
      }
    }
    return -1;
  }

  void encode(std::string_view text, std::vector<int32_t>& out) const override {
    thread_local bpe::MergeScratch scratch;
    thread_local std::vector<int32_t> syms;
    size_t i = 0;
    while (i < text.size()) {
      const size_t e = bpe::next_piece_end(text, i, pattern_);
      const std::string_view piece = text.substr(i, e - i);
      i = e;
      if (piece.size() == 1) {
        out.push_back(byte_ids_[static_cast<unsigned char>(piece[0])]);
        continue;
      }
      if (const auto it = token_ids_.find(piece); it != token_ids_.end()) {
        out.push_back(it->second);
        continue;
      }
      if (cache_ && cache_->find(piece, out)) continue;
      syms.clear();
      for (const char c : piece) syms.push_back(byte_ids_[static_cast<unsigned char>(c)]);
      bpe::merge(syms, pairs_, bpe::MergeOrder::kLeftmostSingle, scratch);
      out.insert(out.end(), syms.begin(), syms.end());
      if (cache_) cache_->insert(piece, syms);
    }
  }

  std::string decode(std::span<const int32_t> ids) const override {
    std::string s;
    for (const int32_t id : ids) {
      if (id < 0 || int64_t(id) >= vocab_size())
        user_error("TikTokenizer: cannot decode id ", id, " (vocabulary size ", vocab_size(), ")");
      if (id < num_special_)
        s += special_text(id);
      else
        s += token_bytes_[size_t(id - num_special_)];
    }
    return s;
  }

 private:
  static std::string special_text(int32_t id) {
    if (id < kNumNamedSpecials) return kNamedSpecials[id];
    return "<SPECIAL_" + std::to_string(id) + ">";
  }

  // tiktoken's text format: "base64 rank" per line; blank lines are skipped.
  static std::vector<RankEntry> parse_text(const std::string& path, std::string_view text) {
    std::vector<RankEntry> out;
    size_t line_no = 0;
    for (size_t start = 0; start < text.size();) {
      size_t nl = text.find('\n', start);
      if (nl == std::string_view::npos) nl = text.size();
      std::string_view line = text.substr(start, nl - start);
      start = nl + 1;
      ++line_no;
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
      auto bad = [&](const auto&... msg) {
        user_error("--tokenizer-model '", path, "' line ", line_no, ": ", msg..., " (expected \"<base64 token> <rank>\")");
      };
      const size_t sp = line.find(' ');
      if (sp == std::string_view::npos || sp == 0) bad("no space between token and rank");
      const std::string_view tok = line.substr(0, sp), rank_s = line.substr(sp + 1);
      RankEntry e;
      if (!bpe::base64_decode(tok, e.bytes) || e.bytes.empty()) bad("\"", tok, "\" is not base64");
      const auto r = std::from_chars(rank_s.data(), rank_s.data() + rank_s.size(), e.rank);
      if (rank_s.empty() || r.ec != std::errc() || r.ptr != rank_s.data() + rank_s.size() || e.rank < 0)
        bad("rank \"", rank_s, "\" is not a non-negative integer");
      e.where = line_no;
      out.push_back(std::move(e));
    }
    return out;
  }

  // Megatron's JSON: entries beyond the kept vocabulary are cut before checking, as Megatron does.
  static std::vector<RankEntry> parse_json(const std::string& path, const std::string& text, int64_t keep) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
      const auto [line, col] = bpe::line_col(text, e.byte > 0 ? e.byte - 1 : 0);
      user_error("--tokenizer-model '", path, "' line ", line, ", column ", col, ": invalid JSON (", e.what(), ")");
    } catch (const nlohmann::json::exception& e) {  // e.g. a number too large for a double (out_of_range 406)
      user_error("--tokenizer-model '", path, "': invalid JSON (", e.what(), ")");
    }
    if (!j.is_array()) user_error("--tokenizer-model '", path, "': a JSON rank file must be a list of {\"rank\", \"token_bytes\", \"token_str\"}");
    std::vector<RankEntry> out;
    const size_t n = std::min<size_t>(j.size(), size_t(keep));
    for (size_t i = 0; i < n; ++i) {
      const nlohmann::json& x = j[i];
      auto bad = [&](const std::string& msg) { user_error("--tokenizer-model '", path, "' entry ", i, ": ", msg); };
      if (!x.is_object() || !x.contains("rank") || !x.contains("token_bytes"))
        bad("expected an object with \"rank\" and \"token_bytes\"");
      const nlohmann::json& r = x["rank"];
      const nlohmann::json& b = x["token_bytes"];
      if (!r.is_number_integer() || r.get<int64_t>() != int64_t(i)) bad("\"rank\" must equal the entry's index");
      RankEntry e;
      if (!b.is_string() || !bpe::base64_decode(b.get<std::string>(), e.bytes) || e.bytes.empty())
        bad("\"token_bytes\" is not a base64 string");
      if (i < 256 && (e.bytes.size() != 1 || static_cast<unsigned char>(e.bytes[0]) != i))
        bad("the first 256 entries must be the single bytes 0..255 in order");
      e.rank = int64_t(i);
      e.where = i;
      out.push_back(std::move(e));
    }
    return out;
  }

  void build(const std::string& path, std::vector<RankEntry>& entries, int64_t inner, bool json) {
    const char* unit = json ? " entry " : " line ";
    token_bytes_.assign(size_t(inner), std::string());
    std::vector<uint8_t> seen(size_t(inner), 0);
    token_ids_.reserve(size_t(inner));
    for (RankEntry& e : entries) {
      if (e.rank >= inner) continue;
      if (seen[size_t(e.rank)])
        user_error("--tokenizer-model '", path, "'", unit, e.where, ": rank ", e.rank, " appears twice");
      seen[size_t(e.rank)] = 1;
      const int32_t id = int32_t(e.rank + num_special_);
      if (!token_ids_.emplace(e.bytes, id).second)
        user_error("--tokenizer-model '", path, "'", unit, e.where, ": the same token appears twice");
      token_bytes_[size_t(e.rank)] = std::move(e.bytes);
    }
    for (int64_t r = 0; r < inner; ++r)
      if (!seen[size_t(r)])
        user_error("--tokenizer-model '", path, "': rank ", r, " is missing (ranks below ", inner,
                   " must all be present; --vocab-size sets how many are used)");
    for (int b = 0; b < 256; ++b) {
      const char c = char(b);
      const auto it = token_ids_.find(std::string_view(&c, 1));
      if (it == token_ids_.end())
        user_error("--tokenizer-model '", path, "': no token for the single byte ", b,
                   " among the ranks used; byte-level BPE needs all 256");
      byte_ids_[size_t(b)] = it->second;
    }
    // Every split of a token into two tokens is a merge of that token's rank.
    pairs_.reserve(token_bytes_.size() * 3);
    for (size_t r = 0; r < token_bytes_.size(); ++r) {
      const std::string_view t = token_bytes_[r];
      for (size_t k = 1; k < t.size(); ++k) {
        const auto l = token_ids_.find(t.substr(0, k));
        if (l == token_ids_.end()) continue;
        const auto rr = token_ids_.find(t.substr(k));
        if (rr == token_ids_.end()) continue;
        pairs_.insert(l->second, rr->second, int32_t(r), int32_t(r + size_t(num_special_)));
      }
    }
  }

  PretokenPattern pattern_;
  int64_t num_special_ = 0;
  std::vector<std::string> token_bytes_;  // rank -> bytes
  std::unordered_map<std::string, int32_t, SvHash, SvEq> token_ids_;
  int32_t byte_ids_[256] = {};
  bpe::PairTable pairs_;
  std::unique_ptr<bpe::WordCache> cache_;
};

}  // namespace

namespace bpe {
std::unique_ptr<Tokenizer> make_tiktoken_tokenizer(const TokenizerConfig& cfg, const BpeOptions& opts) {
  return std::make_unique<TikTokenizer>(cfg, opts);
}
}  // namespace bpe

std::unique_ptr<Tokenizer> make_tiktoken_tokenizer(const TokenizerConfig& cfg) {
  return bpe::make_tiktoken_tokenizer(cfg, bpe::BpeOptions{});
}

}  // namespace loom

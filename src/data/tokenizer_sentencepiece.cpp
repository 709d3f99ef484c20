// SentencePiece tokenizers over libsentencepiece, matching Megatron-LM's three wrappers:
//   SentencePieceTokenizer    (_SentencePieceTokenizer): the model's pieces, then special tokens <CLS>,
//       <SEP>, <EOD>, <MASK> and the model's pad/bos/eos pieces (<PAD>/<BOS>/<EOS> when the model has
//       none); a special token already among the pieces keeps its id, the others get the next free ids
//       in that order. Their literal text is cut out of the input before SentencePiece sees it, and
//       decode writes them back space-separated. eod = <EOD>.
//   GPTSentencePieceTokenizer (_GPTSentencePieceTokenizer): the pieces only; eod = the model's eos id.
//   Llama2Tokenizer           (_Llama2Tokenizer): the pieces only; encode prepends the model's bos id
//       (Megatron's tokenize(bos=True)); eod = the model's eos id.
// Invariants: ids are in [0, vocab_size); the processor is read-only after construction, and
// SentencePieceProcessor::Encode/Decode are const, so encode/decode are thread-safe.
// libsentencepiece trusts the normalisation tables inside a .model (a double-array trie plus a
// string pool): a corrupt table makes it read out of bounds while encoding. Those tables are checked
// here, before the library sees the file (model_problem, charsmap_problem).
#include <sentencepiece_processor.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>

#include "data/tokenizers_impl.h"
#include "loom/core/check.h"
#include "loom/core/file_io.h"

namespace loom {

namespace {

enum class SpKind { kMegatron, kGpt, kLlama2 };

// ---- .model pre-validation -------------------------------------------------------------------
// Just enough protobuf wire format to find ModelProto.normalizer_spec (field 3) and
// .denormalizer_spec (field 5), and in each NormalizerSpec.precompiled_charsmap (field 2). Sub-messages
// given more than once merge, so the last charsmap wins, as in protobuf. Unknown fields are skipped;
// bytes that are not wire format are rejected (the library would reject them too).
class WireReader {
 public:
  explicit WireReader(std::string_view s) : p_(s.data()), end_(s.data() + s.size()) {}
  bool done() const { return p_ == end_; }
  bool varint(uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p_ == end_) return false;
      const uint8_t b = uint8_t(*p_++);
      v |= uint64_t(b & 0x7F) << shift;
      if (b < 0x80) return true;
    }
    return false;
  }
  bool bytes(uint64_t n, std::string_view& out) {
    if (n > uint64_t(end_ - p_)) return false;
    out = std::string_view(p_, size_t(n));
    p_ += n;
    return true;
  }
  // Reads one field; `payload` is set for length-delimited ones. False on malformed input.
  bool field(uint32_t& number, uint32_t& wire_type, std::string_view& payload, int depth = 0) {
    uint64_t key, v;
    if (!varint(key)) return false;
    number = uint32_t(key >> 3);
    wire_type = uint32_t(key & 7);
    if (number == 0 || (key >> 3) > 0x1FFFFFFF) return false;
    switch (wire_type) {
      case 0: return varint(v);
      case 1: return bytes(8, payload);
      case 2: return varint(v) && bytes(v, payload);
      case 5: return bytes(4, payload);
      case 3: {  // group: fields up to the matching end-group
        if (depth > 64) return false;
        for (;;) {
          uint32_t n, wt;
          std::string_view ignored;
          if (!field(n, wt, ignored, depth + 1)) return false;
          if (wt == 4) return n == number;
        }
      }
      case 4: return depth > 0;
      default: return false;
    }
  }

 private:
  const char* p_;
  const char* end_;
};

// Darts-clone double-array unit, the trie format of the charsmap.
struct DartsUnit {
  uint32_t u;
  bool has_leaf() const { return (u >> 8) & 1; }
  uint32_t value() const { return u & 0x7FFFFFFFu; }
  uint32_t label() const { return u & 0x800000FFu; }
  uint32_t offset() const { return (u >> 10) << ((u & (1u << 9)) >> 6); }
};

// A charsmap blob is [u32 trie byte size][trie units][NUL-terminated replacement strings]. The
// library's prefix search follows pos ^= unit.offset(), pos ^= byte with no bounds checks and then
// reads the string at a leaf's value up to its NUL. Walk every state the search can reach (any input
// byte may follow) and require each read to stay inside the blob. Returns an empty string if valid.
std::string charsmap_problem(std::string_view blob) {
  if (blob.empty()) return {};  // no table: identity normalisation
  if (blob.size() <= 4) return "charsmap shorter than its header";
  uint32_t trie_bytes;
  std::memcpy(&trie_bytes, blob.data(), 4);  // little-endian, as written by spm_train on x86/ARM
  if (trie_bytes > blob.size() - 4) return "charsmap trie larger than the blob";
  const size_t units = trie_bytes / 4;
  if (units == 0) return "charsmap trie is empty";
  const std::string_view pool = blob.substr(4 + trie_bytes);
  const size_t last_nul = pool.rfind('\0');
  auto unit = [&](size_t i) {
    DartsUnit d;
    std::memcpy(&d.u, blob.data() + 4 + 4 * i, 4);
    return d;
  };
  std::vector<uint8_t> seen(units, 0);
  std::vector<size_t> stack;
  auto visit = [&](size_t state) -> bool {
    if ((state | 0xFF) >= units) return false;  // state ^ byte could leave the array
    if (!seen[state]) {
      seen[state] = 1;
      stack.push_back(state);
    }
    return true;
  };
  if (!visit(unit(0).offset())) return "charsmap trie root points outside the trie";
  while (!stack.empty()) {
    const size_t state = stack.back();
    stack.pop_back();
    for (uint32_t c = 0; c < 256; ++c) {
      const DartsUnit d = unit(state ^ c);
      if (d.label() != c) continue;
      const size_t next = (state ^ c) ^ d.offset();
      if (!visit(next)) return "charsmap trie edge points outside the trie";
      if (d.has_leaf()) {
        const uint32_t v = unit(next).value();
        if (last_nul == std::string_view::npos || v > last_nul)
          return "charsmap replacement outside the string pool";
      }
    }
  }
  return {};
}

// Checks every charsmap in the serialized ModelProto; returns a description of the first problem.
std::string model_problem(std::string_view model) {
  std::string_view charsmap[2];  // normalizer, denormalizer
  WireReader top(model);
  while (!top.done()) {
    uint32_t number, wt;
    std::string_view spec;
    if (!top.field(number, wt, spec)) return "not protobuf wire format";
    if (wt != 2 || (number != 3 && number != 5)) continue;
    WireReader inner(spec);
    while (!inner.done()) {
      uint32_t n2, wt2;
      std::string_view value;
      if (!inner.field(n2, wt2, value)) return "malformed normalizer spec";
      if (n2 == 2 && wt2 == 2) charsmap[number == 5] = value;
    }
  }
  for (const auto& blob : charsmap) {
    std::string problem = charsmap_problem(blob);
    if (!problem.empty()) return problem;
  }
  return {};
}

struct SpecialToken {
  std::string text;
  int32_t id;
};

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(std::string name, SpKind kind, const std::string& path, const std::string& bytes)
      : name_(std::move(name)), path_(path), kind_(kind) {
    const std::string problem = model_problem(bytes);
    if (!problem.empty())
      user_error("--tokenizer-model '", path, "' is not a valid SentencePiece model (", problem, ")");
    sentencepiece::util::Status status;
    try {
      status = sp_.LoadFromSerializedProto(bytes);
    } catch (const std::exception& e) {  // its trie builder throws, e.g. on a piece containing NUL
      user_error("--tokenizer-model '", path, "' is not a valid SentencePiece model (", e.what(), ")");
    }
    if (!status.ok())
      user_error("--tokenizer-model '", path, "' is not a valid SentencePiece model (", status.ToString(),
                 ")");
    num_pieces_ = sp_.GetPieceSize();
    if (num_pieces_ <= 0) user_error("--tokenizer-model '", path, "' is a SentencePiece model with no pieces");
    vocab_ = num_pieces_;
    if (kind_ == SpKind::kMegatron) add_megatron_special_tokens();
    eod_ = kind_ == SpKind::kMegatron ? find_special("<EOD>") : sp_.eos_id();
  }

  std::string name() const override { return name_; }
  int64_t vocab_size() const override { return vocab_; }
  int32_t eod() const override { return eod_; }
  // The model's control pieces (<s>, </s>), its user-defined "<...>" pieces (<|im_start|>, ...) and the
  // added specials.
  int32_t special_token(std::string_view text) const override {
    const std::string t(text);
    if (const int32_t id = find_special(t); id >= 0) return id;
    const int32_t id = model_piece_id(t);
    if (id < 0 || sp_.IsUnknown(id) || sp_.IsUnused(id) || sp_.IsByte(id)) return -1;
    return sp_.IsControl(id) || (t.size() > 2 && t.front() == '<' && t.back() == '>') ? id : -1;
  }

  void encode(std::string_view text, std::vector<int32_t>& out) const override {
    if (kind_ == SpKind::kLlama2) {
      // Megatron would emit -1 for a model without bos; skip it instead.
      if (sp_.bos_id() >= 0) out.push_back(sp_.bos_id());
      encode_plain(text, out);
    } else if (kind_ == SpKind::kGpt || specials_.empty()) {
      encode_plain(text, out);
    } else {
      encode_with_specials(text, out);
    }
  }

  std::string decode(std::span<const int32_t> ids) const override {
    if (kind_ != SpKind::kMegatron) return decode_plain(ids);
    // Megatron: each special token becomes "<decoded run> <TOKEN> ", runs between them decode normally.
    std::string text;
    size_t last = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      const SpecialToken* st = special_by_id(ids[i]);
      if (!st) continue;
      text += decode_plain(ids.subspan(last, i - last));
      text += ' ';
      text += st->text;
      text += ' ';
      last = i + 1;
    }
    text += decode_plain(ids.subspan(last));
    return text;
  }

 private:
  // Megatron's _SentencePieceTokenizer._initalize (with vocab_extra_ids = 0).
  void add_megatron_special_tokens() {
    for (const char* t : {"<CLS>", "<SEP>", "<EOD>", "<MASK>"}) add_special(t);
    add_special(piece_or(sp_.pad_id(), "<PAD>"));
    add_special(piece_or(sp_.bos_id(), "<BOS>"));
    add_special(piece_or(sp_.eos_id(), "<EOS>"));
  }

  std::string piece_or(int id, const char* fallback) const {
    return id >= 0 && id < num_pieces_ ? sp_.IdToPiece(id) : std::string(fallback);
  }

  // The id of piece `t` in the model, or -1. PieceToId answers unk for unknown text, hence the check.
  int32_t model_piece_id(const std::string& t) const {
    const int id = sp_.PieceToId(t);
    return id >= 0 && id < num_pieces_ && sp_.IdToPiece(id) == t ? id : -1;
  }

  void add_special(const std::string& t) {
    if (t.empty() || find_special(t) >= 0) return;  // an empty pattern would match everywhere
    int32_t id = model_piece_id(t);
    if (id < 0) {
      LOOM_CHECK(vocab_ < (int64_t(1) << 31) - 1, "[sentencepiece] vocabulary overflows int32: ", vocab_);
      id = int32_t(vocab_++);
    }
    specials_.push_back({t, id});
  }

  int32_t find_special(std::string_view t) const {
    for (const auto& s : specials_)
      if (s.text == t) return s.id;
    return -1;
  }

  const SpecialToken* special_by_id(int32_t id) const {
    for (const auto& s : specials_)
      if (s.id == id) return &s;
    return nullptr;
  }

  void encode_plain(std::string_view text, std::vector<int32_t>& out) const {
    if (text.empty()) return;
    std::vector<int> ids;
    const auto status = sp_.Encode(text, &ids);
    // Only a malformed model fails here (e.g. pieces the normaliser output cannot be split into).
    if (!status.ok())
      user_error("[", name_, "] --tokenizer-model '", path_, "' cannot encode this text: ", status.ToString());
    out.insert(out.end(), ids.begin(), ids.end());
  }

  // Repeatedly cut at the earliest occurrence of any special token (ties: the one added first), as
  // Megatron's tokenize does. next[k] caches token k's first occurrence at or after the position it
  // was searched from; it stays valid while it is not behind the cursor, so each token's search
  // restarts only after the cursor passes it.
  void encode_with_specials(std::string_view text, std::vector<int32_t>& out) const {
    std::vector<size_t> next(specials_.size());
    for (size_t k = 0; k < specials_.size(); ++k) next[k] = text.find(specials_[k].text);
    size_t pos = 0;
    for (;;) {
      size_t best = std::string_view::npos, best_k = 0;
      for (size_t k = 0; k < specials_.size(); ++k) {
        if (next[k] != std::string_view::npos && next[k] < pos) next[k] = text.find(specials_[k].text, pos);
        if (next[k] < best) {
          best = next[k];
          best_k = k;
        }
      }
      if (best == std::string_view::npos) break;
      encode_plain(text.substr(pos, best - pos), out);
      out.push_back(specials_[best_k].id);
      pos = best + specials_[best_k].text.size();
    }
    encode_plain(text.substr(pos), out);
  }

  std::string decode_plain(std::span<const int32_t> ids) const {
    if (ids.empty()) return {};
    for (const int32_t id : ids)
      if (id < 0 || id >= num_pieces_)
        user_error("[", name_, "] decode: token id ", id, " is outside the vocabulary [0, ", vocab_, ")");
    std::string text;
    const auto status = sp_.Decode(std::vector<int>(ids.begin(), ids.end()), &text);
    if (!status.ok())
      user_error("[", name_, "] --tokenizer-model '", path_, "' cannot decode these ids: ", status.ToString());
    return text;
  }

  std::string name_;
  std::string path_;  // --tokenizer-model, for messages
  SpKind kind_;
  sentencepiece::SentencePieceProcessor sp_;
  int num_pieces_ = 0;
  int64_t vocab_ = 0;
  std::vector<SpecialToken> specials_;  // kMegatron only, in Megatron's insertion order, unique texts
  int32_t eod_ = -1;
};


}  // namespace

std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const TokenizerConfig& cfg, bool llama2) {
  SpKind kind = SpKind::kLlama2;
  std::string name = "Llama2Tokenizer";
  if (!llama2) {
    if (cfg.type == "GPTSentencePieceTokenizer") {
      kind = SpKind::kGpt;
      name = cfg.type;
    } else {
      kind = SpKind::kMegatron;
      name = "SentencePieceTokenizer";
    }
  }
  if (cfg.tokenizer_model.empty())
    user_error("--tokenizer-type ", name, " needs --tokenizer-model (a SentencePiece .model file)");
  return std::make_unique<SentencePieceTokenizer>(name, kind, cfg.tokenizer_model,
                                                  read_file(cfg.tokenizer_model, "--tokenizer-model: SentencePiece model"));
}

}  // namespace loom

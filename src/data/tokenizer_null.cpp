// NullTokenizer (Megatron's _NullTokenizer): text is decimal ids separated by whitespace; --vocab-size N
// gives ids [0, N) and the EOD id N, so the vocabulary holds N + 1 ids, as in Megatron.
#include <cctype>
#include <charconv>

#include "data/tokenizers_impl.h"
#include "loom/core/check.h"

namespace loom {

namespace {

class NullTokenizer final : public Tokenizer {
 public:
  explicit NullTokenizer(int64_t vocab_without_eod) : vocab_(vocab_without_eod + 1) {}
  std::string name() const override { return "NullTokenizer"; }
  int64_t vocab_size() const override { return vocab_; }
  void encode(std::string_view text, std::vector<int32_t>& out) const override {
    size_t i = 0;
    while (i < text.size()) {
      while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
      if (i == text.size()) break;
      size_t j = i;
      while (j < text.size() && !std::isspace(static_cast<unsigned char>(text[j]))) ++j;
      int64_t id = 0;
      const auto r = std::from_chars(text.data() + i, text.data() + j, id);
      if (r.ec != std::errc() || r.ptr != text.data() + j || id < 0 || id >= vocab_)
        user_error("NullTokenizer: '", text.substr(i, j - i), "' is not a token id in [0, ", vocab_, ")");
      out.push_back(int32_t(id));
      i = j;
    }
  }
  std::string decode(std::span<const int32_t> ids) const override {
    std::string s;
    for (size_t k = 0; k < ids.size(); ++k) {
      if (k) s += ' ';
      s += std::to_string(ids[k]);
    }
    return s;
  }
  int32_t eod() const override { return int32_t(vocab_ - 1); }  // = --vocab-size

 private:
  int64_t vocab_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_null_tokenizer(const TokenizerConfig& cfg) {
  if (!cfg.vocab_size) user_error("--tokenizer-type NullTokenizer needs --vocab-size");
  if (*cfg.vocab_size < 1 || *cfg.vocab_size > (int64_t(1) << 31) - 2)
    user_error("--vocab-size must be in [1, 2^31 - 2] for NullTokenizer, got ", *cfg.vocab_size);
  return std::make_unique<NullTokenizer>(*cfg.vocab_size);
}

}  // namespace loom

// Tokenizers, selected by Megatron's --tokenizer-type: GPT2BPETokenizer (--vocab-file, --merge-file),
// TikTokenizer (--tokenizer-model rank file, --tiktoken-pattern v1|v2|gpt2|cl100k), SentencePieceTokenizer and
// Llama2Tokenizer (--tokenizer-model .model), NullTokenizer (--vocab-size N: ids as text, EOD = N).
// Encoding is thread-safe (loom preprocess runs it from many threads) and deterministic.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string name() const = 0;    // the --tokenizer-type value, e.g. "GPT2BPETokenizer"
  virtual int64_t vocab_size() const = 0;  // ids are in [0, vocab_size)
  // Appends the ids of `text` to `out`. Thread-safe.
  virtual void encode(std::string_view text, std::vector<int32_t>& out) const = 0;
  std::vector<int32_t> encode(std::string_view text) const {
    std::vector<int32_t> ids;
    encode(text, ids);
    return ids;
  }
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  // End-of-document id appended by `loom preprocess --append-eod` (e.g. <|endoftext|>); -1 if none.
  virtual int32_t eod() const = 0;
  // The id of a special (control) token by its text ("<s>", "<|im_start|>", ...), which encode() never
  // produces from text; -1 when the vocabulary has no such token. Chat templates are built from these.
  virtual int32_t special_token(std::string_view /*text*/) const { return -1; }
};

struct TokenizerConfig {
  std::string type;            // --tokenizer-type
  std::string vocab_file;      // --vocab-file (GPT-2 encoder.json / vocab.json)
  std::string merge_file;      // --merge-file (GPT-2 vocab.bpe / merges.txt)
  std::string tokenizer_model; // --tokenizer-model (tiktoken rank file or SentencePiece .model)
  std::string tiktoken_pattern = "v2";   // --tiktoken-pattern v1 | v2 (Megatron's) | gpt2 | cl100k
  int64_t tiktoken_num_special_tokens = 1000;  // --tiktoken-num-special-tokens
  std::optional<int64_t> vocab_size;     // --vocab-size (NullTokenizer)
};

// Builds the tokenizer; UserError naming the flag or file for a missing/invalid input.
std::unique_ptr<Tokenizer> make_tokenizer(const TokenizerConfig& cfg);

}  // namespace loom

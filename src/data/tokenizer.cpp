// --tokenizer-type dispatch.
#include "data/tokenizers_impl.h"
#include "loom/core/check.h"

namespace loom {

std::unique_ptr<Tokenizer> make_tokenizer(const TokenizerConfig& cfg) {
  if (cfg.type == "GPT2BPETokenizer") return make_gpt2_bpe_tokenizer(cfg);
  if (cfg.type == "TikTokenizer") return make_tiktoken_tokenizer(cfg);
  if (cfg.type == "SentencePieceTokenizer" || cfg.type == "GPTSentencePieceTokenizer")
    return make_sentencepiece_tokenizer(cfg, false);
  if (cfg.type == "Llama2Tokenizer") return make_sentencepiece_tokenizer(cfg, true);
  if (cfg.type == "NullTokenizer") return make_null_tokenizer(cfg);
  if (cfg.type.empty()) user_error("--tokenizer-type is required");
  user_error("--tokenizer-type: unknown tokenizer '", cfg.type,
             "' (valid: GPT2BPETokenizer, TikTokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, "
             "Llama2Tokenizer, NullTokenizer)");
}

}  // namespace loom

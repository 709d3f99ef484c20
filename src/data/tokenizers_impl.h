// Constructors of the concrete tokenizers, one source file each; make_tokenizer() dispatches on
// --tokenizer-type. Each throws UserError naming the flag/file for bad input.
#pragma once
#include <string_view>
#include <vector>

#include "loom/data/tokenizer.h"

namespace loom {

std::unique_ptr<Tokenizer> make_gpt2_bpe_tokenizer(const TokenizerConfig& cfg);     // tokenizer_gpt2.cpp
std::unique_ptr<Tokenizer> make_tiktoken_tokenizer(const TokenizerConfig& cfg);     // tokenizer_tiktoken.cpp
std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const TokenizerConfig& cfg, bool llama2);  // tokenizer_sentencepiece.cpp
std::unique_ptr<Tokenizer> make_null_tokenizer(const TokenizerConfig& cfg);         // tokenizer_null.cpp

// Pre-tokenisation (the regex split that runs before BPE), pretokenize.cpp. Pieces cover the text
// exactly, in order. kGpt2 is GPT-2's pattern (also tiktoken's r50k/p50k; TikTokenizer's
// --tiktoken-pattern gpt2): 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// kCl100k is cl100k_base's (--tiktoken-pattern cl100k): (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|
// \p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
// kMegatronV1 / kMegatronV2 are the patterns Megatron-LM's TikTokenizer actually uses for
// --tiktoken-pattern v1 / v2 (PATTERN_TIKTOKEN / PATTERN_TIKTOKEN_V2 in its tokenizer.py):
// v1: [^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+
// v2: [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|
//     [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|
//     ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
// \s is Unicode White_Space (Python `regex`, Rust `regex`/fancy-regex), and cl100k's (?i:...) uses
// simple case folding, so 'ſ (U+017F) is a contraction like 's and 'S.
// Invalid UTF-8 bytes are treated as single code points of category "other" (never letters/numbers).
enum class PretokenPattern { kGpt2, kCl100k, kMegatronV1, kMegatronV2 };
void pretokenize(std::string_view text, PretokenPattern pattern, std::vector<std::string_view>& pieces);

}  // namespace loom

// Chat templates for `loom preprocess --sft --chat-template NAME` (docs/data.md): a conversation
// {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]} rendered as token ids with
// the answer mask (1 for the assistant's content and the token that ends its turn). The special tokens
// are looked up by their text in the tokenizer (Tokenizer::special_token); each message's text is
// encoded on its own, so a mask boundary never falls inside a token.
//   llama2  <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {assistant} </s> per exchange
//   llama3  <|begin_of_text|> then per message <|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>
//   chatml  per message <|im_start|>{role}\n{content}<|im_end|>\n
// Private to the data layer.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "loom/data/tokenizer.h"

namespace loom {

class ChatTemplate {
 public:
  // UserError naming --chat-template for an unknown name, or for special tokens the tokenizer lacks.
  ChatTemplate(const std::string& name, const Tokenizer& tok);
  // Appends the conversation's ids and mask; returns "" or why the conversation is bad (roles out of
  // order, no assistant answer, a non-string content, ...).
  std::string render(const nlohmann::json& messages, std::vector<int32_t>& ids, std::vector<int32_t>& mask) const;

 private:
  enum class Kind { kLlama2, kLlama3, kChatML };
  Kind kind_;
  const Tokenizer& tok_;
  int32_t a_ = -1, b_ = -1, c_ = -1, d_ = -1;  // the template's special ids, in the order of its names
};

}  // namespace loom

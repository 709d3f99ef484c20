// ChatTemplate (data/chat_template.h).
#include "data/chat_template.h"

#include "loom/core/check.h"

namespace loom {

ChatTemplate::ChatTemplate(const std::string& name, const Tokenizer& tok) : tok_(tok) {
  std::vector<const char*> names;
  if (name == "llama2") {
    kind_ = Kind::kLlama2;
    names = {"<s>", "</s>"};
  } else if (name == "llama3") {
    kind_ = Kind::kLlama3;
    names = {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
  } else if (name == "chatml") {
    kind_ = Kind::kChatML;
    names = {"<|im_start|>", "<|im_end|>"};
  } else {
    user_error("--chat-template: unknown template '", name, "' (valid: llama2, llama3, chatml)");
  }
  int32_t* slots[] = {&a_, &b_, &c_, &d_};
  std::string missing;
  for (size_t k = 0; k < names.size(); ++k) {
    *slots[k] = tok.special_token(names[k]);
    if (*slots[k] < 0) missing += std::string(missing.empty() ? "" : " ") + names[k];
  }
  if (!missing.empty())
    user_error("--chat-template ", name, " needs the special tokens ", missing, " in the tokenizer, which ", tok.name(),
               " does not have (a SentencePiece model with them as control symbols, for example)");
}

std::string ChatTemplate::render(const nlohmann::json& messages, std::vector<int32_t>& ids,
                                 std::vector<int32_t>& mask) const {
  if (!messages.is_array() || messages.empty()) return "'messages' must be a non-empty list";
  std::vector<std::pair<std::string, std::string>> turns;
  for (size_t i = 0; i < messages.size(); ++i) {
    const nlohmann::json& m = messages[i];
    if (!m.is_object() || !m.contains("role") || !m.contains("content") || !m["role"].is_string() ||
        !m["content"].is_string())
      return "message " + std::to_string(i) + " needs string 'role' and 'content'";
    const std::string role = m["role"];
    const bool system = role == "system";
    if (system && i != 0) return "message " + std::to_string(i) + ": a system message must come first";
    if (!system && role != "user" && role != "assistant")
      return "message " + std::to_string(i) + ": role '" + role + "' (valid: system, user, assistant)";
    const size_t k = turns.size() - (!turns.empty() && turns[0].first == "system" ? 1 : 0);  // index among user/assistant
    if (!system && role != (k % 2 == 0 ? "user" : "assistant"))
      return "message " + std::to_string(i) + ": expected a " + (k % 2 == 0 ? "user" : "assistant") +
             " message (user and assistant alternate, starting with user)";
    turns.emplace_back(role, m["content"].get<std::string>());
  }
  if (turns.back().first != "assistant") return "the conversation must end with an assistant message (the answer)";
  std::vector<int32_t> scratch;
  auto text = [&](const std::string& s, int32_t m) {
    scratch.clear();
    tok_.encode(s, scratch);
    ids.insert(ids.end(), scratch.begin(), scratch.end());
    mask.insert(mask.end(), scratch.size(), m);
  };
  auto special = [&](int32_t id, int32_t m) {
    ids.push_back(id);
    mask.push_back(m);
  };
  const size_t first = turns[0].first == "system" ? 1 : 0;
  switch (kind_) {
    case Kind::kLlama2: {  // Llama 2's chat format: one [INST] block per exchange, BOS/EOS around each
      for (size_t i = first; i < turns.size(); i += 2) {
        std::string prompt = "[INST] ";
        if (first == 1 && i == first) prompt += "<<SYS>>\n" + turns[0].second + "\n<</SYS>>\n\n";
        prompt += turns[i].second + " [/INST]";
        special(a_, 0);
        text(prompt, 0);
        text(" " + turns[i + 1].second + " ", 1);
        special(b_, 1);
      }
      break;
    }
    case Kind::kLlama3: {
      special(a_, 0);
      for (const auto& [role, content] : turns) {
        const int32_t m = role == "assistant" ? 1 : 0;
        special(b_, 0);
        text(role, 0);
        special(c_, 0);
        text("\n\n", 0);
        text(content, m);
        special(d_, m);
      }
      break;
    }
    case Kind::kChatML: {
      for (const auto& [role, content] : turns) {
        const int32_t m = role == "assistant" ? 1 : 0;
        special(a_, 0);
        text(role + "\n", 0);
        text(content, m);
        special(b_, m);
        text("\n", 0);
      }
      break;
    }
  }
  return {};
}

}  // namespace loom

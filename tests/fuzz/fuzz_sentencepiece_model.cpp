// libFuzzer target: the input bytes are a SentencePiece .model file given to make_tokenizer as
// --tokenizer-model, for each of SentencePieceTokenizer, GPTSentencePieceTokenizer and Llama2Tokenizer.
// A UserError is the expected answer to a bad file (on load, or from encode/decode when the library's
// own checks reject a malformed model); anything else escaping (a crash, a sanitizer report, a
// LOOM_CHECK) is a finding. A model that loads must keep its invariants: eod in [-1, V), encoded ids
// in [0, V), decode never rejects an id in [0, V) as outside the vocabulary.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "loom/core/check.h"
#include "loom/data/tokenizer.h"
#include "fuzz_util.h"

namespace {

using fuzz_util::require;

const std::string& model_path() {
  static const std::string path = "/tmp/loom_fuzz_spm_" + std::to_string(::getpid()) + ".model";
  return path;
}

void exercise(const loom::Tokenizer& tok, std::string_view extra_text) {
  const int64_t V = tok.vocab_size();
  require(V >= 1, "vocab_size >= 1");
  require(tok.eod() >= -1 && tok.eod() < V, "eod in [-1, vocab_size)");
  // Fixed text with Megatron special-token spellings, whitespace runs and non-ASCII, plus raw input
  // bytes (often invalid UTF-8).
  std::string text = "  Hello<EOD>world</s><s> <CLS><SEP><MASK><PAD><BOS><EOS><pad>\n caf\xC3\xA9 \xE6\x97\xA5 12345 ";
  text.append(extra_text);
  const std::vector<int32_t> ids = tok.encode(text);
  for (const int32_t id : ids) require(id >= 0 && id < V, "encoded id in [0, vocab_size)");
  (void)tok.decode(ids);
  std::vector<int32_t> all;
  for (int64_t id = 0; id < V && id < 2048; ++id) all.push_back(int32_t(id));
  for (int64_t id = V - 1; id >= 2048 && id >= V - 64; --id) all.push_back(int32_t(id));
  (void)tok.decode(all);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz_util::write_file(model_path(), std::string_view(reinterpret_cast<const char*>(data), size));
  const std::string_view tail(reinterpret_cast<const char*>(data) + (size > 64 ? size - 64 : 0),
                              size > 64 ? 64 : size);
  for (const char* type : {"SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"}) {
    loom::TokenizerConfig cfg;
    cfg.type = type;
    cfg.tokenizer_model = model_path();
    std::unique_ptr<loom::Tokenizer> tok;
    try {
      tok = loom::make_tokenizer(cfg);
    } catch (const loom::UserError&) {
      continue;  // rejected with a message: the expected outcome for a bad file
    }
    try {
      exercise(*tok, tail);
    } catch (const loom::UserError& e) {
      // A malformed model may fail to encode/decode (the library's own consistency checks), but
      // decode must never call an id that encode produced, or any id below vocab_size, invalid.
      require(std::string_view(e.what()).find("outside the vocabulary") == std::string_view::npos, e.what());
    }
  }
  std::remove(model_path().c_str());
  return 0;
}

// libFuzzer target: TikTokenizer loading a fuzzed rank file (tiktoken's "base64 rank" lines, or
// Megatron's JSON list when the input starts with '['), with each --tiktoken-pattern and a small
// special-token count. A UserError is the expected answer to a bad file; anything else escaping (a crash,
// a sanitizer report, a LOOM_CHECK) is a finding. A tokenizer that loads must keep its invariants on any
// text (fixed samples plus the input's last bytes): ids in [num_special, vocab_size), eod = 2, and
// decode(encode(x)) == x byte for byte.
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

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const std::string path = "/tmp/loom_fuzz_tiktoken_" + std::to_string(::getpid()) + ".tiktoken";
  fuzz_util::write_file(path, in);
  const std::string_view tail = in.substr(size > 256 ? size - 256 : 0);
  for (const char* pattern : {"v1", "v2", "gpt2", "cl100k"}) {
    loom::TokenizerConfig cfg;
    cfg.type = "TikTokenizer";
    cfg.tokenizer_model = path;
    cfg.tiktoken_pattern = pattern;
    cfg.tiktoken_num_special_tokens = 8;
    std::unique_ptr<loom::Tokenizer> tok;
    try {
      tok = loom::make_tokenizer(cfg);
    } catch (const loom::UserError&) {
      break;  // the file is rejected whatever the pattern
    }
    const int64_t V = tok->vocab_size();
    require(V >= 8 + 256, "vocab_size >= num_special + 256");
    require(tok->eod() == 2, "eod is </s> = 2");
    for (const std::string_view text :
         {std::string_view("Hello world's  TEST\n\n  x\r\n 123456 caf\xC3\xA9 e\xCC\x81 \xE6\x97\xA5 a.//b I'M"),
          std::string_view("\xff\xfe a\xc3( \xed\xa0\x80"), tail}) {
      const std::vector<int32_t> ids = tok->encode(text);
      for (const int32_t id : ids) require(id >= 8 && id < V, "encoded id in [num_special, vocab_size)");
      require(tok->decode(ids) == text, "decode(encode(x)) == x");
    }
  }
  std::remove(path.c_str());
  return 0;
}

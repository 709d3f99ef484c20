// libFuzzer target: GPT2BPETokenizer loading fuzzed vocabulary and merge files. The input is
// "<encoder.json bytes>\n=====\n<vocab.bpe bytes>"; without the separator the whole input is the
// encoder.json and the merge file is just a header. A UserError is the expected answer to a bad file;
// anything else escaping (a crash, a sanitizer report, a LOOM_CHECK) is a finding. A tokenizer that
// loads must keep its invariants on any text (fixed samples plus the input's last bytes, often invalid
// UTF-8): ids in [0, vocab_size), eod in range, and decode(encode(x)) == x byte for byte.
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
using fuzz_util::write_file;

std::string temp_path(const char* what) {
  return "/tmp/loom_fuzz_gpt2_" + std::to_string(::getpid()) + "_" + what;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  constexpr std::string_view kSep = "\n=====\n";
  const size_t sep = in.find(kSep);
  const std::string_view vocab = sep == std::string_view::npos ? in : in.substr(0, sep);
  const std::string_view merges = sep == std::string_view::npos ? std::string_view("#version: 0.2\n")
                                                                : in.substr(sep + kSep.size());
  loom::TokenizerConfig cfg;
  cfg.type = "GPT2BPETokenizer";
  cfg.vocab_file = temp_path("encoder.json");
  cfg.merge_file = temp_path("vocab.bpe");
  write_file(cfg.vocab_file, vocab);
  write_file(cfg.merge_file, merges);
  std::unique_ptr<loom::Tokenizer> tok;
  try {
    tok = loom::make_tokenizer(cfg);
  } catch (const loom::UserError&) {
    tok.reset();
  }
  if (tok) {
    const int64_t V = tok->vocab_size();
    require(V >= 257, "vocab_size >= 257 (256 bytes + <|endoftext|>)");
    require(tok->eod() >= 0 && tok->eod() < V, "eod in [0, vocab_size)");
    const std::string_view tail = in.substr(size > 256 ? size - 256 : 0);
    for (const std::string_view text :
         {std::string_view("Hello world's  TEST\n\n  x\r\n 123 caf\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC <|endoftext|>"),
          std::string_view("\xff\xfe a\xc3( \xed\xa0\x80"), tail}) {
      const std::vector<int32_t> ids = tok->encode(text);
      for (const int32_t id : ids) require(id >= 0 && id < V, "encoded id in [0, vocab_size)");
      require(tok->decode(ids) == text, "decode(encode(x)) == x");
    }
  }
  std::remove(cfg.vocab_file.c_str());
  std::remove(cfg.merge_file.c_str());
  return 0;
}

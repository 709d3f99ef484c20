// libFuzzer target: arbitrary bytes as the JSONL input of run_preprocess (NullTokenizer). Byte 0 picks
// options: bit0 --skip-bad-lines, bit1 --append-eod, bit2 --workers 3, bit3 --json-keys text title,
// bit4 vocab 70000 (int32 output) instead of 1000, bit5 also run with the other worker count and
// require byte-identical output. The rest is the file. A UserError (bad line, ...) must leave no files;
// a successful run must produce datasets that open and agree with the returned statistics.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "loom/core/check.h"
#include "loom/data/indexed_dataset.h"
#include "loom/data/preprocess.h"
#include "loom/data/tokenizer.h"
#include "fuzz_preprocess.h"
#include "fuzz_util.h"

namespace fs = std::filesystem;

namespace {

using fuzz_util::require;

// A fresh directory per input, removed afterwards (libFuzzer does not run atexit handlers). On tmpfs
// when there is one: rewriting files on a disk filesystem waits for writeback.
const fs::path& dir() { return fuzz_util::scratch_dir("jsonl"); }

struct ScratchDir : fuzz_util::Scratch {
  ScratchDir() : Scratch(dir()) {}
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

// run_preprocess hands every input to worker threads: one CPU for all of them (fuzz_util.h).
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz_util::pin_to_current_cpu();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t opt = data[0];
  const ScratchDir scratch;
  loom::PreprocessConfig cfg = fuzz_util::jsonl_input(dir(), data + 1, size - 1);
  cfg.tokenizer.type = "NullTokenizer";
  cfg.tokenizer.vocab_size = (opt & 16) ? 70000 : 1000;
  cfg.skip_bad_lines = opt & 1;
  cfg.append_eod = opt & 2;
  cfg.workers = (opt & 4) ? 3 : 1;
  if (opt & 8) cfg.json_keys = {"text", "title"};
  cfg.log_interval = 7;

  loom::PreprocessStats stats;
  if (!fuzz_util::run_preprocess_checked(cfg, dir(), stats)) return 0;
  require(stats.outputs.size() == cfg.json_keys.size(), "one output per key");
  const auto tok = loom::make_tokenizer(cfg.tokenizer);
  const int32_t eod = tok->eod();
  const int64_t vocab = tok->vocab_size();
  std::vector<std::string> bytes;
  for (size_t k = 0; k < stats.outputs.size(); ++k) {
    const auto ds = loom::IndexedDataset::open(stats.outputs[k]);
    require(int64_t(ds->document_indices().size()) == stats.documents + 1, "document count");
    require(ds->dtype() == loom::index_dtype_for_vocab(vocab), "dtype");
    int64_t tokens = 0;
    const auto di = ds->document_indices();
    const auto lens = ds->sequence_lengths();
    std::vector<int32_t> buf;
    for (size_t d = 0; d + 1 < di.size(); ++d)
      for (int64_t s = di[d]; s < di[d + 1]; ++s) {
        require(lens[s] > 0, "no empty sequences");
        buf.resize(size_t(lens[s]));
        ds->read(s, 0, lens[s], buf.data());
        for (int32_t t : buf) require(t >= 0 && t < vocab, "token in vocabulary");
        if (cfg.append_eod && s == di[d + 1] - 1) require(buf.back() == eod, "EOD ends each non-empty document");
        tokens += lens[s];
      }
    require(tokens == stats.tokens[k], "token count");
    bytes.push_back(slurp(stats.outputs[k] + ".bin") + slurp(stats.outputs[k] + ".idx"));
  }
  if (opt & 32) {  // determinism across worker counts
    cfg.workers = cfg.workers == 1 ? 3 : 1;
    loom::PreprocessStats again;
    require(fuzz_util::run_preprocess_checked(cfg, dir(), again), "second run failed");
    for (size_t k = 0; k < again.outputs.size(); ++k)
      require(bytes[k] == slurp(again.outputs[k] + ".bin") + slurp(again.outputs[k] + ".idx"),
              "output depends on --workers");
  }
  return 0;
}

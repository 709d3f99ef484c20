// Save and load time of a GPT-2 124M checkpoint through the ckpt layer, as one process writes and reads it:
// the f32 master weights and both Adam moments of every parameter (3 x 124.5M floats, 1.49 GB) as whole
// pieces of one shard. A save is save_sharded_checkpoint (staging dir, shard + metadata.json, fsyncs,
// commit); a load is ShardedCheckpoint::open plus read() of every piece into fresh host buffers (the files
// are in the page cache after the save: this is the CPU cost of a load, where checksums weigh the most).
// Both are single-threaded; each is timed in wall-clock and in process CPU seconds (user + system: less
// disturbed by other work on a shared machine).
// Uses only API that predates checksums, so the same source builds against an older libloom_ckpt for a
// before/after comparison (bench/RESULTS.md).
//
//   loom_bench_ckpt DIR [REPS=3]     prints one JSON line per repetition and one with the minimum
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "loom/ckpt/checkpoint.h"
#include "loom/ckpt/sharded.h"
#include "loom/core/tensor.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// GPT-2 124M's parameters under Megatron's names (vocabulary padded to 50304, tied output layer).
std::vector<std::pair<std::string, loom::Shape>> gpt2_124m() {
  const int64_t C = 768, V = 50304, P = 1024, L = 12;
  std::vector<std::pair<std::string, loom::Shape>> out = {{"embedding.word_embeddings.weight", {V, C}},
                                                          {"embedding.position_embeddings.weight", {P, C}}};
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "decoder.layers." + std::to_string(l) + ".";
    for (const char* ln : {"input_layernorm", "pre_mlp_layernorm"}) {
      out.push_back({p + ln + ".weight", {C}});
      out.push_back({p + ln + ".bias", {C}});
    }
    out.push_back({p + "self_attention.linear_qkv.weight", {3 * C, C}});
    out.push_back({p + "self_attention.linear_qkv.bias", {3 * C}});
    out.push_back({p + "self_attention.linear_proj.weight", {C, C}});
    out.push_back({p + "self_attention.linear_proj.bias", {C}});
    out.push_back({p + "mlp.linear_fc1.weight", {4 * C, C}});
    out.push_back({p + "mlp.linear_fc1.bias", {4 * C}});
    out.push_back({p + "mlp.linear_fc2.weight", {C, 4 * C}});
    out.push_back({p + "mlp.linear_fc2.bias", {C}});
  }
  out.push_back({"decoder.final_layernorm.weight", {C}});
  out.push_back({"decoder.final_layernorm.bias", {C}});
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DIR [REPS=3]\n", argv[0]);
    return 2;
  }
  const std::string root = argv[1];
  const int reps = argc > 2 ? std::atoi(argv[2]) : 3;

  // Every tensor the checkpoint holds, filled with varied bits (a cheap LCG).
  std::vector<loom::Tensor> storage;
  std::vector<loom::TensorPiece> pieces;
  int64_t bytes = 0, params = 0;
  uint32_t x = 12345;
  for (const auto& [name, shape] : gpt2_124m()) {
    params += shape.numel();
    for (const std::string& n : {name, "optimizer.exp_avg." + name, "optimizer.exp_avg_sq." + name}) {
      loom::Tensor t = loom::Tensor::empty(shape, loom::DType::kF32);
      float* v = t.data<float>();
      for (int64_t i = 0; i < t.numel(); ++i) {
        x = x * 1664525u + 1013904223u;
        v[i] = float(int32_t(x)) * 1e-10f;
      }
      loom::TensorPiece p;
      p.name = n;
      p.global_shape = shape;
      p.data = t;
      bytes += t.nbytes();
      storage.push_back(std::move(t));
      pieces.push_back(std::move(p));
    }
  }
  const std::string layout = R"({"tp":1,"pp":1,"cp":1,"dp":1,"ep":1,"etp":1,"sharding":"no_shard"})";
  double best_save = 1e30, best_load = 1e30, best_save_cpu = 1e30, best_load_cpu = 1e30;
  for (int r = 0; r < reps; ++r) {
    std::error_code ec;
    std::filesystem::remove_all(root, ec);
    const auto t0 = Clock::now();
    const double c0 = cpu_seconds();
    loom::save_sharded_checkpoint(root, 1, pieces, layout, R"({"iteration": 1})", 0, 1, [] {});
    const double save = seconds_since(t0), save_cpu = cpu_seconds() - c0;

    std::vector<loom::Tensor> dst;
    std::vector<loom::TensorPiece> targets = pieces;
    for (loom::TensorPiece& t : targets) {
      dst.push_back(loom::Tensor::empty(t.global_shape, loom::DType::kF32));
      t.data = dst.back();
    }
    const auto t1 = Clock::now();
    const double c1 = cpu_seconds();
    {
      const loom::ShardedCheckpoint ck = loom::ShardedCheckpoint::open(loom::checkpoint_dir(root, 1));
      ck.read(targets);
    }  // unmapped: part of a load
    const double load = seconds_since(t1), load_cpu = cpu_seconds() - c1;
    best_save = std::min(best_save, save);
    best_load = std::min(best_load, load);
    best_save_cpu = std::min(best_save_cpu, save_cpu);
    best_load_cpu = std::min(best_load_cpu, load_cpu);
    std::printf("{\"rep\": %d, \"params\": %lld, \"bytes\": %lld, \"save_s\": %.4f, \"load_s\": %.4f, "
                "\"save_cpu_s\": %.4f, \"load_cpu_s\": %.4f}\n",
                r, static_cast<long long>(params), static_cast<long long>(bytes), save, load, save_cpu, load_cpu);
    std::fflush(stdout);
  }
  std::printf("{\"min_save_s\": %.4f, \"min_load_s\": %.4f, \"min_save_cpu_s\": %.4f, \"min_load_cpu_s\": %.4f}\n",
              best_save, best_load, best_save_cpu, best_load_cpu);
  std::error_code ec;
  std::filesystem::remove_all(root, ec);
  return 0;
}

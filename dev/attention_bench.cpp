// Microbenchmark of the CPU attention core (dev/: not part of the build). Prints the best forward and
// backward time over `reps` runs (wall and process CPU time) and GFLOP/s for one shape, activation dtype and
// attention dropout. FLOPs count only the visible score pairs (T(T+1)/2 causal, fewer with a window), i.e.
// forward ~ 4 * B * NH * T^2 * HS / 2 (QK^T and PV), and backward 2.5x forward (QK^T, dO V^T, P^T dO,
// dS^T Q, dS K). The "per CPU-second" figure divides by process CPU time instead of wall time: on a shared
// machine it shows what the threads got done while they actually ran.
// Build, from the repository root, after `cmake --build build-h2 --target loom_backend`:
//   g++ -std=c++20 -O3 -march=native -fopenmp -Iinclude -Isrc dev/attention_bench.cpp
//       build-h2/libloom_backend.a build-h2/libloom_core.a -ldnnl -o /tmp/attention_bench
// Run: OMP_NUM_THREADS=2 /tmp/attention_bench [B T NH NKV HS window reps dtype p]
//   (defaults 8 256 12 12 64 -1 20 f32 0): dtype f32|bf16|f16, p the attention dropout probability.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include <sys/mman.h>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/lowp.h"

int main(int argc, char** argv) {
  auto arg = [&](int i, int64_t def) { return argc > i ? int64_t(std::atoll(argv[i])) : def; };
  const int64_t B = arg(1, 8), T = arg(2, 256), NH = arg(3, 12), NKV = arg(4, NH), HS = arg(5, 64);
  const int64_t window = arg(6, -1), reps = arg(7, 20);
  const std::string dts = argc > 8 ? argv[8] : "f32";
  const float drop = argc > 9 ? std::strtof(argv[9], nullptr) : 0.0f;
  using loom::DType;
  const DType dt = dts == "bf16" ? DType::kBF16 : dts == "f16" ? DType::kF16 : DType::kF32;
  loom::AttentionParams p;
  p.num_heads = NH;
  p.num_kv_heads = NKV;
  p.head_dim = HS;
  p.softmax_scale = 1.0f / std::sqrt(float(HS));
  p.window = window;
  p.dropout_p = drop;
  p.dropout_seed = 1;
  p.dropout_stream = 2;
  const int64_t C3 = NKV * (NH / NKV + 2) * HS, CO = NH * HS;
  // LOOM_BENCH_HUGEPAGES=1: back the buffers with 2 MiB pages (rows of qkv are ~9 KiB apart, so with
  // 4 KiB pages every row copy is a TLB miss).
  const bool huge = std::getenv("LOOM_BENCH_HUGEPAGES") && std::atoi(std::getenv("LOOM_BENCH_HUGEPAGES"));
  // n elements of dtype d (lse is always f32).
  auto buffer = [&](int64_t n, DType d) {
    const size_t bytes = (size_t(n) * loom::dtype_size(d) + (2u << 20) - 1) / (2u << 20) * (2u << 20);
    void* p = std::aligned_alloc(2u << 20, bytes);
    if (huge) madvise(p, bytes, MADV_HUGEPAGE);
    return p;
  };
  void *qkv = buffer(B * T * C3, dt), *dqkv = buffer(B * T * C3, dt), *out = buffer(B * T * CO, dt),
       *dout = buffer(B * T * CO, dt), *lse = buffer(B * NH * T, DType::kF32);
  std::mt19937 gen(1);
  std::normal_distribution<float> dist;
  std::vector<float> row(static_cast<size_t>(C3));
  auto fill = [&](void* p, int64_t cols) {  // B * T rows of normal values, rounded to dt
    for (int64_t r = 0; r < B * T; ++r) {
      for (int64_t c = 0; c < cols; ++c) row[size_t(c)] = dist(gen);
      loom::cpu::narrow(loom::cpu::elem_ptr(p, dt, r * cols), dt, row.data(), cols);
    }
  };
  fill(qkv, C3);
  fill(dout, CO);
  using loom::Shape;
  using loom::TensorView;
  TensorView tqkv(qkv, dt, Shape{B, T, C3}), tdqkv(dqkv, dt, Shape{B, T, C3});
  TensorView tout(out, dt, Shape{B, T, CO}), tdout(dout, dt, Shape{B, T, CO});
  TensorView tlse(lse, DType::kF32, Shape{B, NH, T});
  loom::cpu::CpuOps ops;

  auto now = [] { return std::chrono::steady_clock::now(); };
  auto secs = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
  // CPU seconds of the whole process: on a shared machine, wall time / (cpu time / threads) shows how
  // much of the wall time was lost to other processes.
  auto cpu = [] {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
  };
  double best_f = 1e30, best_b = 1e30, cpu_f = 1e30, cpu_b = 1e30;
  for (int64_t r = 0; r < reps + 2; ++r) {  // 2 warm-up runs
    const double c0 = cpu();
    const auto t0 = now();
    ops.attention_forward(tout, tlse, tqkv, p);
    const auto t1 = now();
    const double c1 = cpu();
    ops.attention_backward(tdqkv, tdout, tqkv, tout, tlse, p);
    const auto t2 = now();
    const double c2 = cpu();
    if (r >= 2) {
      best_f = std::min(best_f, secs(t0, t1));
      best_b = std::min(best_b, secs(t1, t2));
      cpu_f = std::min(cpu_f, c1 - c0);
      cpu_b = std::min(cpu_b, c2 - c1);
    }
  }
  // Visible score pairs: T(T+1)/2 causal, fewer with a window.
  double pairs = 0;
  for (int64_t i = 0; i < T; ++i) pairs += double(window > 0 ? std::min<int64_t>(i + 1, window) : i + 1);
  const double fwd_flops = 4.0 * double(B * NH) * pairs * double(HS);
  const double bwd_flops = 2.5 * fwd_flops;
  std::printf("%s p=%.2f B=%ld T=%ld NH=%ld NKV=%ld HS=%ld window=%ld threads=%d\n", dts.c_str(), double(drop),
              long(B), long(T), long(NH), long(NKV), long(HS), long(window), omp_get_max_threads());
  std::printf("forward  %8.3f ms  %8.3f ms cpu  %6.1f GFLOP/s   (%.1f GFLOP per CPU-second)\n", best_f * 1e3,
              cpu_f * 1e3, fwd_flops / best_f * 1e-9, fwd_flops / cpu_f * 1e-9);
  std::printf("backward %8.3f ms  %8.3f ms cpu  %6.1f GFLOP/s   (%.1f GFLOP per CPU-second)\n", best_b * 1e3,
              cpu_b * 1e3, bwd_flops / best_b * 1e-9, bwd_flops / cpu_b * 1e-9);
  std::printf("fwd+bwd  %8.3f ms  %6.1f GFLOP/s\n", (best_f + best_b) * 1e3,
              (fwd_flops + bwd_flops) / (best_f + best_b) * 1e-9);
  return 0;
}

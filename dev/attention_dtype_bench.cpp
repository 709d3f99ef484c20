// Microbenchmark of the CPU attention core by activation dtype and attention dropout (dev/: not part of the
// build). For one shape, prints the best wall time of forward and backward over `reps` runs, and the best
// process CPU time per run (on a shared machine, CPU time is the steadier figure: it excludes the time
// the threads spent waiting for a core).
// Build, from the repository root, after `cmake --build build-h3 --target loom_backend`:
//   g++ -std=c++20 -O3 -march=native -fopenmp -Iinclude -Isrc dev/attention_dtype_bench.cpp
//       build-h3/libloom_backend.a build-h3/libloom_core.a -ldnnl -o /tmp/attention_dtype_bench
// Run: OMP_NUM_THREADS=2 /tmp/attention_dtype_bench [dtype p B T NH NKV HS window reps]
//   dtype f32|bf16|f16, p the attention dropout probability (defaults f32 0 8 256 12 12 64 -1 20).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "loom/core/dtype.h"

int main(int argc, char** argv) {
  using loom::DType;
  const std::string dts = argc > 1 ? argv[1] : "f32";
  const float p = argc > 2 ? std::strtof(argv[2], nullptr) : 0.0f;
  auto arg = [&](int i, int64_t def) { return argc > i ? int64_t(std::atoll(argv[i])) : def; };
  const int64_t B = arg(3, 8), T = arg(4, 256), NH = arg(5, 12), NKV = arg(6, NH), HS = arg(7, 64);
  const int64_t window = arg(8, -1), reps = arg(9, 20);
  const DType dt = dts == "bf16" ? DType::kBF16 : dts == "f16" ? DType::kF16 : DType::kF32;
  loom::AttentionParams ap;
  ap.num_heads = NH;
  ap.num_kv_heads = NKV;
  ap.head_dim = HS;
  ap.softmax_scale = 1.0f / std::sqrt(float(HS));
  ap.window = window;
  ap.dropout_p = p;
  ap.dropout_seed = 1;
  ap.dropout_stream = 2;
  const int64_t C3 = NKV * (NH / NKV + 2) * HS, CO = NH * HS;
  const size_t es = loom::dtype_size(dt);
  std::vector<uint8_t> qkv(size_t(B * T * C3) * es), dqkv(qkv.size()), out(size_t(B * T * CO) * es), dout(out.size());
  std::vector<float> lse(size_t(B * NH * T));
  std::mt19937 gen(1);
  std::normal_distribution<float> dist;
  auto fill = [&](std::vector<uint8_t>& v) {
    for (size_t i = 0; i < v.size() / es; ++i) {
      const float x = dist(gen);
      if (dt == DType::kF32) std::memcpy(&v[i * 4], &x, 4);
      else {
        const uint16_t h = dt == DType::kBF16 ? loom::f32_to_bf16(x) : loom::f32_to_f16(x);
        std::memcpy(&v[i * 2], &h, 2);
      }
    }
  };
  fill(qkv);
  fill(dout);
  using loom::Shape;
  using loom::TensorView;
  TensorView tqkv(qkv.data(), dt, Shape{B, T, C3}), tdqkv(dqkv.data(), dt, Shape{B, T, C3});
  TensorView tout(out.data(), dt, Shape{B, T, CO}), tdout(dout.data(), dt, Shape{B, T, CO});
  TensorView tlse(lse.data(), DType::kF32, Shape{B, NH, T});
  loom::cpu::CpuOps ops;
  auto now = [] { return std::chrono::steady_clock::now(); };
  auto secs = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
  auto cpu = [] {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
  };
  double best_f = 1e30, best_b = 1e30, cpu_f = 1e30, cpu_b = 1e30;
  for (int64_t r = 0; r < reps + 2; ++r) {  // 2 warm-up runs
    const double c0 = cpu();
    const auto t0 = now();
    ops.attention_forward(tout, tlse, tqkv, ap);
    const auto t1 = now();
    const double c1 = cpu();
    ops.attention_backward(tdqkv, tdout, tqkv, tout, tlse, ap);
    const auto t2 = now();
    const double c2 = cpu();
    if (r >= 2) {
      best_f = std::min(best_f, secs(t0, t1));
      best_b = std::min(best_b, secs(t1, t2));
      cpu_f = std::min(cpu_f, c1 - c0);
      cpu_b = std::min(cpu_b, c2 - c1);
    }
  }
  std::printf("%s p=%.2f B=%ld T=%ld NH=%ld NKV=%ld HS=%ld window=%ld threads=%d\n", dts.c_str(), double(p), long(B),
              long(T), long(NH), long(NKV), long(HS), long(window), omp_get_max_threads());
  std::printf("forward  %8.3f ms wall  %8.3f ms cpu\n", best_f * 1e3, cpu_f * 1e3);
  std::printf("backward %8.3f ms wall  %8.3f ms cpu\n", best_b * 1e3, cpu_b * 1e3);
  std::printf("fwd+bwd  %8.3f ms wall  %8.3f ms cpu\n", (best_f + best_b) * 1e3, (cpu_f + cpu_b) * 1e3);
  return 0;
}

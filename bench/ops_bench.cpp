// Op-level CPU benchmarks at GPT-2 124M shapes (B·T = 2048 rows, C = 768, Vp = 50304): the matmuls of
// a layer and of the output layer (GFLOP/s counters, to compare with oneDNN's ceiling), attention,
// the fused cross-entropy and AdamW. Run: build/bench/loom_bench_ops (also part of `make bench`).
#include <benchmark/benchmark.h>

#include "loom/backend/device_context.h"
#include "loom/core/rng.h"

using namespace loom;

namespace {

const DeviceContext& ctx() {
  static auto c = make_cpu_context();
  return *c;
}

Tensor randn(Shape s, float std = 0.02f) {
  Tensor t = Tensor::empty(s, DType::kF32);
  philox_fill_normal(t.data<float>(), t.numel(), 7, hash_stream("bench"), 0, 0.0f, std);
  return t;
}

// Forward + both backward products of a linear layer: 6·M·N·K FLOPs.
void BM_Linear(benchmark::State& st) {
  const int64_t M = st.range(0), K = st.range(1), N = st.range(2);
  Tensor x = randn({M, K}, 1.0f), w = randn({N, K}), b = randn({N}), y = randn({M, N});
  Tensor dx = randn({M, K}), dw = randn({N, K}), db = randn({N});
  for (auto _ : st) {
    ctx().ops().matmul_forward(y, x, w, b);
    ctx().ops().matmul_backward(dx, dw, db, y, x, w);
  }
  st.counters["GFLOP/s"] = benchmark::Counter(6.0 * double(M * N * K) * double(st.iterations()) / 1e9,
                                              benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Linear)
    ->Args({2048, 768, 2304})
    ->Args({2048, 768, 768})
    ->Args({2048, 768, 3072})
    ->Args({2048, 3072, 768})
    ->Args({2048, 768, 50304})
    ->Args({256, 768, 3072})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_Attention(benchmark::State& st) {
  const int64_t B = st.range(0), T = st.range(1), NH = 12, HS = 64;
  Tensor qkv = randn({B, T, 3 * NH * HS}, 1.0f), out = randn({B, T, NH * HS}), lse = randn({B, NH, T});
  Tensor dout = randn({B, T, NH * HS}), dqkv = randn({B, T, 3 * NH * HS});
  const AttentionParams p{NH, NH, HS, 0.125f, true, -1};
  for (auto _ : st) {
    ctx().ops().attention_forward(out, lse, qkv, p);
    ctx().ops().attention_backward(dqkv, dout, qkv, out, lse, p);
  }
  // Causal: half of the 4·B·NH·T²·HS forward FLOPs, backward 2.5x forward.
  st.counters["GFLOP/s"] = benchmark::Counter(3.5 * 2.0 * double(B * NH * T * T * HS) * double(st.iterations()) / 1e9,
                                              benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Attention)->Args({4, 64})->Args({8, 256})->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_CrossEntropy(benchmark::State& st) {
  const int64_t N = st.range(0), V = 50257, Vp = 50304;
  Tensor logits = randn({N, Vp}, 1.0f), losses = Tensor::empty({N}, DType::kF32);
  Tensor targets = Tensor::empty({N}, DType::kI32);
  for (int64_t i = 0; i < N; ++i) targets.data<int32_t>()[i] = int32_t((i * 7919) % V);
  for (auto _ : st) ctx().ops().cross_entropy_forward_backward(losses, logits, targets, V, TensorView(), 1e-3f);
  st.counters["GB/s"] = benchmark::Counter(2.0 * double(N * Vp * 4) * double(st.iterations()) / 1e9,
                                           benchmark::Counter::kIsRate);
}
BENCHMARK(BM_CrossEntropy)->Arg(256)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_AdamW(benchmark::State& st) {
  const int64_t n = st.range(0);
  Tensor p = randn({n}), g = randn({n}), m = randn({n}), v = randn({n}, 0.0f);
  AdamWParams a;
  a.lr = 1e-4f;
  for (auto _ : st) ctx().ops().adamw_update(p, g, m, v, a);
  st.counters["GB/s"] = benchmark::Counter(7.0 * double(n * 4) * double(st.iterations()) / 1e9,
                                           benchmark::Counter::kIsRate);
}
BENCHMARK(BM_AdamW)->Arg(124475904)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();

// Op-level CPU benchmarks at GPT-2 124M shapes (B·T = 2048 rows, C = 768, Vp = 50304): the matmuls of
// a layer and of the output layer (GFLOP/s counters, to compare with oneDNN's ceiling), attention,
// the fused cross-entropy and AdamW; the three products of a linear layer one by one (also over 8 cold
// weights, as an MoE layer's experts run them) and the row-wise ops in f32 / bf16 / f16 (mixed precision). Run: build/bench/loom_bench_ops (also part of
// `make bench`); e.g. --benchmark_filter='Product|Lowp' for the mixed-precision ones.
#include <benchmark/benchmark.h>

#include <string>
#include <utility>
#include <vector>

#include "backend/cpu/attention_bf16.h"
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

// Dtype codes of the mixed-precision benchmarks' last argument.
DType dtype_arg(int64_t code) { return code == 0 ? DType::kF32 : code == 1 ? DType::kBF16 : DType::kF16; }

Tensor randn_as(Shape s, DType dt, float std = 0.02f) {
  Tensor f = randn(s, std);
  if (dt == DType::kF32) return f;
  Tensor t = Tensor::empty(s, dt);
  ctx().ops().cast(t, f);
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

// One product of a linear layer (M, K) -> (M, N) in dtype code st.range(4) (0 f32, 1 bf16, 2 f16):
// st.range(3) = 0 forward out = x·Wᵀ, 1 dinp = dout·W, 2 dweight += doutᵀ·x into an f32 main grad.
// 2·M·N·K FLOPs.
// Product `which` of BM_LinearProduct's numbering on one layer's tensors (y is out, or dout), and its label.
void linear_product(int64_t which, Tensor& y, Tensor& x, Tensor& w, Tensor& dx, Tensor& dw) {
  if (which == 0) ctx().ops().matmul_forward(y, x, w, TensorView());
  if (which == 1) ctx().ops().matmul_backward(dx, TensorView(), TensorView(), y, x, w);
  if (which == 2) ctx().ops().matmul_backward(TensorView(), dw, TensorView(), y, x, w);
}
std::string linear_product_label(DType dt, int64_t which) {
  return std::string(dtype_name(dt)) + (which == 0 ? " x.W^T" : which == 1 ? " dout.W" : " dout^T.x");
}

void BM_LinearProduct(benchmark::State& st) {
  const int64_t M = st.range(0), K = st.range(1), N = st.range(2), which = st.range(3);
  const DType dt = dtype_arg(st.range(4));
  Tensor x = randn_as({M, K}, dt, 1.0f), w = randn_as({N, K}, dt), y = randn_as({M, N}, dt);
  Tensor dx = randn_as({M, K}, dt), dw = randn({N, K});
  for (auto _ : st) linear_product(which, y, x, w, dx, dw);
  st.SetLabel(linear_product_label(dt, which));
  st.counters["GFLOP/s"] = benchmark::Counter(2.0 * double(M * N * K) * double(st.iterations()) / 1e9,
                                              benchmark::Counter::kIsRate);
}
void linear_product_args(benchmark::internal::Benchmark* b) {
  for (int64_t dt : {1, 0, 2})
    for (auto [K, N] : {std::pair<int64_t, int64_t>{768, 2304}, {768, 768}, {768, 3072}, {3072, 768}, {768, 50304}})
      for (int64_t which : {0, 1, 2}) b->Args({2048, K, N, which, dt});
}
BENCHMARK(BM_LinearProduct)->Apply(linear_product_args)->Unit(benchmark::kMillisecond)->UseRealTime();

// The same products over E = 8 distinct weights in turn, as a mixture-of-experts layer runs its experts'
// groups: with 8 weights of a Mixtral expert (7168 x 1024 bf16 is 14.7 MB each) no weight is in cache when
// its product starts, which is what the swapped forward and the packed input-gradient weight are chosen by
// (matmul.cpp). Time per pass over the 8 products; rows M per product, dtype code st.range(4).
void BM_ColdWeightProducts(benchmark::State& st) {
  constexpr int E = 8;
  const int64_t M = st.range(0), K = st.range(1), N = st.range(2), which = st.range(3);
  const DType dt = dtype_arg(st.range(4));
  std::vector<Tensor> x, w, y, dx, dw;
  for (int e = 0; e < E; ++e) {
    x.push_back(randn_as({M, K}, dt, 1.0f));
    w.push_back(randn_as({N, K}, dt));
    y.push_back(randn_as({M, N}, dt));
    dx.push_back(randn_as({M, K}, dt));
    dw.push_back(randn({N, K}));
  }
  for (auto _ : st)
    for (int e = 0; e < E; ++e) linear_product(which, y[e], x[e], w[e], dx[e], dw[e]);
  st.SetLabel(linear_product_label(dt, which) + ", 8 weights");
  st.counters["GFLOP/s"] = benchmark::Counter(2.0 * E * double(M * N * K) * double(st.iterations()) / 1e9,
                                              benchmark::Counter::kIsRate);
}
void cold_weight_args(benchmark::internal::Benchmark* b) {
  // A Mixtral expert's fc1 (K 1024 -> N 7168) and fc2 (3584 -> 1024) over the ~128 and ~512 rows of
  // bench/moe_bench.sh's mixtral-512 and mixtral-2048, in bf16.
  for (int64_t M : {128, 512})
    for (auto [K, N] : {std::pair<int64_t, int64_t>{1024, 7168}, {3584, 1024}})
      for (int64_t which : {0, 1, 2}) b->Args({M, K, N, which, 1});
}
BENCHMARK(BM_ColdWeightProducts)->Apply(cold_weight_args)->Unit(benchmark::kMillisecond)->UseRealTime();

// Linear fwd + bwd in bf16 / f16 with f32 main grads (dweight, dbias), as a --bf16 step runs it.
void BM_LinearLowp(benchmark::State& st) {
  const int64_t M = st.range(0), K = st.range(1), N = st.range(2);
  const DType dt = dtype_arg(st.range(3));
  Tensor x = randn_as({M, K}, dt, 1.0f), w = randn_as({N, K}, dt), b = randn_as({N}, dt), y = randn_as({M, N}, dt);
  Tensor dx = randn_as({M, K}, dt), dw = randn({N, K}), db = randn({N});
  for (auto _ : st) {
    ctx().ops().matmul_forward(y, x, w, b);
    ctx().ops().matmul_backward(dx, dw, db, y, x, w);
  }
  st.SetLabel(dtype_name(dt));
  st.counters["GFLOP/s"] = benchmark::Counter(6.0 * double(M * N * K) * double(st.iterations()) / 1e9,
                                              benchmark::Counter::kIsRate);
}
BENCHMARK(BM_LinearLowp)
    ->Args({2048, 768, 2304, 1})
    ->Args({2048, 768, 3072, 1})
    ->Args({2048, 3072, 768, 1})
    ->Args({2048, 768, 3072, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Row-wise ops of a transformer layer at (2048, 768) (GeLU and the bias gradient at (2048, 3072)) in dtype
// code st.range(1);
// st.range(0) picks the op. GB/s counts the bytes the op must move at that dtype.
void BM_RowOpsLowp(benchmark::State& st) {
  const int64_t op = st.range(0), N = 2048, C = 768;
  const DType dt = dtype_arg(st.range(1));
  const double es = double(dtype_size(dt));
  Tensor a = randn_as({N, C}, dt, 1.0f), b = randn_as({N, C}, dt, 1.0f), out = randn_as({N, C}, dt);
  Tensor res = randn_as({N, C}, dt), w = randn_as({C}, dt, 1.0f), bias = randn_as({C}, dt);
  Tensor mean = randn({N}), rstd = randn({N}), dw = randn({C}), db = randn({C});
  Tensor h = randn_as({N, 4 * C}, dt, 1.0f), dh = randn_as({N, 4 * C}, dt), out4 = randn_as({N, 4 * C}, dt);
  Tensor db4 = randn({4 * C});
  ctx().ops().layernorm_forward(out, mean, rstd, a, w, bias, 1e-5f);
  double bytes = 0;
  const char* label = "";
  for (auto _ : st) {
    switch (op) {
      case 0: ctx().ops().layernorm_forward(out, mean, rstd, a, w, bias, 1e-5f); break;
      case 1: ctx().ops().residual_layernorm_forward(res, out, mean, rstd, a, b, w, bias, 1e-5f); break;
      case 2: ctx().ops().layernorm_backward(b, dw, db, out, a, w, mean, rstd); break;
      case 3: ctx().ops().gelu_forward(dh, h); break;
      case 4: ctx().ops().gelu_backward(dh, h, out4); break;  // not in place: values must not decay
      case 5: ctx().ops().residual_forward(out, a, b); break;
      case 6: ctx().ops().bias_backward(db4, h); break;
    }
  }
  switch (op) {
    case 0: label = "layernorm fwd"; bytes = 2 * N * C * es; break;
    case 1: label = "residual+layernorm fwd"; bytes = 4 * N * C * es; break;
    case 2: label = "layernorm bwd"; bytes = 4 * N * C * es; break;
    case 3: label = "gelu fwd (2048x3072)"; bytes = 2 * N * 4 * C * es; break;
    case 4: label = "gelu bwd (2048x3072)"; bytes = 3 * N * 4 * C * es; break;
    case 5: label = "residual"; bytes = 3 * N * C * es; break;
    case 6: label = "bias grad (2048x3072)"; bytes = N * 4 * C * es; break;
  }
  st.SetLabel(std::string(label) + " " + dtype_name(dt));
  st.counters["GB/s"] = benchmark::Counter(bytes * double(st.iterations()) / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_RowOpsLowp)->ArgsProduct({{0, 1, 2, 3, 4, 5, 6}, {0, 1, 2}})->Unit(benchmark::kMicrosecond)->UseRealTime();

// Fused cross-entropy forward + backward on bf16 / f16 logits (dlogits in place, in that dtype).
void BM_CrossEntropyLowp(benchmark::State& st) {
  const int64_t N = st.range(0), V = 50257, Vp = 50304;
  const DType dt = dtype_arg(st.range(1));
  Tensor logits = randn_as({N, Vp}, dt, 1.0f), losses = Tensor::empty({N}, DType::kF32);
  Tensor targets = Tensor::empty({N}, DType::kI32);
  for (int64_t i = 0; i < N; ++i) targets.data<int32_t>()[i] = int32_t((i * 7919) % V);
  for (auto _ : st) ctx().ops().cross_entropy_forward_backward(losses, logits, targets, V, TensorView(), 1e-3f);
  st.SetLabel(dtype_name(dt));
  const double bytes = 2.0 * double(N * Vp) * double(dtype_size(dt));
  st.counters["GB/s"] = benchmark::Counter(bytes * double(st.iterations()) / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_CrossEntropyLowp)->Args({2048, 1})->Args({2048, 2})->Unit(benchmark::kMillisecond)->UseRealTime();

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

// bf16 attention forward + backward, args (B, T, NH, NKV, path): path 1 = the default (VDPBF16PS products where
// the CPU has AVX512-BF16), 0 = the f32 tile path on the widened rows. GPT-2 124M's layer (12 heads) and a
// Llama-3.2-1B-shaped one (32 query heads, 8 kv heads), head size 64.
void BM_AttentionLowp(benchmark::State& st) {
  const int64_t B = st.range(0), T = st.range(1), NH = st.range(2), NKV = st.range(3), HS = 64;
  const bool saved = cpu::attn::bf16_attention_enabled();
  cpu::attn::set_bf16_attention(st.range(4) != 0);
  Tensor qkv = randn_as({B, T, NKV * (NH / NKV + 2) * HS}, DType::kBF16, 1.0f);
  Tensor out = randn_as({B, T, NH * HS}, DType::kBF16), dout = randn_as({B, T, NH * HS}, DType::kBF16);
  Tensor dqkv = randn_as({B, T, NKV * (NH / NKV + 2) * HS}, DType::kBF16), lse = randn({B, NH, T});
  const AttentionParams p{NH, NKV, HS, 0.125f, true, -1};
  for (auto _ : st) {
    ctx().ops().attention_forward(out, lse, qkv, p);
    ctx().ops().attention_backward(dqkv, dout, qkv, out, lse, p);
  }
  st.SetLabel(cpu::attn::bf16_attention_enabled() ? "bf16 products" : "f32 products");
  cpu::attn::set_bf16_attention(saved);
  st.counters["GFLOP/s"] = benchmark::Counter(3.5 * 2.0 * double(B * NH * T * T * HS) * double(st.iterations()) / 1e9,
                                              benchmark::Counter::kIsRate);
}
BENCHMARK(BM_AttentionLowp)
    ->Args({8, 256, 12, 12, 0})
    ->Args({8, 256, 12, 12, 1})
    ->Args({4, 512, 32, 8, 0})
    ->Args({4, 512, 32, 8, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

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

// AdamW over GPT-2 124M's parameters. st.range(1): 0 = the update alone; 1 = as a --bf16 step runs it, the
// gradient zeroed after reading and the bf16 compute copy written. GB/s counts the bytes that must move:
// read p, g, m, v and write p, m, v (28 B per parameter), plus the zeroed g and the bf16 copy (6 B) in form 1.
void BM_AdamW(benchmark::State& st) {
  const int64_t n = st.range(0);
  const bool step_form = st.range(1) == 1;
  Tensor p = randn({n}), g = randn({n}), m = randn({n}), v = randn({n}, 0.0f);
  Tensor compute = step_form ? Tensor::empty({n}, DType::kBF16) : Tensor();
  AdamWParams a;
  a.lr = 1e-4f;
  a.zero_grad = step_form;
  for (auto _ : st) ctx().ops().adamw_update(p, g, m, v, a, compute);
  st.counters["GB/s"] = benchmark::Counter((step_form ? 34.0 : 28.0) * double(n) * double(st.iterations()) / 1e9,
                                           benchmark::Counter::kIsRate);
  st.SetLabel(step_form ? "zeroed grad + bf16 copy" : "update only");
}
BENCHMARK(BM_AdamW)->Args({124475904, 0})->Args({124475904, 1})->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();

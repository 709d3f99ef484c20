// loom_bench_moe: forward + backward of one mixture-of-experts layer on the CPU (bench/moe_bench.sh runs it
// next to bench/pytorch_moe.py). One iteration is what a training step does with an MoE MLP:
//   forward   router (logits GEMM + top-k routing) -> moe_permute -> GroupedMLP (fc1, SwiGLU/GeLU, fc2)
//             -> moe_unpermute (probability-weighted combine)
//   backward  moe_unpermute -> GroupedMLP (both grouped GEMMs' dinp and dweight) -> moe_permute -> router
//             (dlogits from dprobs, the gate's dinp and weight gradient), dx = both input paths summed.
// Softmax routing with top-k renormalisation (HF Mixtral's), no capacity, no aux/z loss (HF computes its
// aux loss outside the block). Every iteration routes fresh random tokens (x ~ N(0, 1), generated
// before the clock starts), as training does, so the expert group sizes change from one call to the next;
// dy ~ N(0, 1) is fixed. --same-tokens routes one batch every iteration instead (fixed group sizes: shows
// what the changing sizes cost). Weights N(0, 0.02). Before each iteration (outside the clock) the parameter
// gradients are zeroed and marked so, as the optimizer step leaves them, so the experts' weight gradients are
// stored, the step's first write (GradWrite::kOverwrite); --accumulate-grads never zeroes them and every
// iteration adds to them, as a later micro-batch of gradient accumulation does. Buffers whose size does not
// depend on the routing (M = N·k rows without a capacity) are allocated once; GroupedMLP::backward allocates
// its own temporaries, as in training.
//
// Prints per-iteration times on stderr and one JSON line on stdout: the median, min and max ms of the
// timed iterations, GFLOP/s by the formula of bench/README.md ("MoE layer"), and the median ms of each
// phase (the phases are timed inside the same iterations; their sum is the total up to clock reads).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "loom/backend/device_context.h"
#include "loom/nn/modules.h"
#include "loom/nn/moe.h"

namespace loom {
namespace {

struct Args {
  int64_t N = 2048, C = 1024, F = 3584, E = 8, k = 2;
  bool gated = true;
  DType dtype = DType::kF32;
  int warmup = 2, steps = 5;
  uint64_t seed = 1234;
  bool same_tokens = false;  // route the same tokens every iteration (fixed group sizes; a diagnostic)
  bool accumulate_grads = false;  // never zero the gradients: every iteration adds to them
};

[[noreturn]] void usage(const char* msg) {
  std::fprintf(stderr,
               "loom_bench_moe: %s\n"
               "usage: loom_bench_moe [--tokens N] [--hidden C] [--ffn F] [--experts E] [--topk k]\n"
               "                      [--gelu] [--dtype f32|bf16] [--warmup W] [--steps S] [--seed S]\n"
               "                      [--same-tokens] [--accumulate-grads]\n",
               msg);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value for " + f).c_str());
      return argv[++i];
    };
    auto integer = [&]() -> int64_t {
      const std::string v = value();
      char* end = nullptr;
      const long long x = std::strtoll(v.c_str(), &end, 10);
      if (end == v.c_str() || *end != '\0') usage((f + " expects an integer, got '" + v + "'").c_str());
      return int64_t(x);
    };
    if (f == "--tokens") a.N = integer();
    else if (f == "--hidden") a.C = integer();
    else if (f == "--ffn") a.F = integer();
    else if (f == "--experts") a.E = integer();
    else if (f == "--topk") a.k = integer();
    else if (f == "--gelu") a.gated = false;
    else if (f == "--same-tokens") a.same_tokens = true;
    else if (f == "--accumulate-grads") a.accumulate_grads = true;
    else if (f == "--warmup") a.warmup = int(integer());
    else if (f == "--steps") a.steps = int(integer());
    else if (f == "--seed") a.seed = uint64_t(integer());
    else if (f == "--dtype") {
      const std::string v = value();
      if (v == "f32") a.dtype = DType::kF32;
      else if (v == "bf16") a.dtype = DType::kBF16;
      else usage(("--dtype expects f32 or bf16, got '" + v + "'").c_str());
    } else {
      usage(("unknown flag " + f).c_str());
    }
  }
  if (a.N < 1 || a.C < 1 || a.F < 1 || a.E < 1 || a.k < 1 || a.k > a.E) usage("sizes must be >= 1 and topk <= experts");
  if (a.k == 1) usage("--topk 1 needs pre-softmax routing, which the PyTorch reference does not model");
  if (a.warmup < 0 || a.steps < 1) usage("--warmup must be >= 0 and --steps >= 1");
  return a;
}

// The phases of one iteration, in order; their median ms go into the JSON line.
enum Phase { kRouterFwd, kPermuteFwd, kExpertsFwd, kUnpermuteFwd, kUnpermuteBwd, kExpertsBwd, kPermuteBwd,
             kRouterBwd, kNumPhases };
const char* const kPhaseNames[kNumPhases] = {"router_fwd",    "permute_fwd", "experts_fwd", "unpermute_fwd",
                                             "unpermute_bwd", "experts_bwd", "permute_bwd", "router_bwd"};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// A (rows, cols) tensor of `dt` filled with N(0, 1) from `rng` (rounded once when 16-bit).
Tensor normal_tensor(const DeviceContext& ctx, Shape s, DType dt, std::mt19937& rng) {
  Tensor f = Tensor::empty(s, DType::kF32);
  std::normal_distribution<float> nd;
  float* p = f.data<float>();
  for (int64_t i = 0; i < f.numel(); ++i) p[i] = nd(rng);
  if (dt == DType::kF32) return f;
  Tensor t = ctx.empty(s, dt);
  ctx.ops().cast(t, f);
  return t;
}

int run(const Args& a) {
  auto ctx = make_cpu_context();
  const OpTable& ops = ctx->ops();
  RouterConfig cfg;
  cfg.num_experts = a.E;
  cfg.topk = a.k;
  cfg.load_balancing = MoeLoadBalancing::kNone;
  ParameterSet ps;
  Router router(ps, "decoder.layers.0.mlp", a.C, cfg, 0.02f);
  GroupedMLP mlp(ps, "decoder.layers.0.mlp", a.E, a.C, a.F, a.gated, 0.02f, 0.02f);
  ps.allocate(*ctx, a.dtype, DType::kF32);  // bf16: bf16 compute copy, f32 master weights and main grads
  ps.initialize(a.seed);

  const int64_t N = a.N, C = a.C, E = a.E, M = N * a.k;
  std::mt19937 rng(uint32_t(a.seed));
  const Tensor dy = normal_tensor(*ctx, {N, C}, a.dtype, rng);
  Tensor xp = ctx->empty({M, C}, a.dtype), yp = ctx->empty({M, C}, a.dtype), y = ctx->empty({N, C}, a.dtype);
  Tensor dyp = ctx->empty({M, C}, a.dtype), dxp = ctx->empty({M, C}, a.dtype);
  Tensor dx = ctx->empty({N, C}, a.dtype), dx_router = ctx->empty({N, C}, a.dtype);
  Tensor dprobs = ctx->empty({N, E}, DType::kF32);
  Router::Saved rs;
  GroupedMLP::Saved ms;

  using Clock = std::chrono::steady_clock;
  std::vector<double> totals;
  std::vector<std::vector<double>> phases(kNumPhases);
  std::vector<int64_t> min_group(size_t(a.warmup + a.steps)), max_group(size_t(a.warmup + a.steps));
  const Tensor x0 = normal_tensor(*ctx, {N, C}, a.dtype, rng);
  for (int it = 0; it < a.warmup + a.steps; ++it) {
    const Tensor x = a.same_tokens || it == 0 ? x0 : normal_tensor(*ctx, {N, C}, a.dtype, rng);
    if (!a.accumulate_grads) {  // what the optimizer step leaves: zeroed gradients, known to be zero
      ps.zero_grads(*ctx);
      ps.mark_grads_zero();
    }
    double t[kNumPhases];
    auto t0 = Clock::now(), start = t0;
    auto lap = [&](Phase p) {
      const auto now = Clock::now();
      t[p] = std::chrono::duration<double, std::milli>(now - t0).count();
      t0 = now;
    };
    router.forward(*ctx, rs, x, N, /*training=*/true);
    lap(kRouterFwd);
    LOOM_CHECK(rs.routing.num_rows() == M, "[moe bench] expected ", M, " permuted rows, got ", rs.routing.num_rows());
    const std::vector<int64_t>& sizes = rs.routing.group_sizes;
    ops.moe_permute_forward(xp, x, rs.row_id_map);
    lap(kPermuteFwd);
    mlp.forward(*ctx, yp, ms, xp, sizes);
    lap(kExpertsFwd);
    ops.moe_unpermute_forward(y, yp, rs.probs, rs.row_id_map);
    lap(kUnpermuteFwd);
    ops.moe_unpermute_backward(dyp, dprobs, dy, yp, rs.probs, rs.row_id_map);
    lap(kUnpermuteBwd);
    mlp.backward(*ctx, dxp, dyp, xp, ms, sizes);
    lap(kExpertsBwd);
    ops.moe_permute_backward(dx, dxp, rs.row_id_map);
    lap(kPermuteBwd);
    router.backward(*ctx, dx_router, dprobs, x, rs, /*aux_grad_scale=*/1.0);
    ops.residual_forward(dx, dx, dx_router);
    lap(kRouterBwd);
    const double total = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    min_group[size_t(it)] = *std::min_element(sizes.begin(), sizes.end());
    max_group[size_t(it)] = *std::max_element(sizes.begin(), sizes.end());
    const bool timed = it >= a.warmup;
    std::fprintf(stderr, "iter %d/%d (%s) ms %.1f  groups %lld..%lld rows\n", it + 1, a.warmup + a.steps,
                 timed ? "timed" : "warmup", total, (long long)min_group[size_t(it)], (long long)max_group[size_t(it)]);
    if (!timed) continue;
    totals.push_back(total);
    for (int p = 0; p < kNumPhases; ++p) phases[size_t(p)].push_back(t[p]);
  }

  // Forward matmul FLOPs (router + the experts' two grouped GEMMs) x 3 for forward + backward.
  const double F1 = a.gated ? 2.0 * double(a.F) : double(a.F);
  const double flops =
      3.0 * (2.0 * double(N) * double(C) * double(E) + 2.0 * double(M) * double(C) * (F1 + double(a.F)));
  const double ms_med = median(totals);
  std::printf("{\"impl\": \"loom\", \"N\": %lld, \"C\": %lld, \"F\": %lld, \"E\": %lld, \"topk\": %lld, "
              "\"act\": \"%s\", \"precision\": \"%s\", \"same_tokens\": %s, \"grads\": \"%s\", \"threads\": %d, "
              "\"warmup\": %d, \"steps\": %d, \"ms\": %.3f, \"ms_min\": %.3f, \"ms_max\": %.3f, "
              "\"gflops\": %.3f, \"phases_ms\": {",
              (long long)N, (long long)C, (long long)a.F, (long long)E, (long long)a.k, a.gated ? "swiglu" : "gelu",
              a.dtype == DType::kF32 ? "fp32" : "bf16", a.same_tokens ? "true" : "false",
              a.accumulate_grads ? "accumulate" : "first-write", omp_get_max_threads(),
              a.warmup, a.steps, ms_med, *std::min_element(totals.begin(), totals.end()),
              *std::max_element(totals.begin(), totals.end()), flops / (ms_med / 1e3) / 1e9);
  for (int p = 0; p < kNumPhases; ++p)
    std::printf("%s\"%s\": %.3f", p ? ", " : "", kPhaseNames[p], median(phases[size_t(p)]));
  std::printf("}}\n");
  return 0;
}

}  // namespace
}  // namespace loom

int main(int argc, char** argv) {
  try {
    return loom::run(loom::parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom_bench_moe: %s\n", e.what());
    return 1;
  }
}

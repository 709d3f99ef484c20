// GEMM ceiling of a training step: every matrix product of one GPT/Llama training step (forward, input
// gradient and weight gradient of each linear, the attention products, the output layer) timed through
// oneDNN directly, at the model's shapes, in the best configuration oneDNN offers for it, with none of
// Loom's code in between. The sum of those times is the shortest step any implementation built on these
// GEMMs could take; bench/run_bench.sh and bench/llama_bench.sh print it next to the measured step and
// the step's fraction of it.
//
//   loom_bench_ceiling --dtype bf16 --batch 8 --seq 256 --hidden 768 --ffn 3072 --layers 12 --heads 12
//       --vocab 50304 [--kv-heads N] [--glu] [--reps 3] [--all-variants]
//
// Variants timed per product (the fastest is the ceiling):
//   f32:  dnnl_sgemm on all threads; the matmul primitive with plain (strided) operands
//   bf16: the matmul primitive with plain operands, and with the weight operand in the layout oneDNN
//         prefers (format_tag::any; the one-off reorder is not timed), f32 output for weight gradients,
//         bf16 otherwise; with a runtime row count for products with a row-major A that overwrite C, and
//         with a runtime reduction for weight gradients (both run oneDNN's gemm:jit instead of brgemm)
// Weight gradients are timed adding into the f32 main grad (a sum post-op; sgemm's beta 1) and storing it
// (Loom stores on a step's first write of each weight gradient, adds on later micro-batches): the faster
// counts, as for any other variant.
// Attention products are timed as batched matmuls over B x heads with the full T x T score matrix; the
// causal half of that time is what the ceiling charges (the bench's FLOP formula counts causal work).
// Prints a table on stderr and one JSON line on stdout: {"dtype", "threads", "ceiling_ms", "flop", "ceiling_gflops",
// "products": [{"name", "ms" (best, one product), "count" (per step), "flop" (one product)}, ...]}.
#include <dnnl.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dnnl.hpp>
#include <string>
#include <vector>

namespace {

using dnnl::memory;
using Clock = std::chrono::steady_clock;

struct Product {
  std::string name;
  int64_t batch, M, N, K;  // C (batch, M, N) = op(A) (M, K) · op(B) (K, N)
  bool ta, tb;             // A stored (K, M) / B stored (N, K)
  bool weight_b;           // B is a weight (its layout may be chosen: format_tag::any)
  bool accumulate;         // C += (weight gradients into f32 main grads)
  double count;            // times per step (layers; 0.5 for causal attention)
};

struct Args {
  std::string dtype = "f32";
  int64_t B = 8, T = 256, C = 768, F = 0, L = 12, NH = 12, KV = 0, V = 50304;
  bool glu = false;
  bool all = false;  // --all-variants: print every variant's time, not just the best
  int reps = 3;
};

[[noreturn]] void usage(const char* msg) {
  std::fprintf(stderr,
               "loom_bench_ceiling: %s\nusage: loom_bench_ceiling --dtype f32|bf16 --batch B --seq T --hidden C "
               "[--ffn F (4C)] --layers L --heads NH [--kv-heads KV (NH)] --vocab Vpadded [--glu] [--reps N (3)] "
               "[--all-variants]\n",
               msg);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--glu" || k == "--all-variants") {
      (k == "--glu" ? a.glu : a.all) = true;
      continue;
    }
    if (i + 1 >= argc) usage(("missing value for " + k).c_str());
    const char* v = argv[++i];
    auto num = [&] {
      char* end = nullptr;
      const long long x = std::strtoll(v, &end, 10);
      if (!end || *end || x < 1) usage((k + " needs a positive integer, got '" + v + "'").c_str());
      return int64_t(x);
    };
    if (k == "--dtype") a.dtype = v;
    else if (k == "--batch") a.B = num();
    else if (k == "--seq") a.T = num();
    else if (k == "--hidden") a.C = num();
    else if (k == "--ffn") a.F = num();
    else if (k == "--layers") a.L = num();
    else if (k == "--heads") a.NH = num();
    else if (k == "--kv-heads") a.KV = num();
    else if (k == "--vocab") a.V = num();
    else if (k == "--reps") a.reps = int(num());
    else usage(("unknown argument " + k).c_str());
  }
  if (a.dtype != "f32" && a.dtype != "bf16") usage("--dtype is f32 or bf16");
  if (a.C % a.NH) usage("--hidden must be a multiple of --heads");
  if (!a.F) a.F = 4 * a.C;
  if (!a.KV) a.KV = a.NH;
  return a;
}

std::vector<Product> step_products(const Args& a) {
  const int64_t M = a.B * a.T, HS = a.C / a.NH, L = a.L;
  std::vector<Product> p;
  // A linear y = x·Wᵀ with W (N, K): forward, input gradient dout·W, weight gradient doutᵀ·x.
  auto linear = [&](const std::string& n, int64_t N, int64_t K, double count) {
    p.push_back({n + " fwd", 1, M, N, K, false, true, true, false, count});
    p.push_back({n + " dinp", 1, M, K, N, false, false, true, false, count});
    p.push_back({n + " dweight", 1, N, K, M, true, false, false, true, count});
  };
  linear("qkv", (a.NH + 2 * a.KV) * HS, a.C, double(L));
  linear("proj", a.C, a.C, double(L));
  linear("fc1", a.glu ? 2 * a.F : a.F, a.C, double(L));
  linear("fc2", a.C, a.F, double(L));
  linear("lm head", a.V, a.C, 1.0);
  // Attention per (sequence, head): S = Q·Kᵀ, O = P·V; dP = dO·Vᵀ, dV = Pᵀ·dO, dQ = dS·K, dK = dSᵀ·Q.
  const int64_t bh = a.B * a.NH;
  const double half = 0.5 * double(L);
  p.push_back({"attn QK^T", bh, a.T, a.T, HS, false, true, false, false, half});
  p.push_back({"attn PV", bh, a.T, HS, a.T, false, false, false, false, half});
  p.push_back({"attn dO V^T", bh, a.T, a.T, HS, false, true, false, false, half});
  p.push_back({"attn P^T dO", bh, a.T, HS, a.T, true, false, false, false, half});
  p.push_back({"attn dS K", bh, a.T, HS, a.T, false, false, false, false, half});
  p.push_back({"attn dS^T Q", bh, a.T, HS, a.T, true, false, false, false, half});
  return p;
}

double flops(const Product& p) { return 2.0 * double(p.batch) * double(p.M) * double(p.N) * double(p.K); }

template <class F>
double time_ms(int reps, F&& run) {
  run();  // warm-up (JIT, first touch)
  double best = 1e300;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    run();
    best = std::min(best, std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  return best;
}

// 64-byte aligned buffers, as Loom's allocator gives (vector storage is only 16-byte aligned, which made
// the bf16 LM-head products 9-36% slower).
struct Buffer {
  explicit Buffer(size_t bytes) : p(static_cast<char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64))) {
    if (!p) {
      std::fprintf(stderr, "loom_bench_ceiling: out of memory (%zu bytes)\n", bytes);
      std::exit(1);
    }
    // Small finite values in either dtype (bytes 00 3c: bf16 2^-7; f32 pairs ~0.0078): no NaN/denormal paths.
    for (size_t i = 0; i + 1 < bytes; i += 2) p[i] = 0, p[i + 1] = 0x3c;
  }
  ~Buffer() { std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  char* p;
};

memory::desc strided(int64_t batch, int64_t rows, int64_t cols, bool transposed, memory::data_type dt) {
  // Logical (rows, cols), stored row-major as (rows, cols) or, transposed, as (cols, rows).
  if (batch == 1)
    return memory::desc({rows, cols}, dt, transposed ? memory::dims{1, rows} : memory::dims{cols, 1});
  return memory::desc({batch, rows, cols}, dt,
                      transposed ? memory::dims{rows * cols, 1, rows} : memory::dims{rows * cols, cols, 1});
}

struct Runner {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};

  // The matmul primitive; weights_any: B in oneDNN's preferred layout (reordered once, untimed);
  // runtime: 'M' or 'K' described as a runtime dimension (oneDNN 2.6 then runs its gemm-based kernel,
  // gemm:jit, instead of brgemm; Loom does so for long-reduction input gradients and large weight
  // gradients), executed with the real size; batch 1 only.
  // add: C += (the sum post-op), else C = ; weight gradients are timed both ways.
  double primitive(const Product& p, memory::data_type in, memory::data_type out, bool weights_any, int reps,
                   char runtime, bool add) {
    const memory::desc a = strided(p.batch, p.M, p.K, p.ta, in);
    const memory::desc b_plain = strided(p.batch, p.K, p.N, p.tb, in);
    const memory::desc b = weights_any ? memory::desc(b_plain.dims(), in, memory::format_tag::any) : b_plain;
    const memory::desc c = strided(p.batch, p.M, p.N, false, out);
    // The primitive's descriptors: a runtime dimension where asked (plain strides), else a, b, c.
    const memory::dim rm = runtime == 'M' ? DNNL_RUNTIME_DIM_VAL : p.M;
    const memory::dim rk = runtime == 'K' ? DNNL_RUNTIME_DIM_VAL : p.K;
    const memory::dims sa = p.ta ? memory::dims{1, p.M} : memory::dims{p.K, 1};
    const memory::dims sb = p.tb ? memory::dims{1, p.K} : memory::dims{p.N, 1};
    const memory::desc pa = runtime ? memory::desc({rm, rk}, in, sa) : a;
    const memory::desc pb = runtime ? memory::desc({rk, p.N}, in, sb) : b;
    const memory::desc pc = runtime ? memory::desc({rm, p.N}, out, memory::dims{p.N, 1}) : c;
    dnnl::primitive_attr attr;
    if (add) {
      dnnl::post_ops po;
      po.append_sum(1.0f);
      attr.set_post_ops(po);
    }
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(pa, pb, pc), attr, eng);
    // Executed on concrete descriptors: the real sizes, and B in the layout the primitive chose.
    const memory::desc ea = runtime ? a : pd.src_desc(), eb = runtime ? b_plain : pd.weights_desc();
    const memory::desc ec = runtime ? c : pd.dst_desc();
    Buffer ab(ea.get_size()), bb(eb.get_size()), cb(ec.get_size());
    memory am(ea, eng, ab.p), bm(eb, eng, bb.p), cm(ec, eng, cb.p);
    const dnnl::matmul prim(pd);
    return time_ms(reps, [&] {
      prim.execute(strm, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
      strm.wait();
    });
  }
};

// f32 through dnnl_sgemm (row-major, all threads; batched products: one sgemm per batch entry).
double sgemm(const Product& p, int reps, bool add) {
  const size_t a_n = size_t(p.M * p.K), b_n = size_t(p.K * p.N), c_n = size_t(p.M * p.N);
  Buffer Ab(4 * a_n * size_t(p.batch)), Bb(4 * b_n * size_t(p.batch)), Cb(4 * c_n * size_t(p.batch));
  const float* A = reinterpret_cast<const float*>(Ab.p);
  const float* B = reinterpret_cast<const float*>(Bb.p);
  float* C = reinterpret_cast<float*>(Cb.p);
  const int64_t lda = p.ta ? p.M : p.K, ldb = p.tb ? p.K : p.N;
  return time_ms(reps, [&] {
    if (p.batch == 1) {
      dnnl_sgemm(p.ta ? 'T' : 'N', p.tb ? 'T' : 'N', p.M, p.N, p.K, 1.0f, A, lda, B, ldb, add ? 1.0f : 0.0f, C,
                 p.N);
      return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < p.batch; ++i)
      dnnl_sgemm(p.ta ? 'T' : 'N', p.tb ? 'T' : 'N', p.M, p.N, p.K, 1.0f, A + size_t(i) * a_n, lda, B + size_t(i) * b_n,
                 ldb, 0.0f, C + size_t(i) * c_n, p.N);
  });
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  const bool bf16 = a.dtype == "bf16";
  Runner r;
  std::fprintf(stderr, "GEMM ceiling, %s, %d threads: B=%lld T=%lld C=%lld F=%lld L=%lld heads=%lld/%lld V=%lld%s\n",
               a.dtype.c_str(), omp_get_max_threads(), (long long)a.B, (long long)a.T, (long long)a.C,
               (long long)a.F, (long long)a.L, (long long)a.NH, (long long)a.KV, (long long)a.V,
               a.glu ? " (GLU)" : "");
  std::fprintf(stderr, "%-13s %6s %6s %6s %6s %5s  %9s %9s  %s\n", "product", "batch", "M", "N", "K", "count",
               "best ms", "GFLOP/s", "variant");
  double total_ms = 0, total_flop = 0;
  std::string products;  // the JSON line's per-product list
  for (const Product& p : step_products(a)) {
    double best = 1e300;
    std::string how;
    std::string variants;
    auto consider = [&](double ms, const char* name) {
      if (ms < best) best = ms, how = name;
      char buf[64];
      std::snprintf(buf, sizeof buf, "%s%s %.3f", variants.empty() ? "" : ", ", name, ms);
      variants += buf;
    };
    if (bf16) {
      const auto bf = memory::data_type::bf16;
      const auto out = p.accumulate ? memory::data_type::f32 : bf;
      consider(r.primitive(p, bf, out, false, a.reps, 0, p.accumulate), "matmul plain");
      if (p.weight_b) consider(r.primitive(p, bf, out, true, a.reps, 0, false), "matmul blocked B");
      if (p.batch == 1 && !p.ta && !p.accumulate)
        consider(r.primitive(p, bf, out, false, a.reps, 'M', false), "matmul runtime M");
      if (p.batch == 1 && p.accumulate) {
        consider(r.primitive(p, bf, out, false, a.reps, 'K', true), "matmul runtime K");
        consider(r.primitive(p, bf, out, false, a.reps, 0, false), "matmul plain, stored");
        consider(r.primitive(p, bf, out, false, a.reps, 'K', false), "matmul runtime K, stored");
      }
    } else {
      consider(sgemm(p, a.reps, p.accumulate), "sgemm");
      if (p.accumulate) consider(sgemm(p, a.reps, false), "sgemm, stored");
      consider(r.primitive(p, memory::data_type::f32, memory::data_type::f32, false, a.reps, 0, p.accumulate),
               "matmul plain");
    }
    total_ms += best * p.count;
    total_flop += flops(p) * p.count;
    char item[160];
    std::snprintf(item, sizeof item, "%s{\"name\": \"%s\", \"ms\": %.4f, \"count\": %.1f, \"flop\": %.0f}",
                  products.empty() ? "" : ", ", p.name.c_str(), best, p.count, flops(p));
    products += item;
    std::fprintf(stderr, "%-13s %6lld %6lld %6lld %6lld %5.1f  %9.3f %9.1f  %s\n", p.name.c_str(),
                 (long long)p.batch, (long long)p.M, (long long)p.N, (long long)p.K, p.count, best,
                 flops(p) / best / 1e6, (a.all ? variants : how).c_str());
  }
  // A full training step runs each product's forward, input-gradient and weight-gradient GEMMs once.
  std::fprintf(stderr, "GEMMs of one step at the ceiling: %.1f ms for %.1f GFLOP = %.1f GFLOP/s\n", total_ms,
               total_flop / 1e9, total_flop / total_ms / 1e6);
  std::printf(
      "{\"dtype\": \"%s\", \"threads\": %d, \"ceiling_ms\": %.3f, \"flop\": %.0f, \"ceiling_gflops\": %.2f, "
      "\"products\": [%s]}\n",
      a.dtype.c_str(), omp_get_max_threads(), total_ms, total_flop, total_flop / total_ms / 1e6, products.c_str());
  return 0;
}

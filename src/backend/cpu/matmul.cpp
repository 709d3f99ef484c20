// Linear-layer matmuls on the CPU through oneDNN's matmul primitive (no hand-written GEMM).
// All three products of a linear layer are expressed with strided (transposed) views, so no operand is
// ever copied or transposed in memory:
//   forward  out  (M, N)  = inp (M, K) · W^T        W^T viewed as (K, N) with strides (1, K)
//   dinp          (M, K)  = dout (M, N) · W          W is (N, K) row-major
//   dweight       (N, K) += dout^T (N, M) · inp      dout^T viewed with strides (1, N); sum post-op accumulates
// Primitives are cached by (shapes, strides, dtypes, accumulate) because creating one costs far more than
// running a small one. f32 products use oneDNN's sgemm entry point instead (see gemm()). The bias gradient is a column sum done by bias_backward (fixed-order, deterministic).
#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>
#include <unordered_map>

#include "backend/cpu/cpu_ops.h"

namespace loom::cpu {

namespace {

using dnnl::memory;

memory::data_type to_dnnl(DType dt) {
  switch (dt) {
    case DType::kF32: return memory::data_type::f32;
    case DType::kBF16: return memory::data_type::bf16;
    case DType::kF16: return memory::data_type::f16;
    default: LOOM_FAIL("[matmul] unsupported dtype ", dtype_name(dt), " (f32, bf16, f16 only)");
  }
}

// C (M, N) [+]= op(A) (M, K) · op(B) (K, N), BLAS-style: op(X) is X or X^T of a row-major stored matrix
// with leading dimension ld. Explicit transpose flags (not strides) keep 1-wide dimensions unambiguous.
struct GemmKey {
  int64_t M, N, K;
  bool trans_a, trans_b;
  int64_t lda, ldb;
  DType ta, tb, tc;
  bool bias, accumulate;
  auto tie() const { return std::tie(M, N, K, trans_a, trans_b, lda, ldb, ta, tb, tc, bias, accumulate); }
  bool operator<(const GemmKey& o) const { return tie() < o.tie(); }
};

struct Gemm {
  memory::desc a, b, c, bias;
  dnnl::matmul prim;
};

class DnnlRuntime {
 public:
  static DnnlRuntime& get() {
    static DnnlRuntime rt;
    return rt;
  }

  // C (M, N) [+]= A (M, K) · B (K, N) [+ bias (1, N)], A and B described by strides, C row-major.
  void gemm(const GemmKey& key, const void* a, const void* b, void* c, const void* bias) {
    if (key.ta == DType::kF32 && key.tb == DType::kF32 && key.tc == DType::kF32 && !key.bias) {
      // f32: oneDNN's BLAS-style sgemm (row-major) runs every GPT shape at the machine's f32 peak,
      // while the matmul primitive's brgemm falls to half of it on some transposed products.
      const dnnl_status_t st = dnnl_sgemm(key.trans_a ? 'T' : 'N', key.trans_b ? 'T' : 'N', key.M, key.N, key.K,
                                          1.0f, static_cast<const float*>(a), key.lda, static_cast<const float*>(b),
                                          key.ldb, key.accumulate ? 1.0f : 0.0f,
                                          static_cast<float*>(c), key.N);
      LOOM_CHECK(st == dnnl_success, "[matmul] dnnl_sgemm failed with status ", int(st), " for M=", key.M,
                 " N=", key.N, " K=", key.K);
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(key);
    if (it == cache_.end()) it = cache_.emplace(key, build(key)).first;
    Gemm& g = it->second;
    memory am(g.a, engine_, const_cast<void*>(a));
    memory bm(g.b, engine_, const_cast<void*>(b));
    memory cm(g.c, engine_, c);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
    if (key.bias) args.emplace(DNNL_ARG_BIAS, memory(g.bias, engine_, const_cast<void*>(bias)));
    g.prim.execute(stream_, args);
    stream_.wait();
  }

 private:
  DnnlRuntime() : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {}

  Gemm build(const GemmKey& k) {
    Gemm g;
    g.a = memory::desc({k.M, k.K}, to_dnnl(k.ta), k.trans_a ? memory::dims{1, k.lda} : memory::dims{k.lda, 1});
    g.b = memory::desc({k.K, k.N}, to_dnnl(k.tb), k.trans_b ? memory::dims{1, k.ldb} : memory::dims{k.ldb, 1});
    g.c = memory::desc({k.M, k.N}, to_dnnl(k.tc), memory::dims{k.N, 1});
    dnnl::primitive_attr attr;
    if (k.accumulate) {
      dnnl::post_ops po;
      po.append_sum(1.0f);
      attr.set_post_ops(po);
    }
    std::unique_ptr<dnnl::matmul::desc> d;
    if (k.bias) {
      g.bias = memory::desc({1, k.N}, to_dnnl(k.tc == DType::kF32 ? DType::kF32 : k.tc), memory::dims{k.N, 1});
      d = std::make_unique<dnnl::matmul::desc>(g.a, g.b, g.bias, g.c);
    } else {
      d = std::make_unique<dnnl::matmul::desc>(g.a, g.b, g.c);
    }
    dnnl::matmul::primitive_desc pd(*d, attr, engine_);
    g.prim = dnnl::matmul(pd);
    return g;
  }

  dnnl::engine engine_;
  dnnl::stream stream_;
  std::mutex mu_;
  std::map<GemmKey, Gemm> cache_;
};

void check_2d(const char* op, TensorView t, int64_t rows, int64_t cols, const char* name) {
  LOOM_CHECK(t.shape().rows() == rows && t.shape().cols() == cols, "[", op, "] ", name, " expected (", rows, ", ",
             cols, ") (leading dims flattened), got ", t.desc());
  LOOM_CHECK(t.device().is_cpu(), "[", op, "] ", name, " must be a CPU tensor, got ", t.desc());
}

}  // namespace

void CpuOps::matmul_forward(TensorView out, TensorView inp, TensorView weight, TensorView bias) const {
  LOOM_CHECK(weight.ndim() == 2, "[matmul_forward] weight must be (N, K), got ", weight.desc());
  const int64_t N = weight.size(0), K = weight.size(1), M = inp.shape().rows();
  check_2d("matmul_forward", inp, M, K, "inp");
  check_2d("matmul_forward", out, M, N, "out");
  if (bias) {
    LOOM_CHECK(bias.numel() == N, "[matmul_forward] bias expected (", N, "), got ", bias.desc());
    LOOM_CHECK(bias.dtype() == out.dtype(), "[matmul_forward] bias dtype must match out: ", bias.desc());
  }
  if (M == 0 || N == 0) return;
  if (K == 0) {
    fill_(out, 0.0f);
    if (bias) bias_add_forward(out.reshape({M, N}), bias);
    return;
  }
  const bool all_f32 = inp.dtype() == DType::kF32 && weight.dtype() == DType::kF32 && out.dtype() == DType::kF32;
  // f32 goes through sgemm, which has no bias epilogue: add the bias in a second (cheap) pass.
  const bool fuse_bias = bias && !all_f32;
  const GemmKey key{M, N, K, false, true, K, K, inp.dtype(), weight.dtype(), out.dtype(), fuse_bias, false};
  DnnlRuntime::get().gemm(key, inp.raw(), weight.raw(), out.raw(), fuse_bias ? bias.raw() : nullptr);
  if (bias && !fuse_bias) bias_add_forward(out.reshape({M, N}), bias);
}

void CpuOps::matmul_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout, TensorView inp,
                             TensorView weight) const {
  LOOM_CHECK(weight.ndim() == 2, "[matmul_backward] weight must be (N, K), got ", weight.desc());
  const int64_t N = weight.size(0), K = weight.size(1), M = dout.shape().rows();
  check_2d("matmul_backward", dout, M, N, "dout");
  if (dinp) {
    check_2d("matmul_backward", dinp, M, K, "dinp");
    if (N == 0) {
      fill_(dinp, 0.0f);
    } else if (M > 0 && K > 0) {
      const GemmKey key{M, K, N, false, false, N, K, dout.dtype(), weight.dtype(), dinp.dtype(), false, false};
      DnnlRuntime::get().gemm(key, dout.raw(), weight.raw(), dinp.raw(), nullptr);
    }
  }
  if (dweight) {
    check_2d("matmul_backward", inp, M, K, "inp");
    LOOM_CHECK(dweight.shape() == weight.shape(), "[matmul_backward] dweight ", dweight.desc(), " vs weight ",
               weight.desc());
    if (M > 0 && N > 0 && K > 0) {
      const GemmKey key{N, K, M, true, false, N, K, dout.dtype(), inp.dtype(), dweight.dtype(), false, true};
      DnnlRuntime::get().gemm(key, dout.raw(), inp.raw(), dweight.raw(), nullptr);
    }
  }
  if (dbias) {
    LOOM_CHECK(dbias.numel() == N, "[matmul_backward] dbias expected (", N, "), got ", dbias.desc());
    bias_backward(dbias, dout.reshape({M, N}));
  }
}

}  // namespace loom::cpu

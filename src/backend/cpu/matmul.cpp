// Linear-layer matmuls on the CPU through oneDNN (no hand-written GEMM).
// All three products of a linear layer are expressed with strided (transposed) views, so no operand has to
// be copied or transposed in memory (the bf16 exceptions below are choices made for speed):
//   forward  out  (M, N)  = inp (M, K) · W^T        W^T viewed as (K, N) with strides (1, K)
//   dinp          (M, K)  = dout (M, N) · W          W is (N, K) row-major
//   dweight       (N, K) += dout^T (N, M) · inp      dout^T viewed with strides (1, N); sum post-op accumulates
//                                                   (GradWrite::kOverwrite: no post-op, the old values unread)
// dtypes: inp/weight/dout (and bias) share the compute dtype (f32, bf16 or f16); out and dinp are in it or
// f32; dweight/dbias accumulate into f32 main grads or into the compute dtype (f32 sum, one rounding).
//   f32  -> dnnl_sgemm, cut into shape-fixed pieces (matmul_sgemm.cpp; the matmul primitive's brgemm
//           reaches only half of sgemm's speed on some transposed f32 products; bench/RESULTS.md);
//   bf16 -> the matmul primitive (AMX / AVX512-BF16 brgemm; f32 accumulation, bias fused, sum post-op for
//           +=). Unlike f32, a transposed stride is not what makes a product slow: at GPT-2 shapes dweight
//           (transposed dout) runs at 0.6-0.75x and dinp (all operands plain) at 0.6-1.2x of the forward's
//           rate, and making an operand plain first with a oneDNN reorder (a transposed copy, or weights in
//           the blocked layout) cost more than it saved in every case measured. With AVX512-BF16 and
//           without AMX, B operands are packed into the blocked layout by Loom's own copy (packs_b,
//           pack_b: the input gradient's weight at any row count, the forward's W^T from 256 rows on),
//           which does pay for itself; without AMX a forward whose weight is the larger side runs
//           swapped, out^T = W · inp^T, transposed into out afterwards (swaps_forward); otherwise no
//           operand is copied.
//           AMX and VCVTNEPS2BF16 flush bf16 subnormals (|x| < 1.2e-38) to zero; every other value is
//           the RNE rounding of the f32 accumulation;
//           On CPUs without AVX-512 this oneDNN has no bf16 matmul kernel: bf16 then goes through
//           gemm_widened like f16 (probed at first use);
//   f16  -> gemm_widened (matmul_sgemm.cpp): this oneDNN version has no CPU f16 matmul (it needs AVX512-FP16/AMX-FP16
//           kernels), so tiles are widened to f32 and multiplied by sgemm: f32 speed plus the widening
//           (5-30% more time, single thread).
// Primitives are cached by (shapes, strides, dtypes, bias dtype, accumulate) because creating one costs far
// more than running a small one. The bias gradient is a column sum done by bias_backward (fixed-order,
// deterministic).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/lowp.h"
#include "backend/cpu/matmul_internal.h"
#include "backend/cpu/transpose16.h"

namespace loom::cpu {

namespace {

using dnnl::memory;
using matmul_detail::GemmKey;
using matmul_detail::gemm_widened;
using matmul_detail::sgemm_fixed_split;
using matmul_detail::ThreadLimit;

memory::data_type to_dnnl(DType dt) {
  switch (dt) {
    case DType::kF32: return memory::data_type::f32;
    case DType::kBF16: return memory::data_type::bf16;
    case DType::kF16: return memory::data_type::f16;
    default: LOOM_FAIL("[matmul] unsupported dtype ", dtype_name(dt), " (f32, bf16, f16 only)");
  }
}

struct Gemm {
  memory::desc a, b, c, bias;
  dnnl::matmul prim;  // with a runtime M or K (DNNL_RUNTIME_DIM_VAL) where runtime_dim(key) says so
  // Where packs_b(key): prim takes B in oneDNN's blocked layout b_packed, which Loom writes before each
  // call (pack_b); stride_kb / stride_nb are its strides (elements) between 32-row and 64-column blocks.
  bool packed = false;
  memory::desc b_packed;
  int64_t stride_kb = 0, stride_nb = 0;
};

// bf16 products that run faster in oneDNN 2.6's gemm-based kernel (gemm:jit) than in the AMX brgemm kernel
// its matmul primitive picks for fixed shapes. A primitive with a runtime dimension is how to get it (brgemm
// takes none), and one primitive then serves every size of that dimension. Measured on an AMX machine
// (bench/RESULTS.md):
// - kRows: input gradients dout · W (plain operands, no bias, no accumulation) whose reduction is at least
//   5x their width, on at least 256 rows: the LM head's (K = vocabulary), a GLU fc1's (K = 2 x ffn: Llama,
//   a Mixtral expert); 1.2-1.8x faster. At 3-4x (GPT-2's qkv and fc1) brgemm is ~13% faster, below 256
//   rows they are even. M is the runtime dimension.
// - kReduction: weight gradients dW (+)= dout^T · x into f32 over more than 512 tokens: gemm:jit is 1.1-1.75x
//   faster in every shape tried from 768 tokens on (GPT-2's qkv/proj/fc1/fc2 and LM head, Llama's, small
//   256-1200-wide ones). Over 256-512 tokens (MoE expert groups, short steps) brgemm is as fast or up to 2x
//   faster and stays. K is the runtime dimension.
//   Without AMX (oneDNN's AVX512-BF16 brgemm; measured on an AMD Zen 5), gemm:jit wins over fewer tokens
//   too: over 128-512 tokens, 1.2-1.7x on 3072-7168 x 1024 gradients (a Mixtral expert's fc1 over 128
//   tokens 4.33 -> 2.51 ms, fc2 1.94 -> 1.08), and inside a layer on small ones as well, where each
//   gradient is written cold: a fine-grained MoE layer (64 experts of 1024 x 1024 and 1024 x 512 over ~256
//   tokens) 253-258 -> 228-230 ms (stored) and 281-291 -> 231-237 ms (accumulated), a 4-layer hidden-256
//   GPT step 27.2-27.5 -> 26.5-26.7 ms; isolated and hot, the GEMM probe has gemm:jit 8% ahead on 1024 x 1024
//   over 256 tokens (bench/RESULTS.md, session 14). Only products of a few thousand multiply-adds per token
//   lose (a hidden-64 model's step, where a call's setup is the cost). Over fewer tokens too: over 64 (a
//   Mixtral layer over 256 tokens 59.5-61.7 -> 53.0-57.1 ms, the fine-grained one over 512 71.0-71.9 ->
//   66.1-67.3, GPT-2 124M over 2 x 32 tokens 152-165 -> 139-155 ms a step); over 16 it is even. So there a
//   weight gradient of at least 2^17 elements takes it from 32 tokens on. The same holds when the gradient is
//   stored rather than accumulated (GradWrite::kOverwrite): gemm:jit again, which then skips reading the old
//   gradient (a Mixtral MoE layer over 512 tokens 107 -> 101 ms, where brgemm without the sum post-op took 109).
enum class RuntimeDim { kNone, kRows, kReduction };

RuntimeDim runtime_dim(const GemmKey& k) {
  if (k.ta != DType::kBF16 || k.tb != DType::kBF16 || k.bias || k.trans_b) return RuntimeDim::kNone;
  if (!k.trans_a && !k.accumulate && k.M >= 256 && k.K >= 5 * k.N) return RuntimeDim::kRows;
  if (k.trans_a && k.tc == DType::kF32) {  // only weight gradients have a transposed A
    if (k.K > 512) return RuntimeDim::kReduction;
    if (!matmul_uses_amx() && k.K >= 32 && k.M * k.N >= (int64_t(1) << 17)) return RuntimeDim::kReduction;
  }
  return RuntimeDim::kNone;
}

// oneDNN 2.6's bf16 gemm cuts the reduction between threads when both output dimensions are <= 768, K >= 2048
// and M/64 + N/64 is below the thread count (gemm_driver.cpp), which would make the sums depend on it: the
// LM head's input gradient at 256 rows does so from 17 threads on. At most that many threads keeps every
// thread count's bits the same.
int gemm_jit_threads(const GemmKey& k) {
  return int(std::min<int64_t>(omp_get_max_threads(), std::max<int64_t>(1, k.M / 64 + k.N / 64)));
}

// bf16 products whose B operand Loom packs itself, per call, into the blocked layout oneDNN's brgemm
// kernel reads (pack_b), instead of handing it B as stored. Measured without AMX (AVX512-BF16 brgemm, an
// AMD Zen 5, 2 threads, weights cold; bench/RESULTS.md): brgemm given a plain B re-packs it inside the
// call, and made under kBrgemmThreads it does so once per row block of its 15-thread partition. From ~480
// rows on that costs up to half of the product (a Mixtral expert's fc1 forward over 512 rows: 19.2 ms,
// packed 11.7; GPT-2's fc2 input gradient over 2048 rows: 12.4 -> 10.9), while Loom's packing moves each
// element once at memory speed (0.1-0.8 ms per weight). A B stored as (K, N) (the input gradient's W) is
// packed by interleaving row pairs, which pays at any row count with weights of 0.5 M elements and up
// (8 weights of 7168 x 1024 over 8 rows 7.2 -> 5.1 ms, over 128 rows 23.1 -> 19.6; 1024 x 3584 over 128
// rows 18.8 -> 13.5) and is even on small ones. A transposed B (the forward's W^T) takes a transpose,
// which costs more than it saves below 256 rows (a 7168 x 1024 forward over 64 rows: 1.9 -> 2.2 ms; such
// forwards mostly run swapped now, see swaps_forward). On AMX machines the blocked layout is another one
// and was not measured, so nothing changes there. The packed copy lives in one scratch buffer of at most
// kMaxPackedBytes (GPT-2's 77 MB LM head fits, Llama-3's 525 MB one does not and stays as stored).
constexpr int64_t kPackMinRowsTransposed = 256;
constexpr int64_t kMaxPackedBytes = int64_t(128) << 20;

std::atomic<bool> g_packing{true};  // set_matmul_packing

bool packs_b(const GemmKey& k) {
  const int64_t padded_n = (k.N + 63) / 64 * 64;
  return g_packing.load() && k.ta == DType::kBF16 && k.tb == DType::kBF16 && !k.trans_a &&
         (!k.trans_b || k.M >= kPackMinRowsTransposed) && k.K % 32 == 0 && k.K * padded_n * 2 <= kMaxPackedBytes &&
         matmul_uses_avx512_bf16() && !matmul_uses_amx();
}

// Writes B (K, N) (B(k, n) = b[n * ldb + k] when trans_b, else b[k * ldb + n]; bf16 as 16-bit patterns) in
// the blocked layout 16a64b2a: 32-row x 64-column blocks at the given strides, each stored as 16 rows of
// 64 (k, k + 1) pairs; a last block past N is filled with zeros. Every element is moved, none computed: the
// product sees the same values.
void pack_b(uint16_t* dst, const uint16_t* b, int64_t K, int64_t N, int64_t ldb, bool trans_b, int64_t stride_kb,
            int64_t stride_nb) {
  const int64_t kb_count = K / 32, nb_count = (N + 63) / 64;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t nb = 0; nb < nb_count; ++nb) {
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      auto* d = reinterpret_cast<uint32_t*>(dst + kb * stride_kb + nb * stride_nb);
      const int64_t width = std::min<int64_t>(64, N - nb * 64);
      if (trans_b) {  // 64 stored rows (n) of 16 pairs (k) -> 16 rows of 64 pairs
        const auto* src = reinterpret_cast<const uint32_t*>(b + nb * 64 * ldb + kb * 32);
        if (width == 64) {
          transpose_u32(d, src, ldb / 2, 16);
        } else {  // the rows past N read as zeros
          uint32_t tail[64 * 16] = {};
          for (int64_t r = 0; r < width; ++r) std::memcpy(tail + r * 16, src + r * (ldb / 2), 16 * sizeof(uint32_t));
          transpose_u32(d, tail, 16, 16);
        }
      } else {  // 32 stored rows (k) of 64 columns (n) -> 16 rows of 64 pairs
        interleave_pairs(d, 64, b + kb * 32 * ldb + nb * 64, ldb, width, 16);
        if (width < 64)
          for (int64_t p = 0; p < 16; ++p) std::memset(d + p * 64 + width, 0, size_t(64 - width) * sizeof(uint32_t));
      }
    }
  }
}

// oneDNN 2.6's brgemm matmul chooses its blocking from the thread count it is made under, and the K blocking
// sets how AMX groups the sums (AMX's dot products do not round like a chain of f32 FMAs): made under 1, 2
// or 3 threads, 70 of 280 forward and input-gradient shapes gave different bits (256 x 256 over K 1,200
// at 1 vs 2; 1024 x 256 over K 1,200 at 1 vs 3). It runs on min(that count, the current one) threads, so
// every fixed-shape primitive is made under one count, whatever Loom runs with: all 280 then give the same
// bits on 1, 2, 3, 4 and 8 threads, at the same speed on 2 (bench/RESULTS.md). The count is 15, not more:
// from 16 on, AMX brgemm may also cut K between up to nthr/8 thread groups, and falls back to one group
// (other sums) when fewer threads run. So a fixed-shape bf16 product uses at most 15 threads.
constexpr int kBrgemmThreads = 15;

class DnnlRuntime {
 public:
  static constexpr size_t kMaxPrimitives = 1024;

  static DnnlRuntime& get() {
    static DnnlRuntime rt;
    return rt;
  }

  size_t cached_primitives() {
    std::lock_guard<std::mutex> lock(mu_);
    return cache_.size();
  }

  size_t packed_products() {
    std::lock_guard<std::mutex> lock(mu_);
    return packed_products_;
  }

  size_t built_primitives() {
    std::lock_guard<std::mutex> lock(mu_);
    return built_;
  }

  // C (M, N) [+]= A (M, K) · B (K, N) [+ bias (1, N)], A and B described by strides, C row-major.
  void gemm(const GemmKey& key, const void* a, const void* b, void* c, const void* bias) {
    if (key.ta == DType::kF32 && key.tb == DType::kF32 && key.tc == DType::kF32 && !key.bias) {
      // f32: oneDNN's BLAS-style sgemm (row-major) runs every GPT shape at the machine's f32 peak,
      // while the matmul primitive's brgemm falls to half of it on some transposed products.
      sgemm_fixed_split(key.trans_a ? 'T' : 'N', key.trans_b ? 'T' : 'N', key.M, key.N, key.K,
                        static_cast<const float*>(a), key.lda, static_cast<const float*>(b), key.ldb,
                        key.accumulate ? 1.0f : 0.0f, static_cast<float*>(c), key.N);
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    const RuntimeDim rd = runtime_dim(key);
    GemmKey cache_key = key;
    if (rd == RuntimeDim::kRows) cache_key.M = DNNL_RUNTIME_DIM_VAL;
    if (rd == RuntimeDim::kReduction) cache_key.K = DNNL_RUNTIME_DIM_VAL;
    cache_key.pack = rd == RuntimeDim::kNone && packs_b(key);
    Gemm& g = find(cache_key);
    // A primitive with a runtime dimension runs on descriptors with this call's sizes.
    const bool rt = rd != RuntimeDim::kNone;
    const Gemm concrete = rt ? descriptors(key) : Gemm{};
    memory am(rt ? concrete.a : g.a, engine_, const_cast<void*>(a));
    memory bm(rt ? concrete.b : g.b, engine_, const_cast<void*>(b));
    memory cm(rt ? concrete.c : g.c, engine_, c);
    if (g.packed) {
      uint16_t* buf = packed_buffer(g.b_packed.get_size());
      pack_b(buf, static_cast<const uint16_t*>(b), key.K, key.N, key.ldb, key.trans_b, g.stride_kb, g.stride_nb);
      bm = memory(g.b_packed, engine_, buf);
      ++packed_products_;
    }
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
    if (key.bias) args.emplace(DNNL_ARG_BIAS, memory(g.bias, engine_, const_cast<void*>(bias)));
    const ThreadLimit limit(rt ? gemm_jit_threads(key) : omp_get_max_threads());
    g.prim.execute(stream_, args);
    stream_.wait();
  }

 private:
  DnnlRuntime() : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {}

  // The primitive for `key` (built on first use), marked most recently used; the caller holds mu_.
  Gemm& find(const GemmKey& key) {
    auto it = cache_.find(key);
    if (it != cache_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.lru);
      return it->second.gemm;
    }
    Gemm g = build(key);
    ++built_;
    if (cache_.size() >= kMaxPrimitives) {
      cache_.erase(lru_.back());
      lru_.pop_back();
    }
    lru_.push_front(key);
    return cache_.emplace(key, Entry{std::move(g), lru_.begin()}).first->second.gemm;
  }

  // The operand descriptors of `k` (its M or K may be DNNL_RUNTIME_DIM_VAL; the strides never are).
  static Gemm descriptors(const GemmKey& k) {
    Gemm g;
    g.a = memory::desc({k.M, k.K}, to_dnnl(k.ta), k.trans_a ? memory::dims{1, k.lda} : memory::dims{k.lda, 1});
    g.b = memory::desc({k.K, k.N}, to_dnnl(k.tb), k.trans_b ? memory::dims{1, k.ldb} : memory::dims{k.ldb, 1});
    g.c = memory::desc({k.M, k.N}, to_dnnl(k.tc), memory::dims{k.N, 1});
    return g;
  }

  Gemm build(const GemmKey& k) {
    Gemm g = descriptors(k);
    dnnl::primitive_attr attr;
    if (k.accumulate) {
      dnnl::post_ops po;
      po.append_sum(1.0f);
      attr.set_post_ops(po);
    }
    std::unique_ptr<dnnl::matmul::desc> d;
    if (k.bias) {
      g.bias = memory::desc({1, k.N}, to_dnnl(k.bias_dt), memory::dims{k.N, 1});
      d = std::make_unique<dnnl::matmul::desc>(g.a, g.b, g.bias, g.c);
    } else {
      d = std::make_unique<dnnl::matmul::desc>(g.a, g.b, g.c);
    }
    // A fixed-shape primitive (brgemm) is made under kBrgemmThreads whatever the thread count; one with a
    // runtime dimension (gemm:jit) under the current one, which it threads its epilogue with.
    const bool runtime = k.M == DNNL_RUNTIME_DIM_VAL || k.K == DNNL_RUNTIME_DIM_VAL;
    const ThreadLimit team(runtime ? omp_get_max_threads() : kBrgemmThreads);
    if (k.pack && build_packed(k, attr, g)) return g;
    dnnl::matmul::primitive_desc pd(*d, attr, engine_);
    g.prim = dnnl::matmul(pd);
    return g;
  }

  // The primitive of `k` with B in the layout oneDNN picks for it, when that is the 16a64b2a layout pack_b
  // writes (K unpadded, N padded to whole 64-column blocks); false (g untouched) otherwise, and the product
  // then takes B as stored.
  bool build_packed(const GemmKey& k, const dnnl::primitive_attr& attr, Gemm& g) {
    const memory::desc any(g.b.dims(), g.b.data_type(), memory::format_tag::any);
    const auto d = k.bias ? dnnl::matmul::desc(g.a, any, g.bias, g.c) : dnnl::matmul::desc(g.a, any, g.c);
    dnnl::matmul::primitive_desc pd(d, attr, engine_);
    const memory::desc w = pd.weights_desc();
    const dnnl_memory_desc_t& md = w.data;
    if (md.format_kind != dnnl_blocked || md.ndims != 2 || md.padded_dims[0] != k.K ||
        md.padded_dims[1] != (k.N + 63) / 64 * 64 || md.offset0 != 0)
      return false;
    const dnnl_blocking_desc_t& bl = md.format_desc.blocking;
    if (bl.inner_nblks != 3 || bl.inner_blks[0] != 16 || bl.inner_idxs[0] != 0 || bl.inner_blks[1] != 64 ||
        bl.inner_idxs[1] != 1 || bl.inner_blks[2] != 2 || bl.inner_idxs[2] != 0)
      return false;
    g.prim = dnnl::matmul(pd);
    g.packed = true;
    g.b_packed = w;
    g.stride_kb = bl.strides[0];
    g.stride_nb = bl.strides[1];
    return true;
  }

  // The scratch B is packed into (64-byte aligned, grown on demand, kept; the caller holds mu_).
  uint16_t* packed_buffer(size_t bytes) {
    if (bytes > packed_bytes_) {
      packed_.reset(static_cast<uint16_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
      LOOM_CHECK(packed_ != nullptr, "[matmul] cannot allocate ", bytes, " bytes for a packed bf16 operand");
      packed_bytes_ = bytes;
    }
    return packed_.get();
  }

  dnnl::engine engine_;
  dnnl::stream stream_;
  std::mutex mu_;
  // The cached primitives, most recently used first in lru_. A training step asks for a fixed set of
  // shapes, but inference (every prompt length is a new M) would otherwise add primitives, each with its
  // JIT-compiled kernels, without end; beyond kMaxPrimitives the least recently used one is dropped
  // (oneDNN's own primitive cache holds 1024 as well).
  struct Entry {
    Gemm gemm;
    std::list<GemmKey>::iterator lru;
  };
  std::map<GemmKey, Entry> cache_;
  std::list<GemmKey> lru_;
  struct FreeDeleter {
    void operator()(void* p) const { std::free(p); }
  };
  std::unique_ptr<uint16_t, FreeDeleter> packed_;
  size_t packed_bytes_ = 0;
  size_t packed_products_ = 0;
  size_t built_ = 0;
};

// oneDNN's matmul primitive takes bf16 (AMX / AVX512-BF16); f16 needs AVX512-FP16 + AMX-FP16 kernels this
// oneDNN version does not have, so f16 products go through gemm_widened.
// Whether it does depends on the CPU: this oneDNN has bf16 matmul kernels for AVX-512 machines only, so
// on an AVX2-only CPU bf16 goes through gemm_widened too (probed once by creating a small primitive).
bool bf16_primitive_available() {
  static const bool ok = [] {
    try {
      const dnnl::engine eng(dnnl::engine::kind::cpu, 0);
      const memory::desc a({4, 16}, memory::data_type::bf16, memory::format_tag::ab);
      const memory::desc b({16, 8}, memory::data_type::bf16, memory::format_tag::ab);
      const memory::desc c({4, 8}, memory::data_type::f32, memory::format_tag::ab);
      const dnnl::matmul::desc d(a, b, c);
      const dnnl::matmul::primitive_desc pd(d, eng);
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return ok;
}

bool primitive_takes(DType dt) { return dt == DType::kBF16 && bf16_primitive_available(); }

// bf16 forward products (no bias) computed swapped, out^T (N, M) = W (N, K) · inp^T, and transposed into
// out. brgemm reads its A operand as stored but copies B into its own layout inside every call, so the
// plain product copies the weight (N x K) each time, and the swapped one the input (M x K) plus the
// transpose of the output (M x N). Without AMX (AVX512-BF16 brgemm, an AMD Zen 5, 2 threads, weights cold:
// bench/RESULTS.md) the swap wins when the weight is the larger side, M (N + K) <= N K, from 32 rows on: a
// Mixtral expert's fc1 (7168 x 1024) over 128 rows 3.7 -> 2.5 ms, over 512 rows 10.6 -> 8.4 ms; Llama-1B's
// fc1 (11264 x 2048) over 1024 rows -14%; a 32000-token LM head over 32 rows -20%. It is even or up to 4%
// slower past that line (GPT-2's 768 x 768 over 512 rows, 768 x 3072 over 1024, a 7168 x 1024 expert over
// 2048), and up to 2x slower below 32 rows, where brgemm has a kernel of its own for a few rows (decoding
// one token: 12 of a Llama's 1280 x 768 products 0.74 -> 1.59 ms). On AMX machines it was not measured:
// off. With a bias (GPT-2) the bias would run along the swapped product's rows; not done. The swapped
// output goes through a per-thread scratch buffer that is kept, so outputs over kMaxSwapBytes (a long
// prompt's logits over a large vocabulary) run unswapped rather than hold that much memory for good.
constexpr int64_t kSwapMinRows = 32;
constexpr int64_t kMaxSwapBytes = int64_t(64) << 20;

std::atomic<bool> g_swapping{true};        // set_matmul_swapping
std::atomic<size_t> g_swapped_products{0};  // matmul_swapped_products

bool swaps_forward(int64_t M, int64_t N, int64_t K, size_t out_esize) {
  return g_swapping.load() && M >= kSwapMinRows && M * (N + K) <= N * K &&
         M * N * int64_t(out_esize) <= kMaxSwapBytes && !matmul_uses_amx();
}

// Scratch slot (lowp.h) of the swapped product's output: moe.cpp holds slots 2 and 3 around its matmuls.
constexpr int kSwapSlot = 7;

// dst (cols x rows, row-major) = src^T for src (rows x cols) of esize-byte (2 or 4) elements; row blocks in
// parallel.
void transpose_into(void* dst, const void* src, size_t esize, int64_t rows, int64_t cols) {
  const int64_t block = 256;
  const int64_t nb = (rows + block - 1) / block;
#pragma omp parallel for schedule(static) if (rows * cols > (int64_t(1) << 15))
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t r0 = b * block, nr = std::min(block, rows - r0);
    if (esize == 2)
      transpose_matrix(static_cast<uint16_t*>(dst) + r0, rows, static_cast<const uint16_t*>(src) + r0 * cols, cols,
                       nr, cols);
    else
      transpose_matrix(static_cast<uint32_t*>(dst) + r0, rows, static_cast<const uint32_t*>(src) + r0 * cols, cols,
                       nr, cols);
  }
}

}  // namespace

bool matmul_caches_shapes(DType dt) { return primitive_takes(dt); }

size_t matmul_cached_primitives() { return DnnlRuntime::get().cached_primitives(); }

bool matmul_uses_amx() {
  static const bool amx = matmul_detail::onednn_isa_has(dnnl_cpu_isa_avx512_core_amx);
  return amx;
}

bool matmul_uses_avx512_bf16() {
  static const bool bf16 = matmul_detail::onednn_isa_has(dnnl_cpu_isa_avx512_core_bf16);
  return bf16;
}

size_t matmul_max_cached_primitives() { return DnnlRuntime::kMaxPrimitives; }

size_t matmul_built_primitives() { return DnnlRuntime::get().built_primitives(); }

size_t matmul_packed_products() { return DnnlRuntime::get().packed_products(); }

void set_matmul_packing(bool on) { g_packing.store(on); }

size_t matmul_swapped_products() { return g_swapped_products.load(); }

void set_matmul_swapping(bool on) { g_swapping.store(on); }

void CpuOps::do_matmul_forward(TensorView out, TensorView inp, TensorView weight, TensorView bias) const {
  const int64_t N = weight.size(0), K = weight.size(1), M = inp.shape().rows();
  const DType cd = inp.dtype();
  if (M == 0 || N == 0) return;
  if (K == 0) {
    fill_(out, 0.0f);
    if (bias) bias_add_forward(out.reshape({M, N}), bias);
    return;
  }
  const bool all_f32 = cd == DType::kF32;
  // f32 goes through sgemm, which has no bias epilogue: add the bias in a second (cheap) pass.
  const bool fuse_bias = bias && !all_f32;
  GemmKey key{M, N, K, false, true, K, K, cd, cd, out.dtype(), fuse_bias, false};
  if (fuse_bias) key.bias_dt = bias.dtype();
  const size_t esize = dtype_size(out.dtype());
  if (!bias && primitive_takes(cd) && swaps_forward(M, N, K, esize)) {
    // out^T (N, M) = W (N, K) · inp^T into scratch, then transposed into out.
    const GemmKey swapped{N, M, K, false, true, K, K, cd, cd, out.dtype(), false, false};
    void* t = thread_scratch(kSwapSlot, (size_t(M * N) * esize + 3) / 4);
    DnnlRuntime::get().gemm(swapped, weight.raw(), inp.raw(), t, nullptr);
    transpose_into(out.raw(), t, esize, N, M);
    ++g_swapped_products;
    return;
  }
  if (all_f32 || primitive_takes(cd)) {
    DnnlRuntime::get().gemm(key, inp.raw(), weight.raw(), out.raw(), fuse_bias ? bias.raw() : nullptr);
    if (bias && !fuse_bias) bias_add_forward(out.reshape({M, N}), bias);
  } else {
    gemm_widened(key, inp.raw(), weight.raw(), out.raw(), bias ? bias.raw() : nullptr,
                 bias ? bias.dtype() : DType::kF32);
  }
}

void CpuOps::do_matmul_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout,
                                TensorView inp, TensorView weight, GradWrite dweight_write) const {
  const int64_t N = weight.size(0), K = weight.size(1), M = dout.shape().rows();
  const DType cd = dout.dtype();
  auto run = [&](const GemmKey& key, const void* a, const void* b, void* c) {
    if (cd == DType::kF32 || primitive_takes(cd))
      DnnlRuntime::get().gemm(key, a, b, c, nullptr);
    else
      gemm_widened(key, a, b, c, nullptr, DType::kF32);
  };
  if (dinp) {
    if (N == 0) {
      fill_(dinp, 0.0f);
    } else if (M > 0 && K > 0) {
      run(GemmKey{M, K, N, false, false, N, K, cd, cd, dinp.dtype(), false, false}, dout.raw(), weight.raw(),
          dinp.raw());
    }
  }
  const bool overwrite = dweight_write == GradWrite::kOverwrite;
  if (dweight && M > 0 && N > 0 && K > 0)
    run(GemmKey{N, K, M, true, false, N, K, cd, cd, dweight.dtype(), false, !overwrite}, dout.raw(), inp.raw(),
        dweight.raw());
  else if (dweight && overwrite)  // an empty product stores zeros
    fill_(dweight, 0.0f);
  if (dbias) bias_backward(dbias, dout.reshape({M, N}));
}

}  // namespace loom::cpu

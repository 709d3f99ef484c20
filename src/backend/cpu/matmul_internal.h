// Internals shared by the CPU matmul's two files: matmul.cpp (the oneDNN matmul primitive for bf16, the
// products' dispatch) and matmul_sgemm.cpp (f32 products through oneDNN's sgemm with a fixed work split,
// f16 and primitive-less bf16 products as f32 tiles through it).
#pragma once
#include <omp.h>

#include <cstdint>
#include <tuple>

#include "loom/core/dtype.h"

namespace loom::cpu::matmul_detail {

// Whether oneDNN's effective ISA here (its CPU's, lowered by DNNL_MAX_CPU_ISA) has every feature of `isa`, a
// dnnl_cpu_isa_t value (dnnl_cpu_isa_avx512_core, ..._avx512_core_bf16, ..._avx512_core_amx). Callers keep
// the answer: it is fixed for the process.
bool onednn_isa_has(unsigned isa);

// C (M, N) [+]= op(A) (M, K) · op(B) (K, N), BLAS-style: op(X) is X or X^T of a row-major stored matrix
// with leading dimension ld. Explicit transpose flags (not strides) keep 1-wide dimensions unambiguous.
struct GemmKey {
  int64_t M, N, K;
  bool trans_a, trans_b;
  int64_t lda, ldb;
  DType ta, tb, tc;
  bool bias, accumulate;
  DType bias_dt = DType::kF32;  // when bias
  bool pack = false;            // set by DnnlRuntime::gemm: Loom packs B (packs_b)
  auto tie() const {
    return std::tie(M, N, K, trans_a, trans_b, lda, ldb, ta, tb, tc, bias, accumulate, bias_dt, pack);
  }
  bool operator<(const GemmKey& o) const { return tie() < o.tie(); }
};

// Sets the calling thread's OpenMP team size (what oneDNN threads a call with, or makes a primitive for) for
// a scope, and restores it on exit, exceptions included. No-op when `threads` is already the maximum.
class ThreadLimit {
 public:
  explicit ThreadLimit(int threads) : saved_(omp_get_max_threads()) {
    if (threads != saved_) omp_set_num_threads(threads);
  }
  ~ThreadLimit() {
    if (omp_get_max_threads() != saved_) omp_set_num_threads(saved_);
  }
  ThreadLimit(const ThreadLimit&) = delete;
  ThreadLimit& operator=(const ThreadLimit&) = delete;

 private:
  int saved_;
};

// dnnl_sgemm with a work split that does not depend on the thread count. oneDNN's own threading may cut
// the K reduction between threads (it does on AVX2 machines for N <= 48-ish and for large K), which makes
// the result depend on OMP_NUM_THREADS; here the output is cut into at most 16 pieces fixed by the shape
// and the CPU (along its larger dimension; without AVX-512, as a grid that keeps the pieces on oneDNN's
// copy-based kernels: sgemm_pieces in matmul_sgemm.cpp), each piece one single-threaded sgemm (inside the
// parallel region oneDNN runs serially) that reduces over the whole K, so every thread count gives the
// same bits.
void sgemm_fixed_split(char ta, char tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                       const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// sgemm_fixed_split's cut of the output (M, N) into pm x pn pieces, every piece but the last of its row and
// of its column step_m x step_n (multiples of 8), for oneDNN's AVX-512 sgemm or its AVX2 one:
//   - along the larger dimension into up to 16 pieces of >= 64 (AVX-512, and without it where those pieces
//     are on the same kernels as the whole product);
//   - without AVX-512, where those pieces would run on oneDNN's no-copy kernels (sgemm_copy_based_avx2
//     false: about half the speed at GPT-2's shapes) and the whole product does not, as a grid of the
//     largest count of {16, 12, 8, 6, 4, 3, 2} whose every piece stays on the copy-based kernels (of the
//     grids with that count, the one with the squarest pieces).
struct SgemmPieces {
  int64_t pm = 1, pn = 1;
  int64_t step_m = 0, step_n = 0;
};
SgemmPieces sgemm_pieces(int64_t M, int64_t N, bool avx512);
// Whether oneDNN 2.6's AVX2 sgemm runs an (m, n) output on its copy-based kernels as far as the sizes decide
// (1/m + 1/n below nocopy_checker_avx2's line, 0.0038).
bool sgemm_copy_based_avx2(int64_t m, int64_t n);

// C (M, N) [+]= op(A) · op(B) (+ bias) for operands the matmul primitive cannot take: tiles of op(A) and
// op(B) are widened (exactly) into f32 scratch in their stored layout and multiplied by sgemm with the
// same transpose flags; C accumulates in f32 across K tiles and is narrowed (RNE) once per call when it is
// not f32. bias (N), when given, is added in f32 before that rounding (as bias_add_forward does).
void gemm_widened(const GemmKey& k, const void* a, const void* b, void* c, const void* bias, DType bias_dt);

}  // namespace loom::cpu::matmul_detail

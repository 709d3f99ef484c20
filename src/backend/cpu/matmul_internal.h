// Internals shared by the CPU matmul's two files: matmul.cpp (the oneDNN matmul primitive for bf16, the
// products' dispatch) and matmul_sgemm.cpp (f32 products through oneDNN's sgemm with a fixed work split,
// f16 and primitive-less bf16 products as f32 tiles through it).
#pragma once
#include <omp.h>

#include <cstdint>
#include <tuple>

#include "loom/core/dtype.h"

namespace loom::cpu::matmul_detail {

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
// the result depend on OMP_NUM_THREADS; here the output is cut along its larger dimension into at most 16
// pieces fixed by the shape, each piece one single-threaded sgemm (inside the parallel region oneDNN runs
// serially) that reduces over the whole K, so every thread count gives the same bits. Cost: up to ~1.5x on
// large-K products (dweight), near 1x elsewhere (2 cores, AVX2; bench/RESULTS.md).
void sgemm_fixed_split(char ta, char tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                       const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// C (M, N) [+]= op(A) · op(B) (+ bias) for operands the matmul primitive cannot take: tiles of op(A) and
// op(B) are widened (exactly) into f32 scratch in their stored layout and multiplied by sgemm with the
// same transpose flags; C accumulates in f32 across K tiles and is narrowed (RNE) once per call when it is
// not f32. bias (N), when given, is added in f32 before that rounding (as bias_add_forward does).
void gemm_widened(const GemmKey& k, const void* a, const void* b, void* c, const void* bias, DType bias_dt);

}  // namespace loom::cpu::matmul_detail

// The CPU matmul's sgemm side (see matmul.cpp's header for which products come here): f32 products through
// oneDNN's dnnl_sgemm cut into pieces fixed by the shape, and products the matmul primitive cannot take
// (f16; bf16 without AVX-512) as f32 tiles through the same.
#include <omp.h>

#include <algorithm>
#include <utility>
#include <oneapi/dnnl/dnnl.hpp>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/lowp.h"
#include "backend/cpu/matmul_internal.h"

namespace loom::cpu {

namespace matmul_detail {

namespace {

// oneDNN 2.6's sgemm without AVX-512 runs a product whose sizes have 1/m + 1/n >= 0.0038 on its "no-copy"
// kernels (nocopy_checker_avx2 in its gemm_driver.cpp), which reach about half the speed of its copy-based
// ones at GPT-2's shapes (bench/RESULTS.md: GPT-2's fc2 weight gradient, 768 x 3072 over 2048 tokens, took
// 80 ms in 16 pieces of 768 x 192, 42 ms in 6 of 768 x 512). Its AVX-512 line sits lower (0.00196), and its
// no-copy kernels there keep up.
constexpr double kAvx2NocopyLine = 0.0038;

// The step for cutting D into p pieces (a multiple of 8), and the size of the last piece (0: p is too many).
std::pair<int64_t, int64_t> cut(int64_t D, int64_t p) {
  const int64_t step = ((D + p - 1) / p + 7) / 8 * 8;
  return {step, D - (p - 1) * step};
}

}  // namespace

bool onednn_isa_has(unsigned isa) { return (unsigned(dnnl_get_effective_cpu_isa()) & isa) == isa; }

bool sgemm_copy_based_avx2(int64_t m, int64_t n) { return 1.0 / double(m) + 1.0 / double(n) < kAvx2NocopyLine; }

SgemmPieces sgemm_pieces(int64_t M, int64_t N, bool avx512) {
  const bool by_m = M >= N;
  const int64_t D = by_m ? M : N;
  const int64_t P = std::max<int64_t>(1, std::min<int64_t>(16, (D + 63) / 64));
  SgemmPieces one_d;
  (by_m ? one_d.pm : one_d.pn) = P;
  one_d.step_m = by_m ? cut(M, P).first : M;
  one_d.step_n = by_m ? N : cut(N, P).first;
  if (avx512) return one_d;
  const int64_t last_m = by_m ? cut(M, P).second : M, last_n = by_m ? N : cut(N, P).second;
  if (sgemm_copy_based_avx2(last_m, last_n) || !sgemm_copy_based_avx2(M, N)) return one_d;
  for (const int64_t count : {16, 12, 8, 6, 4, 3, 2}) {
    SgemmPieces best;
    double best_line = kAvx2NocopyLine;
    for (int64_t pm = 1; pm <= count; ++pm) {
      if (count % pm) continue;
      const int64_t pn = count / pm;
      const auto [sm, lm] = cut(M, pm);
      const auto [sn, ln] = cut(N, pn);
      if (lm <= 0 || ln <= 0) continue;
      const double line = 1.0 / double(std::min(sm, lm)) + 1.0 / double(std::min(sn, ln));
      if (line < best_line) best = {pm, pn, sm, sn}, best_line = line;
    }
    if (best.step_m > 0) return best;
  }
  return one_d;
}

void sgemm_fixed_split(char ta, char tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                       const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  static const bool avx512 = onednn_isa_has(dnnl_cpu_isa_avx512_core);
  const SgemmPieces p = sgemm_pieces(M, N, avx512);
  const int64_t count = p.pm * p.pn;
  int status = int(dnnl_success);
  if (count == 1) {
    // One piece: run it on this thread alone. Outside a parallel region oneDNN would thread it itself
    // (splitting K on some shapes: thread-count-dependent sums) and, for the small products of LoRA's
    // rank-r GEMMs, spend more on waking and joining threads than on the product.
    sgemm_serial(ta == 'T', tb == 'T', M, N, K, A, lda, B, ldb, beta != 0.0f, C, ldc);
    return;
  }
#pragma omp parallel for schedule(static) reduction(max : status)
  for (int64_t t = 0; t < count; ++t) {
    const int64_t m0 = (t / p.pn) * p.step_m, n0 = (t % p.pn) * p.step_n;
    if (m0 >= M || n0 >= N) continue;
    const int64_t mb = std::min(p.step_m, M - m0), nb = std::min(p.step_n, N - n0);
    const float* a = ta == 'N' ? A + m0 * lda : A + m0;
    const float* b = tb == 'N' ? B + n0 : B + n0 * ldb;
    const dnnl_status_t st = dnnl_sgemm(ta, tb, mb, nb, K, 1.0f, a, lda, b, ldb, beta, C + m0 * ldc + n0, ldc);
    if (st != dnnl_success) status = std::max(status, int(st));
  }
  LOOM_CHECK(status == int(dnnl_success), "[matmul] dnnl_sgemm failed with status ", status, " for M=", M, " N=", N,
             " K=", K);
}

constexpr int64_t kTileM = 2048, kTileN = 2048, kTileK = 1024;

void gemm_widened(const GemmKey& k, const void* a, const void* b, void* c, const void* bias, DType bias_dt) {
  const bool c_f32 = k.tc == DType::kF32;
  std::vector<float> bias_f32;
  if (bias) {
    bias_f32.resize(size_t(k.N));
    widen(bias_f32.data(), bias, bias_dt, k.N);
  }
  // Widens rows [r0, r0 + nr) x cols [c0, c0 + nc) of a stored row-major matrix (leading dim ld).
  auto widen_block = [](float* dst, const void* src, DType dt, int64_t ld, int64_t r0, int64_t nr, int64_t c0,
                        int64_t nc) {
#pragma omp parallel for schedule(static) if (nr * nc > (int64_t(1) << 15))
    for (int64_t r = 0; r < nr; ++r) widen(dst + r * nc, elem_ptr(src, dt, (r0 + r) * ld + c0), dt, nc);
  };
  const int64_t tm = std::min(kTileM, k.M), tn = std::min(kTileN, k.N), tk = std::min(kTileK, k.K);
  float* ta = thread_scratch(4, size_t(tm * tk));
  float* tb = thread_scratch(5, size_t(tk * tn));
  float* tc = c_f32 ? nullptr : thread_scratch(6, size_t(tm * tn));
  for (int64_t m0 = 0; m0 < k.M; m0 += kTileM) {
    const int64_t mb = std::min(kTileM, k.M - m0);
    for (int64_t n0 = 0; n0 < k.N; n0 += kTileN) {
      const int64_t nb = std::min(kTileN, k.N - n0);
      float* cf = c_f32 ? static_cast<float*>(c) + m0 * k.N + n0 : tc;
      const int64_t ldc = c_f32 ? k.N : nb;
      if (!c_f32 && k.accumulate) widen_block(tc, c, k.tc, k.N, m0, mb, n0, nb);
      for (int64_t k0 = 0; k0 < k.K; k0 += kTileK) {
        const int64_t kb = std::min(kTileK, k.K - k0);
        // op(A) tile (mb, kb): stored (kb, mb) when transposed. With a single K tile it is the same for
        // every N tile: widened once per M tile.
        if (n0 == 0 || k.K > kTileK) {
          if (k.trans_a)
            widen_block(ta, a, k.ta, k.lda, k0, kb, m0, mb);
          else
            widen_block(ta, a, k.ta, k.lda, m0, mb, k0, kb);
        }
        if (k.trans_b)
          widen_block(tb, b, k.tb, k.ldb, n0, nb, k0, kb);
        else
          widen_block(tb, b, k.tb, k.ldb, k0, kb, n0, nb);
        const float beta = (k0 > 0 || k.accumulate) ? 1.0f : 0.0f;
        sgemm_fixed_split(k.trans_a ? 'T' : 'N', k.trans_b ? 'T' : 'N', mb, nb, kb, ta, k.trans_a ? mb : kb, tb,
                          k.trans_b ? kb : nb, beta, cf, ldc);
      }
      const float* bf = bias ? bias_f32.data() + n0 : nullptr;
#pragma omp parallel for schedule(static) if (mb * nb > (int64_t(1) << 15))
      for (int64_t r = 0; r < mb; ++r) {
        float* row = cf + r * ldc;
        if (bf) {
#pragma omp simd
          for (int64_t j = 0; j < nb; ++j) row[j] += bf[j];
        }
        if (!c_f32) narrow(elem_ptr(c, k.tc, (m0 + r) * k.N + n0), k.tc, row, nb);
      }
    }
  }
}

}  // namespace matmul_detail

void sgemm_serial(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                  const float* B, int64_t ldb, bool accumulate, float* C, int64_t ldc) {
  // Inside an active parallel region oneDNN runs serially; outside one it would thread the product itself.
  const matmul_detail::ThreadLimit limit(omp_in_parallel() ? omp_get_max_threads() : 1);
  const dnnl_status_t st = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, 1.0f, A, lda, B, ldb,
                                      accumulate ? 1.0f : 0.0f, C, ldc);
  LOOM_CHECK(st == dnnl_success, "[matmul] dnnl_sgemm failed with status ", int(st), " for M=", M, " N=", N,
             " K=", K);
}

}  // namespace loom::cpu

// The bf16 path of the CPU attention core: block products on AVX512-BF16's VDPBF16PS (16 f32 lanes, each +=
// the dot product of a pair of bf16 values with another pair: twice the multiply-adds of an f32 FMA per
// instruction), run by the bf16 tasks of attention_bf16.cpp, which attention.cpp chooses for bf16 activations
// when the CPU has it. Like the CUDA backend's tensor-core path (and every tensor-core FlashAttention), the
// probabilities P and the score gradients dS are rounded to bf16 for the products that take them; scores,
// softmax statistics and every accumulator are f32.
#pragma once
#include <cstdint>

#include "backend/cpu/attention_tiles.h"

namespace loom::cpu::attn {

// True when the CPU (and the OS, for the AVX-512 register state) can run AVX512-BF16. Asked once.
bool bf16_dot_supported();

// Whether bf16 attention runs its products on VDPBF16PS: bf16_dot_supported() unless switched off. The
// switch exists for tests, which compare this path with the f32 one on one machine; it is process-wide and
// must not be flipped while an attention call runs.
bool bf16_attention_enabled();
void set_bf16_attention(bool on);

// c (m x n f32, ldc floats per row) = [c +] a (m x k bf16 bits, lda elements per row) . B, where B (k x n) is
// given pair-interleaved: b[p * ldb + j] = B[2p][j] | B[2p + 1][j] << 16. m is a multiple of 4, n of 16, k of
// 2; a's rows start at even elements. Every c element is summed over the pairs of k in ascending order,
// always the same way: the result depends on the arguments only (not on threads or alignment).
void bf16_gemm(float* c, int64_t ldc, const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t m,
               int64_t n, int64_t k, bool accumulate);

// The tasks' tile products, restricted to what the tile's band leaves visible, per group of 4 output rows (as
// the f32 tile kernels skip, attention_tiles.h). The tile has kBlock rows of a (lda elements apart) and of c
// (ldc floats apart); only its first `rows` (kn keys or qn queries) are computed. The rows after them in the
// same group of 4 receive products over the valid rows' range (the callers never read them, or their a rows
// are 0), the later groups are left as they are. What is left out is exact zeros, so every entry of the first
// `rows` has bf16_gemm's bits on the whole tile:
//   - kQueryCols: c (kBlock x kBlock: key rows, query columns) = a (keys x n) . B (n x kBlock queries), the
//     scores S^T = K.Q^T and dP^T = V.dO^T. A query vector (16 columns) that no key of a row group sees is set
//     to 0 instead of computed (with accumulate, left as it is): the callers mask such entries before reading
//     them, or, past a query block's last query, they are the products of its zero-padded rows, 0 anyway;
//   - kReduceQueries: c (key rows x n) += a (keys x kBlock queries) . B (kBlock queries x n), dV += P^T.dO
//     and dK += dS^T.q; kReduceKeys: c (query rows x n) += a (queries x kBlock keys) . B (kBlock keys x n),
//     O += P.V and dQ += dS.K. Only the pairs of the queries (keys) some row of the group sees are summed:
//     a is 0 outside them (P and dS are masked), and without accumulate rows with none are set to 0.
// On the diagonal tiles of a causal mask this leaves out ~40% of the multiply-adds. B is pair-interleaved as
// for bf16_gemm; n is a multiple of 16 (of 2 for kQueryCols), lda even.
enum class BandUse { kQueryCols, kReduceQueries, kReduceKeys };
void bf16_band_gemm(float* c, int64_t ldc, const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t n,
                    bool accumulate, const Band& band, BandUse use, int64_t rows);

}  // namespace loom::cpu::attn

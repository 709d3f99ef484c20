// The bf16 path of the CPU attention core: block products on AVX512-BF16's VDPBF16PS (16 f32 lanes, each +=
// the dot product of a pair of bf16 values with another pair: twice the multiply-adds of an f32 FMA per
// instruction), run by the bf16 tasks of attention_bf16.cpp, which attention.cpp chooses for bf16 activations
// when the CPU has it. Like the CUDA backend's tensor-core path (and every tensor-core FlashAttention), the
// probabilities P and the score gradients dS are rounded to bf16 for the products that take them; scores,
// softmax statistics and every accumulator are f32.
#pragma once
#include <cstdint>

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

}  // namespace loom::cpu::attn

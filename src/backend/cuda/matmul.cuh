// Launchers for the linear-layer matmuls on the GPU (kernels and the cuBLASLt plumbing in matmul.cu).
// Contracts are the OpTable's (loom/backend/ops.h); the CPU twin is src/backend/cpu/matmul.cpp.
//   forward  out (M, N)      = inp (M, K) · weight (N, K)^T + bias (N)
//   backward dinp (M, K)     = dout · weight            (overwrite)
//            dweight (N, K) += dout^T · inp            (accumulate, f32 or the compute dtype; = with
//                                                       GradWrite::kOverwrite: beta 0, zeros when M = 0)
//            dbias (N)      += column sums of dout     (accumulate; fixed-order two-stage reduction)
// Products run on the tensor cores through cuBLASLt with f32 accumulation (CUBLAS_COMPUTE_32F, no TF32
// for f32 operands, so results track the CPU reference to f32 rounding). Host-only header.
//
// detail::lt_matmul is the shared cuBLASLt entry point (also used by fp8_gemm in fp8.cu): it caches the
// descriptors and the heuristic's algorithm per problem, so repeated shapes skip the heuristic.
#pragma once
#include <cstdint>

#include "backend/cuda/cuda_context.cuh"
#include "loom/backend/ops.h"
#include "loom/core/tensor.h"

namespace loom::cuda {

void matmul_forward(const CudaContext& ctx, TensorView out, TensorView inp, TensorView weight, TensorView bias);
void matmul_backward(const CudaContext& ctx, TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout,
                     TensorView inp, TensorView weight, GradWrite dweight_write = GradWrite::kAccumulate);

namespace detail {

// One column-major cuBLASLt product: D (m x n, ldd) = scale_a·op(A) · scale_b·op(B) [+ D] [+ bias (m)], with
// op(A) (m x k) and op(B) (k x n); C is D itself (beta = 1 when accumulate). Arithmetic in f32.
struct LtGemm {
  int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  const void* a = nullptr;
  DType a_type = DType::kF32;
  int64_t lda = 0;
  const void* b = nullptr;
  DType b_type = DType::kF32;
  int64_t ldb = 0;
  void* d = nullptr;
  DType d_type = DType::kF32;
  int64_t ldd = 0;
  bool accumulate = false;
  const void* bias = nullptr;  // BIAS epilogue (m elements of d_type); nullptr: none
  const float* a_scale = nullptr;  // FP8 operands: device scalars multiplying A and B (nullptr: 1)
  const float* b_scale = nullptr;
};

// Enqueues the product on ctx.compute_stream(). When cuBLASLt has no algorithm for the problem it returns
// false without launching anything if allow_unsupported (the caller falls back), else throws naming `op`.
bool lt_matmul(const CudaContext& ctx, const LtGemm& g, const char* op, bool allow_unsupported = false);

// out (M, N) = round_to_out([out +] src (M, N) f32 + bias (N)); src may be null (0) or alias out when out is
// f32; bias may be null; bias and out any of f32/bf16/f16. The f32 sum order matches the CPU reference
// (src + bias first, then the old value).
void gemm_finalize(const CudaContext& ctx, TensorView out, const float* src, TensorView bias, bool accumulate,
                   int64_t M, int64_t N);

}  // namespace detail

}  // namespace loom::cuda

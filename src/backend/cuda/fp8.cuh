// Launchers for the FP8 ops on the GPU (kernels in fp8.cu): per-tensor quantise/dequantise, the
// delayed-scaling update, the FP8 GEMM and a tiled 2-D transpose. Contracts are the OpTable's
// (loom/backend/ops.h); the CPU twin is src/backend/cpu/fp8.cpp.
//
// Scales, inverse scales and amaxes are (1)-element f32 device tensors, read and written only by kernels,
// so none of these ops synchronises the host. Quantise/dequantise/update are bit-identical to the CPU.
// fp8_gemm runs on cuBLASLt's FP8 tensor-core kernels on sm_89+ when the shape and pointers allow (K and
// N multiples of 16, 16-byte aligned operands); otherwise it dequantises both operands to f32 scratch and
// runs the f32 product, exactly as the CPU reference does, so the op always works. Host-only header.
#pragma once
#include "backend/cuda/cuda_context.cuh"
#include "loom/core/tensor.h"

namespace loom::cuda {

void fp8_quantize(const CudaContext& ctx, TensorView out, TensorView inp, TensorView scale, TensorView amax);
void fp8_dequantize(const CudaContext& ctx, TensorView out, TensorView inp, TensorView scale_inv);
void fp8_update_scaling(const CudaContext& ctx, TensorView amax_history, TensorView scale, TensorView scale_inv,
                        float fp8_max, int margin, bool use_max);
void fp8_gemm(const CudaContext& ctx, TensorView out, TensorView a, TensorView a_scale_inv, TensorView b,
              TensorView b_scale_inv, TensorView bias, bool accumulate);
void transpose(const CudaContext& ctx, TensorView out, TensorView inp);

}  // namespace loom::cuda

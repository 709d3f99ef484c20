// Launchers for the CUDA mixture-of-experts ops (kernels in moe.cu): token permutation / unpermutation and
// their backwards, and the grouped GEMM. Each takes the context first, then exactly the OpTable method's
// parameters, with the semantics of the CPU reference (src/backend/cpu/moe.cpp). Arguments are checked by
// the OpTable entry points (src/backend/op_checks_moe.cpp); row_id_map lives on the device, so its values
// are not checked here: entries outside [0, M) are skipped (never an out-of-bounds access) and the
// bijection onto [0, M) is the router's guarantee. All work is on ctx.compute_stream(); nothing syncs.
// Host-only header (no device code).
#pragma once
#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_context.cuh"
#include "loom/backend/ops.h"
#include "loom/core/tensor.h"

namespace loom::cuda {

void moe_permute_forward(const CudaContext& ctx, TensorView out, TensorView inp, TensorView row_id_map);
void moe_permute_backward(const CudaContext& ctx, TensorView dinp, TensorView dout, TensorView row_id_map);
void moe_unpermute_forward(const CudaContext& ctx, TensorView out, TensorView inp, TensorView probs,
                           TensorView row_id_map);
void moe_unpermute_backward(const CudaContext& ctx, TensorView dinp, TensorView dprobs, TensorView dout,
                            TensorView inp, TensorView probs, TensorView row_id_map);
// One cuBLASLt GEMM per non-empty group (matmul.cu's launchers on slices of the buffers).
void grouped_matmul_forward(const CudaContext& ctx, TensorView out, TensorView inp, TensorView weight,
                            const std::vector<int64_t>& group_sizes);
void grouped_matmul_backward(const CudaContext& ctx, TensorView dinp, TensorView dweight, TensorView dout,
                             TensorView inp, TensorView weight, const std::vector<int64_t>& group_sizes,
                             GradWrite dweight_write);

}  // namespace loom::cuda

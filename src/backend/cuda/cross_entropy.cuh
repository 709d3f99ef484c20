// Launcher for the fused softmax cross-entropy of the op table on the GPU (kernels in cross_entropy.cu).
// Semantics are the CPU reference's (src/backend/cpu/cross_entropy.cpp; loom/backend/ops.h): losses (N) f32
// for every row, dlogits written in place over the logits when dlogits_scale != 0, padding columns
// [vocab_size, Vp) excluded and given gradient 0, loss_mask scaling the gradient only, rows with mask 0
// allowed any target (loss 0, gradient 0), any other out-of-range target an error raised before any work.
//
// Invariants: one host synchronisation per call (the target check, which must finish before the logits
// are touched); everything else is asynchronous on ctx.compute_stream(); results are bit-identical run to
// run (one block per row, fixed reduction trees). Host-only header.
#pragma once
#include <cstdint>

#include "backend/cuda/cuda_context.cuh"
#include "loom/core/tensor.h"

namespace loom::cuda {

// logits (N, Vp) f32/bf16/f16, targets (N) i32, losses (N) f32, loss_mask (N) f32 optional.
void cross_entropy_forward_backward(const CudaContext& ctx, TensorView losses, TensorView logits,
                                    TensorView targets, int64_t vocab_size, TensorView loss_mask,
                                    float dlogits_scale);

}  // namespace loom::cuda

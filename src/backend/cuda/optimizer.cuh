// Launchers for the optimizer and buffer utilities of the op table on the GPU (kernels in optimizer.cu):
// AdamW, the f64 sum of squares behind the global gradient norm, the inf/NaN scan of the loss scaler,
// scale_ and fill_. Semantics are those of the CPU reference (src/backend/cpu/optimizer.cpp and
// elementwise.cpp); see loom/backend/ops.h.
//
// Invariants: everything runs on ctx.compute_stream(); only sum_squares and has_inf_or_nan synchronise
// the host (they return host values: one small device-to-host copy each). sum_squares is deterministic
// for a given element count: its split of the work is a function of numel alone, never of timing, the
// device or the buffer's alignment. Host-only header.
#pragma once
#include "backend/cuda/cuda_context.cuh"
#include "loom/backend/ops.h"
#include "loom/core/tensor.h"

namespace loom::cuda {

// PyTorch/apex AdamW on f32 param, grad, exp_avg m and exp_avg_sq v (all f32, same numel), rounding
// exactly as the CPU op does (same f32 operation order, no FMA contraction beyond the CPU's two fmas).
void adamw_update(const CudaContext& ctx, TensorView param, TensorView grad, TensorView m, TensorView v,
                  const AdamWParams& p);
// torch.optim.SGD (dampening 0, no Nesterov) on f32 param, grad and (momentum != 0) momentum buffer,
// rounding exactly as the CPU op does (explicit fmas where PyTorch's kernels fuse).
void sgd_update(const CudaContext& ctx, TensorView param, TensorView grad, TensorView momentum_buf,
                const SgdParams& p);
// Sum of squares of any float tensor (f32, bf16, f16, fp8), accumulated in f64.
double sum_squares(const CudaContext& ctx, TensorView x);
// True when x (any float dtype) holds an inf or a NaN.
bool has_inf_or_nan(const CudaContext& ctx, TensorView x);
// Elements of x (any float dtype) equal to +0 or -0.
int64_t count_zeros(const CudaContext& ctx, TensorView x);
// Σ|x|, max|x|, Σ sqrt|x| of an f32 buffer in f64: per-block partials (a function of numel only) summed in
// block order on the host.
AbsStats abs_stats(const CudaContext& ctx, TensorView x);
// x *= s in f32, rounded once to x's dtype (any float dtype).
void scale_(const CudaContext& ctx, TensorView x, float s);
// x = value converted as the CPU converts it (float dtypes with RNE, fp8 saturating; i32/i64/u16 as a
// C++ cast of the float).
void fill_(const CudaContext& ctx, TensorView x, float value);

}  // namespace loom::cuda

// Launchers for the CUDA elementwise ops of the op table (kernels in elementwise.cu, glu.cu, rope.cu and
// dropout.cu): residual add, GeLU, bias add and bias gradient, gated MLP activations, rotary embedding and
// hidden dropout. Each launcher takes the context first, then exactly the OpTable method's parameters, and
// has the semantics of the CPU reference (src/backend/cpu/elementwise.cpp, glu.cpp, rope.cpp, dropout.cpp):
// same accepted dtypes, same accumulate/overwrite rules. Arguments are checked by the OpTable entry points
// (src/backend/op_checks*.cpp) on the host, before any launch; a launcher called directly trusts its caller.
// All work is enqueued on ctx.compute_stream(); no launcher synchronizes.
// Host-only header (no device code).
#pragma once
#include <cstdint>

#include "backend/cuda/cuda_context.cuh"
#include "loom/backend/ops.h"
#include "loom/core/tensor.h"

namespace loom::cuda {

// out = a + b (one dtype: f32, bf16 or f16).
void residual_forward(const CudaContext& ctx, TensorView out, TensorView a, TensorView b);
// out = gelu(inp), tanh approximation.
void gelu_forward(const CudaContext& ctx, TensorView out, TensorView inp);
// dinp = gelu'(inp) * dout (overwrite; dinp may be dout).
void gelu_backward(const CudaContext& ctx, TensorView dinp, TensorView inp, TensorView dout);
// out (N, C) += bias (C); bias in out's dtype, f32, or (f32 out) bf16/f16.
void bias_add_forward(const CudaContext& ctx, TensorView out, TensorView bias);
// dbias (C) += column sums of dout (N, C); dbias f32 or dout's dtype. Deterministic, no atomics, and summed
// in the CPU's order (64-row f32 partials, then f64 over the blocks), so f32 results match the CPU.
void bias_backward(const CudaContext& ctx, TensorView dbias, TensorView dout);

// inp (N, 2F) = [gate | up]; out (N, F) = act(gate) · up.
void glu_forward(const CudaContext& ctx, TensorView out, TensorView inp, GluKind kind);
// dinp (N, 2F) = [dgate | dup] (overwrite; dinp may be inp).
void glu_backward(const CudaContext& ctx, TensorView dinp, TensorView inp, TensorView dout, GluKind kind);

// Rotary embedding in place on the q and k heads of qkv (B, T, NKV*(NH/NKV+2)*HS); cos/sin (max_positions,
// rotary_dim/2) f32 on the device; position_ids (B, T) i32 on the device, optional. Without position_ids
// T <= max_positions (checked by the entry point). Device position ids cannot be checked on the host
// without a copy and a sync: the caller (data loader) guarantees 0 <= id < max_positions, and a row whose
// id is out of range is left untouched by the kernel (no out-of-bounds read).
void rope_forward(const CudaContext& ctx, TensorView qkv, TensorView cos, TensorView sin, const AttentionParams& p,
                  const RopeParams& r, TensorView position_ids);
// The inverse rotation on the dq and dk heads of dqkv, in place.
void rope_backward(const CudaContext& ctx, TensorView dqkv, TensorView cos, TensorView sin, const AttentionParams& p,
                   const RopeParams& r, TensorView position_ids);

// out = inp * keep / (1 - p), keep[i] = dropout_keep(seed, stream, offset + i, dropout_threshold(p)): the
// CPU's mask bit for bit. out may be inp (no other overlap); p == 0 is a copy.
void dropout_forward(const CudaContext& ctx, TensorView out, TensorView inp, float p, uint64_t seed, uint64_t stream,
                     uint64_t offset);
// dinp = dout * keep / (1 - p) with the same mask (dinp may be dout).
void dropout_backward(const CudaContext& ctx, TensorView dinp, TensorView dout, float p, uint64_t seed,
                      uint64_t stream, uint64_t offset);

}  // namespace loom::cuda

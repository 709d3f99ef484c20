// Launchers for the token + position embedding on the GPU (kernels in embedding.cu), with the OpTable
// semantics of include/loom/backend/ops.h and the CPU reference src/backend/cpu/embedding.cpp:
//   out (B, T, C) = wte[tokens[b, t]] + wpe[pos[b, t]], pos = position_ids[b, t] when given, else t;
//   dwte[tokens[b, t]] += dout[b, t]; dwpe[pos[b, t]] += dout[b, t] (accumulate; wpe/dwpe optional).
// wte, wpe, out and dout share one compute dtype (f32, bf16 or f16); dwte/dwpe are f32 or that dtype.
// Sums are f32 in the CPU's order (token order per gradient row), rounded once, so results equal the CPU
// op's bit for bit, and are deterministic (no float atomics; the backward sorts the token ids).
//
// Id range: shapes are checked on the host (by the OpTable entry point), but the ids live on the device,
// and reading them back would stall the stream every step. The kernels check them instead: an out-of-range
// token (or position) id makes its output row NaN in the forward, is skipped by the backward, and raises a
// sticky per-device flag that embedding_take_error() reads. The data loader validates ids against the
// vocabulary, so this is a backstop, not the primary check. All work runs on ctx.compute_stream().
// Host-only header.
#pragma once
#include "backend/cuda/cuda_context.cuh"
#include "loom/core/tensor.h"

namespace loom::cuda {

void embedding_forward(const CudaContext& ctx, TensorView out, TensorView tokens, TensorView wte, TensorView wpe,
                       TensorView position_ids);
void embedding_backward(const CudaContext& ctx, TensorView dwte, TensorView dwpe, TensorView dout, TensorView tokens,
                        TensorView position_ids);

// True when an embedding op on ctx's device has met an out-of-range token or position id since the last
// call; clears the flag. Waits for the compute stream (call it at log intervals, not in the hot path).
bool embedding_take_error(const CudaContext& ctx);

}  // namespace loom::cuda

// Launchers of the register-tiled flash attention (kernels in flash_attention.cu and flash_attention_bwd.cu,
// building blocks in flash_tiles.cuh): the fast path of the
// whole-sequence attention_forward / attention_backward for the shapes training runs most (bf16/f16, head
// size 64 or 128, causal or not, MHA/GQA/MQA, no sliding window, no document segments, no attention
// dropout, 16-byte aligned rows). attention_op.cu asks eligible() and falls back to its general kernels for
// everything else, so both paths keep the op's contract: the CPU's semantics (src/backend/cpu/attention.cpp),
// out/lse/dqkv overwritten, deterministic (no float atomics), O(T) memory, all work on the compute stream.
// Host-only header.
#pragma once
#include <initializer_list>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/cuda_context.cuh"
#include "loom/core/tensor.h"

namespace loom::cuda::flash {

// True when the flash kernels take this whole-sequence problem (pb.q == pb.kv, packed qkv) with `tensors`
// (forward: out; backward: out, dout, dqkv) in q's dtype and 16-byte aligned.
bool eligible(const attn_detail::Problem& pb, std::initializer_list<TensorView> tensors);

// out (B, T, NH*HS) and lse (B, NH, T) f32, overwritten.
void forward(const CudaContext& ctx, const attn_detail::Problem& pb, TensorView out, TensorView lse);

// dqkv (B, T, NKV*(G+2)*HS) overwritten: dQ, dK, dV in the packed layout of qkv.
void backward(const CudaContext& ctx, const attn_detail::Problem& pb, TensorView dqkv, TensorView dout,
              TensorView out, TensorView lse);

}  // namespace loom::cuda::flash

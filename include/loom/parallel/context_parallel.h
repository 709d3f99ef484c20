// Context parallelism (Megatron's --context-parallel-size): the sequence is cut across the CP ranks and
// attention runs as a ring that passes key/value blocks round with online-softmax merges.
//
// Layout (load-balanced for causal attention): the T tokens are cut into 2·CP chunks of T / (2·CP); cp rank i
// holds chunks i and 2·CP-1-i, concatenated, so local T_l = T / CP, and local token t has global position
// i·c + t for t < c and (2·CP-1-i)·c + t - c after (c = T / (2·CP)). Every token-wise tensor of the batch
// (tokens, targets, loss mask, position ids, segment ids) is sliced the same way (cp_slice_sequence); all
// layers except attention are token-wise and run on the local tokens unchanged.
//
// Ring (ContextParallelAttention): at step s = 0 .. CP-1 a rank holds the compact K/V block (B, T_l, NKV·2·HS)
// of rank (r - s) mod CP, computes its queries against it with global positions (attention_block_forward),
// merges the partial result (attention_merge, f32 accumulators), and passes the block to rank r+1 while
// receiving the next one from r-1 (send_async/recv_async, overlapping the transfer with the block's compute).
// Backward runs the same ring with the FINAL out/lse: dq accumulates locally (f32); each block's dK/dV (f32,
// computed fresh at each step) is added to the running sum received from r-1 for the same block and passed
// on to r+1, so after CP steps every block's gradient arrives back at its owner.
// Message order between a pair of ranks (the communicator matches messages by order): at each step a rank
// first posts the receive of the previous step's dK/dV, then the K/V of the next step, matching the sender's
// order (K/V of step s at the start of step s, dK/dV of step s at its end).
// With CP = 1 both calls are the single-device attention_forward/backward.
// Supported with CP > 1: causal or full attention, GQA, sliding windows, document segments
// (--reset-attention-mask; the segment ids of every rank are all-gathered once per call) and attention
// dropout (the mask uses the global positions, so a CP run drops exactly what the CP = 1 run drops).
#pragma once
#include <cstdint>
#include <vector>

#include "loom/backend/device_context.h"
#include "loom/dist/communicator.h"

namespace loom {

// Global positions of the T / cp_size local tokens of cp_rank (see the layout above). T must be a multiple
// of 2·cp_size (user_error naming --seq-length and --context-parallel-size otherwise).
std::vector<int32_t> cp_local_positions(int64_t seq_len, int cp_size, int cp_rank);

// out (B, T / cp_size, ...) = this rank's two chunks of inp (B, T, ...), any dtype, copied with ctx.copy (works
// for host and device tensors). With cp_size 1 a plain copy.
void cp_slice_sequence(const DeviceContext& ctx, TensorView out, TensorView inp, int cp_size, int cp_rank);
// The inverse placement: writes inp (B, T / cp_size, ...) into this rank's two chunks of out (B, T, ...); the
// rest of out is untouched (for gathering a sequence back, e.g. in tests and evaluation dumps).
void cp_unslice_sequence(const DeviceContext& ctx, TensorView out, TensorView inp, int cp_size, int cp_rank);

class ContextParallelAttention {
 public:
  // out (B, T_l, NH·HS) and lse (B, NH, T_l) f32 of this rank's queries over the whole sequence, from its
  // qkv (B, T_l, NKV·(NH/NKV+2)·HS) in the compute dtype (out has that dtype). segment_ids (B, T_l) i32: this
  // rank's slice of the document ids, optional. Collective over cp (every rank calls it, same shapes).
  static void forward(const DeviceContext& ctx, TensorView out, TensorView lse, TensorView qkv,
                      const AttentionParams& p, const Communicator& cp, TensorView segment_ids = {});
  // dqkv (B, T_l, ...) (overwrite, compute dtype) from dout and the forward's out and lse. Collective over cp.
  static void backward(const DeviceContext& ctx, TensorView dqkv, TensorView dout, TensorView qkv, TensorView out,
                       TensorView lse, const AttentionParams& p, const Communicator& cp,
                       TensorView segment_ids = {});
};

}  // namespace loom

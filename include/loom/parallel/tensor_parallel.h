// Tensor-parallel building blocks (Megatron's tensor_parallel package) for the GPT model:
//   - shard ranges of evenly split dimensions;
//   - the f/g conjugate mappings: identity forward / all-reduce backward at a column-parallel input,
//     all-reduce forward at a row-parallel output; with sequence parallelism all-gather / reduce-scatter of
//     row blocks of the flattened (B·T) token axis (rank r holds rows [r·N/TP, (r+1)·N/TP), so gathered
//     blocks are plain concatenations);
//   - the vocabulary-parallel embedding lookup (rows outside this rank's vocabulary range give 0; the caller
//     reduces over the group);
//   - the vocabulary-parallel cross-entropy: global max, sum of exponentials and target logit reduced over
//     the group, dlogits written in place on each rank; no rank materialises full logits.
// Every function is the identity / the plain op when the communicator is null or of size 1.
#pragma once
#include <vector>

#include "loom/backend/device_context.h"
#include "loom/dist/communicator.h"
#include "loom/param/parameter.h"

namespace loom {

// The contiguous range rank `rank` of `parts` holds when `size` (divisible by parts) is split evenly.
ShardRange even_shard(int64_t size, int parts, int rank);

// x = sum over the group of x (in place). No-op without a group.
void tp_all_reduce(const Communicator* tp, TensorView x);
// full (N, C) = concatenation of every rank's shard (N/TP, C).
void sp_all_gather(const Communicator* tp, TensorView full, TensorView shard);
// shard (N/TP, C) = this rank's rows of the sum over the group of full (N, C).
void sp_reduce_scatter(const Communicator* tp, TensorView shard, TensorView full);

// Host i32 (B, T) token ids of `tokens` relative to `vocab_start`: ids outside [vocab_start, vocab_start +
// rows) become 0 and their flat index is listed in `outside`.
void vocab_local_tokens(TensorView local, std::vector<int64_t>& outside, TensorView tokens, int64_t vocab_start,
                        int64_t rows);
// Host i32 (B, T) positions: position_ids when given, else t.
void embedding_positions(TensorView positions, TensorView position_ids);

// out (N, C) = (wte_shard[token - vocab_start] when this rank holds the token, else 0) + (wpe[pos] when
// add_positions). local_tokens / outside from vocab_local_tokens, positions from embedding_positions
// (ignored without wpe). scratch: (N, C) in the compute dtype (holds the position rows).
void vocab_parallel_embedding_forward(const DeviceContext& ctx, TensorView out, TensorView local_tokens,
                                      const std::vector<int64_t>& outside, TensorView wte_shard, TensorView wpe,
                                      TensorView positions, bool add_positions, TensorView scratch);
// dwte_shard[token - vocab_start] += dout (held tokens only), dwpe[pos] += dout (when dwpe is given). dout
// (N, C) is clobbered: the rows of tokens outside the shard are zeroed.
void vocab_parallel_embedding_backward(const DeviceContext& ctx, TensorView dwte_shard, TensorView dwpe,
                                       TensorView dout, TensorView local_tokens, const std::vector<int64_t>& outside,
                                       TensorView positions);

// Vocabulary-parallel softmax cross-entropy over logits (N, Vl) holding global columns [vocab_start,
// vocab_start + Vl) of the padded vocabulary; columns >= vocab_size are padding and excluded. Semantics as
// OpTable::cross_entropy_forward_backward (losses for every row, dlogits = (softmax - onehot) · scale ·
// mask[n] in place when scale != 0, out-of-range targets allowed on masked-out rows only). losses (N) f32
// (also holds the row maxima in between); stats (2, N) f32 scratch. Host (CPU) tensors; logits f32, bf16
// or f16 (arithmetic in f32, sums in f64).
void vocab_parallel_cross_entropy(const DeviceContext& ctx, const Communicator* tp, TensorView losses,
                                  TensorView logits, TensorView targets, int64_t vocab_start, int64_t vocab_size,
                                  TensorView loss_mask, float scale, TensorView stats);

}  // namespace loom

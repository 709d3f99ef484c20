// The op table: forward/backward pairs every backend implements (CPU is the reference; CUDA mirrors it).
//
// Conventions (the contract in DESIGN.md):
//   - arguments: outputs first, then inputs, then saved state, then sizes/params;
//   - parameter gradients ACCUMULATE (+=) so micro-batches add up; the weight gradients of the matmuls
//     (matmul_backward, grouped_matmul_backward) may instead be stored (GradWrite::kOverwrite) into a
//     buffer known to hold zeros, the step's first write, which skips reading it (see GradWrite);
//   - activation gradients OVERWRITE (=), except the residual stream, which accumulates (+=) — the ops
//     that write into the residual stream (layernorm_backward's dinp) say so;
//   - an empty TensorView means "absent" for optional arguments;
//   - dtypes (mixed precision): activations and the parameters an op reads may be f32, bf16 or f16 (the
//     "compute dtype"; all tensors of one kind in one call share it), arithmetic is f32 inside every op;
//     parameter gradients (dweight, dbias, dwte, ...) may be f32 or the compute dtype and accumulate in
//     that dtype (f32 main grads for --bf16, Megatron's default); statistics (mean, rstd, lse, losses)
//     are always f32; token ids are i32. Ops that only take f32 say so;
//   - results are deterministic and independent of the thread count: reductions use a fixed split
//     of the work that does not depend on how many threads run it.
#pragma once
#include <cstdint>
#include <vector>

#include "loom/core/tensor.h"

namespace loom {

// How an op writes a parameter gradient: kAccumulate adds to what the buffer holds (+=, so micro-batches
// add up); kOverwrite stores the result (=) without reading the buffer. kOverwrite is for a buffer known to
// hold zeros (a step's first write; loom/param/parameter.h's take_grad_write decides), where both give
// the same values (0 + x = x, except that a -0 result stays -0) and kOverwrite saves reading the old values:
// a weight gradient over few rows (an expert's token group, a short micro-batch) is bound by that traffic.
// An empty product (no rows) writes zeros under kOverwrite and leaves the buffer as it is under kAccumulate.
enum class GradWrite { kAccumulate, kOverwrite };

struct AttentionParams {
  int64_t num_heads = 0;     // NH: query heads
  int64_t num_kv_heads = 0;  // NKV: key/value heads (query groups); NH % NKV == 0; NKV == NH is MHA
  int64_t head_dim = 0;      // HS
  float softmax_scale = 0;   // usually 1/sqrt(HS)
  bool causal = true;
  int64_t window = -1;  // sliding window: key j visible to query i iff i - window < j <= i; -1 = unlimited
  // Attention dropout on the softmax probabilities (Megatron's --attention-dropout): probability p of
  // (b, h, i, j) being dropped is decided by dropout_keep(dropout_seed, dropout_stream, index) with
  // index = ((b * NH + h) * T + i) * T + j, so forward, backward and a recomputed forward see the same
  // mask whatever the tiling or thread count, and no mask is stored. Kept probabilities are scaled by
  // 1 / (1 - p). 0 disables.
  float dropout_p = 0;
  uint64_t dropout_seed = 0;
  uint64_t dropout_stream = 0;
};

// One query block against one key/value block of the same sequence (context parallelism: each rank holds
// two chunks of the sequence and the key/value blocks travel round the ring). Positions are global, so
// visibility and the dropout mask do not depend on how the sequence was cut: key j is visible to query i
// iff k_pos[j] <= q_pos[i] (causal), q_pos[i] - window < k_pos[j] (window > 0), and, with segment ids,
// k_segment_ids[b, j] == q_segment_ids[b, i]. The dropout mask index of (b, h, i, j) is
// ((b * NH + h) * seq_len + q_pos[i]) * seq_len + k_pos[j], the non-CP kernel's index with global T, so a
// run cut into blocks drops exactly what the whole-sequence attention_forward drops.
struct AttentionBlock {
  TensorView q_pos;          // (Tq) i32: global position of each query token (on the op's device)
  TensorView k_pos;          // (Tk) i32: global position of each key token
  TensorView q_segment_ids;  // (B, Tq) i32, optional (--reset-attention-mask); given with k_segment_ids
  TensorView k_segment_ids;  // (B, Tk) i32, optional
  int64_t seq_len = 0;       // global T (> every position); used by the dropout mask index only
};

struct AdamWParams {
  float lr = 0;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0;
  int64_t step = 1;         // 1-based step count, for bias correction
  float grad_scale = 1.0f;  // gradients are multiplied by this first (clipping coefficient, 1/loss scale)
  bool zero_grad = false;   // write 0 into the gradient after reading it (saves a separate pass)
};

// torch.optim.SGD as Megatron builds it (--optimizer sgd: dampening 0, no Nesterov): L2 weight decay
// added to the gradient, then the heavy-ball momentum buffer.
struct SgdParams {
  float lr = 0;
  float momentum = 0;       // --sgd-momentum; 0: no momentum buffer
  float weight_decay = 0;
  float grad_scale = 1.0f;  // gradients are multiplied by this first (clipping coefficient, 1/loss scale)
  bool zero_grad = false;   // write 0 into the gradient after reading it
};

// Reductions of an f32 buffer for Megatron-DeepSpeed's --log-optimizer-states-to-tensorboard, in f64.
struct AbsStats {
  double sum_abs = 0;       // Σ|x|
  double max_abs = 0;       // max |x| (0 for an empty buffer; NaN if any element is NaN)
  double sum_sqrt_abs = 0;  // Σ sqrt(|x|)
};

// Gated MLP activations (Megatron's --swiglu, and GeGLU / ReGLU): the fc1 output holds the gate half
// then the up half, [gate (F) | up (F)] per row, as Megatron's fused fc1 is chunked; out = act(gate) · up.
enum class GluKind { kSwiGLU, kGeGLU, kReGLU };  // act = silu | gelu (tanh approximation) | relu

// Rotary position embedding (--position-embedding-type rope) applied to the query and key heads of a
// grouped qkv tensor (layout as attention_forward). The first rotary_dim channels of each head rotate
// (--rotary-percent · HS, even), the rest pass through. Pairs are (c, c + rotary_dim/2) (Megatron and
// Hugging Face Llama's rotate_half layout) or (2c, 2c + 1) when interleaved (--rotary-interleaved).
// cos/sin tables (max_positions, rotary_dim / 2) f32 are built by the caller (frequencies, base and
// Llama-3 scaling are the module's business); position = position_ids[b, t] when given, else t.
struct RopeParams {
  int64_t rotary_dim = 0;
  bool interleaved = false;
};

// Non-virtual interface: each public op checks its arguments once, in backend-neutral code
// (src/backend/op_checks*.cpp: shapes, dtypes, devices, parameter ranges — the rules above), then calls
// the backend's private do_<op> with arguments that are known to be valid. A backend checks only what is
// specific to it (a kernel's size limit, a value it reads from its own memory) and says why.
class OpTable {
 public:
  virtual ~OpTable() = default;

  // Every tensor argument of this table's ops must live on this device.
  Device device() const { return device_; }

  // ---- matmul (linear layer) --------------------------------------------------------------------
  // out (M, N) = inp (M, K) · weight (N, K)^T + bias (N). inp/weight in the compute dtype; out in it or f32;
  // accumulation in f32. Leading dims of inp/out are flattened (inp may be (B, T, K)).
  void matmul_forward(TensorView out, TensorView inp, TensorView weight, TensorView bias) const;
  // dinp (M, K) = dout · weight            (overwrite; skipped when dinp is empty)
  // dweight (N, K) += dout^T · inp        (accumulate, or = with GradWrite::kOverwrite; skipped when empty)
  // dbias (N) += column sums of dout      (accumulate; skipped when empty)
  void matmul_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout, TensorView inp,
                       TensorView weight, GradWrite dweight_write = GradWrite::kAccumulate) const;

  // ---- embedding -------------------------------------------------------------------------------
  // out (B, T, C) = wte[tokens[b, t]] + wpe[pos[b, t]]  (wpe (maxpos, C) optional). tokens i32 (B, T).
  // pos = position_ids (B, T) i32 when given (Megatron's --reset-position-ids restarts them at each
  // document), else t.
  void embedding_forward(TensorView out, TensorView tokens, TensorView wte, TensorView wpe,
                         TensorView position_ids = {}) const;
  // dwte[tokens[b, t]] += dout[b, t]; dwpe[pos[b, t]] += dout[b, t]  (accumulate; dwpe optional)
  void embedding_backward(TensorView dwte, TensorView dwpe, TensorView dout, TensorView tokens,
                          TensorView position_ids = {}) const;

  // ---- layernorm ---------------------------------------------------------------------------------
  // Over the last dim C of inp (N, C): out = (inp - mean) * rstd * weight + bias; saves mean, rstd (N).
  void layernorm_forward(TensorView out, TensorView mean, TensorView rstd, TensorView inp, TensorView weight,
                         TensorView bias, float eps) const;
  // dinp += ... (residual stream: ACCUMULATES), dweight += ..., dbias += ...
  void layernorm_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout, TensorView inp,
                          TensorView weight, TensorView mean, TensorView rstd) const;
  // Fused: residual = a + b, then out = layernorm(residual) (one read of a and b, saves mean/rstd).
  void residual_layernorm_forward(TensorView residual, TensorView out, TensorView mean, TensorView rstd, TensorView a,
                                  TensorView b, TensorView weight, TensorView bias, float eps) const;

  // ---- RMSNorm (--normalization RMSNorm) -----------------------------------------------------------
  // Over the last dim C of inp (N, C): out = inp · rstd · weight, rstd = 1 / sqrt(mean(inp²) + eps);
  // saves rstd (N) f32 (may be empty when no backward follows).
  void rmsnorm_forward(TensorView out, TensorView rstd, TensorView inp, TensorView weight, float eps) const;
  // dinp += ... (residual stream: ACCUMULATES), dweight += ...
  void rmsnorm_backward(TensorView dinp, TensorView dweight, TensorView dout, TensorView inp, TensorView weight,
                        TensorView rstd) const;
  // Fused: residual = a + b, then out = rmsnorm(residual).
  void residual_rmsnorm_forward(TensorView residual, TensorView out, TensorView rstd, TensorView a, TensorView b,
                                TensorView weight, float eps) const;

  // ---- gated MLP and rotary embedding ---------------------------------------------------------------
  // inp (N, 2F) = [gate | up]; out (N, F) = act(gate) · up.
  void glu_forward(TensorView out, TensorView inp, GluKind kind) const;
  // dinp (N, 2F) = [dgate | dup] (overwrite; dinp may alias inp) from dout (N, F) and the forward's inp.
  // out (N, F), when given, also receives act(gate) · up, the bits glu_forward writes (a backward that
  // recomputes the activation for the next layer's weight gradient gets it from the same pass); out must
  // not overlap inp, dinp or dout.
  void glu_backward(TensorView dinp, TensorView inp, TensorView dout, GluKind kind, TensorView out = {}) const;
  // Rotates the q and k heads of qkv (B, T, NKV·(NH/NKV + 2)·HS) in place; v is untouched.
  void rope_forward(TensorView qkv, TensorView cos, TensorView sin, const AttentionParams& p, const RopeParams& r,
                    TensorView position_ids = {}) const;
  // The transpose (inverse rotation) applied in place to the dq and dk heads of dqkv.
  void rope_backward(TensorView dqkv, TensorView cos, TensorView sin, const AttentionParams& p, const RopeParams& r,
                     TensorView position_ids = {}) const;

  // ---- elementwise ----------------------------------------------------------------------------------
  void residual_forward(TensorView out, TensorView a, TensorView b) const;  // out = a + b
  // GeLU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
  void gelu_forward(TensorView out, TensorView inp) const;
  // dinp = gelu'(inp) * dout (overwrite; dinp may alias dout). out, when given, also receives gelu(inp), the
  // bits gelu_forward writes, from the same pass; out must not overlap inp, dinp or dout.
  void gelu_backward(TensorView dinp, TensorView inp, TensorView dout, TensorView out = {}) const;
  void bias_add_forward(TensorView out, TensorView bias) const;  // out (N, C) += bias (C)
  void bias_backward(TensorView dbias, TensorView dout) const;   // dbias (C) += colsum(dout)

  // ---- dropout (Megatron's --hidden-dropout) ---------------------------------------------------------
  // out = inp * keep / (1 - p) with keep[i] = dropout_keep(seed, stream, offset + i) for the flat element
  // index i; out may alias inp. The mask is regenerated, never stored. p == 0 is a copy. offset: where the
  // tensor starts in the mask's index space (a piece of a larger tensor draws that tensor's mask, e.g. a
  // context-parallel rank's chunk of the sequence).
  void dropout_forward(TensorView out, TensorView inp, float p, uint64_t seed, uint64_t stream,
                       uint64_t offset = 0) const;
  // dinp = dout * keep / (1 - p) with the same mask (overwrite; dinp may alias dout).
  void dropout_backward(TensorView dinp, TensorView dout, float p, uint64_t seed, uint64_t stream,
                        uint64_t offset = 0) const;

  // ---- attention core ------------------------------------------------------------------------------
  // qkv (B, T, NKV * (NH/NKV + 2) * HS) in Megatron's grouped layout: for each query group g, the
  // NH/NKV query heads of the group, then its key head, then its value head, each HS wide.
  // out (B, T, NH * HS), head h at columns [h*HS, (h+1)*HS). lse (B, NH, T): log-sum-exp of the scaled
  // scores of each query row, saved for backward. Tiled with online softmax: memory is O(T), never T×T.
  // segment_ids (B, T) i32, optional, non-decreasing along T (Megatron's --reset-attention-mask):
  // key j is visible to query i only when segment_ids[b, j] == segment_ids[b, i] (on top of the
  // causal/window rule), so documents packed in one sequence do not attend to each other.
  void attention_forward(TensorView out, TensorView lse, TensorView qkv, const AttentionParams& p,
                         TensorView segment_ids = {}) const;
  // dqkv (overwrite) from dout, recomputing scores from qkv and lse.
  void attention_backward(TensorView dqkv, TensorView dout, TensorView qkv, TensorView out, TensorView lse,
                          const AttentionParams& p, TensorView segment_ids = {}) const;

  // ---- attention blocks (context parallelism; AttentionBlock above) -------------------------------
  // Layouts: q is a packed qkv tensor (B, Tq, NKV*(NH/NKV+2)*HS) whose query heads are used. kv holds the
  // key/value heads of Tk tokens, either packed the same way (its query heads are ignored) or compact
  // (B, Tk, NKV*2*HS): per group g its key head then its value head (the packed layout with no query
  // heads), as attention_kv_pack makes it. qkv-like inputs share one compute dtype (f32, bf16, f16).
  //
  // out (B, Tq, NH*HS) (f32 or the compute dtype), lse (B, NH, Tq) f32: the attention of the queries over
  // this block's keys only (overwrite). A query row with no visible key gets out 0 and lse -inf.
  void attention_block_forward(TensorView out, TensorView lse, TensorView q, TensorView kv, const AttentionBlock& blk,
                               const AttentionParams& p) const;
  // Folds a block's partial result into the running one, in place: lse' = log(e^lse + e^lse_block),
  // out' = e^(lse - lse') out + e^(lse_block - lse') out_block (f32 math; out, out_block f32 or a 16-bit
  // float; a -inf lse contributes nothing). Shapes as attention_block_forward's out and lse.
  void attention_merge(TensorView out, TensorView lse, TensorView out_block, TensorView lse_block) const;
  // Backward of one block given the FINAL out and lse of the queries (all blocks merged), so that
  // P = exp(s - lse) and D = rowsum(dout * out) are the global ones. ACCUMULATES (the blocks of a ring
  // add up): dq (B, Tq, NH*HS) f32 += dS K; dkv (B, Tk, NKV*2*HS) f32 (compact layout) += [dS^T Q | P^T dO].
  // dout and out (B, Tq, NH*HS) f32 or the compute dtype.
  void attention_block_backward(TensorView dq, TensorView dkv, TensorView dout, TensorView q, TensorView kv,
                                TensorView out, TensorView lse, const AttentionBlock& blk,
                                const AttentionParams& p) const;
  // kv (B, T, NKV*2*HS) = the key and value heads of qkv (B, T, NKV*(NH/NKV+2)*HS), same dtype (overwrite).
  void attention_kv_pack(TensorView kv, TensorView qkv, const AttentionParams& p) const;
  // dqkv (B, T, NKV*(NH/NKV+2)*HS) (overwrite, in its own float dtype, rounded once) = the query-head
  // gradients from dq (B, T, NH*HS) f32 and the key/value-head gradients from dkv (B, T, NKV*2*HS) f32.
  void attention_qkv_grad_unpack(TensorView dqkv, TensorView dq, TensorView dkv, const AttentionParams& p) const;

  // ---- mixture of experts: token permutation and grouped GEMM (loom/nn/moe.h) ----------------------
  // row_id_map (N, E) i32 on the op's device: the row of the expert-grouped ("permuted") buffer that holds
  // token n's copy for expert e, or -1 when token n does not go to expert e. The rows 0..M-1 are a
  // bijection onto the (n, e) pairs with row >= 0 (the router builds it expert-major, token order within an
  // expert: Megatron-Core's permute order). Tokens (N, C) and permuted rows (M, C) share one compute dtype;
  // probs / dprobs (N, E) f32; arithmetic in f32. No atomics: every output row is written by one task that
  // visits its inputs in a fixed order (e = 0..E-1), so results do not depend on threads or launch shape.
  // The CPU backend checks that row_id_map is such a bijection (values in its own memory); the CUDA
  // kernels skip entries outside [0, M) and trust the caller for the rest.
  //
  // out (M, C) (overwrite): out[row_id_map[n, e]] = inp[n].
  void moe_permute_forward(TensorView out, TensorView inp, TensorView row_id_map) const;
  // dinp (N, C) (overwrite) = Σ_e dout[row_id_map[n, e]] over the e with a row, in order of e (0 if none).
  void moe_permute_backward(TensorView dinp, TensorView dout, TensorView row_id_map) const;
  // out (N, C) (overwrite) = Σ_e probs[n, e] · inp[row_id_map[n, e]] (inp (M, C): the experts' outputs),
  // summed in f32 in order of e; a token with no row gets 0.
  void moe_unpermute_forward(TensorView out, TensorView inp, TensorView probs, TensorView row_id_map) const;
  // dinp (M, C) (overwrite): dinp[row_id_map[n, e]] = probs[n, e] · dout[n];
  // dprobs (N, E) f32 (overwrite; skipped when empty) = <dout[n], inp[row_id_map[n, e]]>, 0 where no row.
  void moe_unpermute_backward(TensorView dinp, TensorView dprobs, TensorView dout, TensorView inp, TensorView probs,
                              TensorView row_id_map) const;
  // Grouped GEMM over G contiguous row groups (the experts' token groups): group g is rows
  // [o_g, o_g + group_sizes[g]) of inp (M, K) and out (M, N), o_g = Σ_{h<g} group_sizes[h], Σ = M, and
  //   out[rows_g] = inp[rows_g] · weight[g]^T,  weight (G, N, K).
  // group_sizes: host values (the caller has them from routing). One call runs every group's GEMM with the
  // dtype rules of matmul_forward (no bias); an empty group computes nothing.
  void grouped_matmul_forward(TensorView out, TensorView inp, TensorView weight,
                              const std::vector<int64_t>& group_sizes) const;
  // dinp (M, K) (overwrite; skipped when empty; compute dtype or f32) and dweight (G, N, K) (ACCUMULATE, or
  // = with GradWrite::kOverwrite; skipped when empty), per group as matmul_backward. An empty group adds
  // nothing to its dweight[g] (kAccumulate) or zeroes it (kOverwrite).
  void grouped_matmul_backward(TensorView dinp, TensorView dweight, TensorView dout, TensorView inp, TensorView weight,
                               const std::vector<int64_t>& group_sizes,
                               GradWrite dweight_write = GradWrite::kAccumulate) const;

  // ---- cross-entropy ----------------------------------------------------------------------------
  // logits (N, Vp) f32/bf16/f16 (arithmetic in f32), targets i32 (N), columns >= vocab_size are padding and excluded.
  // losses (N) = logsumexp(logits[n, :V]) - logits[n, target]. When dlogits_scale != 0, the logits
  // buffer is overwritten IN PLACE with dlogits = (softmax - onehot) * dlogits_scale * mask[n]
  // (0 in padded columns): one pass, no second V-wide buffer. loss_mask (N) f32 optional: it scales
  // the gradient only (losses are reported for every row); a row whose mask is 0 may carry an
  // out-of-range target (e.g. -1 padding) and then gets loss 0 and gradient 0. Any other
  // out-of-range target is an error, raised before any work.
  void cross_entropy_forward_backward(TensorView losses, TensorView logits, TensorView targets, int64_t vocab_size,
                                      TensorView loss_mask, float dlogits_scale) const;

  // ---- optimizer and buffer utilities -------------------------------------------------------------
  // PyTorch/apex AdamW (decoupled weight decay) on f32 param, grad, exp_avg m, exp_avg_sq v (f32 only).
  // compute (optional, bf16 or f16, param's numel): also receives the updated param rounded (RNE) to its
  // dtype, as cast(compute, param) after the update would give, in the same pass over param.
  void adamw_update(TensorView param, TensorView grad, TensorView m, TensorView v, const AdamWParams& p,
                    TensorView compute = {}) const;
  // torch.optim.SGD (dampening 0, no Nesterov) on f32 param and grad, with the f32 momentum buffer when
  // p.momentum != 0 (undefined otherwise). Per element, rounding as PyTorch's CPU kernels do:
  //   g = grad * grad_scale;  d = fma(p, wd, g) (wd != 0);  buf = buf * momentum + d;  d = buf;
  //   p = fma(d, -lr, p)
  // A zero buffer reproduces PyTorch's first step (buf = clone(d)) exactly. compute: as for adamw_update.
  void sgd_update(TensorView param, TensorView grad, TensorView momentum_buf, const SgdParams& p,
                  TensorView compute = {}) const;
  // Sum of squares in f64 (for the global gradient norm); deterministic for a given numel. Any float dtype
  // (as are has_inf_or_nan, scale_ and fill_).
  double sum_squares(TensorView x) const;
  // True when x contains an inf or NaN.
  bool has_inf_or_nan(TensorView x) const;
  // Number of elements equal to zero (+0 or -0; NaN is not zero), any float dtype: Megatron's
  // --log-num-zeros-in-grad.
  int64_t count_zeros(TensorView x) const;
  // Σ|x|, max|x| and Σ sqrt|x| of an f32 buffer in f64; deterministic for a given numel (fixed blocks).
  AbsStats abs_stats(TensorView x) const;
  void scale_(TensorView x, float s) const;  // x *= s
  void fill_(TensorView x, float value) const;
  // Converts between float dtypes (f32, bf16, f16, fp8) with round-to-nearest-even.
  void cast(TensorView out, TensorView inp) const;

  // ---- FP8 with per-tensor scaling (Transformer Engine's delayed scaling; loom/fp8/fp8.h) -------------
  // Scales, inverse scales and amaxes are (1) f32 tensors on the op's device, never host values, so a
  // step needs no device-to-host copy. out (fp8 e4m3/e5m2) = saturate(round(inp · scale[0])) with
  // round-to-nearest-even; amax[0] = max(amax[0], max |inp|) — +inf when inp holds a NaN or an inf (an
  // order-safe value for max-reductions across ranks), which the scaling update treats as "keep the
  // scale". inp: f32, bf16 or f16.
  void fp8_quantize(TensorView out, TensorView inp, TensorView scale, TensorView amax) const;
  // out (f32, bf16 or f16) = f32(inp) · scale_inv[0], rounded once to out's dtype.
  void fp8_dequantize(TensorView out, TensorView inp, TensorView scale_inv) const;
  // Delayed scaling for n tensors of one fp8 format. amax_history (L, n) f32, row 0 the amaxes recorded
  // this step; scale, scale_inv (n) f32. Per tensor: amax = max over the L rows (use_max) or row 0
  // (most_recent); if amax > 0 and finite, scale = (fp8_max / amax) / 2^margin (an infinite result —
  // amax far below fp8_max — becomes the largest finite f32), else the scale is kept; scale_inv = 1 /
  // scale. Then the history rolls by one row (row i+1 <- row i, the oldest dropped) and row 0 is zeroed.
  void fp8_update_scaling(TensorView amax_history, TensorView scale, TensorView scale_inv, float fp8_max, int margin,
                          bool use_max) const;
  // FP8 GEMM (the tensor-core "TN" form: both operands K-contiguous):
  //   out (M, N) [+]= (a (M, K) · a_scale_inv[0]) · (b (N, K) · b_scale_inv[0])^T + bias (N)
  // a, b fp8 (E4M3 or E5M2; not both E5M2); scale_inv (1) f32 on the device; bias optional, f32, bf16 or
  // f16 (added in f32); out f32, bf16 or f16. Products and sums in f32, the result rounded once to out's dtype;
  // accumulate: out += result (out's old value added in f32) instead of out = result. Leading dims of a
  // and out are flattened.
  void fp8_gemm(TensorView out, TensorView a, TensorView a_scale_inv, TensorView b, TensorView b_scale_inv,
                TensorView bias, bool accumulate) const;
  // out (C, R) = inp (R, C)^T for 2-D tensors of any dtype (1, 2 or 4 bytes per element; same dtype).
  void transpose(TensorView out, TensorView inp) const;

 protected:
  explicit OpTable(Device device) : device_(device) {}

 private:
  // The backends' computations, in the order above: called only by the public op of the same name, after
  // its checks, with the same arguments (defaults filled in).
  virtual void do_matmul_forward(TensorView out, TensorView inp, TensorView weight, TensorView bias) const = 0;
  virtual void do_matmul_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout,
                                  TensorView inp, TensorView weight, GradWrite dweight_write) const = 0;
  virtual void do_embedding_forward(TensorView out, TensorView tokens, TensorView wte, TensorView wpe,
                                    TensorView position_ids) const = 0;
  virtual void do_embedding_backward(TensorView dwte, TensorView dwpe, TensorView dout, TensorView tokens,
                                     TensorView position_ids) const = 0;
  virtual void do_layernorm_forward(TensorView out, TensorView mean, TensorView rstd, TensorView inp, TensorView weight,
                                    TensorView bias, float eps) const = 0;
  virtual void do_layernorm_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout,
                                     TensorView inp, TensorView weight, TensorView mean, TensorView rstd) const = 0;
  virtual void do_residual_layernorm_forward(TensorView residual, TensorView out, TensorView mean, TensorView rstd,
                                             TensorView a, TensorView b, TensorView weight, TensorView bias,
                                             float eps) const = 0;
  virtual void do_rmsnorm_forward(TensorView out, TensorView rstd, TensorView inp, TensorView weight,
                                  float eps) const = 0;
  virtual void do_rmsnorm_backward(TensorView dinp, TensorView dweight, TensorView dout, TensorView inp,
                                   TensorView weight, TensorView rstd) const = 0;
  virtual void do_residual_rmsnorm_forward(TensorView residual, TensorView out, TensorView rstd, TensorView a,
                                           TensorView b, TensorView weight, float eps) const = 0;
  virtual void do_glu_forward(TensorView out, TensorView inp, GluKind kind) const = 0;
  virtual void do_glu_backward(TensorView dinp, TensorView inp, TensorView dout, GluKind kind,
                               TensorView out) const = 0;
  virtual void do_rope_forward(TensorView qkv, TensorView cos, TensorView sin, const AttentionParams& p,
                               const RopeParams& r, TensorView position_ids) const = 0;
  virtual void do_rope_backward(TensorView dqkv, TensorView cos, TensorView sin, const AttentionParams& p,
                                const RopeParams& r, TensorView position_ids) const = 0;
  virtual void do_residual_forward(TensorView out, TensorView a, TensorView b) const = 0;
  virtual void do_gelu_forward(TensorView out, TensorView inp) const = 0;
  virtual void do_gelu_backward(TensorView dinp, TensorView inp, TensorView dout, TensorView out) const = 0;
  virtual void do_bias_add_forward(TensorView out, TensorView bias) const = 0;
  virtual void do_bias_backward(TensorView dbias, TensorView dout) const = 0;
  virtual void do_dropout_forward(TensorView out, TensorView inp, float p, uint64_t seed, uint64_t stream,
                                  uint64_t offset) const = 0;
  virtual void do_dropout_backward(TensorView dinp, TensorView dout, float p, uint64_t seed, uint64_t stream,
                                   uint64_t offset) const = 0;
  virtual void do_attention_forward(TensorView out, TensorView lse, TensorView qkv, const AttentionParams& p,
                                    TensorView segment_ids) const = 0;
  virtual void do_attention_backward(TensorView dqkv, TensorView dout, TensorView qkv, TensorView out, TensorView lse,
                                     const AttentionParams& p, TensorView segment_ids) const = 0;
  virtual void do_attention_block_forward(TensorView out, TensorView lse, TensorView q, TensorView kv,
                                          const AttentionBlock& blk, const AttentionParams& p) const = 0;
  virtual void do_attention_merge(TensorView out, TensorView lse, TensorView out_block, TensorView lse_block) const = 0;
  virtual void do_attention_block_backward(TensorView dq, TensorView dkv, TensorView dout, TensorView q, TensorView kv,
                                           TensorView out, TensorView lse, const AttentionBlock& blk,
                                           const AttentionParams& p) const = 0;
  virtual void do_attention_kv_pack(TensorView kv, TensorView qkv, const AttentionParams& p) const = 0;
  virtual void do_attention_qkv_grad_unpack(TensorView dqkv, TensorView dq, TensorView dkv,
                                            const AttentionParams& p) const = 0;
  virtual void do_moe_permute_forward(TensorView out, TensorView inp, TensorView row_id_map) const = 0;
  virtual void do_moe_permute_backward(TensorView dinp, TensorView dout, TensorView row_id_map) const = 0;
  virtual void do_moe_unpermute_forward(TensorView out, TensorView inp, TensorView probs,
                                        TensorView row_id_map) const = 0;
  virtual void do_moe_unpermute_backward(TensorView dinp, TensorView dprobs, TensorView dout, TensorView inp,
                                         TensorView probs, TensorView row_id_map) const = 0;
  virtual void do_grouped_matmul_forward(TensorView out, TensorView inp, TensorView weight,
                                         const std::vector<int64_t>& group_sizes) const = 0;
  virtual void do_grouped_matmul_backward(TensorView dinp, TensorView dweight, TensorView dout, TensorView inp,
                                          TensorView weight, const std::vector<int64_t>& group_sizes,
                                          GradWrite dweight_write) const = 0;
  virtual void do_cross_entropy_forward_backward(TensorView losses, TensorView logits, TensorView targets,
                                                 int64_t vocab_size, TensorView loss_mask,
                                                 float dlogits_scale) const = 0;
  virtual void do_adamw_update(TensorView param, TensorView grad, TensorView m, TensorView v, const AdamWParams& p,
                               TensorView compute) const = 0;
  virtual void do_sgd_update(TensorView param, TensorView grad, TensorView momentum_buf, const SgdParams& p,
                             TensorView compute) const = 0;
  virtual double do_sum_squares(TensorView x) const = 0;
  virtual int64_t do_count_zeros(TensorView x) const = 0;
  virtual AbsStats do_abs_stats(TensorView x) const = 0;
  virtual bool do_has_inf_or_nan(TensorView x) const = 0;
  virtual void do_scale_(TensorView x, float s) const = 0;
  virtual void do_fill_(TensorView x, float value) const = 0;
  virtual void do_cast(TensorView out, TensorView inp) const = 0;
  virtual void do_fp8_quantize(TensorView out, TensorView inp, TensorView scale, TensorView amax) const = 0;
  virtual void do_fp8_dequantize(TensorView out, TensorView inp, TensorView scale_inv) const = 0;
  virtual void do_fp8_update_scaling(TensorView amax_history, TensorView scale, TensorView scale_inv, float fp8_max,
                                     int margin, bool use_max) const = 0;
  virtual void do_fp8_gemm(TensorView out, TensorView a, TensorView a_scale_inv, TensorView b, TensorView b_scale_inv,
                           TensorView bias, bool accumulate) const = 0;
  virtual void do_transpose(TensorView out, TensorView inp) const = 0;

  Device device_;
};

}  // namespace loom

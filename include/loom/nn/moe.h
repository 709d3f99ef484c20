// Mixture-of-experts building blocks (single device; expert parallelism and the MoE transformer layer build
// on them): the top-k router with Megatron-Core's score functions, capacity and load-balancing losses, and
// the grouped expert MLP. Token permutation between them is the op table's moe_permute / moe_unpermute
// (loom/backend/ops.h), driven by the router's row_id_map.
//
// Data flow for N tokens (B, T) row-major (token n = b·T + t), E experts, top-k:
//   router.forward(x)            -> probs (N, E) f32, row_id_map (N, E) i32, group sizes (E), aux/z losses
//   moe_permute_forward          -> xp (M, C) expert-grouped rows (expert-major, token order within one)
//   experts.forward(xp, sizes)   -> yp (M, C)
//   moe_unpermute_forward(probs) -> y (N, C) = Σ_e probs[n, e] · yp[row(n, e)]
// and backward in reverse; unpermute's dprobs feeds router.backward, which adds the aux/z-loss gradients.
//
// Routing runs on the host in f64 from the f32 logits (a D2H copy of N·E logits and an H2D copy of the
// maps per call on a GPU; the group sizes are needed on the host by the grouped GEMM anyway, as in
// Megatron-Core's GroupedMLP). Semantics (Megatron-Core moe_utils.topk_softmax_with_capacity and
// router.TopKRouter; docs/models.md "Mixture of experts (building blocks)"):
//   - softmax, not pre-softmax: top-k of the logits, probs = softmax over the k chosen logits (equal to
//     Hugging Face Mixtral's renormalised top-k of the full softmax);
//   - softmax, pre-softmax: probs = the top-k of softmax over all experts (not renormalised); k = 1 with
//     softmax requires pre-softmax (validate(), as Megatron-Core);
//   - sigmoid: s = sigmoid(logits), top-k of s (+ expert bias, for selection only), probs = s / (Σ_k s +
//     1e-20) when k > 1, s when k == 1;
//   - probs *= topk_scaling_factor when it is set (non-zero);
//   - ties in every top-k (experts of a token, tokens of an expert under a capacity) go to the LOWER index;
//   - capacity = ceil(N·k / E · capacity_factor); drop policy "probs" keeps each expert's `capacity`
//     largest probs, "position" its first `capacity` tokens; with pad-to-capacity every expert gets exactly
//     min(capacity, N) rows (padding rows are real tokens with prob 0); capacity > N drops nothing;
//   - aux_loss (Switch): coeff · E / (k · N²) · Σ_e (Σ_n scores[n, e]) · count[e], scores = softmax(logits)
//     (sigmoid: sigmoid / Σ_E sigmoid), count[e] = tokens whose top-k of those scores holds e (before drops);
//   - seq_aux_loss: coeff · mean_b Σ_e (E · count_b[e] / (T · k)) · mean_t scores[b, t, e];
//   - z_loss: coeff · mean_n logsumexp(logits[n])²;
//   - sinkhorn (Megatron-Core's sinkhorn_load_balancing, S-BASE): probs = act(logits) at the chosen
//     experts, act = sigmoid for k = 1 and the softmax over all E otherwise (not renormalised); training
//     chooses each token's top-k of the Sinkhorn-Knopp balanced matrix of exp(logits) over the micro-batch
//     (tolerance 1e-4, no gradient through it), evaluation the top-k of act; no capacity, no aux loss;
//   - the losses' gradients enter backward scaled by aux_grad_scale (Megatron's MoEAuxLossAutoScaler:
//     the main loss's backward scale, loss_scale / num_micro_batches).
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "loom/backend/ops.h"
#include "loom/param/parameter.h"

namespace loom {

enum class MoeScoreFunction { kSoftmax, kSigmoid };         // --moe-router-score-function
enum class MoeLoadBalancing { kAuxLoss, kSeqAuxLoss, kSinkhorn, kNone };  // --moe-router-load-balancing-type
enum class MoeDropPolicy { kProbs, kPosition };               // --moe-token-drop-policy

// Megatron's spellings; a UserError naming the flag otherwise.
MoeScoreFunction parse_moe_score_function(const std::string& s);
MoeLoadBalancing parse_moe_load_balancing(const std::string& s);
const char* moe_load_balancing_name(MoeLoadBalancing b);  // "aux_loss", "seq_aux_loss", "sinkhorn", "none"
MoeDropPolicy parse_moe_drop_policy(const std::string& s);

struct RouterConfig {
  int64_t num_experts = 0;  // --num-experts (E)
  int64_t topk = 2;         // --moe-router-topk (k), 1 <= k <= E
  MoeScoreFunction score_function = MoeScoreFunction::kSoftmax;
  bool pre_softmax = false;          // --moe-router-pre-softmax (softmax before top-k)
  double topk_scaling_factor = 0;    // --moe-router-topk-scaling-factor; 0 = unset
  bool enable_expert_bias = false;   // --moe-router-enable-expert-bias (sigmoid only, as Megatron)
  double bias_update_rate = 1e-3;    // --moe-router-bias-update-rate
  MoeLoadBalancing load_balancing = MoeLoadBalancing::kAuxLoss;
  double aux_loss_coeff = 0;         // --moe-aux-loss-coeff
  double z_loss_coeff = 0;           // --moe-z-loss-coeff (0 = off)
  std::optional<double> capacity_factor;  // --moe-expert-capacity-factor; unset = no token dropping
  MoeDropPolicy drop_policy = MoeDropPolicy::kProbs;  // --moe-token-drop-policy
  bool pad_to_capacity = false;      // --moe-pad-expert-input-to-capacity (needs a capacity factor)
  // UserError naming the flag when a value or combination is invalid.
  void validate() const;
};

// The result of routing N tokens, on the host; the module also puts probs and row_id_map on its device.
struct Routing {
  int64_t N = 0, E = 0, k = 0;
  std::vector<int32_t> topk_idx;     // (N, k) chosen experts, best first (ties: lower index first)
  std::vector<float> topk_probs;     // (N, k) their routing probs (0 where the capacity dropped them)
  std::vector<float> probs;          // (N, E) final routing probs, 0 off the routing map
  std::vector<int32_t> row_id_map;   // (N, E) permuted row of (n, e) or -1 (see ops.h)
  std::vector<int64_t> group_sizes;  // (E) rows per expert after capacity / padding; Σ = M
  std::vector<int64_t> tokens_per_expert;  // (E) the final routing map's column sums (= group_sizes)
  double aux_loss = 0;  // the coefficient-scaled load-balancing loss (0 unless training with a coeff)
  double z_loss = 0;    // the coefficient-scaled z-loss
  int64_t num_rows() const;  // M
};

// Pure host routing of logits (N, E) (row-major f32): the forward semantics above. seq_length: T for
// seq_aux_loss (N must be a multiple); training: compute the aux/z losses. expert_bias (E) or empty.
Routing route_tokens(const RouterConfig& cfg, const float* logits, int64_t N, int64_t seq_length, bool training,
                     const std::vector<float>& expert_bias);
// dlogits (N, E) (overwrite) from dprobs (N, E) (the gradient of Routing::probs) plus, when training, the
// aux- and z-loss gradients scaled by aux_grad_scale.
void route_tokens_backward(const RouterConfig& cfg, const float* logits, const Routing& r, const float* dprobs,
                           int64_t seq_length, bool training, double aux_grad_scale,
                           const std::vector<float>& expert_bias, float* dlogits);

// Megatron's get_updated_expert_bias (aux-loss-free balancing, arXiv:2408.15664): with tokens_per_expert
// already summed over the data/tensor/context-parallel ranks by the caller,
// bias[e] += sign(mean(tokens) - tokens[e]) · rate (f32 arithmetic, sign(0) = 0).
std::vector<float> get_updated_expert_bias(const std::vector<float>& tokens_per_expert,
                                           const std::vector<float>& expert_bias, float update_rate);

// The tokens of one micro-batch spread over several ranks (sequence or context parallelism): routing looks
// across tokens (capacity, the load-balancing losses, the expert-bias counts), so every rank of the group
// routes all of them, identically, and keeps its own rows: the same decisions as a single process.
struct RoutingGroup {
  int64_t num_tokens = 0;             // N: the micro-batch's tokens
  std::vector<int64_t> local_tokens;  // the token index in [0, N) of each local row (N = b·T + t order)
  // Fills all (N, width) (token order) from every rank's local (N_local, width) rows; collective.
  std::function<void(float* all, const float* local, int64_t width)> gather;
};

// The router: a linear gate (E, C) without bias, <prefix>.router.weight (Megatron-Core's
// decoder.layers.N.mlp.router.weight), and the routing above.
class Router {
 public:
  struct Saved {
    std::vector<float> logits;  // (N, E) host f32: the micro-batch's (every rank's rows with a group)
    Routing routing;            // of the micro-batch's N tokens
    // This rank's rows (all of them without a group):
    Tensor probs;               // (N_local, E) f32 on the device
    Tensor row_id_map;          // (N_local, E) i32 on the device: rows of this rank's permutation
    std::vector<int64_t> group_sizes;  // (E) this rank's permuted rows per expert
    const RoutingGroup* group = nullptr;
    int64_t seq_length = 0;
    bool training = false;
  };
  // prefix: the MLP's name, e.g. "decoder.layers.3.mlp".
  Router(ParameterSet& ps, const std::string& prefix, int64_t hidden, const RouterConfig& cfg, float init_std);
  // inp (N, C) (leading dims flattened); seq_length T (token n = b·T + t). training: compute the aux/z
  // losses and count tokens for the expert bias (Megatron does both only with gradients enabled).
  // group: the micro-batch's tokens are spread over ranks (null: all are local); it must outlive backward.
  void forward(const DeviceContext& ctx, Saved& s, TensorView inp, int64_t seq_length, bool training,
               const RoutingGroup* group = nullptr) const;
  // dinp (N_local, C) (overwrite) and the gate's weight gradient (accumulate) from dprobs (N_local, E) f32 (the
  // gradient of s.probs; may live on the host or the device), with the aux/z-loss gradients scaled by
  // aux_grad_scale.
  void backward(const DeviceContext& ctx, TensorView dinp, TensorView dprobs, TensorView inp, const Saved& s,
                double aux_grad_scale) const;
  const RouterConfig& config() const { return cfg_; }
  Parameter& weight() const { return *weight_; }
  // The expert bias (a non-trainable f32 buffer, zeros) and the tokens counted since the last update (the
  // caller counts them: Routing::tokens_per_expert of each training micro-batch, once).
  std::vector<float>& expert_bias() { return expert_bias_; }
  const std::vector<float>& expert_bias() const { return expert_bias_; }
  std::vector<float>& local_tokens_per_expert() const { return local_tokens_; }
  // expert_bias = get_updated_expert_bias(tokens_per_expert, expert_bias, rate); zeroes the local counts.
  void update_expert_bias(const std::vector<float>& tokens_per_expert);

 private:
  RouterConfig cfg_;
  int64_t hidden_;
  Parameter* weight_;
  std::vector<float> expert_bias_;
  mutable std::vector<float> local_tokens_;
};

// E expert MLPs over the expert-grouped rows, run as grouped GEMMs. Parameters, per expert e, in
// Transformer Engine's GroupedLinear naming that Megatron-Core's TEGroupedMLP uses
// (<prefix>.experts.linear_fc1.weight<e> (F1, C) with F1 = 2F gated [gate | up] or F, and
// <prefix>.experts.linear_fc2.weight<e> (C, F)), no biases. The E weights of each layer are declared one
// after the other, so they lie contiguously and one (E, ·, ·) view feeds the grouped GEMM.
class GroupedMLP {
 public:
  struct Saved {
    Tensor fc1_out;  // (M, F1)
    Tensor act_out;  // (M, F)
  };
  // gated: SwiGLU (--swiglu); else GeLU (tanh). fc2_init_std: Megatron's output-layer init. Expert
  // parallelism: this rank holds num_experts experts from global index first_expert on; expert-tensor
  // parallelism: each expert's FFN dimension split over etp ranks (fc1's rows — a gated fc1's gate and up
  // rows — and fc2's columns, as column/row-parallel linears), this rank holding shard etp_rank.
  GroupedMLP(ParameterSet& ps, const std::string& prefix, int64_t num_experts, int64_t hidden, int64_t ffn_hidden,
             bool gated, float init_std, float fc2_init_std, int64_t first_expert = 0, int etp = 1, int etp_rank = 0);
  // inp, out (M, C) expert-grouped rows; group_sizes (E) on the host.
  void forward(const DeviceContext& ctx, TensorView out, Saved& s, TensorView inp,
               const std::vector<int64_t>& group_sizes) const;
  // dinp (M, C) overwritten; weight gradients accumulate.
  void backward(const DeviceContext& ctx, TensorView dinp, TensorView dout, TensorView inp, const Saved& s,
                const std::vector<int64_t>& group_sizes) const;
  // The (E, F1, C) / (E, C, F) views of the experts' compute weights and gradients.
  TensorView fc1_weight() const;
  TensorView fc2_weight() const;
  TensorView fc1_grad() const;
  TensorView fc2_grad() const;
  const std::vector<Parameter*>& fc1() const { return fc1_; }
  const std::vector<Parameter*>& fc2() const { return fc2_; }

 private:
  int64_t E_, C_, F_;  // local experts, hidden, this rank's FFN width
  bool gated_;
  std::vector<Parameter*> fc1_, fc2_;
};

}  // namespace loom

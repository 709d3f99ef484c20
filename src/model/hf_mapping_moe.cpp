// Hugging Face <-> Loom layouts of the sparse MoE blocks (see hf_mapping.h): which HF family a
// mixture-of-experts config exports to, and the router / shared-expert / expert tensors of one MoE layer.
// Every expert is a gated MLP like Llama's, so each mapping is a plain copy or a [gate | up] stack.
//
// Routing each family reproduces (loom/nn/moe.h has Loom's semantics):
//   Mixtral      softmax over all experts, top-k, renormalised     = Loom softmax without pre-softmax
//   Qwen-MoE     norm_topk_prob true: the same; false: the top-k of the softmax as they are
//                                                                    = --moe-router-pre-softmax
//   Qwen2-MoE    + one shared expert scaled by sigmoid(x . shared_expert_gate)
//                                                                    = --moe-shared-expert-intermediate-size S
//                                                                      --moe-shared-expert-gate
//   Qwen3-MoE    + per-head RMSNorm of q and k before RoPE            = --qk-layernorm (RMSNorm)
#include <algorithm>

#include "model/hf_mapping_impl.h"

namespace loom::hf_detail {

HfFamily moe_family_for(const GPTConfig& c) {
  const RouterConfig& r = c.moe.router;
  const char* cannot = "; cannot convert to Hugging Face Mixtral, Qwen2-MoE or Qwen3-MoE";
  if (r.score_function != MoeScoreFunction::kSoftmax)
    user_error("--moe-router-score-function sigmoid: Mixtral and Qwen-MoE route by a softmax", cannot);
  if (r.topk_scaling_factor != 0)
    user_error("--moe-router-topk-scaling-factor: Mixtral and Qwen-MoE do not scale the routing probabilities",
               cannot);
  if (r.enable_expert_bias)
    user_error("--moe-router-enable-expert-bias: Mixtral and Qwen-MoE routers have no expert bias", cannot);
  if (r.load_balancing == MoeLoadBalancing::kSinkhorn)
    user_error("--moe-router-load-balancing-type sinkhorn: its probabilities (sigmoid for top-1, an unnormalised "
               "softmax otherwise) are not Mixtral's or Qwen-MoE's routing", cannot);
  const bool dense_layers = std::find(c.moe.layer_pattern.begin(), c.moe.layer_pattern.end(), 0) !=
                            c.moe.layer_pattern.end();
  const char* qwen_window = "--window-size: Qwen-MoE's sliding window covers only some layers (max_window_layers), "
                            "so Loom writes none";
  if (c.moe.shared_expert_intermediate_size > 0) {  // Qwen2-MoE
    if (!c.moe.shared_expert_gate)
      user_error("shared experts without --moe-shared-expert-gate: Qwen2-MoE's shared expert is always gated "
                 "(shared_expert_gate)", cannot);
    if (c.qk_layernorm)
      user_error("--qk-layernorm with shared experts: Qwen2-MoE has no q/k norms, Qwen3-MoE no shared expert", cannot);
    if (!c.add_qkv_bias)
      user_error("shared experts without --add-qkv-bias: Qwen2-MoE's q/k/v projections have biases (always, before "
                 "transformers 5)", cannot);
    if (c.window_size_left >= 0) user_error(qwen_window, cannot);
    return HfFamily::kQwen2Moe;
  }
  if (c.qk_layernorm) {  // Qwen3-MoE
    if (c.window_size_left >= 0) user_error(qwen_window, cannot);
    return HfFamily::kQwen3Moe;
  }
  if (r.pre_softmax)
    user_error("--moe-router-pre-softmax without shared experts or --qk-layernorm: Mixtral renormalises the top-k "
               "probabilities (Loom's softmax routing without --moe-router-pre-softmax); Qwen-MoE's "
               "norm_topk_prob false is pre-softmax, but Qwen2-MoE has a shared expert and Qwen3-MoE q/k norms",
               cannot);
  if (dense_layers)
    user_error("--moe-layer-freq with dense layers: Mixtral has a MoE block in every layer (Qwen-MoE's "
               "mlp_only_layers need a shared expert or --qk-layernorm to tell the family)", cannot);
  if (c.qkv_bias()) user_error("--add-qkv-bias: Mixtral's attention has no biases", cannot);
  return HfFamily::kMixtral;
}

void add_moe_mlp(HfLayout& l, const GPTConfig& c, HfFamily family, const std::string& L, const std::string& H) {
  const int64_t C = c.hidden_size, E = c.moe.num_experts, F = c.moe_ffn_hidden_size(),
                S = c.moe.shared_expert_intermediate_size;
  const bool mixtral = family == HfFamily::kMixtral;
  const std::string M = H + (mixtral ? "block_sparse_moe." : "mlp.");
  l.params.push_back(one_to_one(L + "mlp.router.weight", {E, C}, M + "gate.weight", {E, C}));
  if (S > 0) {
    l.params.push_back(gated_fc1(L + "mlp.shared_experts.linear_fc1.weight", S, C, M + "shared_expert.gate_proj.weight",
                                 M + "shared_expert.up_proj.weight"));
    l.params.push_back(one_to_one(L + "mlp.shared_experts.linear_fc2.weight", {C, S},
                                  M + "shared_expert.down_proj.weight", {C, S}));
    if (c.moe.shared_expert_gate)
      l.params.push_back(
          one_to_one(L + "mlp.shared_experts.gate_weight", {1, C}, M + "shared_expert_gate.weight", {1, C}));
  }
  // Mixtral's expert e: w1 = gate, w3 = up, w2 = down; Qwen's: gate_proj, up_proj, down_proj.
  const auto expert = [&](int64_t e, const char* mixtral_name, const char* qwen_name) {
    return M + "experts." + std::to_string(e) + "." + (mixtral ? mixtral_name : qwen_name) + ".weight";
  };
  for (int64_t e = 0; e < E; ++e)
    l.params.push_back(gated_fc1(L + "mlp.experts.linear_fc1.weight" + std::to_string(e), F, C,
                                 expert(e, "w1", "gate_proj"), expert(e, "w3", "up_proj")));
  for (int64_t e = 0; e < E; ++e)
    l.params.push_back(one_to_one(L + "mlp.experts.linear_fc2.weight" + std::to_string(e), {C, F},
                                  expert(e, "w2", "down_proj"), {C, F}));
}

}  // namespace loom::hf_detail

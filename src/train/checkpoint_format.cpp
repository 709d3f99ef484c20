#include "train/checkpoint_format.h"

#include "loom/core/check.h"
#include "loom/core/file_io.h"

namespace loom {

using nlohmann::json;

json model_config_json(const GPTConfig& m) {
  // A dense model's MoE fields at their defaults, whatever --moe-* flags the run had (they do nothing).
  const MoeConfig dense;
  const MoeConfig& moe = m.is_moe() ? m.moe : dense;
  json pattern = nullptr;
  if (m.is_moe()) {
    pattern = json::array();
    for (int64_t l = 0; l < m.num_layers; ++l) pattern.push_back(m.is_moe_layer(l) ? 1 : 0);
  }
  json j = {{"num_layers", m.num_layers},
          {"hidden_size", m.hidden_size},
          {"num_attention_heads", m.num_attention_heads},
          {"max_position_embeddings", m.max_position_embeddings},
          {"vocab_size", m.vocab_size},
          {"padded_vocab_size", m.padded_vocab_size},
          {"ffn_hidden_size", m.ffn_hidden_size()},
          {"layernorm_epsilon", m.layernorm_epsilon},
          {"init_method_std", m.init_method_std},
          {"hidden_dropout", m.hidden_dropout},
          {"attention_dropout", m.attention_dropout},
          {"normalization", norm_kind_name(m.normalization)},
          {"activation", mlp_activation_name(m.activation)},
          {"kv_channels", m.head_dim()},
          {"num_query_groups", m.num_kv_heads()},
          {"add_bias_linear", m.add_bias_linear},
          {"add_qkv_bias", m.add_qkv_bias},
          {"untie_embeddings_and_output_weights", m.untie_embeddings_and_output_weights},
          {"position_embedding_type", position_embedding_type_name(m.position_embedding_type)},
          {"rotary_base", m.rotary_base},
          {"rotary_percent", m.rotary_percent},
          {"rotary_interleaved", m.rotary_interleaved},
          {"use_rope_scaling", m.use_rope_scaling},
          {"rope_scaling_factor", m.rope_scaling_factor},
          {"window_size", m.window_size_left < 0 ? json(nullptr) : json::array({m.window_size_left, 0})},
          {"qk_layernorm", m.qk_layernorm},
          {"num_experts", moe.num_experts},
          {"moe_ffn_hidden_size", m.is_moe() ? m.moe_ffn_hidden_size() : 0},
          {"moe_router_topk", m.is_moe() ? moe.router.topk : 0},
          {"moe_shared_expert_intermediate_size", moe.shared_expert_intermediate_size},
          {"moe_shared_expert_gate", moe.shared_expert_gate},
          {"moe_layer_pattern", pattern},
          {"moe_router_score_function",
           moe.router.score_function == MoeScoreFunction::kSigmoid ? "sigmoid" : "softmax"},
          {"moe_router_pre_softmax", moe.router.pre_softmax},
          {"moe_router_topk_scaling_factor", moe.router.topk_scaling_factor},
          {"moe_router_enable_expert_bias", moe.router.enable_expert_bias},
          {"moe_router_load_balancing_type", moe_load_balancing_name(moe.router.load_balancing)},
          {"moe_aux_loss_coeff", moe.router.aux_loss_coeff}};
  return j;
}

json read_json_file(const std::string& path, const char* what) {
  const std::string text = read_file(path, what);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    user_error(what, " ", path, " is not valid JSON: ", e.what());
  }
}

}  // namespace loom

// The metadata.json format of Loom checkpoints, shared by the trainer (save/load) and model_io (convert,
// generate): the format tag and version, and the model_config object (every architecture field, under
// Megatron-style names; a reader treats a missing field as the GPT-2 default, a missing MoE field as a dense
// model). Private to the train layer.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "loom/model/gpt.h"

namespace loom {

inline constexpr const char* kCheckpointFormat = "loom-checkpoint";
inline constexpr int kCheckpointFormatVersion = 1;

// Mixture-of-experts fields (written for every model; a dense one has num_experts 0 and the others at their
// defaults): num_experts, moe_ffn_hidden_size (resolved), moe_router_topk, moe_shared_expert_intermediate_size,
// moe_shared_expert_gate, moe_layer_pattern (one 0/1 per layer; null when dense), moe_router_score_function,
// moe_router_pre_softmax, moe_router_topk_scaling_factor, moe_router_enable_expert_bias, and
// moe_aux_loss_coeff (not architecture: kept so that an HF export writes router_aux_loss_coef back).
nlohmann::json model_config_json(const GPTConfig& m);

// Reads and parses a JSON file; UserError naming `what` and the path when it cannot be read or parsed.
nlohmann::json read_json_file(const std::string& path, const char* what);

}  // namespace loom

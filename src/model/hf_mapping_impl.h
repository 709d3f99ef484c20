// Private to the model layer: the row-gather builders hf_mapping.cpp (GPT-2, the Llama layer) and
// hf_mapping_moe.cpp (the sparse MoE blocks of Mixtral and Qwen-MoE, and which of those families a MoE
// config exports to) share.
#pragma once
#include <string>
#include <vector>

#include "loom/model/hf_mapping.h"

namespace loom::hf_detail {

inline std::string layer_name(int64_t i) { return "decoder.layers." + std::to_string(i) + "."; }

// Rows 0..stacked-1 in order, then -1 (zero padding) up to loom_rows.
std::vector<int64_t> identity_rows(int64_t stacked, int64_t loom_rows);

// A Loom parameter that is one HF tensor (transposed: a Conv1D stored (in, out)).
HfParamMap one_to_one(std::string loom_name, Shape loom_shape, std::string hf_name, Shape hf_shape,
                      bool transposed = false);

// A gated MLP's fc1 (2F, C) = [gate | up] from two HF (F, C) tensors, with the note the summary prints.
HfParamMap gated_fc1(std::string loom_name, int64_t F, int64_t C, const std::string& gate, const std::string& up);

// The MoE family of a mixture-of-experts config (Mixtral, Qwen2-MoE or Qwen3-MoE); UserError naming the
// flag that has no counterpart in any of them.
HfFamily moe_family_for(const GPTConfig& c);

// Appends layer `layer`'s sparse MoE block in GPTModel's parameter order (router, shared experts and their
// gate, every expert's fc1, every expert's fc2). L: the Loom layer prefix ("decoder.layers.N."), H: the
// HF one ("model.layers.N.").
void add_moe_mlp(HfLayout& l, const GPTConfig& c, HfFamily family, const std::string& L, const std::string& H);

}  // namespace loom::hf_detail

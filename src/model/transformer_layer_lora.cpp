// LoRA placement (see ModelOptions::lora, loom/nn/lora.h): which adapters a layer gets, where their rows
// land in Loom's fused layouts, and how tensor parallelism splits them.
//   linear_qkv (column-parallel, grouped layout: per query group its NH/NKV query heads, its key head, its
//     value head): a whole adapter's B is split like the weight; q_proj / k_proj / v_proj adapt the query /
//     key / value columns of this rank's groups, their B's rows in head order (this rank: a contiguous
//     range, as its query groups are).
//   linear_fc1 (column-parallel; gated: [gate_r | up_r] on rank r): whole, or gate_proj / up_proj on the
//     two halves.
//   linear_proj, linear_fc2 (row-parallel): A split like the weight's input columns, B whole.
// Column-parallel adapters' A gradients are partial sums over the TP group (Parameter::sequence_parallel).
// lora_site() is the one description of those rows: the layers place adapters with it, and the train
// layer merges adapters into whole weights (and maps them to PEFT's modules) with it.
#include <algorithm>

#include "model/transformer_layer.h"

namespace loom {

namespace {

struct TargetName {
  const char* name;
  std::vector<LoraTarget> targets;  // empty: resolved against the model (up_proj)
};

}  // namespace

const char* lora_target_name(LoraTarget t) {
  switch (t) {
    case LoraTarget::kQkv: return "linear_qkv";
    case LoraTarget::kProj: return "linear_proj";
    case LoraTarget::kFc1: return "linear_fc1";
    case LoraTarget::kFc2: return "linear_fc2";
    case LoraTarget::kQ: return "q_proj";
    case LoraTarget::kK: return "k_proj";
    case LoraTarget::kV: return "v_proj";
    case LoraTarget::kGate: return "gate_proj";
    case LoraTarget::kUp: return "up_proj";
  }
  return "?";
}

std::vector<LoraTarget> parse_lora_targets(const std::vector<std::string>& names, const GPTConfig& cfg) {
  using T = LoraTarget;
  const std::vector<TargetName> known = {
      {"linear_qkv", {T::kQkv}},        {"linear_proj", {T::kProj}},     {"linear_fc1", {T::kFc1}},
      {"linear_fc2", {T::kFc2}},        {"q_proj", {T::kQ}},             {"k_proj", {T::kK}},
      {"v_proj", {T::kV}},              {"o_proj", {T::kProj}},          {"gate_proj", {T::kGate}},
      {"up_proj", {}},                  {"down_proj", {T::kFc2}},        {"attention_qkv", {T::kQkv}},
      {"attention_dense", {T::kProj}},  {"mlp_fc1", {T::kFc1}},          {"mlp_fc2", {T::kFc2}},
      {"attention", {T::kQkv, T::kProj}}, {"mlp", {T::kFc1, T::kFc2}},
      {"all", {T::kQkv, T::kProj, T::kFc1, T::kFc2}},
  };
  if (names.empty())
    user_error("--lora-target-modules is empty; name at least one of linear_qkv, linear_proj, linear_fc1, "
               "linear_fc2 (or PEFT's q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)");
  std::vector<T> out;
  for (const std::string& n : names) {
    const auto it = std::find_if(known.begin(), known.end(), [&](const TargetName& k) { return n == k.name; });
    if (it == known.end())
      user_error("--lora-target-modules: unknown module '", n, "'; valid: linear_qkv, linear_proj, linear_fc1, "
                 "linear_fc2 (Megatron), q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (PEFT), "
                 "attention_qkv, attention_dense, mlp_fc1, mlp_fc2, attention, mlp, all (NeMo)");
    std::vector<T> ts = it->targets;
    if (ts.empty()) ts = {cfg.gated_mlp() ? T::kUp : T::kFc1};
    if (n == "gate_proj" && !cfg.gated_mlp())
      user_error("--lora-target-modules gate_proj: this model's MLP is not gated (--swiglu), so linear_fc1 has no "
                 "gate half; use linear_fc1 (or up_proj)");
    for (T t : ts)
      if (std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
  }
  std::sort(out.begin(), out.end());
  auto has = [&](T t) { return std::find(out.begin(), out.end(), t) != out.end(); };
  for (T slice : {T::kQ, T::kK, T::kV})
    if (has(T::kQkv) && has(slice))
      user_error("--lora-target-modules: linear_qkv and ", lora_target_name(slice), " would both adapt the ",
                 lora_target_name(slice), " columns of linear_qkv; name either the whole layer or its slices");
  for (T slice : {T::kGate, T::kUp})
    if (has(T::kFc1) && has(slice))
      user_error("--lora-target-modules: linear_fc1 and ", lora_target_name(slice), " would both adapt the ",
                 lora_target_name(slice), " half of linear_fc1; name either the whole layer or its halves");
  return out;
}

LoraSite lora_site(const GPTConfig& c, LoraTarget t, int tp) {
  const int64_t C = c.hidden_size, HS = c.head_dim(), NH = c.num_attention_heads, NKV = c.num_kv_heads();
  const int64_t F = c.ffn_hidden_size(), qpg = NH / NKV, W = (qpg + 2) * HS;
  LOOM_CHECK(tp >= 1 && NKV % tp == 0 && F % tp == 0, "[lora_site] TP ", tp, " does not divide ", NKV,
             " query groups and FFN ", F);
  const int64_t groups = NKV / tp;
  // The rows of this rank's query groups that hold part `offset`, `width` of each group.
  auto group_rows = [&](int64_t offset, int64_t width) {
    std::vector<ShardRange> rows;
    for (int64_t g = 0; g < groups; ++g) rows.push_back({g * W + offset, width});
    return rows;
  };
  const std::string qkv = "self_attention.linear_qkv", fc1 = "mlp.linear_fc1";
  switch (t) {
    case LoraTarget::kQkv: return {qkv, qkv, C, c.qkv_size(), {}};
    case LoraTarget::kQ: return {"self_attention.q_proj", qkv, C, NH * HS, group_rows(0, qpg * HS)};
    case LoraTarget::kK: return {"self_attention.k_proj", qkv, C, NKV * HS, group_rows(qpg * HS, HS)};
    case LoraTarget::kV: return {"self_attention.v_proj", qkv, C, NKV * HS, group_rows((qpg + 1) * HS, HS)};
    case LoraTarget::kFc1: return {fc1, fc1, C, (c.gated_mlp() ? 2 : 1) * F, {}};
    case LoraTarget::kGate:
    case LoraTarget::kUp: {
      LOOM_CHECK(c.gated_mlp(), "[lora_site] ", lora_target_name(t), " needs a gated MLP");
      const bool gate = t == LoraTarget::kGate;
      return {gate ? "mlp.gate_proj" : "mlp.up_proj", fc1, C, F, {{gate ? 0 : F / tp, F / tp}}};
    }
    case LoraTarget::kProj: return {"self_attention.linear_proj", "self_attention.linear_proj", NH * HS, C, {}};
    case LoraTarget::kFc2: return {"mlp.linear_fc2", "mlp.linear_fc2", F, C, {}};
  }
  LOOM_CHECK(false, "[lora_site] unknown LoRA target");
  return {};
}

void TransformerLayer::add_lora(ParameterSet& ps, const GPTConfig& c, int64_t i, const TpRegion& region,
                                const LoraOptions& lora) {
  const int tp = region.size(), r = region.rank();
  LOOM_CHECK(!moe, "[TransformerLayer] LoRA adapters on a mixture-of-experts layer are not built");
  const int64_t C = c.hidden_size;
  const LoraConfig& cfg = lora.config;
  auto split = [&](int64_t n) { return tp == 1 ? std::vector<ShardRange>{} : std::vector<ShardRange>{even_shard(n, tp, r)}; };
  auto column = [&](ColumnParallelLinear& lin, const LoraSite& s, std::vector<ShardRange> b_shard, int64_t layer_out) {
    LoraAdapter& a = lin.add_lora(ps, prefix(i) + s.module,
                                  {C, s.out, std::nullopt, std::move(b_shard), s.rows, layer_out}, cfg);
    a.a().sequence_parallel = tp > 1;  // dA sums every rank's partial dh
  };
  auto row = [&](RowParallelLinear& lin, const LoraSite& s) {
    LoraPlacement p = LoraPlacement::whole(s.in, C);
    if (tp > 1) p.a_shard = even_shard(s.in, tp, r);
    lin.add_lora(ps, prefix(i) + s.module, p, cfg);
  };
  const int64_t qkv_local = c.qkv_size() / tp, fc1_local = (c.gated_mlp() ? 2 : 1) * c.ffn_hidden_size() / tp;
  for (LoraTarget t : lora.targets) {
    const LoraSite s = lora_site(c, t, tp);
    switch (t) {
      case LoraTarget::kQkv:
      case LoraTarget::kQ:
      case LoraTarget::kK:
      case LoraTarget::kV: column(qkv, s, split(s.out), qkv_local); break;
      case LoraTarget::kFc1:
        column(*fc1, s, tp == 1 ? std::vector<ShardRange>{} : fc1_shard(c, tp, r), fc1_local);
        break;
      case LoraTarget::kGate:
      case LoraTarget::kUp: column(*fc1, s, split(s.out), fc1_local); break;
      case LoraTarget::kProj: row(proj, s); break;
      case LoraTarget::kFc2: row(*fc2, s); break;
    }
  }
}

}  // namespace loom

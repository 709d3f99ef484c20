// `loom calc` for mixture-of-experts models: the expert layout's validation, where a MoE layer's
// parameters live (routed experts over EP x ETP, the router and shared experts with the dense layer's TP
// split), the expert-data-parallel group ZeRO shards the experts' states over, and a MoE layer's own
// activation buffers. compute_calc (calc.cpp) folds these into its figures; docs/calc.md, "Mixture of
// experts", states them.
#include <algorithm>
#include <cmath>

#include "loom/core/check.h"
#include "train/calc_impl.h"

namespace loom::calc_detail {

namespace {

int resolved_etp(const ParallelConfig& p) {
  return p.expert_tensor_parallel_size == 0 ? p.tensor_model_parallel_size : p.expert_tensor_parallel_size;
}

}  // namespace

int64_t moe_layers_in(const GPTConfig& m, int64_t first, int64_t count) {
  int64_t n = 0;
  for (int64_t l = first; l < first + count; ++l) n += m.is_moe_layer(l) ? 1 : 0;
  return n;
}

void validate_moe_calc(CalcInput& in, const TrainConfig& cfg) {
  const ParallelConfig& p = in.parallel;
  const int t = p.tensor_model_parallel_size, ep = p.expert_model_parallel_size, etp = resolved_etp(p);
  const GPTConfig& m = in.model;
  if (ep < 1) user_error("--expert-model-parallel-size must be >= 1, got ", ep);
  if (!m.is_moe()) {
    if (ep != 1) user_error("--expert-model-parallel-size ", ep, " needs --num-experts (mixture-of-experts layers)");
    if (p.expert_tensor_parallel_size != 0 && p.expert_tensor_parallel_size != t)
      user_error("--expert-tensor-parallel-size ", p.expert_tensor_parallel_size,
                 " needs --num-experts (mixture-of-experts layers)");
    return;
  }
  if (m.moe.num_experts % ep != 0)
    user_error("--num-experts (", m.moe.num_experts, ") must be divisible by --expert-model-parallel-size (", ep, ")");
  const int64_t emp = int64_t(etp) * ep * p.pipeline_model_parallel_size;
  if (in.num_gpus % emp != 0)
    user_error("--num-gpus (", in.num_gpus, ") must be divisible by --expert-tensor-parallel-size (", etp,
               ") x --expert-model-parallel-size (", ep, ") x --pipeline-model-parallel-size (",
               p.pipeline_model_parallel_size, ") = ", emp, " (Megatron's expert grid)");
  if (m.moe_ffn_hidden_size() % etp != 0)
    user_error("--moe-ffn-hidden-size (", m.moe_ffn_hidden_size(), ") must be divisible by "
               "--expert-tensor-parallel-size (", etp, ")");
  if (m.moe.shared_expert_intermediate_size % t != 0)
    user_error("--moe-shared-expert-intermediate-size (", m.moe.shared_expert_intermediate_size,
               ") must be divisible by --tensor-model-parallel-size (", t, ")");
  // A layout `loom train` refuses (config.cpp) is a note here, not an error: the figures are still given.
  if (t > 1 && !in.sequence_parallel && !(etp == t && ep == 1))
    in.notes.push_back("--tensor-model-parallel-size > 1 with expert parallelism or an --expert-tensor-parallel-size "
                       "other than TP needs --sequence-parallel in `loom train` (each rank routes its own tokens)");
  if (cfg.lora.enabled())
    user_error("--lora-rank with --num-experts: LoRA adapters on experts are not built (as `loom train`); "
               "fine-tune MoE models in full");
  if (!cfg.precision.fp8_format.empty())
    in.notes.push_back("--fp8-format with --num-experts: `loom train` runs the expert GEMMs in BF16 (no FP8 path yet)");
}

void moe_figures(const CalcInput& in, int64_t L_stage, CalcReport& r) {
  const GPTConfig& m = in.model;
  if (!m.is_moe()) return;
  const ParallelConfig& p = in.parallel;
  const int t = p.tensor_model_parallel_size, pp = p.pipeline_model_parallel_size, c = p.context_parallel_size;
  const int64_t C = m.hidden_size, E = m.moe.num_experts, k = m.moe.router.topk, F = m.moe_ffn_hidden_size(),
                S = m.moe.shared_expert_intermediate_size, gate = m.gated_mlp() ? 2 : 1;
  CalcReport::Moe o;
  o.active_params = m.num_active_parameters();
  const int64_t expert = C * gate * F + F * C;  // one routed expert: fc1 (F1, C) + fc2 (C, F)
  o.expert_params = m.num_moe_layers() * E * expert;
  o.ep = p.expert_model_parallel_size;
  o.etp = resolved_etp(p);
  o.expert_dp = in.num_gpus / (int64_t(o.etp) * o.ep * pp);
  o.layers_first_stage = moe_layers_in(m, 0, L_stage);
  o.layers_last_stage = moe_layers_in(m, m.num_layers - L_stage, L_stage);
  // Router (E, C) and the shared gate (1, C) are whole on every TP rank; the shared experts are a
  // column/row-parallel MLP like the dense one.
  o.layer_shared_per_rank = E * C + (C * gate * S + S * C) / t + (S > 0 && m.moe.shared_expert_gate ? C : 0);
  o.layer_experts_per_rank = E / o.ep * (expert / o.etp);
  o.experts_first_stage = o.layers_first_stage * o.layer_experts_per_rank;
  o.experts_last_stage = o.layers_last_stage * o.layer_experts_per_rank;

  // Activations of one MoE layer, one micro-batch, on one rank (the buffers MoeLayerSaved keeps). The micro-
  // batch's N tokens are routed together (capacity counts them all); this rank holds n of them.
  const bool b16 = is_16bit(in.precision), sp = in.sequence_parallel && t > 1;
  const int64_t cb = b16 ? 2 : 4;
  const int64_t N = in.seq_length / c * in.micro_batch_size;
  o.tokens = sp ? N / t : N;
  int64_t rows_mb = N * k;
  if (const auto& cf = m.moe.router.capacity_factor) {
    const int64_t capacity = int64_t(std::ceil(double(N * k) / double(E) * *cf));
    rows_mb = m.moe.router.pad_to_capacity ? E * std::min(capacity, N) : std::min(rows_mb, E * capacity);
  }
  o.rows = rows_mb * o.tokens / N;
  o.rows_move = o.ep > 1 || (o.etp > 1 && sp);
  const double M = double(o.rows), n = double(o.tokens), h = double(C);
  // Permuted rows xp and the experts' output (+ the rows received and sent back when they move), the
  // experts' fc1 output and activation (their FFN / ETP), the router's probabilities (f32) and row map
  // (i32), and the shared experts' fc1 output (all N tokens under SP), output (f32 gate).
  o.layer_bytes = double(cb) * M * (2.0 * h + double(gate * F + F) / double(o.etp)) +
                  (o.rows_move ? 2.0 * double(cb) * M * h : 0.0) + 8.0 * n * double(E) +
                  (S > 0 ? double(cb) * (double(N) * double(gate * S) / double(t) + n * h) +
                               (m.moe.shared_expert_gate ? 4.0 * n : 0.0)
                         : 0.0);
  const double sbh = double(N) * h;
  o.dense_mlp_bytes = (b16 ? 1.0 : 2.0) * 16.0 * sbh / double(t);

  // A single process keeps the buffers of every MoE layer it does not recompute, and of the group it is
  // recomputing.
  const std::string& g = in.recompute.granularity;
  const int64_t L = m.num_layers;
  if (g != "full") {
    o.loom_layers = m.num_moe_layers();
  } else {
    const int64_t nr = std::min(*in.recompute.num_layers, L);
    if (in.recompute.method == "uniform") {
      for (int64_t first = 0; first < L; first += nr)
        o.loom_layers = std::max(o.loom_layers, moe_layers_in(m, first, std::min(nr, L - first)));
    } else {
      o.loom_layers = moe_layers_in(m, nr, L - nr) + (moe_layers_in(m, 0, nr) > 0 ? 1 : 0);
    }
  }
  r.moe = o;
}

}  // namespace loom::calc_detail

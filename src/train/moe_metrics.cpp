// Mixture of experts in the training loop: the router figures of a step (Megatron's load_balancing_loss and
// z_loss without their coefficients, mean over MoE layers; per-expert token counts; load imbalance) and
// the aux-loss-free expert-bias update. Every rank of a micro-batch's token group routes all of its tokens,
// so the figures are reduced over the data-parallel replicas (mean / sum) and the pipeline stages (each
// holds its own layers) only.
#include <algorithm>

#include "loom/parallel/host_collectives.h"
#include "train/moe_metrics.h"

namespace loom {


StepOutcome::Moe collect_moe_figures(TrainingRun& run) {
  StepOutcome::Moe out;
  const GPTConfig& m = run.cfg.model;
  if (!m.is_moe()) return out;
  const int64_t L = m.num_layers, E = m.moe.num_experts;
  // Per layer: [lb, z, tokens (E)], zero where this rank holds no such MoE layer.
  std::vector<float> v(size_t(L * (2 + E)), 0.0f);
  for (GPTModel* c : run.models()) {
    for (const MoeLayerStats& s : c->moe_stats()) {
      if (s.micro_batches == 0) continue;
      float* row = &v[size_t(s.layer * (2 + E))];
      row[0] = float(s.load_balancing_loss / double(s.micro_batches));
      row[1] = float(s.z_loss / double(s.micro_batches));
      for (int64_t e = 0; e < E; ++e) row[2 + e] = float(s.tokens_per_expert[size_t(e)]);
    }
    c->reset_moe_stats();
  }
  all_reduce_host(*run.ctx, run.ps->dp(), v.data(), int64_t(v.size()));
  all_reduce_host(*run.ctx, run.ps->pp(), v.data(), int64_t(v.size()));
  const double dp = double(run.ps->dp_size());
  const RouterConfig& rc = m.moe.router;
  double lb = 0, z = 0;
  out.present = true;
  out.load_imbalance = 0;
  for (int64_t l = 0; l < L; ++l) {
    if (!m.is_moe_layer(l)) continue;
    const float* row = &v[size_t(l * (2 + E))];
    out.layers.push_back(l);
    out.layer_lb.push_back(double(row[0]) / dp);
    out.layer_z.push_back(double(row[1]) / dp);
    lb += out.layer_lb.back();
    z += out.layer_z.back();
    std::vector<double> t(row + 2, row + 2 + E);
    double sum = 0, mx = 0;
    for (double x : t) {
      sum += x;
      mx = std::max(mx, x);
    }
    if (sum > 0) out.load_imbalance = std::max(out.load_imbalance, mx / (sum / double(E)));
    out.tokens.push_back(std::move(t));
  }
  const double n = double(out.layers.size());
  if (rc.aux_loss_coeff != 0 && rc.load_balancing != MoeLoadBalancing::kNone) out.load_balancing_loss = lb / n;
  if (rc.z_loss_coeff != 0) out.z_loss = z / n;
  return out;
}

void update_expert_biases(TrainingRun& run) {
  if (!run.cfg.model.is_moe() || !run.cfg.model.moe.router.enable_expert_bias) return;
  for (GPTModel* c : run.models())
    c->update_expert_bias([&](std::vector<float>& counts) {
      all_reduce_host(*run.ctx, run.ps->dp(), counts.data(), int64_t(counts.size()));
    });
}

}  // namespace loom

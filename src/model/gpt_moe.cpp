// GPTModel's mixture-of-experts pieces outside the layers: the routing group of a micro-batch spread over
// sequence- and context-parallel ranks, the router statistics, and the expert-bias update.
#include "loom/parallel/host_collectives.h"
#include "model/gpt_impl.h"

namespace loom {

std::unique_ptr<RoutingGroup> GPTModel::make_routing_group(int64_t B, int64_t T) const {
  if (!cfg_.is_moe()) return nullptr;
  const ModelParallel& mp = opts_.parallel;
  const int TP = mp.tp_size(), CP = mp.cp_size();
  const bool sp = mp.sequence_parallel && TP > 1;
  if (!sp && CP == 1) return nullptr;
  const Communicator* comm = sp && CP > 1 ? mp.tp_cp : sp ? mp.tp : mp.cp;
  LOOM_CHECK(comm != nullptr && comm->size() == (sp ? TP : 1) * CP, "[GPTModel] MoE routing over ",
             (sp ? TP : 1) * CP, " sequence/context-parallel ranks needs ModelParallel::",
             sp && CP > 1 ? "tp_cp" : sp ? "tp" : "cp", " of that size");
  const int64_t Tl = T / CP, rows = B * Tl, Nl = sp ? rows / TP : rows, Tc = Tl / 2;
  // The micro-batch token (b·T + t) of local row j of the member at (tp, cp).
  auto tokens_of = [&](int tp, int cp) {
    std::vector<int64_t> out(static_cast<size_t>(Nl));
    for (int64_t j = 0; j < Nl; ++j) {
      const int64_t row = (sp ? int64_t(tp) * Nl : 0) + j, b = row / Tl, tl = row % Tl;
      const int64_t t = CP == 1 ? tl : tl < Tc ? int64_t(cp) * Tc + tl : int64_t(2 * CP - 1 - cp) * Tc + (tl - Tc);
      out[size_t(j)] = b * T + t;
    }
    return out;
  };
  auto g = std::make_unique<RoutingGroup>();
  g->num_tokens = B * T;
  g->local_tokens = tokens_of(sp ? mp.tp_rank() : 0, mp.cp_rank());
  std::vector<int64_t> order;  // the tokens of the gathered rows, member by member
  for (int q = 0; q < comm->size(); ++q) {
    const std::vector<int64_t> t = sp ? tokens_of(q % TP, q / TP) : tokens_of(0, q);
    order.insert(order.end(), t.begin(), t.end());
  }
  const DeviceContext& ctx = ctx_;
  g->gather = [comm, order = std::move(order), Nl, &ctx](float* all, const float* local, int64_t width) {
    std::vector<float> host(size_t(int64_t(comm->size()) * Nl * width));
    all_gather_host(ctx, *comm, host.data(), local, Nl * width, DType::kF32);
    for (size_t r = 0; r < order.size(); ++r)
      std::copy_n(&host[r * size_t(width)], width, &all[size_t(order[r] * width)]);
  };
  return g;
}

std::vector<MoeLayerStats> GPTModel::moe_stats() const {
  std::vector<MoeLayerStats> out;
  for (const auto& L : layers_)
    if (L->moe) out.push_back(L->moe->stats());
  return out;
}

void GPTModel::reset_moe_stats() {
  for (const auto& L : layers_)
    if (L->moe) {
      MoeLayerStats& s = L->moe->stats();
      s.load_balancing_loss = s.z_loss = 0;
      s.micro_batches = 0;
      std::fill(s.tokens_per_expert.begin(), s.tokens_per_expert.end(), 0.0);
    }
}

void GPTModel::update_expert_bias(const std::function<void(std::vector<float>&)>& sum) {
  for (const auto& L : layers_) {
    if (!L->moe || !L->moe->router.config().enable_expert_bias) continue;
    Router& r = L->moe->router;
    std::vector<float> counts = r.local_tokens_per_expert();
    sum(counts);
    r.update_expert_bias(counts);
  }
}

std::vector<std::pair<std::string, std::vector<float>*>> GPTModel::expert_biases() {
  std::vector<std::pair<std::string, std::vector<float>*>> out;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const auto& L = layers_[l];
    if (L->moe && L->moe->router.config().enable_expert_bias)
      out.emplace_back(TransformerLayer::prefix(opts_.parallel.first_layer + int64_t(l)) + "mlp.router.expert_bias",
                       &L->moe->router.expert_bias());
  }
  return out;
}

}  // namespace loom

// ParallelState: this process's place in the rank grid, built once at start-up and immutable after.
// Megatron's order "tp-cp-ep-dp-pp" (TP fastest-varying, so a TP group is adjacent ranks on one node):
//   rank = tp_rank + TP·(cp_rank + CP·(dp_rank + DP·pp_rank))      (the dense layers' grid)
// Groups (each a Communicator over the ranks that share every other coordinate):
//   tp       tensor-model-parallel      ranks differing in tp_rank only
//   cp       context-parallel           cp_rank only
//   dp       data-parallel              dp_rank only
//   dp_cp    data-parallel with context ranks differing in (dp_rank, cp_rank): the replicas of every
//                                       parameter, over which gradients are reduced
//   pp       pipeline-model-parallel    pp_rank only (stage s talks to s ± 1 through it)
//   mp       model-parallel             ranks differing in (tp_rank, pp_rank): together they hold one full
//                                       model once (gradient norm, loss-scale overflow check)
//   embedding first and last pipeline stage (same other coordinates): the tied word embedding's gradient
//                                       is summed over it; size 1 when PP = 1
//   world    every rank
//
// The expert grid (mixture-of-experts layers; Megatron-Core's second RankGenerator in
// initialize_model_parallel: tp = ETP, ep = EP, dp = EDP, pp = PP, cp = 1, the same order). The same world
// is cut again, with the pipeline stages unchanged:
//   rank = etp_rank + ETP·(ep_rank + EP·(edp_rank + EDP·pp_rank)),   EDP = world / (ETP·EP·PP)
// so TP·CP·DP ranks of a stage are re-read as ETP·EP·EDP (EP may span what is CP or DP in the dense grid).
//   ep         expert-model-parallel                 ep_rank only: the experts are split over it (the
//                                                    token dispatcher's all-to-all)
//   etp        expert-tensor-parallel                etp_rank only: each expert's weights are split over it
//   etp_ep     expert-tensor-and-model-parallel      (etp_rank, ep_rank)
//   expert_dp  expert-data-parallel                  edp_rank only: the replicas of an expert's weights,
//                                                    over which expert gradients are reduced
//   expert_mp  expert-tensor-model-pipeline-parallel (etp_rank, ep_rank, pp_rank): holds every expert once
// With EP = 1 and ETP = TP (the defaults) the expert groups coincide with dense ones and are those same
// communicators (ep: a one-rank group; etp, etp_ep: tp; expert_dp: dp_cp; expert_mp: mp), so a run
// without expert parallelism creates no extra communicators.
#pragma once
#include <chrono>
#include <memory>
#include <string>

#include "loom/dist/communicator.h"

namespace loom {

struct ParallelConfig {
  int tensor_model_parallel_size = 1;    // --tensor-model-parallel-size
  int pipeline_model_parallel_size = 1;  // --pipeline-model-parallel-size
  int context_parallel_size = 1;         // --context-parallel-size
  int expert_model_parallel_size = 1;    // --expert-model-parallel-size (EP)
  // --expert-tensor-parallel-size (ETP); 0: the same as tensor_model_parallel_size (Megatron's default).
  int expert_tensor_parallel_size = 0;
};

class ParallelState {
 public:
  // Builds the groups over `world` (collective: every rank of world calls it with the same cfg). Throws
  // UserError naming the flags for impossible layouts (world size not divisible by TP·PP·CP or by
  // ETP·EP·PP, sizes < 1).
  static std::unique_ptr<ParallelState> create(const ParallelConfig& cfg, std::unique_ptr<Communicator> world);
  // The single-process state (every group is the self group); the layout must multiply to world_size 1
  // unless world_size > 1 is given only to validate (then no groups are usable: for `loom calc`).
  static std::unique_ptr<ParallelState> create(const ParallelConfig& cfg, int world_size, int rank);

  int world_size() const { return world_size_; }
  int rank() const { return rank_; }
  int tp_size() const { return cfg_.tensor_model_parallel_size; }
  int pp_size() const { return cfg_.pipeline_model_parallel_size; }
  int cp_size() const { return cfg_.context_parallel_size; }
  int dp_size() const { return dp_size_; }
  int tp_rank() const { return rank_ % tp_size(); }
  int cp_rank() const { return (rank_ / tp_size()) % cp_size(); }
  int dp_rank() const { return (rank_ / (tp_size() * cp_size())) % dp_size_; }
  int pp_rank() const { return rank_ / (tp_size() * cp_size() * dp_size_); }
  bool is_first_rank() const { return rank_ == 0; }
  bool is_last_rank() const { return rank_ == world_size_ - 1; }
  bool is_pipeline_first_stage() const { return pp_rank() == 0; }
  bool is_pipeline_last_stage() const { return pp_rank() == pp_size() - 1; }
  // The global rank at grid coordinates (tp, cp, dp, pp).
  int rank_of(int tp, int cp, int dp, int pp) const { return tp + tp_size() * (cp + cp_size() * (dp + dp_size_ * pp)); }

  // The expert grid (pp_rank is the same in both grids).
  int ep_size() const { return cfg_.expert_model_parallel_size; }
  int etp_size() const { return etp_size_; }
  int expert_dp_size() const { return expert_dp_size_; }
  int etp_rank() const { return rank_ % etp_size_; }
  int ep_rank() const { return (rank_ / etp_size_) % ep_size(); }
  int expert_dp_rank() const { return (rank_ / (etp_size_ * ep_size())) % expert_dp_size_; }
  // The global rank at expert-grid coordinates (etp, ep, edp, pp).
  int expert_rank_of(int etp, int ep, int edp, int pp) const {
    return etp + etp_size_ * (ep + ep_size() * (edp + expert_dp_size_ * pp));
  }

  const Communicator& world() const { return *world_; }
  const Communicator& tp() const { return *tp_; }
  const Communicator& cp() const { return *cp_; }
  const Communicator& dp() const { return *dp_; }
  const Communicator& dp_cp() const { return *dp_cp_; }
  const Communicator& pp() const { return *pp_; }
  const Communicator& mp() const { return *mp_; }
  const Communicator& embedding() const { return *embedding_; }
  const Communicator& ep() const { return *ep_view_; }
  const Communicator& etp() const { return *etp_view_; }
  // The tensor x context-parallel group (tp fastest), when TP > 1 and CP > 1; else the one of them that is
  // larger (a one-rank group when both are 1).
  const Communicator& tp_cp() const { return tp_cp_ ? *tp_cp_ : cp_size() > 1 ? *cp_ : *tp_; }
  const Communicator& etp_ep() const { return *etp_ep_view_; }
  const Communicator& expert_dp() const { return *expert_dp_view_; }
  const Communicator& expert_mp() const { return *expert_mp_view_; }
  // Kept for callers written before the grid existed: all ranks (a global norm over world must then
  // not count replicas twice).
  const Communicator& model_and_dp() const { return *world_; }

 private:
  // Points the expert views at the dense groups they coincide with (EP = 1, ETP = TP; `ep` is then
  // ep_, a one-rank group) or at the expert groups.
  void link_expert_views();

  ParallelConfig cfg_;
  int world_size_ = 1, rank_ = 0, dp_size_ = 1, etp_size_ = 1, expert_dp_size_ = 1;
  std::unique_ptr<Communicator> world_, tp_, cp_, dp_, dp_cp_, pp_, mp_, embedding_;
  std::unique_ptr<Communicator> tp_cp_;  // only when TP > 1 and CP > 1
  std::unique_ptr<Communicator> ep_, etp_, etp_ep_, expert_dp_, expert_mp_;  // etp_..: only when they differ
  const Communicator *ep_view_ = nullptr, *etp_view_ = nullptr, *etp_ep_view_ = nullptr, *expert_dp_view_ = nullptr,
                     *expert_mp_view_ = nullptr;
};

}  // namespace loom

// ParallelState: this process's place in the rank grid, built once at start-up and immutable after.
// Megatron's order "tp-cp-ep-dp-pp" (TP fastest-varying, so a TP group is adjacent ranks on one node):
//   rank = tp_rank + TP·(cp_rank + CP·(dp_rank + DP·pp_rank))      (expert parallelism: size 1 for now)
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
};

class ParallelState {
 public:
  // Builds the groups over `world` (collective: every rank of world calls it with the same cfg). Throws
  // UserError naming the flags for impossible layouts (world size not divisible by TP·PP·CP, sizes < 1).
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

  const Communicator& world() const { return *world_; }
  const Communicator& tp() const { return *tp_; }
  const Communicator& cp() const { return *cp_; }
  const Communicator& dp() const { return *dp_; }
  const Communicator& dp_cp() const { return *dp_cp_; }
  const Communicator& pp() const { return *pp_; }
  const Communicator& mp() const { return *mp_; }
  const Communicator& embedding() const { return *embedding_; }
  // Kept for callers written before the grid existed: all ranks (a global norm over world must then
  // not count replicas twice).
  const Communicator& model_and_dp() const { return *world_; }

 private:
  ParallelConfig cfg_;
  int world_size_ = 1, rank_ = 0, dp_size_ = 1;
  std::unique_ptr<Communicator> world_, tp_, cp_, dp_, dp_cp_, pp_, mp_, embedding_;
};

}  // namespace loom

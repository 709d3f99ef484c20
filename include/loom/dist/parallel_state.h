// ParallelState: this process's place in the rank grid, built once at start-up and immutable after.
// Megatron's order "tp-cp-ep-dp-pp" (TP fastest-varying). This build stage runs one process, so every
// group is the self group; the grid arithmetic is already here so that layouts validate the same way.
#pragma once
#include <memory>

#include "loom/dist/communicator.h"

namespace loom {

struct ParallelConfig {
  int tensor_model_parallel_size = 1;    // --tensor-model-parallel-size
  int pipeline_model_parallel_size = 1;  // --pipeline-model-parallel-size
  int context_parallel_size = 1;         // --context-parallel-size
};

class ParallelState {
 public:
  // Builds the groups for `world_size` processes; this rank is `rank`. Throws UserError for impossible layouts.
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

  const Communicator& world() const { return *world_; }
  const Communicator& tp() const { return *tp_; }
  const Communicator& dp() const { return *dp_; }
  // All ranks that hold a replica or shard of the model state that a global norm must cover.
  const Communicator& model_and_dp() const { return *world_; }

 private:
  ParallelConfig cfg_;
  int world_size_ = 1, rank_ = 0, dp_size_ = 1;
  std::unique_ptr<Communicator> world_, tp_, dp_;
};

}  // namespace loom

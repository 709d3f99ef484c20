#include "loom/dist/parallel_state.h"

namespace loom {

std::unique_ptr<ParallelState> ParallelState::create(const ParallelConfig& cfg, int world_size, int rank) {
  auto ps = std::unique_ptr<ParallelState>(new ParallelState());
  ps->cfg_ = cfg;
  ps->world_size_ = world_size;
  ps->rank_ = rank;
  const int mp = cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size * cfg.context_parallel_size;
  if (cfg.tensor_model_parallel_size < 1 || cfg.pipeline_model_parallel_size < 1 || cfg.context_parallel_size < 1)
    user_error("--tensor-model-parallel-size, --pipeline-model-parallel-size and --context-parallel-size must be >= 1");
  if (world_size % mp != 0)
    user_error("world size ", world_size, " is not divisible by tensor (", cfg.tensor_model_parallel_size,
               ") x pipeline (", cfg.pipeline_model_parallel_size, ") x context (", cfg.context_parallel_size,
               ") parallel sizes = ", mp);
  ps->dp_size_ = world_size / mp;
  if (world_size != 1)
    user_error("this build runs a single process (world size 1); got world size ", world_size,
               ". Multi-process training arrives with the MPI communicator");
  ps->world_ = make_self_communicator("world");
  ps->tp_ = make_self_communicator("tensor-model-parallel");
  ps->dp_ = make_self_communicator("data-parallel");
  return ps;
}

}  // namespace loom

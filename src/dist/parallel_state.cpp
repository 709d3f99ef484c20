// ParallelState: validation of the layout and the groups, each built by splitting the world
// communicator by the coordinates its members share.
#include "loom/dist/parallel_state.h"

namespace loom {

namespace {

int validate_layout(const ParallelConfig& cfg, int world_size) {
  if (cfg.tensor_model_parallel_size < 1)
    user_error("--tensor-model-parallel-size must be >= 1, got ", cfg.tensor_model_parallel_size);
  if (cfg.pipeline_model_parallel_size < 1)
    user_error("--pipeline-model-parallel-size must be >= 1, got ", cfg.pipeline_model_parallel_size);
  if (cfg.context_parallel_size < 1)
    user_error("--context-parallel-size must be >= 1, got ", cfg.context_parallel_size);
  const int mp = cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size * cfg.context_parallel_size;
  if (world_size % mp != 0)
    user_error("world size ", world_size, " is not divisible by --tensor-model-parallel-size (",
               cfg.tensor_model_parallel_size, ") x --pipeline-model-parallel-size (", cfg.pipeline_model_parallel_size,
               ") x --context-parallel-size (", cfg.context_parallel_size, ") = ", mp,
               "; launch a multiple of ", mp, " processes or change the sizes");
  return world_size / mp;
}

}  // namespace

std::unique_ptr<ParallelState> ParallelState::create(const ParallelConfig& cfg, int world_size, int rank) {
  auto ps = std::unique_ptr<ParallelState>(new ParallelState());
  ps->cfg_ = cfg;
  ps->world_size_ = world_size;
  ps->rank_ = rank;
  ps->dp_size_ = validate_layout(cfg, world_size);
  if (world_size != 1) return ps;  // validation only (loom calc): no usable groups
  for (auto* g : {&ps->world_, &ps->tp_, &ps->cp_, &ps->dp_, &ps->dp_cp_, &ps->pp_, &ps->mp_, &ps->embedding_})
    *g = make_self_communicator("world");
  ps->tp_ = make_self_communicator("tensor-model-parallel");
  ps->cp_ = make_self_communicator("context-parallel");
  ps->dp_ = make_self_communicator("data-parallel");
  ps->dp_cp_ = make_self_communicator("data-parallel (with context-parallel)");
  ps->pp_ = make_self_communicator("pipeline-model-parallel");
  ps->mp_ = make_self_communicator("model-parallel");
  ps->embedding_ = make_self_communicator("embedding");
  return ps;
}

std::unique_ptr<ParallelState> ParallelState::create(const ParallelConfig& cfg, std::unique_ptr<Communicator> world) {
  auto ps = std::unique_ptr<ParallelState>(new ParallelState());
  ps->cfg_ = cfg;
  ps->world_size_ = world->size();
  ps->rank_ = world->rank();
  ps->dp_size_ = validate_layout(cfg, ps->world_size_);
  const int tp = ps->tp_rank(), cp = ps->cp_rank(), dp = ps->dp_rank(), pp = ps->pp_rank();
  const int TP = ps->tp_size(), CP = ps->cp_size(), DP = ps->dp_size_, PP = ps->pp_size();
  // A group is the set of ranks sharing the coordinates in its color; key orders members by the rest.
  const Communicator& w = *world;
  ps->tp_ = w.split(cp + CP * (dp + DP * pp), tp, "tensor-model-parallel");
  ps->cp_ = w.split(tp + TP * (dp + DP * pp), cp, "context-parallel");
  ps->dp_ = w.split(tp + TP * (cp + CP * pp), dp, "data-parallel");
  ps->dp_cp_ = w.split(tp + TP * pp, cp + CP * dp, "data-parallel (with context-parallel)");
  ps->pp_ = w.split(tp + TP * (cp + CP * dp), pp, "pipeline-model-parallel");
  ps->mp_ = w.split(cp + CP * dp, tp + TP * pp, "model-parallel");
  // First and last stage of each pipeline (one rank per pipeline when PP = 1).
  const bool in_embedding = pp == 0 || pp == PP - 1;
  ps->embedding_ = w.split(in_embedding ? tp + TP * (cp + CP * dp) : -1, pp, "embedding");
  if (!ps->embedding_) ps->embedding_ = make_self_communicator("embedding (not a member)", ps->rank_);
  ps->world_ = std::move(world);
  return ps;
}

}  // namespace loom

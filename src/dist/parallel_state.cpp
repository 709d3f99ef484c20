// ParallelState: validation of the layout and the groups, each built by splitting the world
// communicator by the coordinates its members share. The expert groups follow Megatron-Core's expert
// RankGenerator (parallel_state.initialize_model_parallel): the same world re-read as ETP·EP·EDP·PP in
// the order tp-ep-dp-pp; they are only created when EP > 1 or ETP != TP (otherwise they are dense groups).
#include "loom/dist/parallel_state.h"

namespace loom {

namespace {

int resolved_etp(const ParallelConfig& cfg) {
  return cfg.expert_tensor_parallel_size == 0 ? cfg.tensor_model_parallel_size : cfg.expert_tensor_parallel_size;
}

// Returns the data-parallel size; checks the expert grid too (Megatron: world_size must be divisible by
// expert_tensor_parallel_size x expert_model_parallel_size x pipeline_model_parallel_size).
int validate_layout(const ParallelConfig& cfg, int world_size) {
  if (cfg.tensor_model_parallel_size < 1)
    user_error("--tensor-model-parallel-size must be >= 1, got ", cfg.tensor_model_parallel_size);
  if (cfg.pipeline_model_parallel_size < 1)
    user_error("--pipeline-model-parallel-size must be >= 1, got ", cfg.pipeline_model_parallel_size);
  if (cfg.context_parallel_size < 1)
    user_error("--context-parallel-size must be >= 1, got ", cfg.context_parallel_size);
  if (cfg.expert_model_parallel_size < 1)
    user_error("--expert-model-parallel-size must be >= 1, got ", cfg.expert_model_parallel_size);
  if (cfg.expert_tensor_parallel_size < 0)
    user_error("--expert-tensor-parallel-size must be >= 1 (or left unset: the tensor-model-parallel size), got ",
               cfg.expert_tensor_parallel_size);
  const int mp = cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size * cfg.context_parallel_size;
  if (world_size % mp != 0)
    user_error("world size ", world_size, " is not divisible by --tensor-model-parallel-size (",
               cfg.tensor_model_parallel_size, ") x --pipeline-model-parallel-size (", cfg.pipeline_model_parallel_size,
               ") x --context-parallel-size (", cfg.context_parallel_size, ") = ", mp,
               "; launch a multiple of ", mp, " processes or change the sizes");
  const int etp = resolved_etp(cfg);
  const int emp = etp * cfg.expert_model_parallel_size * cfg.pipeline_model_parallel_size;
  if (world_size % emp != 0)
    user_error("world size ", world_size, " is not divisible by --expert-tensor-parallel-size (", etp,
               cfg.expert_tensor_parallel_size == 0 ? ", the tensor-model-parallel size" : "",
               ") x --expert-model-parallel-size (", cfg.expert_model_parallel_size,
               ") x --pipeline-model-parallel-size (", cfg.pipeline_model_parallel_size, ") = ", emp,
               "; the expert grid needs ETP x EP to divide the ", world_size / cfg.pipeline_model_parallel_size,
               " ranks of a pipeline stage");
  return world_size / mp;
}

}  // namespace

void ParallelState::link_expert_views() {
  const bool dense = ep_size() == 1 && etp_size_ == tp_size();
  ep_view_ = ep_.get();
  etp_view_ = dense ? tp_.get() : etp_.get();
  etp_ep_view_ = dense ? tp_.get() : etp_ep_.get();
  expert_dp_view_ = dense ? dp_cp_.get() : expert_dp_.get();
  expert_mp_view_ = dense ? mp_.get() : expert_mp_.get();
}

std::unique_ptr<ParallelState> ParallelState::create(const ParallelConfig& cfg, int world_size, int rank) {
  auto ps = std::unique_ptr<ParallelState>(new ParallelState());
  ps->cfg_ = cfg;
  ps->world_size_ = world_size;
  ps->rank_ = rank;
  ps->dp_size_ = validate_layout(cfg, world_size);
  ps->etp_size_ = resolved_etp(cfg);
  ps->expert_dp_size_ = world_size / (ps->etp_size_ * cfg.expert_model_parallel_size * cfg.pipeline_model_parallel_size);
  if (world_size != 1) return ps;  // validation only (loom calc): no usable groups
  ps->world_ = make_self_communicator("world");
  ps->tp_ = make_self_communicator("tensor-model-parallel");
  ps->cp_ = make_self_communicator("context-parallel");
  ps->dp_ = make_self_communicator("data-parallel");
  ps->dp_cp_ = make_self_communicator("data-parallel (with context-parallel)");
  ps->pp_ = make_self_communicator("pipeline-model-parallel");
  ps->mp_ = make_self_communicator("model-parallel");
  ps->embedding_ = make_self_communicator("embedding");
  ps->ep_ = make_self_communicator("expert-model-parallel");
  ps->link_expert_views();  // a world of one has EP = ETP = TP = 1: every expert group is a dense one
  return ps;
}

std::unique_ptr<ParallelState> ParallelState::create(const ParallelConfig& cfg, std::unique_ptr<Communicator> world) {
  auto ps = std::unique_ptr<ParallelState>(new ParallelState());
  ps->cfg_ = cfg;
  ps->world_size_ = world->size();
  ps->rank_ = world->rank();
  ps->dp_size_ = validate_layout(cfg, ps->world_size_);
  ps->etp_size_ = resolved_etp(cfg);
  ps->expert_dp_size_ =
      ps->world_size_ / (ps->etp_size_ * cfg.expert_model_parallel_size * cfg.pipeline_model_parallel_size);
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
  // Tensor x context parallel (MoE routing over a micro-batch's tokens with SP and CP): only when both split.
  if (TP > 1 && CP > 1) ps->tp_cp_ = w.split(dp + DP * pp, tp + TP * cp, "tensor-and-context-parallel");
  // First and last stage of each pipeline (one rank per pipeline when PP = 1).
  const bool in_embedding = pp == 0 || pp == PP - 1;
  ps->embedding_ = w.split(in_embedding ? tp + TP * (cp + CP * dp) : -1, pp, "embedding");
  if (!ps->embedding_) ps->embedding_ = make_self_communicator("embedding (not a member)", ps->rank_);

  // The expert grid. Members are ordered as Megatron's generate_masked_orthogonal_rank_groups lists
  // them: by the masked coordinates, the first of the order fastest, which is ascending global rank.
  const int ETP = ps->etp_size_, EP = ps->ep_size(), EDP = ps->expert_dp_size_;
  const int etp = ps->etp_rank(), ep = ps->ep_rank(), edp = ps->expert_dp_rank();
  if (EP == 1 && ETP == TP) {
    ps->ep_ = make_self_communicator("expert-model-parallel", ps->rank_);
  } else {
    ps->ep_ = w.split(etp + ETP * (edp + EDP * pp), ep, "expert-model-parallel");
    ps->etp_ = w.split(ep + EP * (edp + EDP * pp), etp, "expert-tensor-parallel");
    ps->etp_ep_ = w.split(edp + EDP * pp, etp + ETP * ep, "expert-tensor-and-model-parallel");
    ps->expert_dp_ = w.split(etp + ETP * (ep + EP * pp), edp, "expert-data-parallel");
    ps->expert_mp_ = w.split(edp, etp + ETP * (ep + EP * pp), "expert-tensor-model-pipeline-parallel");
  }
  ps->link_expert_views();
  ps->world_ = std::move(world);
  return ps;
}

}  // namespace loom

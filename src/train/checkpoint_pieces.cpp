// Checkpoint pieces of a training run: owners on save, targets on load (see checkpoint_pieces.h).
#include "train/checkpoint_pieces.h"

#include <utility>

namespace loom {

namespace {

// The piece of optimizer-owned state `s` (its flat range of the parameter's box) under `name`.
TensorPiece state_piece(const StateShard& s, const std::string& name, TensorView v) {
  TensorPiece t = param_box(*s.param, name);
  t.flat_begin = s.begin;
  t.flat_end = s.end;
  t.data = v;
  return t;
}

}  // namespace

bool saves_checkpoint_piece(const ParallelState& ps, const Parameter& p, bool sharded) {
  if (p.tied_embedding_copy) return false;
  if (p.expert) {
    if (p.shard.empty() && ps.etp_rank() != 0) return false;
    return sharded || ps.expert_dp_rank() == 0;
  }
  if (p.shard.empty() && ps.tp_rank() != 0) return false;
  return sharded || (ps.dp_rank() == 0 && ps.cp_rank() == 0);
}

TensorPiece param_box(const Parameter& p, const std::string& name) {
  TensorPiece t;
  t.name = name;
  t.global_shape = p.global_shape;
  if (!p.shard.empty()) {
    t.partition_dim = p.partition_dim;
    for (const ShardRange& r : p.shard) t.ranges.push_back({r.start, r.size});
  }
  return t;
}

std::vector<TensorPiece> checkpoint_save_pieces(const ParallelState& ps, DistributedOptimizer& dopt,
                                                const std::vector<const ParameterSet*>& trainable, bool save_optim) {
  const bool from_masters = dopt.sharding() != ShardingStrategy::kNone;
  std::vector<TensorPiece> pieces;
  // Optimizer state is saved by whoever owns it; without sharding every data-parallel replica owns all of
  // it, so only the first one saves.
  for (const StateShard& s : dopt.state_shards()) {
    const Parameter& p = *s.param;
    if (!saves_checkpoint_piece(ps, p, from_masters)) continue;
    auto add = [&](const std::string& name, TensorView v) { pieces.push_back(state_piece(s, name, v)); };
    if (from_masters) add(p.name, s.master);
    if (save_optim)
      for (const auto& [state, view] : s.optimizer_state()) add(std::string("optimizer.") + state + "." + p.name, view);
  }
  if (!from_masters)
    for (const ParameterSet* set : trainable)
      for (const Parameter& p : set->all()) {  // LoRA: the adapters only
        if (!saves_checkpoint_piece(ps, p, /*sharded=*/false)) continue;
        TensorPiece t = param_box(p, p.name);
        t.data = p.value;
        pieces.push_back(std::move(t));
      }
  return pieces;
}

std::vector<TensorPiece> checkpoint_load_targets(DistributedOptimizer& dopt,
                                                 const std::vector<const ParameterSet*>& trainable, bool load_optim) {
  std::vector<TensorPiece> targets;
  for (const ParameterSet* set : trainable)
    for (const Parameter& p : set->all()) {
      if (!p.value.defined()) continue;
      TensorPiece t = param_box(p, p.name);
      t.data = p.value;
      targets.push_back(std::move(t));
    }
  for (const StateShard& s : dopt.state_shards()) {
    const Parameter& p = *s.param;
    auto add = [&](const std::string& name, TensorView v) { targets.push_back(state_piece(s, name, v)); };
    // The masters (views of the weights or a shard of their own): filled from the same saved tensor.
    if (s.master.defined()) add(p.name, s.master);
    if (load_optim)
      for (const auto& [state, view] : s.optimizer_state()) add(std::string("optimizer.") + state + "." + p.name, view);
  }
  return targets;
}

std::string checkpoint_layout_json(const ParallelState& ps, ShardingStrategy sharding) {
  return "{\"tp\":" + std::to_string(ps.tp_size()) + ",\"pp\":" + std::to_string(ps.pp_size()) +
         ",\"cp\":" + std::to_string(ps.cp_size()) + ",\"dp\":" + std::to_string(ps.dp_size()) +
         ",\"ep\":" + std::to_string(ps.ep_size()) + ",\"etp\":" + std::to_string(ps.etp_size()) +
         ",\"sharding\":\"" + sharding_strategy_name(sharding) + "\"}";
}

}  // namespace loom

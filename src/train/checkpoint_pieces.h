// Which pieces of a training run's state each rank writes to a checkpoint and reads back from one (the
// sharded format of ckpt/sharded.h), without the trainer around it: CheckpointManager calls these, and the
// distributed tests call them on synthetic parameter sets. Private to the train layer.
// Owners: every distinct element is written once in the world.
//   dense parameter   replicated over DP x CP (unless ZeRO shards it: then each dp_cp rank writes the flat
//                     ranges its optimizer owns), and over TP when it has no TP shard (tp_rank 0 writes);
//                     the last stage's copy of the tied embedding is never written;
//   expert parameter  (Parameter::expert) replicated over expert_dp only (ZeRO: each expert_dp rank its
//                     flat ranges), and over ETP when it has no ETP shard (etp_rank 0 writes). Never
//                     filtered by tp/dp/cp rank: with ETP = 1, TP = 2, EP = 2 the two TP ranks hold
//                     different experts.
// Reading needs no owner rule: a rank asks for the boxes it holds by name (a rank that holds only some
// experts asks only for those), and the resharding reader fills them from whichever pieces overlap.
#pragma once
#include <string>
#include <vector>

#include "loom/ckpt/sharded.h"
#include "loom/dist/parallel_state.h"
#include "loom/optim/distributed_optimizer.h"
#include "loom/param/parameter.h"

namespace loom {

// Whether this rank writes its copy of p: the model value without ZeRO (sharded = false), or the
// optimizer-owned pieces of p (masters and optimizer state) under the given strategy's sharding.
bool saves_checkpoint_piece(const ParallelState& ps, const Parameter& p, bool sharded);

// The box of a parameter this rank holds under `name`: the whole tensor, or its (E)TP ranges along
// partition_dim.
TensorPiece param_box(const Parameter& p, const std::string& name);

// The pieces this rank writes for the weights and, with save_optim, the optimizer state
// ("optimizer.<state>.<name>"): from the optimizer's owned masters under ZeRO (a 16-bit run's full f32
// values exist nowhere else), from the trainable sets' values otherwise. Views, possibly on the device.
std::vector<TensorPiece> checkpoint_save_pieces(const ParallelState& ps, DistributedOptimizer& dopt,
                                                const std::vector<const ParameterSet*>& trainable, bool save_optim);

// The pieces this rank fills on load: every trainable value it holds (ZeRO-3: none) and the optimizer's
// master shards, plus the optimizer state with load_optim. Views, possibly on the device.
std::vector<TensorPiece> checkpoint_load_targets(DistributedOptimizer& dopt,
                                                 const std::vector<const ParameterSet*>& trainable, bool load_optim);

// The "layout" object of a checkpoint's metadata: {"tp","pp","cp","dp","ep","etp","sharding"}.
std::string checkpoint_layout_json(const ParallelState& ps, ShardingStrategy sharding);

}  // namespace loom

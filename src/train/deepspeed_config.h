// Megatron-DeepSpeed's launch flags (--deepspeed, --deepspeed_config, --zero-stage, the activation
// checkpointing switches) and its ds_config.json, mapped onto Loom's settings with DeepSpeed's precedence
// (docs/migrating.md has the table of every key). Private to the train layer.
//
// apply_deepspeed_config runs when the flags are parsed: it reads the file, refuses what Loom cannot honour
// (offloading, NVMe, compression, MoE, ...) and unknown keys (naming the closest known one) with a UserError
// that names the key and the file, and sets the run's ZeRO stage, precision and loss scaling, clipping,
// optimizer, scheduler and logging. The batch keys need the data-parallel size: resolve_deepspeed_batch
// completes and checks them as DeepSpeed does, once the set-up knows it. Both record in cfg.deepspeed.notes
// what they decided, in particular which value won where the file and a flag disagree.
#pragma once
#include <set>
#include <string>

#include "loom/train/config.h"

namespace loom {

// given: the flags named on the command line (a file value yields to some of them, e.g. --log-interval).
// The DeepSpeed flags (deepspeed_launch.cpp), then the file when --deepspeed is on.
void apply_deepspeed_config(TrainConfig& cfg, const std::set<std::string>& given);
// The ds_config.json of cfg.deepspeed.config_path onto cfg (deepspeed_config.cpp).
void apply_deepspeed_file(TrainConfig& cfg, const std::set<std::string>& given);

// DeepSpeed's batch rules (train_batch_size = micro x accumulation x data-parallel size; a missing one is
// derived from the others), then the micro and global batch of the run. No-op without a file.
void resolve_deepspeed_batch(TrainConfig& cfg, int dp_size);

}  // namespace loom

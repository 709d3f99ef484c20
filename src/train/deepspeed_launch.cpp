// Megatron-DeepSpeed's launch flags around the ds_config.json reader (train/deepspeed_config.h): what
// --deepspeed, --deepspeed_config, --zero-stage and the activation-checkpointing switches mean with and
// without DeepSpeed, and DeepSpeed's batch rules once the data-parallel size is known.
#include <string>

#include "loom/core/check.h"
#include "train/deepspeed_config.h"

namespace loom {

void apply_deepspeed_config(TrainConfig& cfg, const std::set<std::string>& given) {
  DeepSpeedConfig& ds = cfg.deepspeed;
  ds.micro_batch_flag_given = given.count("--micro-batch-size") > 0;
  ds.global_batch_flag_given = given.count("--global-batch-size") > 0;
  auto note = [&](const std::string& s) { ds.notes.push_back(" > " + s); };
  if (ds.zero_stage && (*ds.zero_stage < 0 || *ds.zero_stage > 3))
    user_error("--zero-stage must be 0, 1, 2 or 3, got ", *ds.zero_stage);
  if (!ds.enabled) {
    if (!ds.config_path.empty())
      user_error("--deepspeed_config ", ds.config_path, " is read with --deepspeed (Megatron-DeepSpeed ignores it "
                 "without): add --deepspeed, or drop the file");
    // Megatron-DeepSpeed without --deepspeed is Megatron: its DeepSpeed-only flags do nothing.
    if (ds.zero_stage) note("--zero-stage " + std::to_string(*ds.zero_stage) + " has no effect without --deepspeed (as "
                            "in Megatron-DeepSpeed); ZeRO without DeepSpeed is --use-distributed-optimizer");
    if (ds.activation_checkpointing || ds.partition_activations || ds.contiguous_checkpointing)
      note("--deepspeed-activation-checkpointing / --partition-activations / --contigious-checkpointing have no effect "
           "without --deepspeed (as in Megatron-DeepSpeed)");
    return;
  }
  if (ds.config_path.empty())
    user_error("--deepspeed needs --deepspeed_config FILE (DeepSpeed's ds_config.json: batch, ZeRO stage, precision)");
  apply_deepspeed_file(cfg, given);
  const bool recompute = cfg.recompute.granularity == "full";
  if (ds.activation_checkpointing)
    note(recompute ? "--deepspeed-activation-checkpointing: full recomputation (DeepSpeed's checkpointing engine "
                     "recomputes what --checkpoint-activations asks for; the results are the same)"
                   : "--deepspeed-activation-checkpointing has no effect without --checkpoint-activations (as in "
                     "Megatron-DeepSpeed)");
  if (ds.partition_activations || ds.contiguous_checkpointing)
    note("--partition-activations / --contigious-checkpointing: DeepSpeed's placement of checkpointed activations; "
         "Loom keeps one input per recomputed layer (split over tensor-parallel ranks with --sequence-parallel) and "
         "the results do not depend on them");
}

void resolve_deepspeed_batch(TrainConfig& cfg, int dp) {
  DeepSpeedConfig& ds = cfg.deepspeed;
  if (!ds.enabled) return;
  const std::string& file = ds.config_path;
  std::optional<int64_t> tb = ds.train_batch_size, mb = ds.micro_batch_size, gas = ds.gradient_accumulation_steps;
  if (!tb && !mb && !gas) {
    ds.notes.push_back(" > ds_config " + file + ": no batch keys; --micro-batch-size and --global-batch-size decide");
    return;
  }
  // DeepSpeed's _set_batch_related_parameters, then its _batch_assertion.
  if (tb && mb && gas) {
  } else if (tb && mb) {
    gas = *tb / *mb / dp;
  } else if (tb && gas) {
    mb = *tb / dp / *gas;
  } else if (mb && gas) {
    tb = *mb * *gas * dp;
  } else if (tb) {
    gas = 1;
    mb = *tb / dp;
  } else if (mb) {
    tb = *mb * dp;
    gas = 1;
  } else {
    user_error("ds_config ", file, ": \"gradient_accumulation_steps\": either train_batch_size or "
               "train_micro_batch_size_per_gpu needs to be provided");
  }
  if (*tb <= 0) user_error("ds_config ", file, ": \"train_batch_size\": ", *tb, " has to be greater than 0");
  if (*mb <= 0)
    user_error("ds_config ", file, ": \"train_micro_batch_size_per_gpu\": micro batch size per gpu ", *mb,
               " has to be greater than 0 (train_batch_size ", *tb, " over ", dp, " data-parallel ranks)");
  if (*gas <= 0)
    user_error("ds_config ", file, ": \"gradient_accumulation_steps\": ", *gas, " has to be greater than 0");
  if (*tb != *mb * *gas * dp)
    user_error("ds_config ", file, ": \"train_batch_size\": check batch related parameters. train_batch_size is not "
               "equal to micro_batch_per_gpu * gradient_acc_step * world_size ", *tb, " != ", *mb, " * ", *gas, " * ",
               dp, " (world_size is the data-parallel size)");
  auto set = [&](int64_t& field, int64_t v, const char* key, const char* flag, bool flag_given) {
    std::string s = " > ds_config " + file + ": " + key + " = " + std::to_string(v);
    if (flag_given && field != v) s += " wins over " + std::string(flag) + " " + std::to_string(field) +
                                       " (DeepSpeed's engine steps with the file's batch)";
    else s += std::string(" (as ") + flag + ")";
    ds.notes.push_back(s);
    field = v;
  };
  set(cfg.batch.micro_batch_size, *mb, "train_micro_batch_size_per_gpu", "--micro-batch-size", ds.micro_batch_flag_given);
  int64_t global = cfg.batch.global_batch_size.value_or(0);
  set(global, *tb, "train_batch_size", "--global-batch-size", ds.global_batch_flag_given);
  cfg.batch.global_batch_size = global;
}

}  // namespace loom

// Post-parse checks of the train flags (train/args_checks.h).
#include "train/args_checks.h"

#include <utility>

#include "loom/core/check.h"

namespace loom {

// Megatron's validate_args for iteration- vs sample-based training, and the token flags.
void check_sample_based_flags(const TrainConfig& cfg, const std::set<std::string>& given) {
  const auto has = [&](const char* f) { return given.count(f) > 0; };
  if (cfg.batch.train_samples) {
    if (has("--train-iters"))
      user_error("--train-iters and --train-samples are mutually exclusive (iteration- or sample-based training)");
    if (*cfg.batch.train_samples < 1) user_error("--train-samples must be >= 1, got ", *cfg.batch.train_samples);
    for (const char* f : {"--lr-decay-iters", "--lr-warmup-iters", "--lr-wsd-decay-iters"})
      if (has(f))
        user_error(f, " is iteration-based; with --train-samples give --lr-decay-samples, --lr-warmup-samples, "
                   "--lr-wsd-decay-samples (or --lr-warmup-fraction)");
  } else {
    for (const char* f : {"--lr-decay-samples", "--lr-warmup-samples", "--lr-wsd-decay-samples"})
      if (has(f)) user_error(f, " is sample-based: it needs --train-samples instead of --train-iters");
  }
  if (cfg.optim.lr_warmup_samples && cfg.optim.lr_warmup_fraction)
    user_error("--lr-warmup-fraction and --lr-warmup-samples are mutually exclusive");
  for (const auto& [flag, v] : {std::pair{"--lr-decay-samples", cfg.optim.lr_decay_samples},
                                {"--lr-warmup-samples", cfg.optim.lr_warmup_samples},
                                {"--lr-wsd-decay-samples", cfg.optim.lr_wsd_decay_samples},
                                {"--train-tokens", cfg.batch.train_tokens}, {"--lr-decay-tokens", cfg.optim.lr_decay_tokens},
                                {"--lr-warmup-tokens", cfg.optim.lr_warmup_tokens}})
    if (v && *v < 0) user_error(flag, " must be >= 0, got ", *v);
  if (cfg.batch.train_tokens && *cfg.batch.train_tokens < 1) user_error("--train-tokens must be >= 1");
  if (cfg.no_pipeline_parallel && cfg.parallel.pipeline_model_parallel_size != 1)
    user_error("--no-pipeline-parallel (Megatron-DeepSpeed's non-pipeline model) needs --pipeline-model-parallel-size "
               "1, got ", cfg.parallel.pipeline_model_parallel_size);
}

}  // namespace loom

// --save / --load for a training run, Megatron's directory layout in Loom's one checkpoint format (a
// single process is a world of one; ckpt/sharded.h), with no pickles:
//   iter_0000100/metadata.json          format, Loom version, iteration, consumed samples/tokens, the model
//                                        config, precision, scheduler, loss-scaler and RNG state, the layout
//   iter_0000100/shard_00000.safetensors one per rank: its pieces of the FP32 master weights (Megatron's
//                                        parameter names), of the optimizer state ("optimizer.exp_avg.<name>",
//                                        "optimizer.exp_avg_sq.<name>"; SGD: "optimizer.momentum_buffer.<name>")
//                                        and the FP8 scaling state, each with its place in the global tensor
// Any checkpoint loads into any layout (resharding), the single-file format of Loom 0.1.0 included, and a
// Hugging Face model directory loads with --finetune (weights only, one process).
// LoRA runs save the adapters only (their masters, optimizer state and the run's progress) with a "lora"
// block in metadata.json (rank, alpha, dropout, targets, and "base": the model they adapt). The frozen base
// comes from --pretrained-checkpoint, else from the LoRA checkpoint's "base", else from --load itself when
// that holds a full model (a Loom checkpoint of any layout, or a Hugging Face directory): then the adapters
// start fresh at iteration 0.
// Resume is bit-exact: the master weights, Adam moments and step, the scheduler's sample count, the loss
// scaler, the data position (consumed samples: the loader is a pure function of it) and the dropout RNG
// (Philox keyed by seed and micro-batch counter) are all restored, and the compute copy of the weights is
// re-derived from the masters by the same rounding. Private to the train layer.
#pragma once
#include <ostream>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "loom/ckpt/safetensors.h"
#include "loom/ckpt/sharded.h"
#include "train/training_run.h"

namespace loom {

class CheckpointManager {
 public:
  CheckpointManager(TrainingRun& run, std::ostream& log);
  // Cheap checks of --load, before any data or model is built.
  static void check_load_flags(const TrainConfig& cfg);
  // Creates --save and writes (then removes) a probe file in it: an unwritable directory is an error at
  // start-up, not at the first save hours later.
  static void check_save_dir(const TrainConfig& cfg);
  // Saves the current iteration to --save (collective; a note without --save). Polls the device input
  // flags first, so weights a bad batch made NaN are never written.
  void save();
  // --load: weights, and unless --finetune / --no-load-* the optimizer, scheduler, loss scaler, progress
  // and RNG. Every check (architecture, tensors, shapes) happens before anything is changed. A LoRA run's
  // frozen base is loaded or, when no model is named, initialised here (never both: for a 1B base the
  // initialisation alone takes seconds).
  void load();

 private:
  std::string metadata_json() const;
  void load_pieces(const ShardedCheckpoint& ck, bool load_optim);
  // Weights only of a full model (Loom checkpoint directory or Hugging Face directory) into every chunk's
  // params(): the base of a LoRA run, or --pretrained-checkpoint. Returns the directory it read.
  std::string load_model_only(const std::string& path, const char* flag);
  void load_hf_weights(const std::string& dir);
  // The frozen base of a LoRA run that loads no model: initialised from --seed (as any random model).
  void initialize_frozen_base();
  void check_optimizer_matches(const nlohmann::json& saved, const std::string& meta_path, const std::string& dir) const;
  // FP8 scaling state of this rank's model chunks as named host tensors (`holder` keeps them alive).
  NamedTensors fp8_state_tensors(std::vector<Tensor>& holder) const;

  TrainingRun& run_;
  std::ostream& log_;
  std::string lora_base_;  // the directory the frozen base of a LoRA run came from (saved as lora.base)
  std::set<std::string> checksum_noted_;  // checkpoints whose "no checksums" note was printed
};

}  // namespace loom

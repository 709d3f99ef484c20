// A tiny training run built by the trainer's own set-up (one process, mock data, CPU), for the tests of
// the trainer's parts (StepRunner, Evaluator, TrainingLog, CheckpointManager).
#pragma once
#include <sstream>
#include <string>
#include <vector>

#include "loom/train/args.h"
#include "train/training_run.h"

namespace loom::parts_test {

inline std::vector<std::string> split_flags(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// 2 layers, hidden 32, vocabulary 97, micro-batch 2, global batch 4 (2 micro-batches), no dropout, no LR
// warm-up, 6 iterations.
inline const char* kTinyFlags =
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--clip-grad 1.0 --weight-decay 0.1 --mock-data --vocab-size 97 --log-interval 1 "
    "--hidden-dropout 0 --attention-dropout 0 --eval-iters 2 --seed 5 --train-iters 6 --device cpu ";

// `run` must outlive nothing it did not build: the chunks refer to run.ps and run.ctx.
inline void build_tiny_run(TrainingRun& run, const std::string& extra = "", std::ostream* log = nullptr) {
  std::ostringstream sink;
  std::ostream& out = log ? *log : sink;
  setup_parallel_and_device(run, parse_train_args(split_flags(std::string(kTinyFlags) + extra)),
                            make_self_communicator("world"), out);
  setup_data(run, out);
  setup_model_and_optimizer(run, out);
}

// The f32 master weights of every chunk, concatenated (host copy).
inline std::vector<float> master_weights(const TrainingRun& run) {
  std::vector<float> out;
  for (const GPTModel* m : run.models()) {
    const TensorView v = m->params().values();
    out.insert(out.end(), v.data<float>(), v.data<float>() + v.numel());
  }
  return out;
}

}  // namespace loom::parts_test

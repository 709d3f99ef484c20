// Issue 20's failures, reproduced: each now ends in a clear error before (or instead of) wasted work.
//   - sizes of zero or below, and absurd layer counts, are refused by the flag parser;
//   - a model that cannot fit the machine is refused with the figure before anything is allocated;
//   - an unwritable --save is found at start-up, not at the first save;
//   - a non-finite loss stops the run naming the iteration (Megatron's --check-for-nan-in-loss-and-grad);
//     the flag's --no- form skips such steps instead; FP16 overflowing at the loss-scale floor stops too;
//   - a run that skipped every step never exits 0.
#include <gtest/gtest.h>

#include <fstream>

#include "e2e_util.h"

namespace loom::e2e {
namespace {

const std::string kTiny =
    "--hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 --global-batch-size 4 "
    "--mock-data --vocab-size 100 --log-interval 1 --eval-iters 0 --seed 5";

Args tiny(int64_t iters) {
  return {"--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
          "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", std::to_string(iters),
          "--mock-data", "--vocab-size", "100", "--log-interval", "1", "--eval-iters", "0", "--seed", "5"};
}

// The run's UserError and its log (the error is "" when the run finished).
std::pair<std::string, std::string> run_with_log(const Args& args) {
  omp_set_num_threads(1);
  std::ostringstream log;
  try {
    run_training(parse_train_args(args), log);
  } catch (const UserError& e) {
    return {e.what(), log.str()};
  }
  return {"", log.str()};
}

TEST(TrainReliability, NonPositiveSizesSaySo) {
  expect_one_line_error(run_loom("train --num-layers 0 --train-iters 2 " + kTiny),
                        "--num-layers must be >= 1, got 0");
  expect_one_line_error(run_loom("train --num-layers 2 --train-iters 2 " + kTiny + " --hidden-size -5"),
                        "--hidden-size must be >= 1, got -5");
  expect_one_line_error(run_loom("train --num-layers 2 --train-iters 0 " + kTiny),
                        "--train-iters must be >= 1, got 0");
  expect_one_line_error(run_loom("train --num-layers 2 --train-iters 2 " + kTiny + " --micro-batch-size -1"),
                        "--micro-batch-size must be >= 1, got -1");
  // An int field must not wrap: 2^32 + 2 is not TP 2.
  expect_one_line_error(run_loom("train --num-layers 2 --train-iters 2 " + kTiny + " --tensor-model-parallel-size 4294967298"),
                        "--tensor-model-parallel-size 4294967298 is too large");
  expect_one_line_error(run_loom("calc --num-layers 0 --hidden-size 64 --num-attention-heads 4 --seq-length 32"),
                        "--num-layers must be >= 1");
}

// These ran for minutes and printed nothing (declaring a model was O(layers^2), nothing bounded the flag).
TEST(TrainReliability, HugeLayerCountsFailAtOnce) {
  expect_one_line_error(run_loom("train --num-layers 4294967298 --train-iters 2 " + kTiny),
                        "--num-layers 4294967298 is too large (at most 65536)");
  expect_one_line_error(run_loom("calc --num-layers 100000 --hidden-size 64 --num-attention-heads 4 --seq-length 32"),
                        "--num-layers 100000 is too large");
  // Within the bound but far beyond the machine: refused by the cheap lower bound, before calc's plan.
  const CliResult r = run_loom("train --num-layers 60000 --hidden-size 4096 --num-attention-heads 32 --seq-length 32 "
                               "--max-position-embeddings 32 --micro-batch-size 2 --train-iters 2 --mock-data "
                               "--vocab-size 128");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("the model cannot fit: each process needs more than"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("training ..."), std::string::npos) << r.out;
}

// A 7B-class model on this machine: refused with calc's figures, before data or model are built.
TEST(TrainReliability, ModelThatCannotFitIsRefusedWithTheFigure) {
  const auto [err, log] = run_with_log({"--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
                                        "--seq-length", "1024", "--max-position-embeddings", "1024",
                                        "--micro-batch-size", "1", "--train-iters", "2", "--mock-data",
                                        "--vocab-size", "32000"});
  EXPECT_NE(err.find("the model cannot fit: each process needs about "), std::string::npos) << err;
  for (const char* part : {"parameters and gradients", "optimizer state", "activations", "GiB", "loom calc",
                           "--tensor-model-parallel-size"})
    EXPECT_NE(err.find(part), std::string::npos) << part << " in: " << err;
  EXPECT_EQ(log.find("training ..."), std::string::npos) << log;
  // A model that fits passes the check and trains.
  const auto [err2, log2] = run_with_log(tiny(1));
  EXPECT_EQ(err2, "") << err2;
}

TEST(TrainReliability, UnwritableSaveFoundAtStartUp) {
  TempDir tmp("save");
  { std::ofstream(tmp / "a_file") << "x"; }
  // A path under a regular file cannot be created, even by root (which ignores permission bits).
  for (const std::string& save : {tmp / "a_file" + "/ckpt", tmp / "a_file"}) {
    const auto [err, log] = run_with_log(cat(tiny(3), {"--save", save, "--save-interval", "1"}));
    EXPECT_NE(err.find("--save " + save + ": cannot create the checkpoint directory"), std::string::npos) << err;
    EXPECT_EQ(log.find("iteration        1/"), std::string::npos) << "trained before failing:\n" << log;
  }
  // A writable one is created at start-up and keeps no probe file behind.
  const std::string fresh = tmp / "new" + "/ckpt";
  const auto [err, log] = run_with_log(cat(tiny(1), {"--save", fresh}));
  EXPECT_EQ(err, "") << err;
  for (const auto& e : std::filesystem::directory_iterator(fresh))
    EXPECT_EQ(e.path().filename().string().find(".loom-write-probe"), std::string::npos) << e.path();
}

// --lr 1e30 blows the weights up after the first update: iteration 2's loss is NaN.
TEST(TrainReliability, NonFiniteLossStopsNamingTheIteration) {
  for (const char* precision : {"", "--bf16"}) {
    Args a = cat(tiny(6), {"--lr", "1e30"});
    if (*precision) a.push_back(precision);
    const auto [err, log] = run_with_log(a);
    EXPECT_NE(err.find("iteration 2: the training loss is NaN; stopped before the update"), std::string::npos)
        << precision << ": " << err;
    EXPECT_NE(err.find("--no-check-for-nan-in-loss-and-grad"), std::string::npos) << err;
    EXPECT_EQ(log.find("iteration        2/"), std::string::npos) << log;  // stopped inside iteration 2
  }
  // Turned off: the NaN steps are skipped and counted, the run goes on (its first step trained).
  const auto [err, log] = run_with_log(cat(tiny(4), {"--lr", "1e30", "--no-check-for-nan-in-loss-and-grad"}));
  EXPECT_EQ(err, "") << err;
  const TrainResult r = train(cat(tiny(4), {"--lr", "1e30", "--no-check-for-nan-in-loss-and-grad"}));
  EXPECT_EQ(r.skipped_iterations, 3);
  EXPECT_EQ(r.nan_iterations, 3);
}

// A scale pinned at 2^32 (the floor) overflows every step: after --hysteresis (2) overflows in a row at
// the floor the run stops — with or without the NaN check, which FP16 overflows do not trigger.
TEST(TrainReliability, Fp16OverflowAtTheLossScaleFloorStops) {
  for (bool check : {true, false}) {
    Args a = cat(tiny(10), {"--fp16", "--initial-loss-scale", "4294967296", "--min-loss-scale", "4294967296"});
    if (!check) a.push_back("--no-check-for-nan-in-loss-and-grad");
    const auto [err, log] = run_with_log(a);
    EXPECT_NE(err.find("iteration 2: the FP16 gradients overflow with the loss scale at its minimum"),
              std::string::npos) << err;
    EXPECT_NE(err.find("for 2 steps in a row"), std::string::npos) << err;
  }
  // --hysteresis 4: four overflows at the floor before the stop.
  const auto [err, log] = run_with_log(cat(tiny(10), {"--fp16", "--initial-loss-scale", "4294967296",
                                                      "--min-loss-scale", "4294967296", "--hysteresis", "4"}));
  EXPECT_NE(err.find("iteration 4: the FP16 gradients overflow"), std::string::npos) << err;
  // The default scale (2^32, floor 1) overflows at first too, backs off and trains: no error.
  const TrainResult r = train(cat(tiny(24), {"--fp16"}));
  EXPECT_GT(r.skipped_iterations, 0);
  EXPECT_LT(r.skipped_iterations, 24);
  // A run too short to get past the back-off skips every step: a warning, not an error (the scale is still
  // calibrating, and a resumed segment may do the same).
  std::string short_log;
  const TrainResult s = train(cat(tiny(3), {"--fp16"}), &short_log);
  EXPECT_EQ(s.skipped_iterations, 3);
  EXPECT_NE(short_log.find("WARNING: every one of the 3 iterations run (1 to 3) was skipped"), std::string::npos)
      << short_log;
}

// Without a dynamic scale, skipping every step (here NaN losses with the check off, from iteration 1 on: the
// initial weights are scaled to inf by --init-method-std) is an error, not exit 0.
TEST(TrainReliability, SkippingEveryStepIsAnError) {
  const auto [err, log] =
      run_with_log(cat(tiny(3), {"--init-method-std", "1e300", "--no-check-for-nan-in-loss-and-grad"}));
  EXPECT_NE(err.find("every one of the 3 iterations run (1 to 3) was skipped for non-finite gradients, so nothing "
                     "was trained. No final checkpoint was written"), std::string::npos) << err << log;
}

// Losses and gradient norms do not depend on the thread count, in fp32 and in bf16. The bf16 run takes every
// kind of bf16 product: weight gradients over 1,024 tokens, the output layer's long-reduction input
// gradient, and brgemm's forward and input-gradient products. oneDNN's brgemm picks its K blocking from the
// thread count a primitive is made under; with that count following the run's, the weight gradients differed
// between 1, 2 and 3 threads from iteration 1 on, and so did fc2's forward and fc1's input gradient at this
// ffn width (1024 x 256 over K 1,200).
TEST(TrainReliability, LossesDoNotDependOnTheThreadCount) {
  const std::string model =
      " train --mock-data --vocab-size 8192 --num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256"
      " --max-position-embeddings 256 --ffn-hidden-size 1200 --micro-batch-size 4 --global-batch-size 4"
      " --train-iters 3 --lr 1e-3 --log-interval 1 --eval-iters 0";
  for (const std::string precision :
       {"", " --bf16",
        // MoE: the experts' grouped GEMMs run a new row count each step
        " --bf16 --swiglu --disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 600"}) {
    std::vector<std::string> runs;
    for (int threads : {1, 3}) {
      const TempDir io("threads");
      const std::string cmd = "OMP_NUM_THREADS=" + std::to_string(threads) + " " + std::string(LOOM_BINARY) + model +
                              precision + " --metrics-jsonl " + (io / "m.jsonl") + " >" + (io / "out") + " 2>&1";
      ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd << "\n" << read_file(io / "out");
      std::string losses;  // "lm loss" and "grad norm" of every iteration, as written (full precision)
      for (const std::string& line : lines_of(read_file(io / "m.jsonl"))) {
        const size_t l = line.find("\"lm loss\""), g = line.find("\"grad norm\"");
        if (l == std::string::npos || g == std::string::npos) continue;
        losses += line.substr(l, line.find(',', l) - l) + " " + line.substr(g, line.find(',', g) - g) + "\n";
      }
      ASSERT_EQ(count_of(losses, "lm loss"), 3u) << read_file(io / "m.jsonl");
      runs.push_back(losses);
    }
    EXPECT_EQ(runs[0], runs[1]) << "configuration:" << (precision.empty() ? " fp32" : precision);
  }
}

}  // namespace
}  // namespace loom::e2e

// `loom calc` predicts what `loom train` allocates: the run's peak allocator bytes (the log's "max
// allocated") equal calc's Loom plan (model plan + optimizer state + FP32 main-grad copy, and with LoRA the
// largest adapter scratch) plus the data loader's batch buffers, for every precision and recomputation
// mode, with and without LoRA.
#include <gtest/gtest.h>

#include <sstream>

#include "loom/train/args.h"
#include "loom/train/calc.h"
#include "loom/train/trainer.h"

using namespace loom;

namespace {

std::vector<std::string> split(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

void expect_prediction_holds(const std::string& extra) {
  const std::string flags =
      "--num-layers 3 --hidden-size 128 --num-attention-heads 4 --seq-length 64 --micro-batch-size 4 "
      "--global-batch-size 8 --train-iters 2 --lr 1e-3 --mock-data --vocab-size 500 --eval-iters 0 "
      "--log-interval 1 " +
      extra;
  const TrainConfig cfg = parse_train_args(split(flags));
  const CalcReport calc = compute_calc(make_calc_input(cfg, CalcOptions{}));
  ASSERT_TRUE(calc.loom_plan.has_value());
  std::ostringstream log;
  const TrainResult run = run_training(cfg, log);
  const int64_t predicted = calc.loom_plan->total();
  // The loader's batch buffers: 5 (B, T) tensors of 4-byte elements per micro-batch, a few in flight.
  const int64_t batch_bytes = 5 * 4 * 64 * 4;
  EXPECT_GE(run.peak_bytes, predicted) << extra;
  EXPECT_LE(run.peak_bytes, predicted + 8 * batch_bytes) << extra << ": calc predicts " << predicted;
  // And the log line reports the same figure calc is compared with.
  EXPECT_NE(log.str().find("max allocated: "), std::string::npos);
}

}  // namespace

TEST(CalcVsRun, Fp32) { expect_prediction_holds(""); }
TEST(CalcVsRun, Bf16) { expect_prediction_holds("--bf16"); }
TEST(CalcVsRun, Fp16WithFp16Grads) { expect_prediction_holds("--fp16"); }
TEST(CalcVsRun, Bf16Selective) { expect_prediction_holds("--bf16 --recompute-granularity selective"); }
TEST(CalcVsRun, Bf16FullUniform) {
  expect_prediction_holds("--bf16 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1");
}
TEST(CalcVsRun, Fp32FullBlock) {
  expect_prediction_holds("--recompute-granularity full --recompute-method block --recompute-num-layers 2");
}

// --optimizer sgd: calc counts the momentum buffer (4 bytes per parameter), or nothing without momentum.
TEST(CalcVsRun, SgdMomentum) { expect_prediction_holds("--optimizer sgd --sgd-momentum 0.9"); }
TEST(CalcVsRun, SgdPlain) { expect_prediction_holds("--optimizer sgd --sgd-momentum 0"); }

// LoRA: the frozen base (compute copy only), the adapters' states and their transient scratch.
TEST(CalcVsRun, LoraBf16SlicesWithDropout) {
  expect_prediction_holds("--bf16 --lora-rank 8 --lora-dropout 0.1 --lora-target-modules q_proj v_proj linear_fc1 "
                          "linear_fc2");
}
TEST(CalcVsRun, LoraFp32FullUniform) {
  expect_prediction_holds("--lora-rank 4 --recompute-granularity full --recompute-method uniform "
                          "--recompute-num-layers 1");
}
TEST(CalcVsRun, LoraFp16WithFp16Grads) { expect_prediction_holds("--fp16 --lora-rank 4 --lora-target-modules all"); }

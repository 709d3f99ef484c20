// `loom train` with the flags of Megatron-LM / Megatron-DeepSpeed launch scripts (docs/migrating.md):
// --optimizer sgd (training, bit-exact resume, optimizer mismatch on --load), the logging flags (num zeros,
// world size and optimizer states in TensorBoard, --timing-log-option, W&B warning, --tensorboard-queue-size),
// sample- and token-based training against their iteration-based equivalents, the profile aliases, the
// DeepSpeed-only flags' errors, and the torchrun/deepspeed launcher error. One process, in-process runs
// except where the binary's exit code and stderr are the point.
#include <cstdlib>
#include <filesystem>

#include "e2e_util.h"

namespace loom::e2e {
namespace {

// Tiny GPT on mock data: gbs 4 = 2 micro-batches of 2, T 16 (64 tokens per iteration).
Args tiny(int64_t iters) {
  return {"--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
          "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", std::to_string(iters), "--lr",
          "1e-2", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--mock-data",
          "--vocab-size", "100", "--log-interval", "1", "--eval-iters", "0", "--seed", "5"};
}

// The same run without --train-iters (for the sample/token-based flags).
Args tiny_no_iters() {
  Args a = tiny(1);
  Args out;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == "--train-iters" || a[i] == "--lr-warmup-iters") {
      ++i;
      continue;
    }
    out.push_back(a[i]);
  }
  return out;
}

std::string events_bytes(const std::string& dir) {
  std::string all;
  for (const auto& e : std::filesystem::directory_iterator(dir)) all += read_file(e.path().string());
  return all;
}

TEST(TrainLaunchFlags, SgdTrainsResumesBitExactAndRefusesAdamState) {
  const Args sgd = cat(tiny(6), {"--optimizer", "sgd", "--sgd-momentum", "0.9", "--weight-decay", "0.1"});
  const TrainResult full = train(sgd);
  const TrainResult adam = train(tiny(6));
  ASSERT_EQ(full.losses.size(), 6u);
  EXPECT_NE(full.losses, adam.losses);  // a different optimizer, a different trajectory

  TempDir tmp("sgd");
  const std::string ck = tmp / "ck";
  train(cat(sgd, {"--save", ck, "--exit-interval", "3"}));
  const TrainResult resumed = train(cat(sgd, {"--load", ck}));
  ASSERT_EQ(resumed.start_iteration, 3);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(resumed.losses[size_t(i)], full.losses[size_t(3 + i)]) << "iteration " << 4 + i;
  // The checkpoint names the optimizer; its state is PyTorch's momentum_buffer.
  const std::string meta = read_file(ck + "/iter_0000003/metadata.json");
  EXPECT_NE(meta.find("\"type\": \"sgd\""), std::string::npos) << meta;
  EXPECT_NE(read_file(ck + "/iter_0000003/shard_00000.safetensors").find("optimizer.momentum_buffer."),
            std::string::npos);

  // Adam's moments are no SGD state, and the other way round, unless the optimizer state is not loaded.
  const std::string adam_ck = tmp / "adam";
  train(cat(tiny(3), {"--save", adam_ck}));
  EXPECT_NE(train_error(cat(sgd, {"--load", adam_ck})).find("holds adamw optimizer state; this run trains with "
                                                            "--optimizer sgd"),
            std::string::npos);
  EXPECT_NE(train_error(cat(tiny(6), {"--load", ck})).find("holds sgd optimizer state"), std::string::npos);
  const TrainResult fresh = train(cat(sgd, {"--load", adam_ck, "--no-load-optim"}));
  EXPECT_EQ(fresh.start_iteration, 3);
  // Plain SGD saves no buffer, so a momentum run cannot resume from it.
  const std::string plain_ck = tmp / "plain";
  train(cat(tiny(3), {"--optimizer", "sgd", "--sgd-momentum", "0", "--save", plain_ck}));
  EXPECT_NE(train_error(cat(sgd, {"--load", plain_ck})).find("--sgd-momentum"), std::string::npos);
  EXPECT_NE(train_error(cat(tiny(3), {"--optimizer", "lamb"})).find("--optimizer: unknown optimizer 'lamb' (valid: "
                                                                    "adam, sgd)"),
            std::string::npos);
  EXPECT_NE(train_error(cat(tiny(3), {"--optimizer", "sgd", "--sgd-momentum", "-1"})).find("--sgd-momentum must be >= 0"),
            std::string::npos);
}

TEST(TrainLaunchFlags, LoggingFlagsReachTheLogAndTensorBoard) {
  TempDir tmp("tb");
  std::string log;
  const TrainResult r =
      train(cat(tiny(3), {"--log-num-zeros-in-grad", "--log-world-size-to-tensorboard", "--tensorboard-dir", tmp / "tb",
                          "--tensorboard-queue-size", "5", "--log-optimizer-states-to-tensorboard",
                          "--log-loss-scale-to-tensorboard", "--wandb-project", "p", "--wandb-exp-name", "x",
                          "--timing-log-level", "1", "--timing-log-option", "max"}),
            &log);
  ASSERT_EQ(r.final_iteration, 3);
  const std::string line = [&] {
    for (const std::string& l : lines_of(log))
      if (iteration_of(l) == 2) return l;
    return std::string();
  }();
  // Megatron's order: grad norm, num zeros, params norm.
  ASSERT_NE(line.find(" num zeros: "), std::string::npos) << line;
  EXPECT_LT(line.find(" grad norm: "), line.find(" num zeros: "));
  EXPECT_EQ(count_of(log, "Loom has no Weights & Biases client"), 1u) << log;
  EXPECT_NE(log.find("max time across ranks (ms):"), std::string::npos) << log;
  EXPECT_EQ(log.find("(min, max) time across ranks"), std::string::npos);
  const std::string ev = events_bytes(tmp / "tb");
  for (const char* tag : {"num-zeros", "world-size", "loss-scale", "optimizer/variance_l2", "optimizer/variance_sqrt_l1",
                          "optimizer/momentum_abs_max", "optimizer/weight_l2"})
    EXPECT_NE(ev.find(tag), std::string::npos) << tag;

  std::string all_log;
  train(cat(tiny(3), {"--timing-log-level", "1", "--timing-log-option", "all"}), &all_log);
  EXPECT_NE(all_log.find("times across ranks (ms):"), std::string::npos) << all_log;
  EXPECT_NE(all_log.find("     rank  0: "), std::string::npos) << all_log;
  EXPECT_NE(train_error(cat(tiny(3), {"--timing-log-option", "mean"})).find("(valid: max, minmax, all)"),
            std::string::npos);
  EXPECT_NE(train_error(cat(tiny(3), {"--tensorboard-queue-size", "0"})).find("--tensorboard-queue-size must be >= 1"),
            std::string::npos);
}

TEST(TrainLaunchFlags, SampleAndTokenBasedTrainingEqualTheirIterationForms) {
  // 24 samples at 4 per iteration = 6 iterations; the schedule in samples = the iteration schedule x 4.
  const TrainResult iters = train(cat(tiny(6), {"--lr-decay-iters", "6"}));
  const TrainResult samples = train(cat(tiny_no_iters(), {"--train-samples", "24", "--lr-decay-samples", "24",
                                                          "--lr-warmup-samples", "8"}));
  EXPECT_EQ(samples.losses, iters.losses);
  EXPECT_EQ(samples.learning_rates, iters.learning_rates);
  // --train-tokens stops at the first iteration that reaches them (64 tokens per iteration).
  std::string log;
  const TrainResult tokens = train(cat(tiny(6), {"--train-tokens", "130"}), &log);
  EXPECT_EQ(tokens.final_iteration, 3);
  EXPECT_EQ(tokens.exit_reason, "train-tokens");
  EXPECT_NE(log.find("--train-tokens 130: training stops after iteration 3"), std::string::npos) << log;
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(tokens.losses[i], iters.losses[i]);
  // Tokens as the lr's clock: with multiples of the tokens per iteration, the same as samples.
  const TrainResult by_tokens = train(cat(tiny_no_iters(), {"--train-samples", "24", "--lr-decay-samples", "24",
                                                            "--lr-warmup-tokens", "128", "--lr-decay-tokens", "384"}));
  EXPECT_EQ(by_tokens.learning_rates, samples.learning_rates);
  EXPECT_NE(train_error(cat(tiny(6), {"--train-samples", "24"})).find("mutually exclusive"), std::string::npos);
  EXPECT_NE(train_error(cat(tiny_no_iters(), {"--train-samples", "24", "--lr-decay-iters", "6"}))
                .find("--lr-decay-iters is iteration-based"),
            std::string::npos);
  EXPECT_NE(train_error(cat(tiny(6), {"--lr-decay-samples", "24"})).find("needs --train-samples"), std::string::npos);
  EXPECT_NE(train_error(cat(tiny_no_iters(), {"--train-samples", "3"})).find("less than one global batch"),
            std::string::npos);
}

TEST(TrainLaunchFlags, MegatronDeepSpeedSwitches) {
  std::string log;
  const TrainResult plain = train(tiny(3));
  const TrainResult r = train(cat(tiny(3), {"--num-workers", "2", "--no-pipeline-parallel",
                                            "--no-async-tensor-model-parallel-allreduce", "--zero-stage", "1",
                                            "--attention-softmax-in-fp32"}),
                              &log);
  EXPECT_EQ(r.losses, plain.losses);
  EXPECT_NE(log.find("--num-workers 2: Loom's loader reads"), std::string::npos) << log;
  EXPECT_NE(log.find("--zero-stage 1 has no effect without --deepspeed"), std::string::npos) << log;
  EXPECT_NE(log.find("--no-async-tensor-model-parallel-allreduce --attention-softmax-in-fp32: Megatron kernel choices"),
            std::string::npos)
      << log;
  EXPECT_NE(train_error(cat(tiny(3), {"--no-pipeline-parallel", "--pipeline-model-parallel-size", "2"}))
                .find("needs --pipeline-model-parallel-size 1"),
            std::string::npos);
  EXPECT_NE(train_error(cat(tiny(3), {"--checkpoint-in-cpu"})).find("--checkpoint-in-cpu"), std::string::npos);
  // --profile-execution is --profile: NVTX and the CUDA profiler, refused on a CPU run; false is off.
  EXPECT_NE(train_error(cat(tiny(3), {"--device", "cpu", "--profile-execution", "true", "--profile-name", "run1"}))
                .find("--profile records NVTX ranges"),
            std::string::npos);
  EXPECT_EQ(train(cat(tiny(3), {"--profile-execution", "false"})).final_iteration, 3);
  EXPECT_NE(train_error(cat(tiny(3), {"--profile-execution", "maybe"})).find("takes true or false"), std::string::npos);
}

// torchrun / the deepspeed launcher start every rank as its own MPI singleton: each would train alone.
TEST(TrainLaunchFlags, TorchrunStyleLaunchIsAnErrorShowingTheMpirunLine) {
  std::string args;
  for (const std::string& a : tiny(3)) args += " " + a;
  const CliResult r = run_loom("train" + args + " --local_rank 1", "");
  ASSERT_EQ(r.code, 0) << r.err;  // without the launcher's variables, a plain single-process run
  const std::string env = "WORLD_SIZE=4 RANK=1 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 ";
  const TempDir io("torchrun");
  const std::string cmd = env + "OMP_NUM_THREADS=1 " + std::string(LOOM_BINARY) + " train" + args + " >" + (io / "out") +
                          " 2>" + (io / "err");
  const int status = std::system(cmd.c_str());
  EXPECT_EQ(WEXITSTATUS(status), 2);
  const std::string err = read_file(io / "err");
  EXPECT_NE(err.find("torchrun/deepspeed-style launcher (WORLD_SIZE=4, RANK=1, LOCAL_RANK=1)"), std::string::npos) << err;
  EXPECT_NE(err.find("mpirun -np 4 --npernode 2 loom train <the same flags>"), std::string::npos) << err;
  EXPECT_NE(err.find("srun --nodes=2 --ntasks=4 loom train"), std::string::npos) << err;
  EXPECT_TRUE(read_file(io / "out").empty());
}

}  // namespace
}  // namespace loom::e2e

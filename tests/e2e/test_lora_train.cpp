// LoRA fine-tuning through `loom train` (issue 17): a tiny Llama pretrained by Loom is the frozen base
// (--load), LoRA adapters train on PEFT slices and whole layers with adapter dropout, checkpoints hold the
// adapters only (with their optimizer state and the run's progress, and the base's path), and a run
// stopped with --exit-interval resumes bit-exactly from them (fp32 and bf16). The first LoRA step's loss is
// the base model's (B starts at zero). Bad input: every mismatch between the flags and a checkpoint is a
// clear error naming the flag.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "e2e_util.h"
#include "loom/ckpt/safetensors.h"
#include "loom/core/check.h"

namespace fs = std::filesystem;
using namespace loom;
using namespace loom::e2e;

namespace {

Args llama(int64_t iters) {
  return {"--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
          "--num-query-groups", "2", "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "48",
          "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
          "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size",
          "4", "--train-iters", std::to_string(iters), "--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style",
          "cosine", "--mock-data", "--vocab-size", "100", "--log-interval", "1", "--eval-iters", "0", "--seed",
          "5"};
}

const Args kLora = {"--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1", "--lora-target-modules",
                    "q_proj", "v_proj", "linear_proj", "linear_fc1", "down_proj"};

std::string iter_dir(const std::string& root, int64_t it) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "/iter_%07lld", (long long)it);
  return root + buf;
}

class LoraTrain : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(LoraTrain, AdapterCheckpointsResumeBitExact) {
  const std::string prec = GetParam();
  TempDir tmp("lora_" + prec);
  const Args p = prec == "bf16" ? Args{"--bf16"} : Args{};
  ASSERT_EQ(train(cat(cat(llama(6), p), {"--save", tmp / "base"})).final_iteration, 6);
  const Args args = cat(cat(cat(llama(12), p), kLora), {"--load", tmp / "base"});
  std::string log;
  const TrainResult straight = train(cat(args, {"--save", tmp / "straight"}), &log);
  ASSERT_EQ(straight.losses.size(), 12u);
  EXPECT_EQ(straight.start_iteration, 0);
  EXPECT_NE(log.find("LoRA base (frozen)"), std::string::npos) << log;
  EXPECT_NE(log.find("trainable adapter parameters"), std::string::npos) << log;
  EXPECT_NE(straight.losses.front(), straight.losses.back());
  // B = 0 at the start: the first step sees exactly the base model (a --finetune run of it).
  const TrainResult base = train(cat(cat(cat(llama(1), p), {"--load", tmp / "base"}), {"--finetune"}));
  ASSERT_EQ(base.losses.size(), 1u);
  EXPECT_EQ(base.losses[0], straight.losses[0]);

  const TrainResult first = train(cat(args, {"--save", tmp / "split", "--exit-interval", "6"}));
  ASSERT_EQ(first.final_iteration, 6);
  // The resume names only the LoRA checkpoint: the base comes from its metadata.
  const Args resume = cat(cat(cat(llama(12), p), kLora), {"--load", tmp / "split", "--save", tmp / "split"});
  const TrainResult second = train(resume);
  EXPECT_EQ(second.start_iteration, 6);
  std::vector<double> joined = first.losses;
  joined.insert(joined.end(), second.losses.begin(), second.losses.end());
  ASSERT_EQ(joined.size(), straight.losses.size());
  for (size_t i = 0; i < joined.size(); ++i) EXPECT_EQ(joined[i], straight.losses[i]) << "iteration " << i + 1;
  for (const char* f : {"shard_00000.safetensors", "metadata.json"})
    EXPECT_TRUE(read_file(iter_dir(tmp / "straight", 12) + "/" + f) == read_file(iter_dir(tmp / "split", 12) + "/" + f))
        << f;

  // Only the adapters (and their Adam moments) are saved: 2 layers x 5 targets x (A, B) x 3.
  const SafetensorsFile shard = SafetensorsFile::open(iter_dir(tmp / "straight", 12) + "/shard_00000.safetensors");
  int64_t n = 0;
  for (const std::string& name : shard.names()) {
    EXPECT_NE(name.find(".lora_"), std::string::npos) << name;
    ++n;
  }
  EXPECT_EQ(n, 2 * 5 * 2 * 3);
  const std::string meta = read_file(iter_dir(tmp / "straight", 12) + "/metadata.json");
  EXPECT_NE(meta.find("\"base\": \"" + fs::absolute(tmp / "base").lexically_normal().string() + "\""),
            std::string::npos) << meta;
  EXPECT_LT(fs::file_size(iter_dir(tmp / "straight", 12) + "/shard_00000.safetensors"),
            fs::file_size(iter_dir(tmp / "base", 6) + "/shard_00000.safetensors") / 4);
}

INSTANTIATE_TEST_SUITE_P(Precisions, LoraTrain, ::testing::Values("fp32", "bf16"),
                         [](const auto& info) { return info.param; });

TEST(LoraTrainErrors, MismatchesNameTheFlag) {
  TempDir tmp("lora_err");
  ASSERT_EQ(train(cat(llama(2), {"--save", tmp / "base"})).final_iteration, 2);
  ASSERT_EQ(train(cat(cat(llama(2), kLora), {"--load", tmp / "base", "--save", tmp / "lora"})).final_iteration, 2);
  auto expect_error = [](const Args& a, const std::string& needle) {
    const std::string e = train_error(a);
    EXPECT_NE(e.find(needle), std::string::npos) << "expected '" << needle << "' in: " << e;
  };
  // Resuming adapters with another rank, other modules or another alpha.
  Args other = kLora;
  other[1] = "8";
  expect_error(cat(cat(llama(4), other), {"--load", tmp / "lora"}), "--lora-rank");
  expect_error(cat(llama(4), {"--load", tmp / "lora", "--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout",
                              "0.1", "--lora-target-modules", "all"}),
               "--lora-target-modules");
  other = kLora;
  other[3] = "16";
  expect_error(cat(cat(llama(4), other), {"--load", tmp / "lora"}), "--lora-alpha");
  // A LoRA checkpoint is no model: neither without LoRA nor as a base.
  expect_error(cat(llama(4), {"--load", tmp / "lora"}), "holds LoRA adapters");
  expect_error(cat(cat(llama(4), kLora), {"--pretrained-checkpoint", tmp / "lora"}), "is a LoRA checkpoint");
  // Flags that need --lora-rank, impossible ranks, modules the model lacks.
  expect_error(cat(llama(2), {"--lora-alpha", "16"}), "needs --lora-rank");
  expect_error(cat(llama(2), {"--lora-rank", "-1"}), "--lora-rank");
  expect_error(cat(llama(2), {"--lora-rank", "33"}), "--lora-rank must be in [1, ");
  expect_error(cat(llama(2), {"--lora-rank", "2", "--lora-target-modules", "lm_head"}), "unknown module 'lm_head'");
  expect_error(cat(llama(2), {"--lora-rank", "2", "--lora-dropout", "1"}), "--lora-dropout");
  expect_error({"--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
                "--micro-batch-size", "1", "--train-iters", "1", "--mock-data", "--vocab-size", "50", "--eval-iters",
                "0", "--lora-rank", "2", "--lora-target-modules", "gate_proj"},
               "not gated");
}

// Recomputation re-runs the adapters too (their activations are recomputed anyway): full and selective
// recomputation give bit-identical losses with adapter dropout on. FP16 (dynamic loss scaling) and FP8 base
// GEMMs (delayed scaling, the base's weight gradients skipped) train the adapters.
TEST(LoraTrain, RecomputationFp16AndFp8) {
  const Args base = cat(cat(llama(6), kLora), {"--bf16"});
  const TrainResult plain = train(base);
  ASSERT_EQ(plain.losses.size(), 6u);
  for (const Args& r : {Args{"--recompute-granularity", "full", "--recompute-method", "uniform",
                             "--recompute-num-layers", "1"},
                        Args{"--recompute-granularity", "selective"}}) {
    const TrainResult got = train(cat(base, r));
    ASSERT_EQ(got.losses.size(), plain.losses.size()) << r[1];
    for (size_t i = 0; i < got.losses.size(); ++i) EXPECT_EQ(got.losses[i], plain.losses[i]) << r[1] << " " << i;
  }
  for (const Args& p : {Args{"--fp16", "--initial-loss-scale", "4096"},
                        Args{"--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "4"}}) {
    const TrainResult got = train(cat(cat(llama(12), kLora), p));
    ASSERT_EQ(got.losses.size(), 12u) << p[0];
    for (double l : got.losses) EXPECT_TRUE(std::isfinite(l)) << p[0];
    EXPECT_LT(got.losses.back(), got.losses.front()) << p[p.size() - 2];
  }
}

// The base may be a Hugging Face directory: the same model exported with `loom convert` gives the same
// LoRA run (the f32 export is exact), and the LoRA checkpoint names that directory as its base.
TEST(LoraTrain, HuggingFaceBase) {
  TempDir tmp("lora_hf");
  ASSERT_EQ(train(cat(llama(4), {"--save", tmp / "base"})).final_iteration, 4);
  const CliResult c = run_loom("convert --from loom:" + (tmp / "base") + " --to hf:" + (tmp / "hf"));
  ASSERT_EQ(c.code, 0) << c.out << c.err;
  const Args args = cat(cat(llama(6), kLora), {"--exit-interval", "4"});
  const TrainResult from_loom = train(cat(args, {"--load", tmp / "base"}));
  std::string log;
  const TrainResult from_hf = train(cat(args, {"--load", tmp / "hf", "--save", tmp / "lora"}), &log);
  ASSERT_EQ(from_hf.losses.size(), 4u);
  EXPECT_EQ(from_hf.losses, from_loom.losses);
  EXPECT_NE(log.find("loading Hugging Face model from"), std::string::npos) << log;
  EXPECT_NE(read_file(iter_dir(tmp / "lora", 4) + "/metadata.json").find(fs::absolute(tmp / "hf").lexically_normal().string()),
            std::string::npos);
  // --pretrained-checkpoint names the base explicitly and wins over the checkpoint's.
  const TrainResult resumed = train(cat(cat(llama(6), kLora), {"--load", tmp / "lora", "--pretrained-checkpoint",
                                                                 tmp / "base"}), &log);
  EXPECT_EQ(resumed.start_iteration, 4);
  EXPECT_EQ(resumed.losses.size(), 2u);
  EXPECT_NE(log.find("LoRA base (frozen) " + fs::absolute(tmp / "base").lexically_normal().string()), std::string::npos)
      << log;
}

// Checkpoint checksums end to end: a checkpoint written by `loom train` and then damaged the way disks and
// copies damage files (1 KiB of garbage, NaNs, in the middle of a tensor's bytes) must not load. Resuming
// fails with one error line naming the checkpoint directory, the file and the tensor and listing the other
// iterations, and --ckpt-step loads one of those instead. The optimizer state is covered as well as the
// weights; a checkpoint written before checksums (the same files without them) still resumes, bit-exact,
// with one note; `loom convert` and `loom generate` refuse damaged Loom checkpoints and damaged HF exports.
// (The two-rank sharded case is tests/dist/train/test_dist_ckpt_checksums.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "e2e_util.h"
#include "loom/ckpt/safetensors.h"
#include "unit/ckpt/ckpt_test_util.h"

namespace fs = std::filesystem;
using namespace loom;
using namespace loom::e2e;

namespace {

constexpr const char* kEmbedding = "embedding.word_embeddings.weight";

// Tiny GPT-2 on mock data (dropout on: the RNG state must come back too).
Args tiny_args(int64_t iters) {
  return {"--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
          "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
          "--train-iters", std::to_string(iters), "--lr", "1e-3", "--lr-warmup-iters", "2", "--mock-data",
          "--vocab-size", "100", "--log-interval", "1", "--eval-iters", "0", "--seed", "5"};
}

std::string words(const Args& a) {
  std::string s;
  for (const std::string& w : a) s += w + " ";
  return s;
}

std::string iter_dir(const std::string& root, int64_t it) {
  char b[32];
  std::snprintf(b, sizeof b, "/iter_%07lld", static_cast<long long>(it));
  return root + b;
}

// Saves iterations 2, 4 and 6 of an 8-iteration run under `root` through the binary (the real save path).
void train_and_save(const std::string& root) {
  const CliResult r =
      run_loom("train " + words(tiny_args(8)) + "--save " + root + " --save-interval 2 --exit-interval 6");
  ASSERT_EQ(r.code, 0) << r.err;
  for (int64_t it : {2, 4, 6}) ASSERT_TRUE(fs::is_directory(iter_dir(root, it))) << iter_dir(root, it);
}

// Overwrites `bytes` in the middle of `tensor`'s data in `file`.
void damage_middle(const std::string& file, const std::string& tensor, const std::string& bytes) {
  const int64_t n = SafetensorsFile::open(file).info(tensor).nbytes();
  ASSERT_GE(n, int64_t(bytes.size())) << tensor;
  ckpt_test::overwrite_tensor_bytes(file, tensor, (n - int64_t(bytes.size())) / 2 / 4 * 4, bytes);
}

std::string garbage_kib() {
  std::string g(1024, '\0');
  for (size_t i = 0; i < g.size(); ++i) g[i] = char(i * 131 + 7);
  return g;
}

void expect_contains_all(const std::string& text, const std::vector<std::string>& parts) {
  for (const std::string& p : parts) EXPECT_NE(text.find(p), std::string::npos) << "missing: " << p << "\nin: " << text;
}

// A damaged resume: exit 2, one error line naming dir, file, tensor and the other iterations; nothing
// trained (no iteration line after the load).
void expect_damaged_resume(const CliResult& r, const std::string& root, const std::string& tensor) {
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  const std::string dir = iter_dir(root, 6);
  expect_contains_all(r.err, {"loom train: error: ", "checkpoint " + dir + " is damaged",
                              dir + "/shard_00000.safetensors", "tensor '" + tensor + "'", "checksum mismatch",
                              "other checkpoints in " + root + ": iterations 2, 4", "--ckpt-step"});
  for (const std::string& line : lines_of(r.out)) EXPECT_LT(iteration_of(line), 0) << line;
}

}  // namespace

// (a) 1 KiB of garbage in the middle of the word embeddings: the resume fails (before, it trained on at a
// loss of 6e29 and exited 0); --ckpt-step 4 resumes from the previous checkpoint and reproduces the
// straight run.
TEST(CkptChecksums, GarbageInWeightsFailsTheResumeAndCkptStepFallsBack) {
  TempDir tmp("ckpt_garbage");
  const std::string root = tmp / "ck";
  train_and_save(root);
  damage_middle(iter_dir(root, 6) + "/shard_00000.safetensors", kEmbedding, garbage_kib());
  const std::string resume = "train " + words(tiny_args(8)) + "--load " + root;
  expect_damaged_resume(run_loom(resume), root, kEmbedding);

  const CliResult back = run_loom(resume + " --ckpt-step 4");
  ASSERT_EQ(back.code, 0) << back.err;
  EXPECT_NE(back.out.find("loading checkpoint from " + root + " at iteration 4"), std::string::npos) << back.out;
  std::string straight_log;
  train(tiny_args(8), &straight_log);
  std::map<int64_t, std::string> straight, resumed;
  for (const std::string& l : lines_of(straight_log)) straight[iteration_of(l)] = log_field(l, "lm loss");
  for (const std::string& l : lines_of(back.out))
    if (iteration_of(l) >= 0) resumed[iteration_of(l)] = log_field(l, "lm loss");
  ASSERT_EQ(resumed.size(), 4u) << back.out;
  for (const auto& [it, loss] : resumed) EXPECT_EQ(loss, straight[it]) << "iteration " << it;

  const CliResult missing = run_loom(resume + " --ckpt-step 5");
  EXPECT_EQ(missing.code, 2) << missing.err;
  expect_contains_all(missing.err, {"--ckpt-step 5", iter_dir(root, 5), "its iterations: 2, 4, 6"});
}

// (b) NaNs written over the middle of an MLP weight (in-process: the same loader).
TEST(CkptChecksums, NansInWeightsFailTheResume) {
  TempDir tmp("ckpt_nan");
  const std::string root = tmp / "ck";
  train_and_save(root);
  const std::string tensor = "decoder.layers.1.mlp.linear_fc1.weight";
  damage_middle(iter_dir(root, 6) + "/shard_00000.safetensors", tensor, ckpt_test::nan_bytes(256));
  const std::string err = train_error(cat(tiny_args(8), {"--load", root}));
  expect_contains_all(err, {iter_dir(root, 6) + "/shard_00000.safetensors", "tensor '" + tensor + "'",
                            "checksum mismatch", "iterations 2, 4"});
  EXPECT_EQ(err.find('\n'), std::string::npos) << err;
}

// (c) Damaged optimizer state: the resume fails naming the Adam moment; loading the weights only
// (--no-load-optim) reads nothing damaged and works.
TEST(CkptChecksums, DamagedOptimizerStateFailsTheResume) {
  TempDir tmp("ckpt_optim");
  const std::string root = tmp / "ck";
  train_and_save(root);
  const std::string tensor = std::string("optimizer.exp_avg_sq.") + kEmbedding;
  damage_middle(iter_dir(root, 6) + "/shard_00000.safetensors", tensor, garbage_kib());
  expect_damaged_resume(run_loom("train " + words(tiny_args(8)) + "--load " + root), root, tensor);
  const TrainResult r = train(cat(tiny_args(8), {"--load", root, "--no-load-optim"}));
  EXPECT_EQ(r.start_iteration, 6);
  EXPECT_EQ(r.final_iteration, 8);
}

// (d) A checkpoint written before checksums (its shard rewritten without them, as Loom wrote it then)
// resumes with one note, and exactly as the checksummed original does.
TEST(CkptChecksums, CheckpointWithoutChecksumsResumesWithOneNote) {
  TempDir tmp("ckpt_old");
  const std::string root = tmp / "ck", old = tmp / "old";
  train_and_save(root);
  fs::copy(root, old, fs::copy_options::recursive);
  ckpt_test::strip_checksums(iter_dir(old, 6) + "/shard_00000.safetensors");
  ASSERT_FALSE(SafetensorsFile::open(iter_dir(old, 6) + "/shard_00000.safetensors").has_checksums());
  std::string log_new, log_old;
  const TrainResult a = train(cat(tiny_args(8), {"--load", root}), &log_new);
  const TrainResult b = train(cat(tiny_args(8), {"--load", old}), &log_old);
  EXPECT_EQ(count_of(log_new, "cannot be verified"), 0u) << log_new;
  EXPECT_EQ(count_of(log_old, "cannot be verified"), 1u) << log_old;
  EXPECT_NE(log_old.find("note: checkpoint " + iter_dir(old, 6) + " was written before Loom recorded checksums"),
            std::string::npos)
      << log_old;
  EXPECT_EQ(b.start_iteration, 6);
  ASSERT_EQ(a.losses.size(), 2u);
  EXPECT_EQ(std::memcmp(a.losses.data(), b.losses.data(), 2 * sizeof(double)), 0);
  // generate says it once too.
  const CliResult g = run_loom("generate --load " + old + " --tokenizer-type NullTokenizer --vocab-size 99 "
                               "--prompt '1 2 3' --max-new-tokens 2");
  ASSERT_EQ(g.code, 0) << g.err;
  EXPECT_EQ(count_of(g.err, "cannot be verified"), 1u) << g.err;
}

// (e) loom convert and loom generate verify: a damaged Loom checkpoint does not convert or generate, and a
// damaged HF export (written by loom convert) does not convert back or generate.
TEST(CkptChecksums, ConvertAndGenerateRefuseDamagedFiles) {
  TempDir tmp("ckpt_convert");
  const std::string root = tmp / "ck";
  train_and_save(root);
  const std::string gen = " --tokenizer-type NullTokenizer --vocab-size 99 --prompt '1 2 3' --max-new-tokens 2";
  ASSERT_EQ(run_loom("convert --from loom:" + root + " --to hf:" + (tmp / "hf")).code, 0);
  ASSERT_EQ(run_loom("generate --load " + (tmp / "hf") + gen).code, 0);
  ASSERT_TRUE(SafetensorsFile::open(tmp / "hf/model.safetensors").has_checksums());

  // The HF export, damaged.
  const std::string hf_file = tmp / "hf/model.safetensors";
  std::string hf_tensor;
  {
    const SafetensorsFile f = SafetensorsFile::open(hf_file);
    for (const std::string& n : f.names())
      if (hf_tensor.empty() || f.info(n).nbytes() > f.info(hf_tensor).nbytes()) hf_tensor = n;
  }
  damage_middle(hf_file, hf_tensor, garbage_kib());
  for (const std::string& cmd : {"convert --from hf:" + (tmp / "hf") + " --to loom:" + (tmp / "back"),
                                 "generate --load " + (tmp / "hf") + gen}) {
    SCOPED_TRACE(cmd);
    const CliResult r = run_loom(cmd);
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    expect_contains_all(r.err, {"Hugging Face model directory " + (tmp / "hf") + " is damaged", hf_file,
                                "tensor '" + hf_tensor + "'", "checksum mismatch"});
  }
  EXPECT_FALSE(fs::exists(tmp / "back"));

  // The Loom checkpoint, damaged.
  damage_middle(iter_dir(root, 6) + "/shard_00000.safetensors", kEmbedding, garbage_kib());
  for (const std::string& cmd : {"convert --from loom:" + root + " --to hf:" + (tmp / "hf2"),
                                 "generate --load " + root + gen}) {
    SCOPED_TRACE(cmd);
    const CliResult r = run_loom(cmd);
    EXPECT_EQ(r.code, 2) << r.err;
    expect_contains_all(r.err, {"checkpoint " + iter_dir(root, 6) + " is damaged", "shard_00000.safetensors",
                                "tensor '" + std::string(kEmbedding) + "'", "iterations 2, 4",
                                iter_dir(root, 4)});
  }
  EXPECT_FALSE(fs::exists(tmp / "hf2"));
  // The earlier checkpoint's directory, as the message suggests, still converts and generates.
  EXPECT_EQ(run_loom("convert --from loom:" + iter_dir(root, 4) + " --to hf:" + (tmp / "hf4")).code, 0);
  EXPECT_EQ(run_loom("generate --load " + iter_dir(root, 4) + gen).code, 0);
}

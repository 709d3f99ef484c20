// `loom generate` end to end: train a tiny model for 5 iterations with `loom train --mock-data --save`,
// then generate from the checkpoint with the NullTokenizer (and with the GPT-2 BPE vocabulary in data/ when
// it is there): the text is the prompt followed by new tokens, tokens/s statistics go to stderr, greedy
// output is the same with and without the KV cache, the same seed samples the same text, and bad input
// (missing --load, a prompt longer than the model's positions, a tokenizer larger than the model's
// vocabulary) is one error line before any work. A mixture-of-experts model (configs/moe-tiny.yaml) trains,
// generates the same greedy text with and without the KV cache, and again after a round trip through HF.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "e2e_util.h"

namespace fs = std::filesystem;

namespace {

using loom::e2e::CliResult;
using loom::e2e::expect_one_line_error;

fs::path work_dir() {
  static const fs::path dir = fs::temp_directory_path() / ("loom_e2e_generate_" + std::to_string(::getpid()));
  return dir;
}

CliResult run(const std::string& args) { return loom::e2e::run_loom(args, work_dir().string()); }

// Trains once per vocabulary; returns the checkpoint dir.
std::string trained(int64_t vocab) {
  const fs::path ckpt = work_dir() / ("ckpt_v" + std::to_string(vocab));
  if (fs::exists(ckpt / "latest_checkpointed_iteration.txt")) return ckpt.string();
  fs::create_directories(work_dir());
  const CliResult r = run(
      "train --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 32 "
      "--micro-batch-size 2 --train-iters 5 --lr 1e-3 --mock-data --vocab-size " +
      std::to_string(vocab) + " --save " + ckpt.string());
  EXPECT_EQ(r.code, 0) << r.err;
  return ckpt.string();
}


class GenerateCli : public ::testing::Test {
 protected:
  static void TearDownTestSuite() { fs::remove_all(work_dir()); }
};

const std::string kNull = " --tokenizer-type NullTokenizer --vocab-size 99 ";

}  // namespace

TEST_F(GenerateCli, GeneratesFromATrainedCheckpoint) {
  const std::string ckpt = trained(100);
  const CliResult r = run("generate --load " + ckpt + kNull + "--prompt '5 6 7' --max-new-tokens 8 --seed 3");
  ASSERT_EQ(r.code, 0) << r.err;
  // "5 6 7" then up to 8 ids (fewer if EOD = 99 came first), one line.
  ASSERT_EQ(r.out.rfind("5 6 7 ", 0), 0u) << r.out;
  ASSERT_EQ(r.out.back(), '\n');
  std::istringstream ids(r.out);
  int64_t n = 0, id = 0;
  while (ids >> id) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, 99);
    ++n;
  }
  EXPECT_GE(n, 4);
  EXPECT_LE(n, 3 + 8);
  EXPECT_NE(r.err.find("tokens/s"), std::string::npos) << r.err;
  // Same seed, same text; greedy is the same with and without the KV cache.
  EXPECT_EQ(run("generate --load " + ckpt + kNull + "--prompt '5 6 7' --max-new-tokens 8 --seed 3").out, r.out);
  const std::string greedy =
      "generate --load " + ckpt + kNull + "--prompt '1 2 3 4' --max-new-tokens 12 --temperature 0";
  const CliResult cached = run(greedy), full = run(greedy + " --no-kv-cache");
  ASSERT_EQ(cached.code, 0) << cached.err;
  EXPECT_EQ(cached.out, full.out);
  EXPECT_NE(full.err.find("no KV cache"), std::string::npos) << full.err;
}

TEST_F(GenerateCli, PromptFileIsABatch) {
  const std::string ckpt = trained(100);
  std::ofstream(work_dir() / "prompts.txt") << "1 2 3\n\n40 41\n7\n";
  const CliResult r = run("generate --load " + ckpt + kNull +
                           "--prompt-file prompts.txt --max-new-tokens 4 --temperature 0 --bf16");
  ASSERT_EQ(r.code, 0) << r.err;
  std::istringstream lines(r.out);
  std::string line;
  std::vector<std::string> got;
  while (std::getline(lines, line)) got.push_back(line);
  ASSERT_EQ(got.size(), 3u) << r.out;
  EXPECT_EQ(got[0].rfind("1 2 3", 0), 0u);
  EXPECT_EQ(got[1].rfind("40 41", 0), 0u);
  EXPECT_EQ(got[2].rfind("7", 0), 0u);
  EXPECT_NE(r.err.find("3 prompts"), std::string::npos) << r.err;
}

TEST_F(GenerateCli, ErrorsBeforeAnyWork) {
  const std::string ckpt = trained(100);
  expect_one_line_error(run("generate" + kNull + "--prompt '1 2'"), "--load");
  expect_one_line_error(run("generate --load " + ckpt + kNull), "--prompt");
  expect_one_line_error(run("generate --load " + (work_dir() / "nope").string() + kNull + "--prompt '1'"),
                        "not a directory");
  std::string long_prompt;
  for (int i = 0; i < 40; ++i) long_prompt += std::to_string(i) + " ";
  expect_one_line_error(run("generate --load " + ckpt + kNull + "--prompt '" + long_prompt + "'"),
                        "--max-position-embeddings");
  expect_one_line_error(
      run("generate --load " + ckpt + " --tokenizer-type NullTokenizer --vocab-size 500 --prompt '1'"),
      "vocabulary of 100");
  expect_one_line_error(run("generate --load " + ckpt + kNull + "--prompt '1' --top-p 2"), "--top-p");
  expect_one_line_error(run("generate --load " + ckpt + kNull + "--prompt '1' --temprature 0"),
                        "did you mean --temperature");
}

TEST_F(GenerateCli, Gpt2Tokenizer) {
  const fs::path data = fs::path(LOOM_SOURCE_DIR) / "data";
  if (!fs::exists(data / "encoder.json") || !fs::exists(data / "vocab.bpe"))
    GTEST_SKIP() << "no GPT-2 vocabulary in data/ (scripts/setup.sh downloads it)";
  const std::string ckpt = trained(50257);
  const std::string tok = " --tokenizer-type GPT2BPETokenizer --vocab-file " + (data / "encoder.json").string() +
                          " --merge-file " + (data / "vocab.bpe").string() + " ";
  const CliResult r = run("generate --load " + ckpt + tok + "--prompt 'The state of the' --max-new-tokens 6");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("The state of the", 0), 0u) << r.out;
  EXPECT_GT(r.out.size(), std::string("The state of the\n").size());
  EXPECT_NE(r.err.find("tokens/s"), std::string::npos);
  // The 100-token mock model cannot take GPT-2's 50257 tokens.
  expect_one_line_error(run("generate --load " + trained(100) + tok + "--prompt 'hi'"), "vocabulary of 100");
}

TEST_F(GenerateCli, MixtureOfExpertsModel) {
  const std::string ckpt = (work_dir() / "moe").string();
  fs::create_directories(work_dir());
  const CliResult t = run("train --config " + std::string(LOOM_SOURCE_DIR) +
                          "/configs/moe-tiny.yaml --seq-length 16 --micro-batch-size 2 --train-iters 3 --lr 1e-3 "
                          "--mock-data --vocab-size 100 --save " + ckpt);
  ASSERT_EQ(t.code, 0) << t.err;
  const std::string greedy = kNull + "--prompt '1 2 3 4' --max-new-tokens 12 --temperature 0";
  const CliResult cached = run("generate --load " + ckpt + greedy);
  const CliResult full = run("generate --load " + ckpt + greedy + " --no-kv-cache");
  ASSERT_EQ(cached.code, 0) << cached.err;
  EXPECT_EQ(cached.out, full.out);
  EXPECT_NE(cached.err.find("active (4 experts, top-2)"), std::string::npos) << cached.err;
  // Through Hugging Face Mixtral and back: the same text from the HF directory.
  const std::string hf = (work_dir() / "moe_hf").string();
  ASSERT_EQ(run("convert --from loom:" + ckpt + " --to hf:" + hf).code, 0);
  EXPECT_EQ(run("generate --load " + hf + greedy).out, cached.out);
}

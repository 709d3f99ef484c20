// `loom convert` and `loom train --load <HF dir> --finetune` end to end, on the tiny HF directories of
// tests/golden/gen_hf_models.py: HF -> Loom -> HF through the binary reproduces model.safetensors byte for
// byte but for the checksum entry Loom adds to its metadata (and, sharded, tensor for tensor); --dtype bf16
// writes BF16; training starts from an HF directory and
// from its converted checkpoint with identical losses (neither is the random init's); bad flags, an existing
// destination and an architecture mismatch fail with exit 2 and one error line naming the flag. The MoE
// directories of tests/golden/gen_hf_moe_models.py round-trip too, and train from the HF Mixtral directory.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "loom/ckpt/hf_dir.h"
#include "loom/core/check.h"
#include "loom/train/args.h"
#include "loom/train/trainer.h"

#include "e2e_util.h"
#include "unit/ckpt/ckpt_test_util.h"

namespace fs = std::filesystem;
using namespace loom;

namespace {

const std::string kFixtures = LOOM_FIXTURE_DIR;
const std::string kGpt2 = kFixtures + "/hf_gpt2";
const std::string kLlama = kFixtures + "/hf_llama";

using e2e::CliResult;
using e2e::run_loom;
using e2e::TempDir;

std::string slurp(const std::string& path) { return e2e::read_file(path); }

// One error line from `loom <cmd>`: exit 2, the command's error prefix and `needle`. stdout may hold the
// lines a run printed before the error (e.g. `train` reaching --load after building the model).
void expect_one_line_error(const CliResult& r, const std::string& cmd, const std::string& needle) {
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find("loom " + cmd + ": error: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
}

// The tiny GPT-2's shape as `loom train` flags, on mock data of its vocabulary, without dropout so that
// runs from the same weights agree bit for bit.
const std::vector<std::string> kGpt2Train = {
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
    "--lr", "1e-3", "--mock-data", "--vocab-size", "101", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--log-interval", "1"};

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& a : v) s += a + " ";
  return s;
}

TrainResult train_in_process(const std::vector<std::string>& extra) {
  std::vector<std::string> args = kGpt2Train;
  args.insert(args.end(), extra.begin(), extra.end());
  std::ostringstream log;
  return run_training(parse_train_args(args), log);
}

}  // namespace

TEST(ConvertCli, Gpt2RoundTripIsByteIdentical) {
  TempDir tmp;
  const CliResult a = run_loom("convert --from hf:" + kGpt2 + " --to loom:" + (tmp / "ck"));
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_TRUE(a.err.empty()) << a.err;
  EXPECT_NE(a.out.find("transformer.h.*.attn.c_attn.weight -> decoder.layers.*.self_attention.linear_qkv.weight "
                       "(transposed, regrouped) x2"),
            std::string::npos)
      << a.out;
  EXPECT_NE(a.out.find("transformer.h.*.mlp.c_fc.weight -> decoder.layers.*.mlp.linear_fc1.weight (transposed) x2"),
            std::string::npos)
      << a.out;
  EXPECT_TRUE(fs::is_regular_file(tmp / "ck/iter_0000000/shard_00000.safetensors"));  // a world of one
  EXPECT_EQ(slurp(tmp / "ck/latest_checkpointed_iteration.txt"), "0");
  const CliResult b = run_loom("convert --from loom:" + (tmp / "ck") + " --to hf:" + (tmp / "hf"));
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_EQ(ckpt_test::without_checksums(slurp(tmp / "hf/model.safetensors")), slurp(kGpt2 + "/model.safetensors"));
  EXPECT_NE(slurp(tmp / "hf/config.json").find("\"model_type\": \"gpt2\""), std::string::npos);
}

TEST(ConvertCli, LlamaShardedAndBf16) {
  TempDir tmp;
  ASSERT_EQ(run_loom("convert --from hf:" + kLlama + " --to loom:" + (tmp / "ck")).code, 0);
  const CliResult sharded = run_loom("convert --from loom:" + (tmp / "ck/iter_0000000") + " --to hf:" + (tmp / "hf") +
                           " --max-shard-size 40KB");
  ASSERT_EQ(sharded.code, 0) << sharded.err;
  EXPECT_TRUE(fs::is_regular_file(tmp / "hf/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(tmp / "hf/model.safetensors"));
  // Sharded HF -> Loom again gives the very same checkpoint weights (the shards differ only in the checksum
  // of metadata.json, which names another source directory).
  ASSERT_EQ(run_loom("convert --from hf:" + (tmp / "hf") + " --to loom:" + (tmp / "ck2")).code, 0);
  EXPECT_EQ(ckpt_test::without_checksums(slurp(tmp / "ck2/iter_0000000/shard_00000.safetensors")),
            ckpt_test::without_checksums(slurp(tmp / "ck/iter_0000000/shard_00000.safetensors")));
  const HfCheckpoint a = HfCheckpoint::open(tmp / "hf"), b = HfCheckpoint::open(kLlama);
  ASSERT_EQ(a.names(), b.names());
  for (const std::string& n : a.names()) {
    const Tensor x = a.read(n, DType::kF32), y = b.read(n, DType::kF32);
    EXPECT_EQ(std::string(static_cast<const char*>(x.raw()), size_t(x.nbytes())),
              std::string(static_cast<const char*>(y.raw()), size_t(y.nbytes())))
        << n;
  }

  const CliResult bf16 = run_loom("convert --from loom:" + (tmp / "ck") + " --to hf:" + (tmp / "bf16") + " --dtype bf16");
  ASSERT_EQ(bf16.code, 0) << bf16.err;
  const HfCheckpoint c = HfCheckpoint::open(tmp / "bf16");
  EXPECT_EQ(c.config().torch_dtype, "bfloat16");
  EXPECT_EQ(c.info("lm_head.weight").dtype_str, "BF16");
  EXPECT_EQ(c.total_bytes() * 2, b.total_bytes());
}

TEST(ConvertCli, BadInvocationsFailWithOneLine) {
  TempDir tmp;
  expect_one_line_error(run_loom("convert --to loom:" + (tmp / "x")), "convert", "--from");
  expect_one_line_error(run_loom("convert --from hf:" + kGpt2), "convert", "--to");
  expect_one_line_error(run_loom("convert --from hf:" + kGpt2 + " --to hf:" + (tmp / "x")), "convert",
                        "does not go from hf: to hf:");
  expect_one_line_error(run_loom("convert --from gguf:" + kGpt2 + " --to loom:" + (tmp / "x")), "convert", "hf:DIR");
  expect_one_line_error(run_loom("convert --from hf:" + kGpt2 + " --to loom:" + (tmp / "x") + " --dtype bf16"), "convert",
                        "--dtype applies to --to hf:DIR only");
  expect_one_line_error(run_loom("convert --from hf:" + kGpt2 + " --to loom:" + (tmp / "x") + " --max-shard-size 5XB"),
                        "convert", "--max-shard-size");
  fs::create_directories(tmp / "full");
  std::ofstream(tmp / "full/keep") << "x";
  expect_one_line_error(run_loom("convert --from hf:" + kGpt2 + " --to loom:" + (tmp / "full")), "convert", "already exists");
  EXPECT_EQ(fs::directory_iterator(tmp / "full")->path().filename(), "keep");
  expect_one_line_error(run_loom("convert --from hf:" + (tmp / "nothing") + " --to loom:" + (tmp / "y")), "convert",
                        "nothing");
  expect_one_line_error(run_loom("convert --from loom:" + kFixtures + " --to hf:" + (tmp / "z")), "convert",
                        "neither a Hugging Face model directory");
  expect_one_line_error(run_loom("convert --from hf:" + kGpt2 + " --to loom:" + (tmp / "w") + " --rotary-interleaved"),
                        "convert", "--rotary-interleaved needs a RoPE model");
  const CliResult help = run_loom("convert --help");
  EXPECT_EQ(help.code, 0);
  EXPECT_NE(help.out.find("--max-shard-size"), std::string::npos) << help.out;
}

TEST(ConvertCli, TrainFinetunesFromAnHfDirectory) {
  const CliResult r = run_loom("train " + join(kGpt2Train) + "--load " + kGpt2 + " --finetune");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("successfully loaded Hugging Face model from " + kGpt2), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("iteration        2/       2"), std::string::npos) << r.out;

  expect_one_line_error(run_loom("train " + join(kGpt2Train) + "--load " + kGpt2), "train", "add --finetune");
  std::vector<std::string> wide = kGpt2Train;
  wide[3] = "64";  // --hidden-size
  expect_one_line_error(run_loom("train " + join(wide) + "--load " + kGpt2 + " --finetune"), "train", "--hidden-size");
}

TEST(ConvertCli, HfDirectoryAndItsConversionTrainIdentically) {
  TempDir tmp;
  ASSERT_EQ(run_loom("convert --from hf:" + kGpt2 + " --to loom:" + (tmp / "ck")).code, 0);
  const TrainResult from_hf = train_in_process({"--load", kGpt2, "--finetune"});
  const TrainResult from_loom = train_in_process({"--load", tmp / "ck", "--finetune"});
  const TrainResult scratch = train_in_process({});
  ASSERT_EQ(from_hf.losses.size(), 2u);
  EXPECT_EQ(from_hf.losses, from_loom.losses);
  EXPECT_NE(from_hf.losses[0], scratch.losses[0]);
  EXPECT_TRUE(std::isfinite(from_hf.losses[1]));
}

TEST(ConvertCli, MixtureOfExpertsRoundTripsAndFinetunes) {
  for (const char* name : {"hf_mixtral", "hf_qwen2_moe", "hf_qwen3_moe"}) {
    TempDir tmp;
    const std::string dir = kFixtures + "/" + name;
    const CliResult to_loom = run_loom("convert --from hf:" + dir + " --to loom:" + (tmp / "ck"));
    ASSERT_EQ(to_loom.code, 0) << to_loom.err;
    ASSERT_EQ(run_loom("convert --from loom:" + (tmp / "ck") + " --to hf:" + (tmp / "hf")).code, 0);
    EXPECT_EQ(ckpt_test::without_checksums(slurp(tmp / "hf/model.safetensors")), slurp(dir + "/model.safetensors")) << name;
  }
  // The fixture's Mixtral as `loom train` flags.
  const std::string mixtral =
      "train --num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
      "--ffn-hidden-size 48 --swiglu --normalization RMSNorm --norm-epsilon 1e-5 --position-embedding-type rope "
      "--rotary-base 1000000 --disable-bias-linear --untie-embeddings-and-output-weights --seq-length 16 "
      "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data "
      "--vocab-size 101 --log-interval 1 --moe-router-topk 2 --load " + kFixtures + "/hf_mixtral --finetune ";
  const CliResult r = run_loom(mixtral + "--num-experts 4");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("iteration        2/       2"), std::string::npos) << r.out;
  expect_one_line_error(run_loom(mixtral + "--num-experts 8"), "train", "--num-experts");
}

// `loom train --sft` end to end on data written by `loom preprocess --sft` (NullTokenizer ids): packed and
// padded runs train and evaluate over answer tokens, resume bit-exactly, the answer mask changes what is
// learned, and the SFT-specific errors name their flag or sample.
#include <cmath>
#include <cstdlib>
#include <fstream>

#include "e2e_util.h"

namespace loom::e2e {
namespace {

// 40 samples: a prompt of 3..12 ids and an answer of 2..9 ids (all < 100).
class SftTrain : public ::testing::Test {
 protected:
  void SetUp() override {
    write_sft_jsonl(dir_ / "sft.jsonl");
    for (const char* mode : {"true", "false"}) {
      const CliResult r = run_loom("preprocess --sft --input " + (dir_ / "sft.jsonl") + " --output-prefix " +
                                   (dir_ / (std::string("all") + mode)) + " --append-eod --answer-only-loss " + mode +
                                   " --tokenizer-type NullTokenizer --vocab-size 100");
      ASSERT_EQ(r.code, 0) << r.err;
    }
  }
  Args args(int64_t iters, const std::string& which = "alltrue") const {
    return {"--sft", "--data-path", dir_ / (which + "_sft_document"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "24", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters",
            std::to_string(iters), "--lr", "3e-3", "--lr-decay-style", "constant", "--log-interval", "1",
            "--eval-interval", "3", "--eval-iters", "2", "--split", "80,20,0", "--seed", "3"};
  }
  TempDir dir_{"sft"};
};

TEST_F(SftTrain, PackedRunTrainsEvaluatesAndResumesBitExact) {
  std::string log;
  const TrainResult full = train(args(6), &log);
  ASSERT_EQ(full.losses.size(), 6u);
  for (double l : full.losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_NE(log.find("data: train SFT train "), std::string::npos) << log;
  EXPECT_NE(log.find(" samples packed into "), std::string::npos) << log;
  EXPECT_NE(log.find("data: validation SFT valid "), std::string::npos) << log;
  ASSERT_EQ(full.valid_losses.size(), 2u);
  const std::string ck = dir_ / "ck";
  train(cat(args(6), {"--save", ck, "--exit-interval", "3"}));
  const TrainResult resumed = train(cat(args(6), {"--load", ck}));
  ASSERT_EQ(resumed.start_iteration, 3);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(resumed.losses[i], full.losses[3 + i]) << "iteration " << 4 + i;
}

TEST_F(SftTrain, AnswerMaskPaddingAndOverlongChangeTheRun) {
  const TrainResult answer_only = train(args(3));
  const TrainResult every_token = train(args(3, "allfalse"));
  EXPECT_NE(answer_only.losses[0], every_token.losses[0]);  // the prompt tokens enter the loss
  std::string log;
  const TrainResult padded = train(cat(args(3), {"--no-sft-packing"}), &log);
  EXPECT_NE(log.find(" samples padded to "), std::string::npos) << log;
  EXPECT_NE(padded.losses[0], answer_only.losses[0]);
  // The longest samples (12 + 9 + EOD = 22 tokens) do not fit --seq-length 15 + 1.
  Args shorter = args(3);
  for (size_t i = 0; i + 1 < shorter.size(); ++i)
    if (shorter[i] == "--seq-length") shorter[i + 1] = "15";
  std::string tlog;
  train(shorter, &tlog);
  EXPECT_NE(tlog.find(" truncated"), std::string::npos) << tlog;
  const std::string err = train_error(cat(shorter, {"--sft-overlong", "error"}));
  EXPECT_NE(err.find("more than --seq-length + 1 = 16; --sft-overlong truncate or skip"), std::string::npos) << err;
}

TEST_F(SftTrain, SftErrorsNameTheFlag) {
  EXPECT_NE(train_error(cat(args(3), {"--reset-position-ids"})).find("drop --reset-position-ids"), std::string::npos);
  EXPECT_NE(train_error(cat(args(3), {"--sft-overlong", "cut"})).find("(valid: truncate, skip, error)"),
            std::string::npos);
  Args mock = {"--sft", "--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "32",
               "--num-attention-heads", "4", "--seq-length", "24", "--micro-batch-size", "2", "--train-iters", "3",
               "--lr", "1e-3"};
  EXPECT_NE(train_error(mock).find("--sft reads one --data-path prefix"), std::string::npos);
  // A GPT dataset (no loss mask beside it) is not SFT data.
  const std::string err = train_error(cat(args(3, "x"), {}));
  EXPECT_NE(err.find("x_sft_document"), std::string::npos) << err;
}

// NeMo's packed records (.npy, the MLPerf Llama-2 70B LoRA layout) as --train-data-path/--valid-data-path.
TEST_F(SftTrain, NpyPackedRecordsTrainAndResume) {
  const std::string gen = dir_ / "gen.py";
  std::ofstream(gen) << "import numpy as np\n"
                        "rng = np.random.RandomState(0)\n"
                        "def recs(n):\n"
                        "    out = []\n"
                        "    for _ in range(n):\n"
                        "        lens = [int(x) for x in rng.randint(3, 9, size=3)]\n"
                        "        ids = [int(x) for x in rng.randint(0, 100, size=sum(lens))]\n"
                        "        mask = [int(x) for x in (rng.rand(sum(lens)) > 0.4)]\n"
                        "        starts = [0, lens[0], lens[0] + lens[1]]\n"
                        "        out.append({'input_ids': ids, 'loss_mask': mask, 'seq_start_id': starts})\n"
                        "    return np.array(out, dtype=object)\n"
                        "np.save('" << (dir_ / "train.npy") << "', recs(12))\n"
                        "np.save('" << (dir_ / "validation.npy") << "', recs(4))\n";
  ASSERT_EQ(std::system(("/usr/bin/python3 " + gen).c_str()), 0);
  const Args npy = {"--train-data-path", dir_ / "train.npy", "--valid-data-path", dir_ / "validation.npy",
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "2", "--hidden-size",
                    "32", "--num-attention-heads", "4", "--seq-length", "24", "--micro-batch-size", "2",
                    "--global-batch-size", "4", "--lr", "3e-3", "--lr-decay-style", "constant", "--log-interval", "1",
                    "--eval-interval", "3", "--eval-iters", "1", "--seed", "3"};
  std::string log;
  const TrainResult full = train(cat(npy, {"--train-iters", "6"}), &log);
  ASSERT_EQ(full.losses.size(), 6u);
  EXPECT_NE(log.find("data: train packed SFT records "), std::string::npos) << log;
  EXPECT_NE(log.find("12 records of up to 25 tokens"), std::string::npos) << log;
  EXPECT_EQ(full.valid_losses.size(), 2u);
  const std::string ck = dir_ / "npyck";
  train(cat(npy, {"--train-iters", "6", "--save", ck, "--exit-interval", "3"}));
  const TrainResult resumed = train(cat(npy, {"--train-iters", "6", "--load", ck}));
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(resumed.losses[i], full.losses[3 + i]);
  // A record longer than --seq-length + 1 names the file and the record.
  Args shorter = cat(npy, {"--train-iters", "2"});
  for (size_t i = 0; i + 1 < shorter.size(); ++i)
    if (shorter[i] == "--seq-length") shorter[i + 1] = "8";
  EXPECT_NE(train_error(shorter).find("train.npy: record "), std::string::npos);
  Args mixed = cat(npy, {"--train-iters", "2"});
  mixed[3] = dir_ / "alltrue_sft_document";
  EXPECT_NE(train_error(mixed).find("--valid-data-path: with a .npy --train-data-path"), std::string::npos);
}

}  // namespace
}  // namespace loom::e2e

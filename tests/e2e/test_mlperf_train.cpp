// `loom train --mlperf-log FILE --target-eval-loss X` end to end on a tiny SFT set (answer-only loss, so
// sequences have different numbers of loss tokens): a reachable target stops at the first evaluation with
// run_stop success, an unreachable one trains to --train-iters and ends aborted, the log passes Loom's own
// structure check (tests/e2e/check_mllog.py, with /usr/bin/python3) and its eval_accuracy values are the
// run's per-sequence metric; the target works without a log; the flags' errors name them.
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>

#include "e2e_util.h"

namespace loom::e2e {
namespace {

class MlperfTrain : public ::testing::Test {
 protected:
  void SetUp() override {
    write_sft_jsonl(dir_ / "sft.jsonl");
    const CliResult r = run_loom("preprocess --sft --input " + (dir_ / "sft.jsonl") + " --output-prefix " +
                                 (dir_ / "d") + " --append-eod --answer-only-loss true --tokenizer-type NullTokenizer "
                                 "--vocab-size 100");
    ASSERT_EQ(r.code, 0) << r.err;
  }
  Args args(int64_t iters) const {
    return {"--sft", "--data-path", dir_ / "d_sft_document", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "100", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "24",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", std::to_string(iters), "--lr",
            "3e-3", "--lr-decay-style", "cosine", "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "2",
            "--split", "80,20,0", "--seed", "3", "--device", "cpu"};
  }
  // Loom's structure check of the log; skipped (true) without Debian's python3.
  static void expect_log_passes(const std::string& log, const std::string& flags) {
    if (::access("/usr/bin/python3", X_OK) != 0) GTEST_SKIP() << "no /usr/bin/python3";
    const std::string cmd = "/usr/bin/python3 " + std::string(LOOM_SOURCE_DIR) + "/tests/e2e/check_mllog.py " + log +
                            " " + flags + " 2>&1";
    std::string out;
    if (FILE* p = ::popen(cmd.c_str(), "r")) {
      char buf[4096];
      for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
      EXPECT_EQ(::pclose(p), 0) << out;
    } else {
      ADD_FAILURE() << "cannot run " << cmd;
    }
  }
  static std::vector<nlohmann::json> events(const std::string& path) {
    std::vector<nlohmann::json> out;
    for (const std::string& l : lines_of(read_file(path))) out.push_back(nlohmann::json::parse(l.substr(9)));
    return out;
  }
  TempDir dir_{"mlperf"};
};

TEST_F(MlperfTrain, ReachedTargetStopsWithSuccess) {
  const std::string log_path = dir_ / "out/mllog.txt";
  std::string log;
  const TrainResult r = train(cat(args(6), {"--mlperf-log", log_path, "--target-eval-loss", "100"}), &log);
  EXPECT_EQ(r.exit_reason, "target-eval-loss");
  EXPECT_EQ(r.final_iteration, 2);
  ASSERT_EQ(r.valid_sequence_losses.size(), 1u);
  EXPECT_NE(log.find("] target reached at iteration 2 (consumed samples: 8): MLPerf validation metric "),
            std::string::npos) << log;
  EXPECT_NE(log.find(" validation loss at iteration 2 | lm loss value: "), std::string::npos) << log;  // Megatron's
  EXPECT_EQ(log.find(" on validation set |"), std::string::npos) << log;  // an exit: no final evaluations
  expect_log_passes(log_path, "--status success --target 100");
  const std::vector<nlohmann::json> ev = events(log_path);
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev.back()["metadata"]["samples_count"], 8);
  EXPECT_EQ(ev.back()["metadata"]["status"], "success");
}

TEST_F(MlperfTrain, UnreachedTargetTrainsToTheEndAborted) {
  const std::string log_path = dir_ / "mllog.txt";
  std::string log;
  const TrainResult r = train(cat(args(6), {"--mlperf-log", log_path, "--target-eval-loss", "0.001"}), &log);
  EXPECT_EQ(r.exit_reason, "train-iters");
  EXPECT_EQ(r.final_iteration, 6);
  ASSERT_EQ(r.valid_sequence_losses.size(), 3u);
  ASSERT_EQ(r.valid_losses.size(), 3u);
  expect_log_passes(log_path, "--status aborted --target 0.001");
  std::vector<double> accuracy;
  int64_t train_losses = 0;
  for (const nlohmann::json& e : events(log_path)) {
    if (e["key"] == "eval_accuracy") accuracy.push_back(e["value"].get<double>());
    if (e["key"] == "train_loss") ++train_losses;
    if (e["key"] == "global_batch_size") {
      EXPECT_EQ(e["value"], 4);
    }
    if (e["key"] == "gradient_accumulation_steps") {
      EXPECT_EQ(e["value"], 2);
    }
    if (e["key"] == "run_stop") {
      EXPECT_EQ(e["metadata"]["samples_count"], 24);
    }
  }
  EXPECT_EQ(train_losses, 6);
  ASSERT_EQ(accuracy.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(accuracy[i], r.valid_sequence_losses[i].second);
    // Answers of different lengths: weighing sequences alike differs from Megatron's micro-batch means.
    EXPECT_NE(accuracy[i], r.valid_losses[i].second);
  }
  // With a target every evaluation scores the same validation samples (MLPerf's rule), so the metric only
  // moves because the weights do.
  EXPECT_NE(log.find(" > MLPerf validation metric (mean per-sequence loss over 8 sequences): "), std::string::npos)
      << log;
}

TEST_F(MlperfTrain, TargetWorksWithoutTheLogAndTheLogWithoutATarget) {
  const TrainResult stopped = train(cat(args(6), {"--target-eval-loss", "100"}));
  EXPECT_EQ(stopped.exit_reason, "target-eval-loss");
  EXPECT_EQ(stopped.final_iteration, 2);
  const std::string log_path = dir_ / "plain.txt";
  const TrainResult full = train(cat(args(4), {"--mlperf-log", log_path, "--mlperf-submission-division", "open",
                                               "--mlperf-submission-org", "Acme", "--mlperf-submission-platform",
                                               "tiny"}));
  EXPECT_EQ(full.final_iteration, 4);
  expect_log_passes(log_path, "--status aborted");
  for (const nlohmann::json& e : events(log_path)) {
    if (e["key"] == "submission_division") {
      EXPECT_EQ(e["value"], "open");
    }
    if (e["key"] == "submission_org") {
      EXPECT_EQ(e["value"], "Acme");
    }
    if (e["key"] == "submission_platform") {
      EXPECT_EQ(e["value"], "tiny");
    }
  }
}

TEST_F(MlperfTrain, FlagErrorsNameTheFlag) {
  const auto error_has = [&](const Args& extra, const std::string& needle) {
    const std::string err = train_error(cat(args(6), extra));
    EXPECT_NE(err.find(needle), std::string::npos) << err;
  };
  error_has({"--target-eval-loss", "0"}, "--target-eval-loss must be a finite loss > 0");
  error_has({"--target-eval-loss", "0.9", "--eval-iters", "0"}, "--target-eval-loss needs evaluation: set --eval-iters");
  error_has({"--target-eval-loss", "0.9", "--eval-interval", "7"},
            "--eval-interval (7) is larger than --train-iters (6)");
  error_has({"--target-eval-loss", "0.9", "--split", "100,0,0"}, "--target-eval-loss needs a validation set");
  error_has({"--mlperf-submission-org", "X"}, "add --mlperf-log or drop them");
  error_has({"--mlperf-log", dir_ / "x", "--mlperf-submission-division", "closedish"},
            "--mlperf-submission-division must be closed or open, got 'closedish'");
  error_has({"--mlperf-log", dir_ / "x", "--mlperf-submission-status", "lab"},
            "--mlperf-submission-status must be onprem, cloud, preview or research");
  error_has({"--mlperf-log", dir_ / "x", "--optimizer", "sgd"}, "use --optimizer adam, or --mlperf-submission-division open");
}

}  // namespace
}  // namespace loom::e2e

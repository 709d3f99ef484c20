// MLPerf's validation metric (--mlperf-log eval_accuracy: the mean over sequences of their mean masked
// loss) under mpirun against the single-process run, on SFT data whose sequences have different numbers of
// loss tokens: data-parallel ranks add their sums of means and counts, context-parallel ranks each hold
// part of every sequence, tensor-parallel ranks share the vocabulary, and only the last pipeline stage has
// losses; rank 0 writes the log in every layout.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "e2e/e2e_util.h"

namespace loom::e2e {
namespace {

std::string sft_data(const TempDir& dir) {
  std::ofstream f(dir / "sft.jsonl");
  for (int k = 0; k < 60; ++k) {
    std::string in, out;
    for (int i = 0; i < 3 + k % 10; ++i) in += std::to_string((k * 7 + i * 3) % 97) + " ";
    for (int i = 0; i < 2 + k % 8; ++i) out += std::to_string((k + i * 5) % 89) + " ";
    f << "{\"input\": \"" << in << "\", \"output\": \"" << out << "\"}\n";
  }
  f.close();
  const CliResult r = run_loom("preprocess --sft --input " + (dir / "sft.jsonl") + " --output-prefix " + (dir / "d") +
                               " --append-eod --answer-only-loss true --tokenizer-type NullTokenizer --vocab-size 100");
  EXPECT_EQ(r.code, 0) << r.err;
  return dir / "d_sft_document";
}

// The eval_accuracy values of a run's MLPerf log (np 1: a single process, no launcher).
std::vector<double> eval_accuracies(const std::string& data, const std::string& flags, int np) {
  TempDir tmp("dist_mlperf");
  const std::string log = tmp / "mllog.txt";
  const std::string launcher = np > 1 ? std::string(LOOM_MPIEXEC) +
                                            " --allow-run-as-root --oversubscribe --bind-to none -np " +
                                            std::to_string(np) + " -x OMP_NUM_THREADS=1 "
                                      : std::string("OMP_NUM_THREADS=1 ");
  const std::string cmd =
      launcher + LOOM_BINARY + " train --sft --data-path " + data +
      " --tokenizer-type NullTokenizer --vocab-size 100 --num-layers 2 --hidden-size 32 --num-attention-heads 4 "
      "--seq-length 24 --micro-batch-size 2 --global-batch-size 8 --train-iters 4 --lr 3e-3 --lr-decay-style "
      "cosine --log-interval 1 --eval-interval 2 --eval-iters 2 --split 70,30,0 --seed 3 --hidden-dropout 0 "
      "--attention-dropout 0 --target-eval-loss 0.001 --mlperf-log " + log + " " + flags + " >" + (tmp / "out") +
      " 2>&1";
  const int st = std::system(cmd.c_str());
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << cmd << "\n" << read_file(tmp / "out");
  std::vector<double> out;
  for (const std::string& l : lines_of(read_file(log))) {
    const nlohmann::json j = nlohmann::json::parse(l.substr(9));
    if (j["key"] == "eval_accuracy") out.push_back(j["value"].get<double>());
  }
  return out;
}

TEST(DistMlperf, SequenceMetricMatchesSingleProcess) {
  TempDir dir("dist_mlperf_data");
  const std::string data = sft_data(dir);
  const std::vector<double> ref = eval_accuracies(data, "", 1);
  ASSERT_EQ(ref.size(), 2u);
  const std::pair<int, const char*> layouts[] = {
      {2, ""},                                  // DP2
      {2, "--tensor-model-parallel-size 2"},    // TP2: vocabulary-parallel cross-entropy
      {2, "--pipeline-model-parallel-size 2"},  // PP2: rank 0 holds no losses
      {2, "--context-parallel-size 2"},         // CP2: each rank holds half of every sequence
      {4, "--pipeline-model-parallel-size 2 --context-parallel-size 2"},
  };
  for (const auto& [np, flags] : layouts) {
    const std::vector<double> got = eval_accuracies(data, flags, np);
    ASSERT_EQ(got.size(), ref.size()) << flags;
    for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], 1e-5 * ref[i]) << "np " << np << " " << flags;
  }
}

}  // namespace
}  // namespace loom::e2e

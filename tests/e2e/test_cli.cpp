// End-to-end CLI checks: bad input gives one clear error line on stderr, a non-zero exit code, nothing
// on stdout and no files written; a small run prints Megatron's log lines.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace fs = std::filesystem;

namespace {

struct CliResult {
  int code = -1;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Runs `loom <args>` in a fresh empty directory and checks nothing was written there.
CliResult loom(const std::string& args, bool expect_clean_dir = true) {
  const fs::path dir = fs::temp_directory_path() / ("loom_e2e_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string tag = std::to_string(::getpid());  // ctest runs tests in parallel processes
  const fs::path out = fs::temp_directory_path() / ("loom_e2e_stdout_" + tag),
                 err = fs::temp_directory_path() / ("loom_e2e_stderr_" + tag);
  const std::string cmd = "cd " + dir.string() + " && OMP_NUM_THREADS=1 " + LOOM_BINARY + " " + args + " >" +
                          out.string() + " 2>" + err.string();
  const int status = std::system(cmd.c_str());
  CliResult r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  if (expect_clean_dir) {
    EXPECT_TRUE(fs::is_empty(dir)) << "files written for: " << args;
  }
  fs::remove_all(dir);
  fs::remove(out);
  fs::remove(err);
  return r;
}

const std::string kModel =
    "train --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
    "--train-iters 4 --lr 1e-3 ";

void expect_one_line_error(const CliResult& r, const std::string& needle) {
  EXPECT_NE(r.code, 0);
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
}

}  // namespace

TEST(Cli, UnknownFlag) {
  expect_one_line_error(loom(kModel + "--mock-data --vocab-size 50 --micro-bach-size 2"),
                        "unknown flag --micro-bach-size (did you mean --micro-batch-size?)");
}

TEST(Cli, MegatronFlagNotInThisBuild) {
  expect_one_line_error(loom(kModel + "--mock-data --vocab-size 50 --use-distributed-optimizer"),
                        "--use-distributed-optimizer (a flag of Megatron's pretrain_gpt.py) is not supported by Loom "
                        "yet");
}

TEST(Cli, UniquePrefixAndUnderscoresAsArgparse) {
  const CliResult r = loom("train --num_layers 2 --hidden-size 32 --num-attention-heads 4 --seq-len 16 "
                           "--micro-batch-size 2 --train-iters 2 --lr 1e-3 --mock-data --vocab-size 50");
  EXPECT_EQ(r.code, 0) << r.err;
  expect_one_line_error(loom(kModel + "--mock-data --vocab-size 50 --lr-"), "ambiguous flag --lr-");
}

TEST(Cli, GlobalBatchNotDivisibleByMicro) {
  expect_one_line_error(loom(kModel + "--mock-data --vocab-size 50 --global-batch-size 3"),
                        "--global-batch-size (3) must be divisible by --micro-batch-size (2)");
}

TEST(Cli, HiddenNotDivisibleByHeads) {
  expect_one_line_error(loom(kModel + "--mock-data --vocab-size 50 --num-attention-heads 5"),
                        "--hidden-size (32) must be divisible by --num-attention-heads (5)");
}

TEST(Cli, MissingDataFile) {
  expect_one_line_error(
      loom(kModel + "--data-path /nonexistent/corpus_text_document --tokenizer-type NullTokenizer --vocab-size 50"),
      "/nonexistent/corpus_text_document.idx");
}

TEST(Cli, UnknownCommandAndHelp) {
  CliResult r = loom("trian");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("unknown command 'trian'"), std::string::npos);
  r = loom("train --help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("--global-batch-size"), std::string::npos);
}

TEST(Cli, TrainPrintsMegatronLogLines) {
  const CliResult r = loom(kModel + "--mock-data --vocab-size 50 --global-batch-size 4 --log-interval 2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("setting number of micro-batches to constant 2"), std::string::npos);
  EXPECT_NE(r.out.find(" > padded vocab (size: 50) with 78 dummy tokens (new size: 128)"), std::string::npos);
  for (const char* field : {"iteration        2/       4 |", "consumed samples:            8 |",
                            "consumed tokens:          128 |", "elapsed time per iteration (ms): ", "learning rate: ",
                            "global batch size:     4 |", "lm loss: ", "loss scale: 1.0 |", "grad norm: ",
                            "number of skipped iterations:   0 |", "number of nan iterations:   0 |",
                            "samples per second: ", "TFLOPs: "})
    EXPECT_NE(r.out.find(field), std::string::npos) << field << "\n" << r.out;
}

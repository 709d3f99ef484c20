// Shared helpers of the end-to-end tests (tests/e2e/*.cpp), all in namespace loom::e2e:
//
//   CliResult r = run_loom("calc --num-layers 2 ...", cwd);  // the built binary: {code, out, err}
//   expect_one_line_error(r, "--num-layers");                 // exit 2, empty stdout, one stderr line
//   TempDir tmp("tag");  tmp / "ckpt"                         // fresh directory, removed at scope exit
//   read_file(path)                                           // whole file as bytes
//   train(args, &log) / train_error(args)                     // `loom train` in-process (run_training)
//   cat(a, b), lines_of(text), count_of(text, needle)         // argument lists and text
//   iteration_of(line), log_field(line, "lm loss")            // Megatron iteration log lines
//
// run_loom runs the binary through the shell with OMP_NUM_THREADS=1 (fast on a loaded machine; results do
// not depend on the thread count), so `args` are shell words: quote what needs quoting. stdout and stderr
// go to files in a private TempDir, never into `cwd`, so a test may check that a run wrote nothing there.
// TempDirs live on /dev/shm when it is writable (tmpfs: checkpoint fsyncs cost nothing) and are unique per
// process and object, so ctest may run tests in parallel.
#pragma once
#include <gtest/gtest.h>
#include <omp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "loom/core/check.h"
#include "loom/train/args.h"
#include "loom/train/trainer.h"

namespace loom::e2e {

// What a run of the loom binary left: its exit code (-1 if it did not exit normally) and its output.
struct CliResult {
  int code = -1;
  std::string out, err;
};

// The whole file as bytes; a file that cannot be opened is a test failure (and reads as "").
inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << "cannot open " << path;
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A fresh empty directory, removed with everything in it when the object goes out of scope.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "tmp") {
    static std::atomic<int> counter{0};
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path base = fs::is_directory("/dev/shm", ec) && ::access("/dev/shm", W_OK) == 0
                              ? fs::path("/dev/shm")
                              : fs::temp_directory_path();
    path_ = (base / ("loom_e2e_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++)))
                .string();
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // The path of `name` inside the directory (which need not exist).
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }
  const std::string& str() const { return path_; }

 private:
  std::string path_;
};

namespace detail {
inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}
}  // namespace detail

// Runs `LOOM_BINARY <args>` (shell words) with OMP_NUM_THREADS=1, in `cwd` when it is not empty.
inline CliResult run_loom(const std::string& args, const std::string& cwd = "") {
  const TempDir io("io");
  const std::string cmd = (cwd.empty() ? "" : "cd " + detail::shell_quote(cwd) + " && ") + "OMP_NUM_THREADS=1 " +
                          LOOM_BINARY + " " + args + " >" + (io / "stdout") + " 2>" + (io / "stderr");
  const int status = std::system(cmd.c_str());
  CliResult r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_file(io / "stdout");
  r.err = read_file(io / "stderr");
  return r;
}

// A command line rejected as bad user input: exit code 2, nothing on stdout, exactly one line on stderr,
// and that line contains `needle`.
inline void expect_one_line_error(const CliResult& r, const std::string& needle) {
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
}

// A small SFT set of NullTokenizer ids (all < 100): `n` samples, sample k a prompt of 3 + k % 10 ids and an
// answer of 2 + k % 8 ids, one {"input", "output"} JSON line each (the SFT and MLPerf e2e tests share it).
inline void write_sft_jsonl(const std::string& path, int n = 40) {
  std::ofstream f(path);
  for (int k = 0; k < n; ++k) {
    std::string in, out;
    for (int i = 0; i < 3 + k % 10; ++i) in += std::to_string((k * 7 + i * 3) % 97) + " ";
    for (int i = 0; i < 2 + k % 8; ++i) out += std::to_string((k + i * 5) % 89) + " ";
    f << "{\"input\": \"" << in << "\", \"output\": \"" << out << "\"}\n";
  }
}

// ---- in-process `loom train` --------------------------------------------------------------------------

using Args = std::vector<std::string>;

inline Args cat(Args a, const Args& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// parse_train_args + run_training with one OpenMP thread; the log goes to *log_out when given.
inline TrainResult train(const Args& args, std::string* log_out = nullptr) {
  omp_set_num_threads(1);
  std::ostringstream log;
  TrainResult r = run_training(parse_train_args(args), log);
  if (log_out) *log_out = log.str();
  return r;
}

// The UserError message of a run that must fail (a test failure, and "", when it does not throw one).
inline std::string train_error(const Args& args) {
  omp_set_num_threads(1);
  std::ostringstream log;
  try {
    run_training(parse_train_args(args), log);
  } catch (const UserError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a UserError; log:\n" << log.str();
  return "";
}

// ---- text ---------------------------------------------------------------------------------------------

inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// Occurrences of `needle` in `text` (overlapping ones included).
inline size_t count_of(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t p = text.find(needle); p != std::string::npos; p = text.find(needle, p + 1)) ++n;
  return n;
}

// The iteration number of a Megatron iteration log line ("... iteration       3/      10 | ..."), or -1.
inline int64_t iteration_of(const std::string& line) {
  static const std::regex re(R"(\] iteration\s+(\d+)/\s*\d+ \|)");
  std::smatch m;
  return std::regex_search(line, m, re) ? std::stoll(m[1]) : -1;
}

// The value text of "| <field>: X |" in a log line ("" when absent).
inline std::string log_field(const std::string& line, const std::string& field) {
  const std::string key = "| " + field + ": ";
  const size_t p = line.find(key);
  if (p == std::string::npos) return "";
  const size_t b = p + key.size();
  return line.substr(b, line.find(" |", b) - b);
}

}  // namespace loom::e2e

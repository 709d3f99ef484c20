// Shared by the distributed `loom train` tests: run `loom train` (under mpirun for np > 1) and read the
// per-iteration losses from --metrics-jsonl (full precision).
#pragma once
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "e2e/e2e_util.h"

namespace loom::e2e {

inline std::string loom_bin() { return LOOM_BINARY; }

inline CliResult run_shell(const std::string& cmd, const TempDir& tmp) {
  const std::string out = (tmp / "stdout"), err = (tmp / "stderr");
  const int st = std::system((cmd + " >" + out + " 2>" + err).c_str());
  CliResult r;
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  r.out = read_file(out);
  r.err = read_file(err);
  return r;
}

inline std::string mpirun(int np) {
  return std::string(LOOM_MPIEXEC) + " --allow-run-as-root --oversubscribe --bind-to none -np " + std::to_string(np) +
         " -x OMP_NUM_THREADS=1 ";
}

inline std::vector<double> jsonl_losses(const std::string& path) {
  std::vector<double> out;
  for (const std::string& line : lines_of(read_file(path))) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("lm loss") && j.contains("consumed samples")) out.push_back(j["lm loss"].get<double>());
  }
  return out;
}

// Runs `loom train` (np == 1: a single process, no launcher) and returns the losses of every iteration.
inline std::vector<double> train_losses(const std::string& model, const std::string& extra, int np, int iters,
                                 std::string* log = nullptr) {
  TempDir tmp("dist");
  const std::string jsonl = (tmp / "m.jsonl");
  const std::string cmd = (np > 1 ? mpirun(np) : std::string("OMP_NUM_THREADS=1 ")) + loom_bin() + " train " + model +
                          " --train-iters " + std::to_string(iters) + " --metrics-jsonl " + jsonl + " " + extra;
  const CliResult r = run_shell(cmd, tmp);
  EXPECT_EQ(r.code, 0) << cmd << "\n" << r.out << r.err;
  if (log) *log = r.out;
  return jsonl_losses(jsonl);
}

inline void expect_close(const std::vector<double>& ref, const std::vector<double>& got, double rel, const std::string& what) {
  ASSERT_EQ(ref.size(), got.size()) << what;
  for (size_t i = 0; i < ref.size(); ++i)
    EXPECT_NEAR(got[i], ref[i], rel * std::abs(ref[i])) << what << ": iteration " << i + 1;
}

}  // namespace loom::e2e

// Fault handling of the MPI communicator, end to end: starts mpirun on dist_fault_child and checks the
// job's exit status, how long it took and what it printed. A hang would show up as the 60 s `timeout`
// guard's status 124 and a long elapsed time.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <sys/wait.h>

namespace {

struct JobResult {
  int status = -1;  // exit status of the job (mpirun's), or 128 + signal
  double seconds = 0;
  std::string output;  // stdout and stderr of every rank
};

#ifdef LOOM_MPIRUN
JobResult run_job(int np, const std::string& mode) {
  const std::string cmd = std::string("timeout 60 ") + LOOM_MPIRUN +
                          " --allow-run-as-root --oversubscribe --bind-to none -np " + std::to_string(np) +
                          " -x OMP_NUM_THREADS=1 " + LOOM_FAULT_CHILD + " " + mode + " 2>&1";
  JobResult r;
  const auto start = std::chrono::steady_clock::now();
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int st = pclose(p);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}
#endif

class MpiFault : public ::testing::Test {
 protected:
  void SetUp() override {
#ifndef LOOM_MPIRUN
    GTEST_SKIP() << "no mpirun found at configure time";
#endif
  }
};

TEST_F(MpiFault, CleanRunExitsZero) {
#ifdef LOOM_MPIRUN
  const JobResult r = run_job(2, "ok");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_LT(r.seconds, 20.0) << r.output;
#endif
}

TEST_F(MpiFault, MismatchedCollectivesAbortWithOperationAndGroup) {
#ifdef LOOM_MPIRUN
  const JobResult r = run_job(2, "mismatch");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.status, 124) << "the job hung until the guard killed it:\n" << r.output;
  EXPECT_LT(r.seconds, 15.0) << r.output;
  EXPECT_NE(r.output.find("did not complete within 2.0 s (--distributed-timeout-minutes)"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("on group fault-test (global ranks 0,1)"), std::string::npos) << r.output;
  EXPECT_TRUE(r.output.find("[loom] rank 1: all_reduce on group fault-test") != std::string::npos ||
              r.output.find("[loom] rank 0: barrier on group fault-test") != std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("mismatched collective returned"), std::string::npos) << r.output;
#endif
}

TEST_F(MpiFault, DeadRankEndsTheJobQuickly) {
#ifdef LOOM_MPIRUN
  const JobResult r = run_job(3, "die");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.status, 124) << "the job hung until the guard killed it:\n" << r.output;
  // The ranks' own timeout is 60 s: ending well before it means the launcher ended the survivors.
  EXPECT_LT(r.seconds, 20.0) << r.output;
#endif
}

}  // namespace

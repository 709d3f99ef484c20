// Resume bit-exactness of `loom train` (the acceptance test of checkpoints): a run stopped at iteration k
// and resumed with --load must print the same loss at every iteration as a run that never stopped, and
// end with byte-identical model.safetensors / optimizer.safetensors / metadata.json. Three ways to stop:
// --exit-interval (in-process), SIGTERM with --exit-signal-handler and kill -9 (three times at random
// moments, resuming in between) after --save-interval saves (both on the loom binary, since a signal has
// to hit a separate process). Each runs with fp32,
// --bf16, --fp16 (a dynamic loss scale that changes during the run) and FP8 (delayed scaling with an
// amax history: fp8_state.safetensors must restore it), with Megatron's default dropout on so that the
// dropout RNG state has to be restored too.
//
// The child's stdout is a pipe shrunk to one page: a child that runs ahead of the reader blocks on its
// log lines, so it cannot get more than ~12 iterations past the line the test reacts to, which keeps the
// iteration it stops at well inside --train-iters without any sleeps.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <omp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "e2e_util.h"
#include "loom/core/check.h"
#include "loom/train/args.h"
#include "loom/train/trainer.h"

namespace fs = std::filesystem;
using namespace loom;
using namespace loom::e2e;

namespace {

int64_t read_tracker(const std::string& root) {
  const std::string text = read_file(root + "/latest_checkpointed_iteration.txt");
  return text.empty() ? -1 : std::stoll(text);
}

std::string iter_dir(const std::string& root, int64_t it) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "/iter_%07lld", (long long)it);
  return root + buf;
}

// Tiny GPT on mock data; every flag that matters for resume is set explicitly. One OpenMP thread keeps
// the runs fast on a loaded machine (losses do not depend on the thread count).
Args tiny_args(const std::string& precision, int64_t iters) {
  Args a = {"--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", std::to_string(iters),
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "3", "--lr-decay-style", "cosine",
            "--mock-data", "--vocab-size", "100", "--log-interval", "1", "--eval-iters", "0", "--seed", "77"};
  if (precision == "bf16") a.push_back("--bf16");
  // FP8 (emulated): a 4-step amax history with "max" makes the scaling state matter across a resume.
  if (precision == "fp8")
    a = cat(a, {"--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"});
  // 65536 doubles every 4 clean iterations and overflows (fp16 dlogits) near 2^22: the scale changes
  // during every run, so a resume that loses the scaler state shows up.
  if (precision == "fp16") a = cat(a, {"--fp16", "--initial-loss-scale", "65536", "--loss-scale-window", "4"});
  return a;
}

template <typename T>
std::vector<T> concat(std::vector<T> a, const std::vector<T>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

template <typename T>
std::vector<T> tail(const std::vector<T>& v, size_t from) {
  return from >= v.size() ? std::vector<T>{} : std::vector<T>(v.begin() + int64_t(from), v.end());
}

// Bitwise equality of doubles (NaN grad norms of skipped fp16 iterations compare equal to NaN).
bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
}

// iteration -> the "lm loss: X" text of its log line ("" when the line has none: a skipped iteration).
std::map<int64_t, std::string> lm_loss_by_iteration(const std::string& log) {
  std::map<int64_t, std::string> out;
  for (const std::string& line : lines_of(log))
    if (const int64_t it = iteration_of(line); it >= 0) out[it] = log_field(line, "lm loss");
  return out;
}

void expect_same_checkpoint_files(const std::string& a, const std::string& b) {
  // A world of one: one shard (weights, Adam moments, FP8 state) and the metadata.
  for (const char* f : {"shard_00000.safetensors", "metadata.json"}) {
    const std::string x = read_file(a + "/" + f), y = read_file(b + "/" + f);
    EXPECT_FALSE(x.empty()) << a << "/" << f;
    EXPECT_TRUE(x == y) << f << " differs between " << a << " and " << b;
  }
}

// `loom train <args>` as a child process; stdout is a one-page pipe read line by line, stderr a file.
class LoomChild {
 public:
  LoomChild(const Args& args, const std::string& stderr_path) {
    // Everything the child needs is built before fork(): only async-signal-safe calls after it.
    std::vector<std::string> strs = {LOOM_BINARY, "train"};
    strs.insert(strs.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& s : strs) argv.push_back(s.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_strs = {"OMP_NUM_THREADS=1"};
    for (char** e = environ; *e; ++e)
      if (std::strncmp(*e, "OMP_NUM_THREADS=", 16) != 0) env_strs.emplace_back(*e);
    std::vector<char*> envp;
    for (std::string& s : env_strs) envp.push_back(s.data());
    envp.push_back(nullptr);
    const int err_fd = ::open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    LOOM_CHECK(err_fd >= 0, "cannot create ", stderr_path);
    int fds[2];
    LOOM_CHECK(::pipe2(fds, O_CLOEXEC) == 0, "pipe failed");
    ::fcntl(fds[0], F_SETPIPE_SZ, 4096);
    pid_ = ::fork();
    LOOM_CHECK(pid_ >= 0, "fork failed");
    if (pid_ == 0) {
      ::dup2(fds[1], STDOUT_FILENO);
      ::dup2(err_fd, STDERR_FILENO);
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(127);
    }
    ::close(fds[1]);
    ::close(err_fd);
    fd_ = fds[0];
  }
  ~LoomChild() {
    if (fd_ >= 0) ::close(fd_);
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }

  // The next stdout line (without '\n'), or nullopt at EOF.
  std::optional<std::string> next_line() {
    for (;;) {
      const size_t nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        out_ += line + "\n";
        return line;
      }
      char chunk[4096];
      const ssize_t n = ::read(fd_, chunk, sizeof chunk);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        if (buf_.empty()) return std::nullopt;
        std::string line;
        line.swap(buf_);
        out_ += line;
        return line;
      }
      buf_.append(chunk, size_t(n));
    }
  }
  // Reads the rest of stdout and reaps the child; returns its wait status.
  int finish() {
    while (next_line()) {
    }
    int status = 0;
    ::waitpid(pid_, &status, 0);
    reaped_ = true;
    return status;
  }
  const std::string& stdout_text() const { return out_; }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  bool reaped_ = false;
  std::string buf_, out_;
};

class TrainResume : public ::testing::TestWithParam<std::string> {};

}  // namespace

// (a) --exit-interval 10, then --load to 20: identical losses, loss scales, grad norms, learning rates
// and validation losses at every iteration, and byte-identical final checkpoint files. Then the RNG
// half: resuming the same checkpoint with --no-load-rng draws other dropout masks (different losses).
TEST_P(TrainResume, ExitIntervalThenLoadIsBitExact) {
  const std::string prec = GetParam();
  TempDir tmp("exit_" + prec);
  // Validation every 5 iterations: the consumed validation samples must be restored too.
  const Args args = cat(tiny_args(prec, 20), {"--eval-interval", "5", "--eval-iters", "1"});
  const TrainResult straight = train(cat(args, {"--save", tmp / "straight"}));
  ASSERT_EQ(straight.losses.size(), 20u);
  if (prec == "fp16") {
    // The test is only meaningful if the dynamic scale moved during the run.
    EXPECT_NE(straight.loss_scales.front(), straight.loss_scales.back());
  }

  const TrainResult first = train(cat(args, {"--save", tmp / "split", "--exit-interval", "10"}));
  ASSERT_EQ(first.final_iteration, 10);
  EXPECT_EQ(first.exit_reason, "exit-interval");
  ASSERT_EQ(read_tracker(tmp / "split"), 10);
  fs::copy(tmp / "split", tmp / "split_copy", fs::copy_options::recursive);

  const TrainResult second = train(cat(args, {"--load", tmp / "split", "--save", tmp / "split"}));
  EXPECT_EQ(second.start_iteration, 10);
  EXPECT_EQ(second.final_iteration, 20);
  EXPECT_TRUE(same_bits(concat(first.losses, second.losses), straight.losses));
  EXPECT_TRUE(same_bits(concat(first.loss_scales, second.loss_scales), straight.loss_scales));
  EXPECT_TRUE(same_bits(concat(first.grad_norms, second.grad_norms), straight.grad_norms));
  EXPECT_TRUE(same_bits(concat(first.learning_rates, second.learning_rates), straight.learning_rates));
  EXPECT_EQ(concat(first.valid_losses, second.valid_losses), straight.valid_losses);
  EXPECT_EQ(second.skipped_iterations + first.skipped_iterations, straight.skipped_iterations);
  EXPECT_TRUE(same_bits({second.final_valid_loss, second.final_test_loss},
                        {straight.final_valid_loss, straight.final_test_loss}));
  ASSERT_EQ(read_tracker(tmp / "split"), 20);
  expect_same_checkpoint_files(iter_dir(tmp / "straight", 20), iter_dir(tmp / "split", 20));

  // --no-load-rng restarts the dropout stream: the first resumed iteration already sees other masks.
  const TrainResult no_rng = train(cat(args, {"--load", tmp / "split_copy", "--no-load-rng"}));
  ASSERT_EQ(no_rng.start_iteration, 10);
  ASSERT_FALSE(no_rng.losses.empty());
  EXPECT_NE(no_rng.losses[0], straight.losses[10]);
  // ... while with the RNG state (same checkpoint copy) the first resumed loss is the straight run's.
  const TrainResult with_rng = train(cat(args, {"--load", tmp / "split_copy", "--exit-interval", "11"}));
  ASSERT_EQ(with_rng.losses.size(), 1u);
  EXPECT_EQ(with_rng.losses[0], straight.losses[10]);
}

// (b) SIGTERM with --exit-signal-handler: the binary finishes the iteration, saves, exits 0; resuming
// prints, iteration for iteration, the lm loss lines of a run that was never interrupted.
TEST_P(TrainResume, SigtermSaveAndResumePrintsTheSameLosses) {
  const std::string prec = GetParam();
  TempDir tmp("sigterm_" + prec);
  const int64_t N = 40;
  std::string straight_log;
  const TrainResult straight = train(cat(tiny_args(prec, N), {"--save", tmp / "straight"}), &straight_log);
  const std::map<int64_t, std::string> straight_lines = lm_loss_by_iteration(straight_log);
  ASSERT_EQ(straight_lines.size(), size_t(N));

  LoomChild child(cat(tiny_args(prec, N), {"--save", tmp / "ckpt", "--exit-signal-handler"}), tmp / "stderr");
  bool sent = false;
  while (const std::optional<std::string> line = child.next_line()) {
    if (!sent && iteration_of(*line) >= 3) {
      ASSERT_EQ(::kill(child.pid(), SIGTERM), 0);
      sent = true;
    }
  }
  const int status = child.finish();
  const std::string out = child.stdout_text();
  ASSERT_TRUE(sent) << out << read_file(tmp / "stderr");
  ASSERT_TRUE(WIFEXITED(status)) << "status " << status << "\n" << read_file(tmp / "stderr");
  EXPECT_EQ(WEXITSTATUS(status), 0) << read_file(tmp / "stderr");
  EXPECT_NE(out.find("exiting program after receiving SIGTERM"), std::string::npos) << out;
  const int64_t k = read_tracker(tmp / "ckpt");
  ASSERT_GE(k, 3);
  ASSERT_LT(k, N) << "the child was not stopped by the signal";
  EXPECT_NE(out.find("saving checkpoint at iteration " + std::string(7 - std::to_string(k).size(), ' ') +
                     std::to_string(k)),
            std::string::npos)
      << out;
  const std::map<int64_t, std::string> child_lines = lm_loss_by_iteration(out);
  ASSERT_FALSE(child_lines.empty());
  EXPECT_EQ(child_lines.rbegin()->first, k) << "the saved iteration is the last one trained";

  std::string resumed_log;
  const TrainResult resumed = train(cat(tiny_args(prec, N), {"--load", tmp / "ckpt", "--save", tmp / "ckpt"}),
                                    &resumed_log);
  EXPECT_EQ(resumed.start_iteration, k);
  std::map<int64_t, std::string> merged = child_lines;
  for (const auto& [it, loss] : lm_loss_by_iteration(resumed_log)) {
    EXPECT_GT(it, k) << "resumed run repeated iteration " << it;
    merged[it] = loss;
  }
  EXPECT_EQ(merged, straight_lines);
  EXPECT_TRUE(same_bits(resumed.losses, tail(straight.losses, size_t(k))));
  EXPECT_TRUE(same_bits(resumed.loss_scales, tail(straight.loss_scales, size_t(k))));
  expect_same_checkpoint_files(iter_dir(tmp / "straight", N), iter_dir(tmp / "ckpt", N));
}

// (c) kill -9 at random moments, three times in a row (possibly in the middle of a save): each time the
// tracker still names a complete checkpoint, the next run resumes from it (checksums verified), and the run
// that finally completes reproduces the straight run bit for bit.
TEST_P(TrainResume, Kill9AfterSaveResumesFromTheTrackerBitExact) {
  const std::string prec = GetParam();
  TempDir tmp("kill9_" + prec);
  const int64_t N = 90;
  const TrainResult straight = train(cat(tiny_args(prec, N), {"--save", tmp / "straight"}));
  ASSERT_EQ(straight.losses.size(), size_t(N));

  std::random_device rd;
  int64_t t = 0;  // the tracker after the last kill
  for (int trial = 0; trial < 3; ++trial) {
    // React to a random iteration line: in the first run one in [11, 25] (the save of iteration 10 has
    // completed by then), in a resumed run one of the first 10 it trains. The child may run up to a page of
    // log lines (~15 iterations) ahead, so it is killed anywhere in them, saves included, and never gets
    // near N.
    const int64_t react_at = trial == 0 ? 11 + int64_t(rd() % 15) : t + 1 + int64_t(rd() % 10);
    SCOPED_TRACE("kill " + std::to_string(trial + 1) + ": SIGKILL after the log line of iteration " +
                 std::to_string(react_at));
    Args args = cat(tiny_args(prec, N), {"--save", tmp / "ckpt", "--save-interval", "5"});
    if (trial > 0) args = cat(args, {"--load", tmp / "ckpt"});
    LoomChild child(args, tmp / "stderr");
    bool killed = false;
    while (const std::optional<std::string> line = child.next_line()) {
      if (!killed && iteration_of(*line) >= react_at) {
        ASSERT_GE(read_tracker(tmp / "ckpt"), std::max<int64_t>(t, 10));
        ASSERT_EQ(::kill(child.pid(), SIGKILL), 0);
        killed = true;
      }
    }
    const int status = child.finish();
    ASSERT_TRUE(killed) << child.stdout_text() << read_file(tmp / "stderr");
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
    const int64_t now = read_tracker(tmp / "ckpt");
    ASSERT_GE(now, std::max<int64_t>(t, 10));
    ASSERT_LT(now, N);
    EXPECT_EQ(now % 5, 0);
    t = now;
  }
  const TrainResult resumed = train(cat(tiny_args(prec, N), {"--load", tmp / "ckpt", "--save", tmp / "ckpt",
                                                             "--save-interval", "5"}));
  EXPECT_EQ(resumed.start_iteration, t);
  EXPECT_TRUE(same_bits(resumed.losses, tail(straight.losses, size_t(t))));
  EXPECT_TRUE(same_bits(resumed.loss_scales, tail(straight.loss_scales, size_t(t))));
  EXPECT_TRUE(same_bits(resumed.grad_norms, tail(straight.grad_norms, size_t(t))));
  ASSERT_EQ(read_tracker(tmp / "ckpt"), N);
  expect_same_checkpoint_files(iter_dir(tmp / "straight", N), iter_dir(tmp / "ckpt", N));
  // The crashed save's leftovers were cleaned up by the resumed run's first save.
  for (const auto& e : fs::directory_iterator(tmp / "ckpt"))
    EXPECT_EQ(e.path().string().find(".loom-staging"), std::string::npos) << e.path();
}

// A SIGTERM that arrives while the child is blocked writing a log line to a full stdout pipe (a slow
// `| tee`, a stalled log collector) must not lose the rest of the log: the save and exit lines still
// appear once the reader catches up.
TEST(TrainSignal, SigtermWhileStdoutIsBlockedKeepsTheLog) {
  TempDir tmp("sigterm_blocked");
  LoomChild child(cat(tiny_args("fp32", 200), {"--save", tmp / "ckpt", "--exit-signal-handler"}), tmp / "stderr");
  while (const std::optional<std::string> line = child.next_line())
    if (iteration_of(*line) >= 2) break;
  // Stop reading: within a few iterations the one-page pipe is full and the child blocks in write().
  ::usleep(300 * 1000);
  ASSERT_EQ(::kill(child.pid(), SIGTERM), 0);
  // The reader stays stalled while the child handles the signal (as a stalled log collector would).
  ::usleep(200 * 1000);
  const int status = child.finish();
  const std::string out = child.stdout_text();
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << read_file(tmp / "stderr");
  const int64_t k = read_tracker(tmp / "ckpt");
  EXPECT_GE(k, 2);
  EXPECT_LT(k, 200);
  EXPECT_NE(out.find("exiting program after receiving SIGTERM"), std::string::npos)
      << "log tail:\n" << out.substr(out.size() > 1500 ? out.size() - 1500 : 0);
  EXPECT_NE(out.find("successfully saved checkpoint from iteration"), std::string::npos);
  // Every iteration up to the saved one was logged.
  const std::map<int64_t, std::string> lines = lm_loss_by_iteration(out);
  for (int64_t it = 1; it <= k; ++it) EXPECT_TRUE(lines.count(it)) << "no log line for iteration " << it;
}

// SIGTERM and SIGINT are blocked in every thread but one that waits for them (loom/core/exit_signals.h):
// a handler running on a computing thread would push its signal frame below that thread's stack pointer,
// which oneDNN's f32 GEMM kernels point into a heap workspace; fp32 runs interrupted mid-step crashed
// ("corrupted size vs. prev_size", SIGSEGV) in 8 of 30 tries before. Checked here three ways: the blocked
// masks of the child's threads (/proc), ten SIGTERMs at random moments of fp32 steps (one thread, a model
// whose products reduce over more than 84 elements), each of which must end in the save and exit 0, and
// SIGTERM without --exit-signal-handler, which must still end the process by the signal.
TEST(TrainSignal, SigtermNeverInterruptsAComputingThread) {
  const Args model = {"--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length",
                      "128", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--mock-data",
                      "--vocab-size", "100", "--log-interval", "1", "--eval-iters", "0", "--train-iters", "400"};
  std::mt19937 rng(std::random_device{}());
  for (int run = 0; run < 10; ++run) {
    TempDir tmp("sigterm_mid_step");
    LoomChild child(cat(model, {"--save", tmp / "ckpt", "--exit-signal-handler"}), tmp / "stderr");
    const int64_t at = 2 + int64_t(rng() % 20);
    bool sent = false;
    while (const std::optional<std::string> line = child.next_line()) {
      if (sent || iteration_of(*line) < at) continue;
      if (run == 0) {
        // Exactly one thread of the child may take SIGTERM (bit 14 of SigBlk) or SIGINT (bit 1).
        int takers = 0, threads = 0;
        for (const auto& task : fs::directory_iterator("/proc/" + std::to_string(child.pid()) + "/task")) {
          std::istringstream status(read_file(task.path() / "status"));
          for (std::string l; std::getline(status, l);)
            if (l.rfind("SigBlk:", 0) == 0) {
              ++threads;
              const unsigned long long blocked = std::stoull(l.substr(7), nullptr, 16);
              if ((blocked & 0x4002ull) != 0x4002ull) ++takers;
            }
        }
        EXPECT_GE(threads, 2);
        EXPECT_EQ(takers, 1) << "threads that can be interrupted by SIGTERM/SIGINT, of " << threads;
      }
      ::usleep(useconds_t(rng() % 20000));  // somewhere inside the next step
      ASSERT_EQ(::kill(child.pid(), SIGTERM), 0);
      sent = true;
    }
    const int status = child.finish();
    ASSERT_TRUE(sent);
    ASSERT_TRUE(WIFEXITED(status)) << "run " << run << ": status " << status << " (signal "
                                   << (WIFSIGNALED(status) ? WTERMSIG(status) : 0) << ")\n"
                                   << read_file(tmp / "stderr");
    EXPECT_EQ(WEXITSTATUS(status), 0) << read_file(tmp / "stderr");
    EXPECT_NE(child.stdout_text().find("exiting program after receiving SIGTERM"), std::string::npos);
  }
  // Without --exit-signal-handler the signal ends the process as its default action does.
  TempDir tmp("sigterm_default");
  LoomChild child(model, tmp / "stderr");
  while (const std::optional<std::string> line = child.next_line())
    if (iteration_of(*line) >= 2) break;
  ASSERT_EQ(::kill(child.pid(), SIGTERM), 0);
  const int status = child.finish();
  ASSERT_TRUE(WIFSIGNALED(status)) << status;
  EXPECT_EQ(WTERMSIG(status), SIGTERM);
}

INSTANTIATE_TEST_SUITE_P(Precisions, TrainResume, ::testing::Values("fp32", "bf16", "fp16", "fp8"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// TrainingLog: Megatron's iteration line over a log interval (losses averaged over the iterations that
// stepped, skipped and NaN iterations counted, grad norm of the last one), the same figures in the JSON
// Lines file, the boxed validation lines, and the timers block at --timing-log-level 1.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "train/training_log.h"
#include "unit/train/trainer_parts_util.h"

namespace loom {
namespace {

// A step's outcome with the fields the log lines read (the rest at their defaults: no zero count, no MoE).
StepOutcome outcome(double loss, double grad_norm, double loss_scale, double lr, bool skipped) {
  StepOutcome o;
  o.loss = loss;
  o.grad_norm = grad_norm;
  o.loss_scale = loss_scale;
  o.lr = lr;
  o.skipped = skipped;
  return o;
}

using parts_test::build_tiny_run;

std::vector<nlohmann::json> jsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

TEST(TrainingLog, IntervalLineAndMetrics) {
  const std::string dir = std::filesystem::temp_directory_path() / ("loom_tlog_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  TrainingRun run;
  build_tiny_run(run, "--log-interval 3 --timing-log-level 1 --metrics-jsonl " + dir + "/m.jsonl");
  std::ostringstream out;
  TrainingLog tlog(run, out);
  tlog.open_writers();
  const double lr = run.sched->lr();
  const StepOutcome a = outcome(4.5, 1.25, 1.0, lr, false), nan_step = outcome(NAN, NAN, 1.0, lr, true),
                    b = outcome(4.0, 0.75, 1.0, lr, false);
  const StepOutcome steps[] = {a, nan_step, b};
  for (int i = 0; i < 3; ++i) {
    tlog.timers().start("forward-backward", 1);
    tlog.timers().stop("forward-backward");
    run.progress.iteration = i + 1;
    run.progress.consumed_train = (i + 1) * run.gbs;
    tlog.iteration(steps[i], 10.0 * (i + 1));
    if (i < 2) {
      EXPECT_EQ(out.str().find(" iteration "), std::string::npos) << "printed before the interval ended";
    }
  }
  const std::string text = out.str();
  EXPECT_NE(text.find(" iteration        3/       6 |"), std::string::npos) << text;
  EXPECT_NE(text.find(" consumed samples:           12 |"), std::string::npos) << text;
  EXPECT_NE(text.find(" elapsed time per iteration (ms): 20.0 |"), std::string::npos) << text;  // all 3 timed
  EXPECT_NE(text.find(" lm loss: 4.250000E+00 |"), std::string::npos) << text;  // the 2 that stepped
  EXPECT_NE(text.find(" grad norm: 0.750 |"), std::string::npos) << text;       // the last one's
  EXPECT_NE(text.find(" number of skipped iterations:   1 |"), std::string::npos) << text;
  EXPECT_NE(text.find(" number of nan iterations:   1 |"), std::string::npos) << text;
  EXPECT_NE(text.find("forward-backward"), std::string::npos) << text;  // the timers block
  EXPECT_NE(text.find("[Rank 0] (after 3 iterations) memory (MB)"), std::string::npos) << text;

  tlog.evaluation("iteration 3", 3.5, false);
  EXPECT_NE(out.str().find(" validation loss at iteration 3 | lm loss value: 3.500000E+00 | lm loss PPL: "),
            std::string::npos)
      << out.str();
  tlog.flush();
  const std::vector<nlohmann::json> lines = jsonl(dir + "/m.jsonl");
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["iteration"], 3);
  EXPECT_EQ(lines[0]["lm loss"].get<double>(), 4.25);
  EXPECT_EQ(lines[0]["grad norm"].get<double>(), 0.75);
  EXPECT_EQ(lines[0]["number of nan iterations"], 1);
  EXPECT_EQ(lines[0]["elapsed time per iteration (ms)"].get<double>(), 20.0);
  EXPECT_EQ(lines[1]["validation lm loss"].get<double>(), 3.5);
  EXPECT_EQ(lines[1]["validation lm loss PPL"].get<double>(), std::exp(3.5));
  std::filesystem::remove_all(dir);
}

// An interval where every iteration was skipped has no loss: no "lm loss" field on the line, null in JSONL.
TEST(TrainingLog, AllSkippedIntervalHasNoLoss) {
  const std::string dir = std::filesystem::temp_directory_path() / ("loom_tlog2_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  TrainingRun run;
  build_tiny_run(run, "--metrics-jsonl " + dir + "/m.jsonl");
  std::ostringstream out;
  TrainingLog tlog(run, out);
  tlog.open_writers();
  run.progress.iteration = 1;
  tlog.iteration(outcome(5.0, NAN, 65536.0, 1e-3, true), 1.0);
  EXPECT_EQ(out.str().find("lm loss:"), std::string::npos) << out.str();
  EXPECT_EQ(out.str().find("grad norm:"), std::string::npos) << out.str();
  const std::vector<nlohmann::json> lines = jsonl(dir + "/m.jsonl");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_TRUE(lines[0]["lm loss"].is_null());
  EXPECT_TRUE(lines[0]["grad norm"].is_null());
  EXPECT_EQ(lines[0]["number of skipped iterations"], 1);
  EXPECT_EQ(lines[0]["number of nan iterations"], 0);  // the loss itself was finite
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace loom

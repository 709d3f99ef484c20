// MLPerf :::MLLOG lines: the exact line format (prefix, key order, integers, shortest doubles, null for
// NaN, escaped strings, file and line of the caller), and a whole llama2_70b_lora run through MlperfRunLog:
// every line valid JSON, the events in the rules' order with their event types, each hyperparameter once,
// samples_count on the block/eval events, LoRA keys only when set, and run_stop aborted from the
// destructor when the run ends without one.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "loom/core/check.h"
#include "loom/train/mlperf_log.h"

namespace loom {
namespace {

std::string temp_path(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("loom_mllog_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

std::vector<std::string> file_lines(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::string> out;
  for (std::string l; std::getline(f, l);) out.push_back(l);
  return out;
}

nlohmann::json parse_mllog(const std::string& line) {
  const std::string prefix = ":::MLLOG ";
  EXPECT_EQ(line.rfind(prefix, 0), 0u) << line;
  return nlohmann::json::parse(line.substr(prefix.size()));
}

TEST(MllogLine, ExactFormat) {
  const std::source_location here = std::source_location::current();
  const std::string line = mllog_line(1718000000123, MllogEvent::kPoint, "seed", int64_t(1234),
                                      {{"samples_count", int64_t(8)}, {"epoch_num", 0.25}}, here);
  EXPECT_EQ(line, ":::MLLOG {\"namespace\": \"\", \"time_ms\": 1718000000123, \"event_type\": \"POINT\", "
                  "\"key\": \"seed\", \"value\": 1234, \"metadata\": {\"file\": \"test_mlperf_log.cpp\", "
                  "\"lineno\": " + std::to_string(here.line()) + ", \"samples_count\": 8, \"epoch_num\": 0.25}}");
  const std::string start = mllog_line(5, MllogEvent::kIntervalStart, "run_start", nullptr, {}, here);
  EXPECT_NE(start.find("\"event_type\": \"INTERVAL_START\", \"key\": \"run_start\", \"value\": null"),
            std::string::npos) << start;
  const std::string end = mllog_line(5, MllogEvent::kIntervalEnd, "run_stop", nullptr,
                                     {{"status", std::string("success")}}, here);
  EXPECT_NE(end.find("\"event_type\": \"INTERVAL_END\""), std::string::npos) << end;
  EXPECT_NE(end.find("\"status\": \"success\"}}"), std::string::npos) << end;
}

TEST(MllogLine, ValuesAreValidJson) {
  const std::source_location here = std::source_location::current();
  const std::string odd = mllog_line(1, MllogEvent::kPoint, "k\"ey\\", std::string("a \"quoted\"\nvalue"),
                                     {{"nan", double(NAN)}, {"flag", true}, {"lr", 4e-4}}, here);
  const nlohmann::json j = parse_mllog(odd);
  EXPECT_EQ(j["key"], "k\"ey\\");
  EXPECT_EQ(j["value"], "a \"quoted\"\nvalue");
  EXPECT_TRUE(j["metadata"]["nan"].is_null());
  EXPECT_EQ(j["metadata"]["flag"], true);
  EXPECT_EQ(j["metadata"]["lr"].get<double>(), 4e-4);
  EXPECT_NE(odd.find("\"lr\": 4e-04"), std::string::npos) << odd;  // shortest round-trip form
  EXPECT_TRUE(j["time_ms"].is_number_integer());
  EXPECT_EQ(j["metadata"]["lineno"], here.line());
}

MlperfRunInfo tiny_info() {
  MlperfRunInfo i;
  i.global_batch_size = 8;
  i.gradient_accumulation_steps = 2;
  i.max_sequence_length = 8192;
  i.train_samples = 3901;
  i.eval_samples = 176;
  i.seed = 7;
  i.base_learning_rate = 4e-4;
  i.adamw_beta_1 = 0.9;
  i.adamw_beta_2 = 0.999;
  i.adamw_epsilon = 1e-8;
  i.weight_decay = 1e-4;
  i.gradient_clip_norm = 0.3;
  i.training_steps = 1024;
  i.decay_schedule = "cosine";
  return i;
}

std::vector<nlohmann::json> run_events(const std::string& path) {
  std::vector<nlohmann::json> out;
  for (const std::string& l : file_lines(path)) out.push_back(parse_mllog(l));
  return out;
}

std::vector<std::string> keys_of(const std::vector<nlohmann::json>& ev) {
  std::vector<std::string> out;
  for (const auto& e : ev) out.push_back(e["key"]);
  return out;
}

TEST(MlperfRunLog, AWholeRunInTheRulesOrder) {
  MlperfConfig cfg;
  cfg.log = temp_path("run.log");
  cfg.org = "Org \"X\"";
  int64_t clock = 1000;
  {
    MlperfRunLog log(cfg, "2xCPU", [&] { return clock++; });
    MlperfRunInfo info = tiny_info();
    info.lora = LoraConfig{16, 32.0f, 0.1f};
    log.init_done(info, 0);
    log.train_loss(8, 2.5, 4e-4);
    log.eval_start(16);
    log.eval_result(16, 1.25, true);
    log.eval_start(32);
    log.eval_result(32, 0.9, false);
    log.run_stop(32, true);
    EXPECT_TRUE(log.stopped());
  }
  const std::vector<nlohmann::json> ev = run_events(cfg.log);
  const std::vector<std::string> want = {
      "cache_clear", "init_start", "submission_benchmark", "submission_division", "submission_org",
      "submission_platform", "submission_status", "global_batch_size", "gradient_accumulation_steps",
      "max_sequence_length", "train_samples", "eval_samples", "seed", "opt_base_learning_rate", "opt_adamw_beta_1",
      "opt_adamw_beta_2", "opt_adamw_epsilon", "opt_adamw_weight_decay", "opt_gradient_clip_norm",
      "opt_learning_rate_warmup_steps", "opt_learning_rate_warmup_factor", "opt_learning_rate_training_steps",
      "opt_learning_rate_decay_schedule", "lora_rank", "lora_alpha", "init_stop", "run_start", "block_start",
      "train_loss", "block_stop", "eval_start", "eval_accuracy", "eval_stop", "block_start", "block_stop",
      "eval_start", "eval_accuracy", "eval_stop", "run_stop"};
  EXPECT_EQ(keys_of(ev), want);
  std::map<std::string, nlohmann::json> first;
  for (const auto& e : ev) first.emplace(e["key"], e);
  EXPECT_EQ(first["submission_benchmark"]["value"], "llama2_70b_lora");
  EXPECT_EQ(first["submission_division"]["value"], "closed");
  EXPECT_EQ(first["submission_org"]["value"], "Org \"X\"");
  EXPECT_EQ(first["submission_platform"]["value"], "2xCPU");
  EXPECT_EQ(first["submission_status"]["value"], "onprem");
  EXPECT_EQ(first["cache_clear"]["value"], true);
  EXPECT_EQ(first["lora_rank"]["value"], 16);
  EXPECT_EQ(first["lora_alpha"]["value"].get<double>(), 32.0);
  EXPECT_EQ(first["global_batch_size"]["value"], 8);
  EXPECT_EQ(first["opt_gradient_clip_norm"]["value"].get<double>(), 0.3);
  EXPECT_EQ(first["init_start"]["event_type"], "INTERVAL_START");
  EXPECT_EQ(first["init_stop"]["event_type"], "INTERVAL_END");
  EXPECT_EQ(first["run_start"]["event_type"], "INTERVAL_START");
  EXPECT_EQ(first["seed"]["event_type"], "POINT");
  int64_t t = 0;
  for (const auto& e : ev) {
    EXPECT_EQ(e["namespace"], "");
    EXPECT_GT(e["time_ms"].get<int64_t>(), t);  // the fake clock ticks once a line
    t = e["time_ms"];
    EXPECT_TRUE(e["metadata"].contains("file") && e["metadata"].contains("lineno")) << e.dump();
    const std::string k = e["key"];
    if (k == "block_start" || k == "block_stop" || k == "eval_start" || k == "eval_stop" || k == "eval_accuracy" ||
        k == "run_stop" || k == "train_loss") {
      EXPECT_TRUE(e["metadata"].contains("samples_count")) << e.dump();
      EXPECT_TRUE(e["metadata"].contains("epoch_num")) << e.dump();
    }
  }
  EXPECT_EQ(ev[31]["value"].get<double>(), 1.25);  // the first eval_accuracy
  EXPECT_EQ(ev[31]["metadata"]["samples_count"], 16);
  EXPECT_EQ(ev[31]["metadata"]["epoch_num"].get<double>(), 16.0 / 3901.0);
  EXPECT_EQ(ev.back()["metadata"]["status"], "success");
  EXPECT_EQ(ev.back()["metadata"]["samples_count"], 32);
  // The constructor and init_done were called here: the metadata names this file.
  EXPECT_EQ(first["run_start"]["metadata"]["file"], "test_mlperf_log.cpp");
}

TEST(MlperfRunLog, WithoutLoraOrAdamWTheirKeysAreLeftOut) {
  MlperfConfig cfg;
  cfg.log = temp_path("nolora.log");
  {
    MlperfRunLog log(cfg, "1xCPU");
    MlperfRunInfo info = tiny_info();
    info.adamw = false;
    log.init_done(info, 0);
    log.run_stop(0, false);
  }
  const std::vector<std::string> keys = keys_of(run_events(cfg.log));
  for (const char* k : {"lora_rank", "lora_alpha", "opt_adamw_beta_1", "opt_adamw_weight_decay"})
    EXPECT_EQ(std::count(keys.begin(), keys.end(), k), 0) << k;
  EXPECT_EQ(std::count(keys.begin(), keys.end(), "opt_base_learning_rate"), 1);
}

TEST(MlperfRunLog, AnUnfinishedRunStopsAbortedAndAnUnstartedOneDoesNotStop) {
  MlperfConfig cfg;
  cfg.log = temp_path("aborted.log");
  {
    MlperfRunLog log(cfg, "1xCPU");
    log.init_done(tiny_info(), 24);
    log.train_loss(40, 3.0, 1e-4);
  }  // an error unwinds the run here
  std::vector<nlohmann::json> ev = run_events(cfg.log);
  ASSERT_GE(ev.size(), 3u);
  EXPECT_EQ(ev[ev.size() - 2]["key"], "block_stop");
  EXPECT_EQ(ev.back()["key"], "run_stop");
  EXPECT_EQ(ev.back()["metadata"]["status"], "aborted");
  EXPECT_EQ(ev.back()["metadata"]["samples_count"], 40);
  {
    MlperfRunLog log(cfg, "1xCPU");  // failed before training started: no run_start, so no run_stop
  }
  const std::vector<std::string> keys = keys_of(run_events(cfg.log));
  EXPECT_EQ(keys.back(), "submission_status");
  EXPECT_EQ(std::count(keys.begin(), keys.end(), "run_stop"), 0);
}

TEST(MlperfRunLog, AnUnwritablePathNamesTheFlag) {
  MlperfConfig cfg;
  cfg.log = "/proc/loom-no-such-dir/x.log";
  try {
    MlperfRunLog log(cfg, "1xCPU");
    ADD_FAILURE() << "expected a UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("--mlperf-log '/proc/loom-no-such-dir/x.log'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace loom

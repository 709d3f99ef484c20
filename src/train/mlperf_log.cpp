// MLPerf Training :::MLLOG lines (see loom/train/mlperf_log.h). Strings are escaped by nlohmann::json,
// numbers are written as metrics_jsonl writes them (integers as integers, doubles in the shortest form that
// parses back to the same value, non-finite as null), so every line is valid JSON after its prefix.
#include "loom/train/mlperf_log.h"

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "loom/core/check.h"
#include "loom/core/file_io.h"
#include "loom/train/metrics_jsonl.h"

namespace loom {

namespace {

std::string json_string(std::string_view s) {
  return nlohmann::json(std::string(s)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string json_value(const MllogValue& v) {
  if (std::holds_alternative<std::nullptr_t>(v)) return "null";
  if (const bool* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  if (const int64_t* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  if (const double* d = std::get_if<double>(&v)) return json_number(*d);
  return json_string(std::get<std::string>(v));
}

const char* event_name(MllogEvent e) {
  switch (e) {
    case MllogEvent::kPoint: return "POINT";
    case MllogEvent::kIntervalStart: return "INTERVAL_START";
    case MllogEvent::kIntervalEnd: return "INTERVAL_END";
  }
  return "POINT";
}

}  // namespace

std::string mllog_line(int64_t time_ms, MllogEvent event, std::string_view key, const MllogValue& value,
                       const MllogFields& metadata, const std::source_location& where) {
  std::string line = ":::MLLOG {\"namespace\": \"\", \"time_ms\": " + std::to_string(time_ms) +
                     ", \"event_type\": \"" + event_name(event) + "\", \"key\": " + json_string(key) +
                     ", \"value\": " + json_value(value) + ", \"metadata\": {\"file\": " +
                     json_string(std::filesystem::path(where.file_name()).filename().string()) +
                     ", \"lineno\": " + std::to_string(where.line());
  for (const auto& [k, v] : metadata) line += ", " + json_string(k) + ": " + json_value(v);
  return line + "}}";
}

int64_t mllog_now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

MllogWriter::MllogWriter(const std::string& path, std::function<int64_t()> clock)
    : path_(path), clock_(clock ? std::move(clock) : std::function<int64_t()>(mllog_now_ms)) {
  file_ = open_log_file(path, "--mlperf-log");
}

MllogWriter::~MllogWriter() {
  if (file_) std::fclose(file_);
}

void MllogWriter::event(MllogEvent event, std::string_view key, const MllogValue& value, const MllogFields& metadata,
                        const std::source_location& where) {
  const std::string line = mllog_line(clock_(), event, key, value, metadata, where) + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0)
    user_error("--mlperf-log ", path_, ": write failed (", std::strerror(errno), ")");
}

// ---- the llama2_70b_lora run -------------------------------------------------------------------------

MlperfRunLog::MlperfRunLog(const MlperfConfig& cfg, const std::string& platform, std::function<int64_t()> clock,
                           const std::source_location& where)
    : w_(cfg.log, std::move(clock)) {
  w_.event(MllogEvent::kPoint, "cache_clear", true, {}, where);
  w_.event(MllogEvent::kIntervalStart, "init_start", nullptr, {}, where);
  const std::pair<const char*, std::string> submission[] = {
      {"submission_benchmark", "llama2_70b_lora"},
      {"submission_division", cfg.division},
      {"submission_org", cfg.org},
      {"submission_platform", cfg.platform.empty() ? platform : cfg.platform},
      {"submission_status", cfg.status}};
  for (const auto& [key, value] : submission) w_.event(MllogEvent::kPoint, key, value, {}, where);
}

MlperfRunLog::~MlperfRunLog() {
  if (!started_ || stopped_) return;
  try {
    run_stop(last_samples_, false);
  } catch (...) {  // a destructor must not throw (it may run while an error unwinds the run)
  }
}

MllogFields MlperfRunLog::samples_metadata(int64_t samples) const {
  const double epochs = train_samples_ > 0 ? double(samples) / double(train_samples_) : 0.0;
  return {{"samples_count", samples}, {"epoch_num", epochs}};
}

void MlperfRunLog::init_done(const MlperfRunInfo& info, int64_t samples, const std::source_location& where) {
  LOOM_CHECK(!started_, "[mlperf] init_done called twice");
  train_samples_ = info.train_samples;
  last_samples_ = samples;
  const auto point = [&](const char* key, const MllogValue& v) { w_.event(MllogEvent::kPoint, key, v, {}, where); };
  point("global_batch_size", info.global_batch_size);
  point("gradient_accumulation_steps", info.gradient_accumulation_steps);
  point("max_sequence_length", info.max_sequence_length);
  point("train_samples", info.train_samples);
  point("eval_samples", info.eval_samples);
  point("seed", info.seed);
  point("opt_base_learning_rate", info.base_learning_rate);
  if (info.adamw) {
    point("opt_adamw_beta_1", info.adamw_beta_1);
    point("opt_adamw_beta_2", info.adamw_beta_2);
    point("opt_adamw_epsilon", info.adamw_epsilon);
    point("opt_adamw_weight_decay", info.weight_decay);
  }
  point("opt_gradient_clip_norm", info.gradient_clip_norm);
  point("opt_learning_rate_warmup_steps", info.warmup_steps);
  point("opt_learning_rate_warmup_factor", info.warmup_factor);
  point("opt_learning_rate_training_steps", info.training_steps);
  point("opt_learning_rate_decay_schedule", info.decay_schedule);
  if (info.lora) {
    point("lora_rank", info.lora->rank);
    point("lora_alpha", double(info.lora->alpha));
  }
  w_.event(MllogEvent::kIntervalEnd, "init_stop", nullptr, {}, where);
  w_.event(MllogEvent::kIntervalStart, "run_start", nullptr, {}, where);
  started_ = true;
  w_.event(MllogEvent::kIntervalStart, "block_start", nullptr, samples_metadata(samples), where);
  in_block_ = true;
}

void MlperfRunLog::train_loss(int64_t samples, double loss, double lr, const std::source_location& where) {
  last_samples_ = samples;
  MllogFields md = samples_metadata(samples);
  md.emplace_back("lr", lr);
  w_.event(MllogEvent::kPoint, "train_loss", loss, md, where);
}

void MlperfRunLog::eval_start(int64_t samples, const std::source_location& where) {
  last_samples_ = samples;
  if (in_block_) w_.event(MllogEvent::kIntervalEnd, "block_stop", nullptr, samples_metadata(samples), where);
  in_block_ = false;
  w_.event(MllogEvent::kIntervalStart, "eval_start", nullptr, samples_metadata(samples), where);
}

void MlperfRunLog::eval_result(int64_t samples, double metric, bool training_goes_on,
                               const std::source_location& where) {
  last_samples_ = samples;
  w_.event(MllogEvent::kPoint, "eval_accuracy", metric, samples_metadata(samples), where);
  w_.event(MllogEvent::kIntervalEnd, "eval_stop", nullptr, samples_metadata(samples), where);
  if (training_goes_on) {
    w_.event(MllogEvent::kIntervalStart, "block_start", nullptr, samples_metadata(samples), where);
    in_block_ = true;
  }
}

void MlperfRunLog::run_stop(int64_t samples, bool success, const std::source_location& where) {
  LOOM_CHECK(started_ && !stopped_, "[mlperf] run_stop needs a started, unstopped run");
  stopped_ = true;
  if (in_block_) w_.event(MllogEvent::kIntervalEnd, "block_stop", nullptr, samples_metadata(samples), where);
  in_block_ = false;
  MllogFields md = samples_metadata(samples);
  md.emplace_back("status", std::string(success ? "success" : "aborted"));
  w_.event(MllogEvent::kIntervalEnd, "run_stop", nullptr, md, where);
}

}  // namespace loom

// JSON Lines metrics file. Keys are escaped by nlohmann::json; numbers are written in std::to_chars'
// shortest round-trip form ("5", not nlohmann's "5.0"; valid JSON for every finite double). Lines are
// flushed one by one: a crash can lose at most the line being written, never an earlier one.
#include "loom/train/metrics_jsonl.h"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "loom/core/check.h"
#include "loom/core/file_io.h"

namespace loom {

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  LOOM_CHECK(r.ec == std::errc(), "[json_number] to_chars failed for ", v);
  return std::string(buf, r.ptr);
}

MetricsJsonlWriter::MetricsJsonlWriter(const std::string& path, bool append) : path_(path) {
  file_ = open_log_file(path, "metrics file", append);
}

MetricsJsonlWriter::~MetricsJsonlWriter() {
  if (file_) std::fclose(file_);
}

void MetricsJsonlWriter::write(const std::vector<std::pair<std::string, double>>& fields) {
  std::string line = "{";
  for (size_t i = 0; i < fields.size(); ++i) {
    if (i) line.push_back(',');
    line += nlohmann::json(fields[i].first).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    line.push_back(':');
    line += json_number(fields[i].second);
  }
  line += "}\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0)
    user_error("metrics file '", path_, "': write failed (", std::strerror(errno), ")");
}

}  // namespace loom

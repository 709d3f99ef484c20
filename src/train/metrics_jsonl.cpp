// JSON Lines metrics file. Lines are formatted by hand (keys escaped per RFC 8259, numbers by
// std::to_chars' shortest round-trip form, which is valid JSON for every finite double) and flushed one
// by one: a crash can lose at most the line being written, never an earlier one.
#include "loom/train/metrics_jsonl.h"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "loom/core/check.h"

namespace loom {

namespace {

void append_json_string(std::string& out, const std::string& s) {
  out.push_back('"');
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out.push_back(ch);  // UTF-8 bytes pass through unchanged
        }
    }
  }
  out.push_back('"');
}

}  // namespace

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  LOOM_CHECK(r.ec == std::errc(), "[json_number] to_chars failed for ", v);
  return std::string(buf, r.ptr);
}

MetricsJsonlWriter::MetricsJsonlWriter(const std::string& path, bool append) : path_(path) {
  namespace fs = std::filesystem;
  const fs::path parent = fs::path(path).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    fs::create_directories(parent, ec);
    if (ec || !fs::is_directory(parent))
      user_error("metrics file '", path, "': cannot create directory '", parent.string(), "' (",
                 ec ? ec.message() : "not a directory", ")");
  }
  file_ = std::fopen(path.c_str(), append ? "ab" : "wb");
  if (!file_) user_error("metrics file '", path, "': cannot open for writing (", std::strerror(errno), ")");
}

MetricsJsonlWriter::~MetricsJsonlWriter() {
  if (file_) std::fclose(file_);
}

void MetricsJsonlWriter::write(const std::vector<std::pair<std::string, double>>& fields) {
  std::string line = "{";
  for (size_t i = 0; i < fields.size(); ++i) {
    if (i) line.push_back(',');
    append_json_string(line, fields[i].first);
    line.push_back(':');
    line += json_number(fields[i].second);
  }
  line += "}\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0)
    user_error("metrics file '", path_, "': write failed (", std::strerror(errno), ")");
}

}  // namespace loom

// Metrics as JSON Lines for scripts: one JSON object per write(), keys in the order given, e.g.
//   {"iteration":10,"lm loss":4.587229,"learning rate":0.0005,"grad norm":null}
// Numbers are printed in the shortest form that parses back to the same double; NaN and ±inf become
// null (JSON has no such numbers). Every line is flushed as it is written, so a killed run keeps all
// complete lines.
#pragma once
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace loom {

class MetricsJsonlWriter {
 public:
  // Creates the parent directories of `path` if needed; `append` keeps existing lines (a resumed run),
  // otherwise the file is truncated. UserError naming `path` if it cannot be created or opened.
  MetricsJsonlWriter(const std::string& path, bool append);
  ~MetricsJsonlWriter();
  MetricsJsonlWriter(const MetricsJsonlWriter&) = delete;
  MetricsJsonlWriter& operator=(const MetricsJsonlWriter&) = delete;

  // Writes one line and flushes it. UserError naming the path on a write failure.
  void write(const std::vector<std::pair<std::string, double>>& fields);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

// The JSON text of one value as write() prints it: shortest round-trip number, or null if not finite.
std::string json_number(double v);

}  // namespace loom

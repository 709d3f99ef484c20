// Formats failed-check messages: "[file:line func] message (check failed: expr)".
#include "loom/core/check.h"

#include <cstring>

namespace loom::detail {

void check_fail(const char* expr, const char* file, int line, const char* func, const std::string& msg) {
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  std::ostringstream os;
  os << msg << " (check failed: " << expr << " at " << base << ":" << line << " in " << func << ")";
  throw Error(os.str());
}

}  // namespace loom::detail

// Error reporting: one macro family for internal invariants (LOOM_CHECK) and one exception type for
// mistakes the user can fix (UserError: a bad flag, a missing file). The CLI prints a UserError as one
// line without source locations; a failed LOOM_CHECK carries the expression, file:line and function.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace loom {

// An internal invariant failed (a bug, or an op called with inconsistent tensors).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad input from the user: the message names the flag or file at fault and what would be valid.
class UserError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
[[noreturn]] void check_fail(const char* expr, const char* file, int line, const char* func,
                             const std::string& msg);
}  // namespace detail

template <typename... Args>
[[noreturn]] void user_error(const Args&... args) {
  throw UserError(detail::concat(args...));
}

}  // namespace loom

#define LOOM_CHECK(cond, ...)                                                                   \
  do {                                                                                          \
    if (!(cond)) [[unlikely]]                                                                   \
      ::loom::detail::check_fail(#cond, __FILE__, __LINE__, __func__,                           \
                                 ::loom::detail::concat(__VA_ARGS__));                          \
  } while (0)

#define LOOM_FAIL(...) \
  ::loom::detail::check_fail("unreachable", __FILE__, __LINE__, __func__, ::loom::detail::concat(__VA_ARGS__))

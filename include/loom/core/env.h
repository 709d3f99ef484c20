// Boolean switches read from the environment (debugging aids such as LOOM_CHECK_GRAD_OVERWRITE and
// LOOM_CPU_ALLOC_POISON), all with one rule.
#pragma once
#include <cstdlib>
#include <cstring>

namespace loom {

// True when `name` is set to anything but "" or "0".
inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

}  // namespace loom

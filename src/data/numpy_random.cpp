// numpy legacy RandomState draws (see numpy_random.h).
#include "data/numpy_random.h"

namespace loom::detail {

uint64_t NumpyRandomState::random_interval(uint64_t max) {
  if (max == 0) return 0;
  // Smallest all-ones mask covering max; draws above max are rejected, never folded.
  uint64_t mask = max;
  mask |= mask >> 1;
  mask |= mask >> 2;
  mask |= mask >> 4;
  mask |= mask >> 8;
  mask |= mask >> 16;
  mask |= mask >> 32;
  uint64_t value;
  if (max <= 0xffffffffULL) {
    while ((value = (next_uint32() & mask)) > max) {
    }
  } else {
    while ((value = (next_uint64() & mask)) > max) {
    }
  }
  return value;
}

}  // namespace loom::detail

// numpy's legacy numpy.random.RandomState, the parts Megatron's dataset index building uses:
// MT19937 seeded from an int the way RandomState(int) does it (Matsumoto-Nishimura init_genrand, the
// same recurrence std::mt19937's constructor uses; numpy only takes init_by_array for array seeds),
// raw 32/64-bit draws, the legacy bounded draw random_interval (masked rejection sampling: 32-bit draws
// while max fits in 32 bits, else 64-bit draws built high word first), and RandomState.shuffle's
// in-place Fisher-Yates (i from n-1 down to 1, j = random_interval(i), swap x[i] and x[j]).
// Bit-exact with numpy (tests compare against /usr/bin/python3 + numpy), so indices built here equal
// the ones Megatron builds for the same seed.
#pragma once
#include <cstdint>
#include <random>
#include <span>

namespace loom::detail {

class NumpyRandomState {
 public:
  // numpy accepts seeds in [0, 2^32 - 1]; callers check the range (it names their flag).
  explicit NumpyRandomState(uint32_t seed) : mt_(seed) {}

  uint32_t next_uint32() { return uint32_t(mt_()); }
  uint64_t next_uint64() {
    const uint64_t hi = next_uint32();
    return (hi << 32) | next_uint32();
  }
  // Uniform in [0, max] (legacy random_interval).
  uint64_t random_interval(uint64_t max);

  // RandomState.shuffle on a 1-D array; the draws depend only on x.size(), not the element type.
  template <typename T>
  void shuffle(std::span<T> x) {
    for (int64_t i = int64_t(x.size()) - 1; i >= 1; --i) {
      const auto j = int64_t(random_interval(uint64_t(i)));
      std::swap(x[size_t(i)], x[size_t(j)]);
    }
  }

 private:
  std::mt19937 mt_;  // MT19937 is fixed by the C++ standard, output for output
};

}  // namespace loom::detail

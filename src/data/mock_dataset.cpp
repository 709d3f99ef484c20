#include "loom/data/mock_dataset.h"

#include "loom/core/check.h"
#include "loom/core/rng.h"

namespace loom {

namespace {
const uint64_t kMockStream = hash_stream("data.mock");
}

MockDataset::MockDataset(int64_t vocab_size, int64_t seq_length, uint64_t seed, int64_t num_samples)
    : vocab_(vocab_size), seq_length_(seq_length), seed_(seed), size_(num_samples) {
  if (vocab_size < 1) user_error("--vocab-size must be >= 1 for --mock-data, got ", vocab_size);
  LOOM_CHECK(seq_length > 0 && num_samples >= 0, "[MockDataset] bad sizes T=", seq_length, " N=", num_samples);
}

std::string MockDataset::description() const {
  return "mock data: " + std::to_string(size_) + " samples of uniform random tokens over a vocabulary of " +
         std::to_string(vocab_);
}

void MockDataset::sample(int64_t index, int32_t* out) const {
  LOOM_CHECK(index >= 0 && index < size_, "[MockDataset] sample ", index, " out of range [0, ", size_, ")");
  const uint64_t base = uint64_t(index) * uint64_t(seq_length_ + 1);
  for (int64_t i = 0; i <= seq_length_; ++i) {
    const uint64_t k = base + uint64_t(i);
    out[i] = int32_t(philox4x32(seed_, kMockStream, k / 4)[k % 4] % uint64_t(vocab_));
  }
}

}  // namespace loom

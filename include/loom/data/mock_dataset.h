// Megatron's --mock-data: samples of uniform random tokens, for benchmarks and tests that need no files.
// Sample k, position j is a pure function of (seed, k, j) (Philox), so any sample is reproducible alone.
#pragma once
#include "loom/data/gpt_dataset.h"

namespace loom {

class MockDataset final : public SampleDataset {
 public:
  MockDataset(int64_t vocab_size, int64_t seq_length, uint64_t seed, int64_t num_samples);
  int64_t size() const override { return size_; }
  int64_t seq_length() const override { return seq_length_; }
  void sample(int64_t index, int32_t* out) const override;
  std::string description() const override;

 private:
  int64_t vocab_, seq_length_;
  uint64_t seed_;
  int64_t size_;
};

}  // namespace loom

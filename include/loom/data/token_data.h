// Training data for this build stage (the Megatron indexed-dataset pipeline replaces the text source):
//   - ByteTextData: any file read as raw bytes, one token per byte (vocabulary 256), memory-mapped;
//   - MockData: random tokens (Megatron's --mock-data), a pure function of (seed, sample, position).
// Samples are windows of seq_length + 1 tokens (inputs and shifted targets). Sample k of a run is a pure
// function of (seed, k), so a resumed run that knows its consumed-sample count sees the same batches.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "loom/core/tensor.h"

namespace loom {

class TokenData {
 public:
  virtual ~TokenData() = default;
  virtual int64_t vocab_size() const = 0;
  virtual std::string description() const = 0;
  // Writes sample `index` (seq_length + 1 tokens) to out.
  virtual void sample(int64_t index, int64_t seq_length, int32_t* out) const = 0;

  // Fills tokens and targets (B, T) i32 with samples first_sample .. first_sample + B - 1.
  void batch(int64_t first_sample, TensorView tokens, TensorView targets) const;
};

class ByteTextData final : public TokenData {
 public:
  // Throws UserError naming the path when it is missing, unreadable, or shorter than seq_length + 1.
  ByteTextData(const std::string& path, int64_t seq_length, uint64_t seed);
  ~ByteTextData() override;
  int64_t vocab_size() const override { return 256; }
  std::string description() const override;
  void sample(int64_t index, int64_t seq_length, int32_t* out) const override;
  int64_t num_tokens() const { return size_; }
  // Entropy in nats of the byte frequencies: the loss of the best model that ignores context.
  double unigram_entropy() const;

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  int64_t size_ = 0;
  uint64_t seed_;
};

class MockData final : public TokenData {
 public:
  MockData(int64_t vocab_size, uint64_t seed) : vocab_(vocab_size), seed_(seed) {}
  int64_t vocab_size() const override { return vocab_; }
  std::string description() const override;
  void sample(int64_t index, int64_t seq_length, int32_t* out) const override;

 private:
  int64_t vocab_;
  uint64_t seed_;
};

}  // namespace loom

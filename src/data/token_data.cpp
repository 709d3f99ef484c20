#include "loom/data/token_data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <vector>

#include "loom/core/rng.h"

namespace loom {

namespace {
const uint64_t kWindowStream = hash_stream("data.window");
const uint64_t kMockStream = hash_stream("data.mock");
}  // namespace

void TokenData::batch(int64_t first_sample, TensorView tokens, TensorView targets) const {
  LOOM_CHECK(tokens.ndim() == 2 && tokens.dtype() == DType::kI32 && targets.shape() == tokens.shape(),
             "[TokenData] tokens/targets must be i32 (B, T), got ", tokens.desc(), " and ", targets.desc());
  const int64_t B = tokens.size(0), T = tokens.size(1);
  int32_t* tok = tokens.data<int32_t>();
  int32_t* tgt = targets.data<int32_t>();
#pragma omp parallel for schedule(static) if (B > 1)
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int32_t> window(size_t(T + 1));
    sample(first_sample + b, T, window.data());
    std::memcpy(tok + b * T, window.data(), size_t(T) * 4);
    std::memcpy(tgt + b * T, window.data() + 1, size_t(T) * 4);
  }
}

ByteTextData::ByteTextData(const std::string& path, int64_t seq_length, uint64_t seed) : path_(path), seed_(seed) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) user_error("--data-path: cannot open '", path, "': ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    user_error("--data-path: '", path, "' is not a regular file");
  }
  size_ = int64_t(st.st_size);
  if (size_ < seq_length + 1) {
    ::close(fd);
    user_error("--data-path: '", path, "' has ", size_, " bytes, fewer than --seq-length + 1 = ", seq_length + 1);
  }
  void* p = ::mmap(nullptr, size_t(size_), PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) user_error("--data-path: cannot map '", path, "': ", std::strerror(errno));
  data_ = static_cast<const uint8_t*>(p);
}

ByteTextData::~ByteTextData() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_t(size_));
}

std::string ByteTextData::description() const {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.4f", unigram_entropy());
  return path_ + ": " + std::to_string(size_) + " tokens (bytes), unigram entropy " + buf + " nats/token";
}

void ByteTextData::sample(int64_t index, int64_t seq_length, int32_t* out) const {
  // Window start uniform over every position that leaves room for seq_length + 1 tokens.
  const uint64_t span = uint64_t(size_ - seq_length);
  const auto w = philox4x32(seed_, kWindowStream, uint64_t(index));
  const uint64_t r = (uint64_t(w[0]) << 32) | w[1];
  const int64_t start = int64_t(r % span);
  for (int64_t i = 0; i <= seq_length; ++i) out[i] = data_[start + i];
}

double ByteTextData::unigram_entropy() const {
  int64_t counts[256] = {};
  for (int64_t i = 0; i < size_; ++i) ++counts[data_[i]];
  double h = 0;
  for (int64_t c : counts)
    if (c) {
      const double p = double(c) / double(size_);
      h -= p * std::log(p);
    }
  return h;
}

std::string MockData::description() const {
  return "mock data: uniform random tokens over a vocabulary of " + std::to_string(vocab_);
}

void MockData::sample(int64_t index, int64_t seq_length, int32_t* out) const {
  const uint64_t base = uint64_t(index) * uint64_t(seq_length + 1);
  for (int64_t i = 0; i <= seq_length; ++i) {
    const uint64_t k = base + uint64_t(i);
    out[i] = int32_t(philox4x32(seed_, kMockStream, k / 4)[k % 4] % uint64_t(vocab_));
  }
}

}  // namespace loom

// Byte-text and mock data: windows, determinism in (seed, sample), errors naming the file.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <cstdio>
#include <fstream>

#include "loom/data/token_data.h"

using namespace loom;

namespace {
std::string write_temp(const std::string& content) {
  char name[] = "/tmp/loom_data_XXXXXX";
  const int fd = mkstemp(name);
  EXPECT_GE(fd, 0);
  FILE* f = fdopen(fd, "wb");
  std::fwrite(content.data(), 1, content.size(), f);
  std::fclose(f);
  return name;
}
}  // namespace

TEST(ByteTextData, WindowsAreContiguousSlicesAndTargetsShifted) {
  std::string text;
  for (int i = 0; i < 1000; ++i) text += char('a' + i % 26);
  const std::string path = write_temp(text);
  ByteTextData d(path, 16, 42);
  EXPECT_EQ(d.num_tokens(), 1000);
  Tensor tok = Tensor::empty({3, 16}, DType::kI32), tgt = Tensor::empty({3, 16}, DType::kI32);
  d.batch(10, tok, tgt);
  for (int b = 0; b < 3; ++b)
    for (int t = 0; t < 16; ++t) {
      const int32_t x = tok.data<int32_t>()[b * 16 + t], y = tgt.data<int32_t>()[b * 16 + t];
      EXPECT_EQ((x - 'a' + 1) % 26, y - 'a');  // the target is the next byte of the text
    }
  // Same (seed, sample) -> same window; different seed -> (almost surely) different windows.
  Tensor tok2 = Tensor::empty({3, 16}, DType::kI32), tgt2 = Tensor::empty({3, 16}, DType::kI32);
  d.batch(10, tok2, tgt2);
  EXPECT_EQ(0, std::memcmp(tok.raw(), tok2.raw(), size_t(tok.nbytes())));
  std::vector<int32_t> w1(17), w2(17);
  d.sample(11, 16, w1.data());
  EXPECT_EQ(0, std::memcmp(w1.data(), tok.data<int32_t>() + 16, 16 * 4));
  ByteTextData other(path, 16, 43);
  int same = 0;
  for (int k = 0; k < 20; ++k) {
    d.sample(k, 16, w1.data());
    other.sample(k, 16, w2.data());
    same += w1 == w2;
  }
  EXPECT_LT(same, 5);
  std::remove(path.c_str());
}

TEST(ByteTextData, UnigramEntropy) {
  const std::string path = write_temp("abababab");  // two symbols, equal frequency: ln 2
  ByteTextData d(path, 4, 1);
  EXPECT_NEAR(d.unigram_entropy(), std::log(2.0), 1e-12);
  std::remove(path.c_str());
}

TEST(ByteTextData, ErrorsNameTheFile) {
  try {
    ByteTextData d("/nonexistent/corpus.txt", 8, 1);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("--data-path: cannot open '/nonexistent/corpus.txt'"), std::string::npos);
  }
  const std::string path = write_temp("short");
  try {
    ByteTextData d(path, 8, 1);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("fewer than --seq-length + 1 = 9"), std::string::npos) << e.what();
  }
  std::remove(path.c_str());
}

TEST(MockData, InRangeDeterministicAndUniform) {
  MockData m(97, 5);
  std::vector<int32_t> a(1001), b(1001);
  std::vector<int64_t> counts(97);
  for (int k = 0; k < 100; ++k) {
    m.sample(k, 1000, a.data());
    m.sample(k, 1000, b.data());
    EXPECT_EQ(a, b);
    for (int32_t x : a) {
      ASSERT_GE(x, 0);
      ASSERT_LT(x, 97);
      ++counts[size_t(x)];
    }
  }
  for (int64_t c : counts) EXPECT_NEAR(double(c), 100100.0 / 97, 200.0);  // ~6 sigma
}

// core/crc32c: the published CRC-32C check values (RFC 3720 B.4 and the "123456789" check), the
// hardware path against the table path on every length around the lane and block boundaries and at
// every alignment, and crc32c_extend chaining over arbitrary split points.
#include "loom/core/crc32c.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace loom {
namespace {

TEST(Crc32c, KnownValues) {
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(""), 0u);
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);    // RFC 3720 B.4: 32 bytes of zeros
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);  // 32 bytes of 0xFF
  std::string inc, dec;
  for (int i = 0; i < 32; ++i) {
    inc.push_back(char(i));
    dec.push_back(char(31 - i));
  }
  EXPECT_EQ(crc32c(inc), 0x46DD794Eu);  // 32 incrementing bytes
  EXPECT_EQ(crc32c(dec), 0x113FDB5Cu);  // 32 decrementing bytes
  for (const char* s : {"", "a", "123456789", "The quick brown fox jumps over the lazy dog"})
    EXPECT_EQ(detail::crc32c_extend_portable(0, s, std::char_traits<char>::length(s)), crc32c(s)) << s;
}

TEST(Crc32c, FastPathMatchesTableAtEveryBoundaryAndAlignment) {
  std::mt19937_64 rng(7);
  std::vector<uint8_t> buf(3 * 8192 * 3 + 4096);
  for (uint8_t& b : buf) b = uint8_t(rng());
  // Lengths around the 8-byte words, the 768-byte short blocks and the 24 KiB long blocks.
  std::vector<size_t> lengths;
  for (size_t base : {size_t(0), size_t(8), size_t(768), size_t(1536), size_t(24576), size_t(49152), size_t(73728)})
    for (size_t d = 0; d < 10; ++d) {
      lengths.push_back(base + d);
      if (base >= d) lengths.push_back(base - d);
    }
  for (size_t n : lengths)
    for (size_t align = 0; align < 8; ++align) {
      if (align + n > buf.size()) continue;
      const uint32_t seed = uint32_t(rng());
      EXPECT_EQ(crc32c_extend(seed, buf.data() + align, n), detail::crc32c_extend_portable(seed, buf.data() + align, n))
          << "length " << n << " offset " << align << (crc32c_hardware() ? " (SSE4.2)" : " (table)");
    }
}

TEST(Crc32c, ExtendChainsOverAnySplit) {
  std::mt19937_64 rng(11);
  std::vector<uint8_t> buf(100000);
  for (uint8_t& b : buf) b = uint8_t(rng());
  const uint32_t whole = crc32c(buf.data(), buf.size());
  for (int t = 0; t < 50; ++t) {
    size_t a = rng() % buf.size(), b = rng() % buf.size();
    if (a > b) std::swap(a, b);
    uint32_t c = crc32c(buf.data(), a);
    c = crc32c_extend(c, buf.data() + a, b - a);
    c = crc32c_extend(c, buf.data() + b, buf.size() - b);
    EXPECT_EQ(c, whole) << "split at " << a << ", " << b;
  }
  // One flipped bit anywhere changes the checksum.
  for (int t = 0; t < 20; ++t) {
    std::vector<uint8_t> x = buf;
    x[rng() % x.size()] ^= uint8_t(1u << (rng() % 8));
    EXPECT_NE(crc32c(x.data(), x.size()), whole);
  }
}

}  // namespace
}  // namespace loom

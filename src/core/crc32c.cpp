// CRC-32C (see include/loom/core/crc32c.h).
//
// The CRC "register" r is the running remainder without the initial/final inversion; crc32c_extend
// inverts on entry and exit. Register arithmetic is in GF(2)[x] mod P in reflected bit order (bit 31 is
// the coefficient of x^0, bit 0 that of x^31), and it is linear: processing bytes B from register r gives
// shift(r, |B|) ^ process(0, B), where shift(r, n) = r * x^(8n) mod P. So three equal lanes A|B|C of a
// block can run as three independent instruction streams (the crc32 instruction has a latency of three
// cycles and a throughput of one) and be joined as shift(shift(rA, L) ^ rB, L) ^ rC; shift by a fixed L
// is linear in r, hence four table lookups.
#include "loom/core/crc32c.h"

#include <array>
#include <bit>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define LOOM_CRC32C_X86 1
#endif

namespace loom {

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // x^32 + ... reflected, without the x^32 term

// Slicing-by-8 tables: t[0] advances the register by one byte; t[k][b] is byte b followed by k zero bytes.
struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  constexpr Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (int k = 1; k < 8; ++k)
      for (uint32_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
  }
};
constexpr Tables kTables;

uint32_t update_portable(uint32_t r, const uint8_t* p, size_t n) {
  const auto& t = kTables.t;
  if constexpr (std::endian::native == std::endian::little) {
    for (; n >= 8; p += 8, n -= 8) {
      uint64_t x;
      std::memcpy(&x, p, 8);
      x ^= r;
      r = t[7][x & 0xFF] ^ t[6][(x >> 8) & 0xFF] ^ t[5][(x >> 16) & 0xFF] ^ t[4][(x >> 24) & 0xFF] ^
          t[3][(x >> 32) & 0xFF] ^ t[2][(x >> 40) & 0xFF] ^ t[1][(x >> 48) & 0xFF] ^ t[0][x >> 56];
    }
  }
  for (; n > 0; ++p, --n) r = t[0][(r ^ *p) & 0xFF] ^ (r >> 8);
  return r;
}

#ifdef LOOM_CRC32C_X86

// a * b mod P (reflected order).
uint32_t multiply_mod_p(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;  // b *= x
  }
  return product;
}

// r -> r * x^(8 * lane_bytes) mod P as four byte-indexed tables.
struct ShiftTable {
  std::array<std::array<uint32_t, 256>, 4> t{};
  explicit ShiftTable(size_t lane_bytes) {
    uint32_t x_pow = 1u << 31;  // x^0
    for (size_t i = 0; i < 8 * lane_bytes; ++i) x_pow = (x_pow & 1) ? (x_pow >> 1) ^ kPoly : x_pow >> 1;
    for (int j = 0; j < 4; ++j)
      for (uint32_t b = 0; b < 256; ++b) t[size_t(j)][b] = multiply_mod_p(x_pow, b << (8 * j));
  }
  uint32_t operator()(uint32_t r) const {
    return t[0][r & 0xFF] ^ t[1][(r >> 8) & 0xFF] ^ t[2][(r >> 16) & 0xFF] ^ t[3][r >> 24];
  }
};

constexpr size_t kLongLane = 8192;  // 24 KiB blocks for long buffers
constexpr size_t kShortLane = 256;  // 768-byte blocks for the rest

inline uint64_t load64(const uint8_t* p) {
  uint64_t x;
  std::memcpy(&x, p, 8);
  return x;
}

template <size_t kLane>
__attribute__((target("sse4.2"))) uint32_t three_lanes(uint32_t r, const uint8_t*& p, size_t& n,
                                                       const ShiftTable& shift) {
  for (; n >= 3 * kLane; p += 3 * kLane, n -= 3 * kLane) {
    uint64_t a = r, b = 0, c = 0;
    for (size_t i = 0; i < kLane; i += 8) {
      a = _mm_crc32_u64(a, load64(p + i));
      b = _mm_crc32_u64(b, load64(p + kLane + i));
      c = _mm_crc32_u64(c, load64(p + 2 * kLane + i));
    }
    r = shift(shift(uint32_t(a)) ^ uint32_t(b)) ^ uint32_t(c);
  }
  return r;
}

__attribute__((target("sse4.2"))) uint32_t update_sse42(uint32_t r, const uint8_t* p, size_t n) {
  static const ShiftTable long_shift(kLongLane), short_shift(kShortLane);
  r = three_lanes<kLongLane>(r, p, n, long_shift);
  r = three_lanes<kShortLane>(r, p, n, short_shift);
  uint64_t r64 = r;
  for (; n >= 8; p += 8, n -= 8) r64 = _mm_crc32_u64(r64, load64(p));
  r = uint32_t(r64);
  for (; n > 0; ++p, --n) r = _mm_crc32_u8(r, *p);
  return r;
}

bool detect_sse42() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
}

#endif

}  // namespace

bool crc32c_hardware() {
#ifdef LOOM_CRC32C_X86
  static const bool hw = detect_sse42();
  return hw;
#else
  return false;
#endif
}

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
#ifdef LOOM_CRC32C_X86
  if (crc32c_hardware()) return ~update_sse42(~crc, p, n);
#endif
  return ~update_portable(~crc, p, n);
}

uint32_t detail::crc32c_extend_portable(uint32_t crc, const void* data, size_t n) {
  return ~update_portable(~crc, static_cast<const uint8_t*>(data), n);
}

}  // namespace loom

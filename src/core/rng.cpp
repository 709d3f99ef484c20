// Philox4x32 with 10 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3").
// Counter words: (block lo, block hi, stream lo, stream hi); key words: (seed lo, seed hi).
#include "loom/core/rng.h"

#include <cmath>

#include "loom/core/check.h"

namespace loom {

namespace {
constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;

inline float to_unit(uint32_t x) {  // (0, 1), never 0 or 1
  // The f64 value is below 1, but for the top 2^7 words it rounds to 1.0f: keep the largest f32 below 1.
  const float u = float((double(x) + 0.5) * (1.0 / 4294967296.0));
  return u < 1.0f ? u : 0x1.fffffep-1f;
}
}  // namespace

std::array<uint32_t, 4> philox4x32(uint64_t seed, uint64_t stream, uint64_t block) {
  uint32_t c0 = uint32_t(block), c1 = uint32_t(block >> 32), c2 = uint32_t(stream), c3 = uint32_t(stream >> 32);
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = uint64_t(kM0) * c0;
    const uint64_t p1 = uint64_t(kM1) * c2;
    const uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n1 = uint32_t(p1);
    const uint32_t n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    const uint32_t n3 = uint32_t(p0);
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += kW0;
    k1 += kW1;
  }
  return {c0, c1, c2, c3};
}

uint32_t dropout_threshold(float p) {
  LOOM_CHECK(p >= 0.0f && p < 1.0f, "[dropout] probability must be in [0, 1), got ", p);
  const double t = std::nearbyint(double(p) * 4294967296.0);
  return t >= 4294967295.0 ? 0xFFFFFFFFu : uint32_t(t);
}

float philox_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return to_unit(philox4x32(seed, stream, index / 4)[index % 4]);
}

void philox_fill_uniform(float* out, int64_t n, uint64_t seed, uint64_t stream, uint64_t offset) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = philox_uniform(seed, stream, offset + uint64_t(i));
}

void philox_fill_normal(float* out, int64_t n, uint64_t seed, uint64_t stream, uint64_t offset, float mean,
                        float std) {
  // Index j uses block j/4; words (0,1) give normals for lanes 0,1 and words (2,3) for lanes 2,3.
  const uint64_t first_block = offset / 4, last_block = (offset + uint64_t(n) + 3) / 4;
  const int64_t nblocks = int64_t(last_block - first_block);
#pragma omp parallel for schedule(static)
  for (int64_t bi = 0; bi < nblocks; ++bi) {
    const uint64_t b = first_block + uint64_t(bi);
    const auto w = philox4x32(seed, stream, b);
    double z[4];
    for (int p = 0; p < 2; ++p) {
      const double u1 = (double(w[2 * p]) + 0.5) * (1.0 / 4294967296.0);
      const double u2 = (double(w[2 * p + 1]) + 0.5) * (1.0 / 4294967296.0);
      const double r = std::sqrt(-2.0 * std::log(u1));
      z[2 * p] = r * std::cos(2.0 * M_PI * u2);
      z[2 * p + 1] = r * std::sin(2.0 * M_PI * u2);
    }
    for (int l = 0; l < 4; ++l) {
      const uint64_t idx = b * 4 + uint64_t(l);
      if (idx < offset || idx >= offset + uint64_t(n)) continue;
      out[idx - offset] = float(double(mean) + double(std) * z[l]);
    }
  }
}

uint64_t hash_stream(std::string_view name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace loom

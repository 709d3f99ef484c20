// Counter-based Philox4x32-10 RNG. A random number is a pure function of (seed, stream, index), so
// initialisation and dropout give the same values whatever the thread count or work split, and a
// tensor shard can be generated without generating the whole tensor.
//   seed   - the user's --seed (the 64-bit key)
//   stream - distinguishes independent uses (e.g. a hash of a parameter name, or a dropout site)
//   index  - the element index inside that use
#pragma once
#include <array>
#include <cstdint>
#include <string_view>

namespace loom {

// One Philox4x32-10 block: 4 uniform 32-bit words for counter (stream, block).
std::array<uint32_t, 4> philox4x32(uint64_t seed, uint64_t stream, uint64_t block);

// Uniform in (0, 1): element i uses word i % 4 of block i / 4.
float philox_uniform(uint64_t seed, uint64_t stream, uint64_t index);

// Fills out[0..n) with N(mean, std^2) values for indices [offset, offset + n) of the stream
// (Box-Muller on word pairs, computed in double). Parallel over blocks; result independent of threads.
void philox_fill_normal(float* out, int64_t n, uint64_t seed, uint64_t stream, uint64_t offset, float mean,
                        float std);
void philox_fill_uniform(float* out, int64_t n, uint64_t seed, uint64_t stream, uint64_t offset);

// Dropout masks: element `index` of a (seed, stream) use is kept iff its Philox word (word index % 4 of
// block index / 4) is >= dropout_threshold(p), i.e. with probability 1 - p up to 2^-32. Kernels that
// drop whole blocks at once call philox4x32 directly with the same rule.
uint32_t dropout_threshold(float p);  // p in [0, 1): round(p * 2^32), saturating
inline bool dropout_keep(uint64_t seed, uint64_t stream, uint64_t index, uint32_t threshold) {
  return philox4x32(seed, stream, index / 4)[index % 4] >= threshold;
}

// 64-bit FNV-1a, for turning names into stream ids.
uint64_t hash_stream(std::string_view name);

}  // namespace loom

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78): the checksum of checkpoint tensors and of
// TensorBoard's TFRecord framing. crc32c("123456789") == 0xE3069283.
//
// Speed: on x86 CPUs with SSE4.2 (chosen at run time with __builtin_cpu_supports, so one binary runs
// everywhere) three independent streams of the crc32 instruction are interleaved and recombined, several
// GB/s per core; elsewhere a slicing-by-8 table, roughly a byte per cycle. Both give the same values.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace loom {

// Extends `crc` (the CRC-32C of earlier bytes, 0 for none) over `n` more bytes, so that
// crc32c_extend(crc32c(a), b) == crc32c(a + b): a stream can be checksummed in pieces as it is written.
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);

inline uint32_t crc32c(const void* data, size_t n) { return crc32c_extend(0, data, n); }
inline uint32_t crc32c(std::string_view data) { return crc32c_extend(0, data.data(), data.size()); }

// Whether the SSE4.2 path is in use (benchmarks and tests report it).
bool crc32c_hardware();

namespace detail {
// The table-driven path on its own (tests compare it with the hardware path).
uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n);
}  // namespace detail

}  // namespace loom

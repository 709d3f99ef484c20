// The on-disk index caches of the datasets (GPTDataset's Megatron-style .npy indices, SftDataset's packing):
// FNV-1a hashes of a dataset's description name the files, written atomically as NumPy .npy (format 1.0,
// little-endian, C order) and read back only when their header matches exactly. Private to the data layer.
#pragma once
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "loom/core/file_io.h"

namespace loom {

inline uint64_t fnv1a64(const void* data, size_t n, uint64_t h = 1469598103934665603ULL) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

inline std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// ---- .npy files (format 1.0, little-endian, C order) -----------------------------------------------

inline std::string npy_header(const char* descr, const std::string& shape) {
  std::string dict = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  const size_t unpadded = 10 + dict.size() + 1;  // magic(6) + version(2) + length(2) + dict + '\n'
  dict.append((64 - unpadded % 64) % 64, ' ');
  dict.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(char(dict.size() & 0xff));
  out.push_back(char(dict.size() >> 8));
  return out + dict;
}

// Python's repr of the shape tuple, as numpy.save writes it.
inline std::string shape_1d(size_t n) {
  std::ostringstream os;
  os << '(' << n << ",)";
  return os.str();
}
inline std::string shape_2d(size_t n, size_t m) {
  std::ostringstream os;
  os << '(' << n << ", " << m << ')';
  return os.str();
}

// Writes header + payload to path atomically (core/file_io.h); false (leaving nothing) on any failure:
// the cache is an optimisation, and a read-only data directory must not stop a run.
inline bool write_atomic(const std::string& path, const std::string& header, const void* data, size_t bytes) {
  return try_write_file_atomic(path, [&](int fd) {
    return write_all(fd, header.data(), header.size()) && (bytes == 0 || write_all(fd, data, bytes));
  });
}

// Loads an .npy written by write_atomic with exactly the expected header (dtype and shape).
template <typename T>
inline bool read_npy(const std::string& path, const std::string& header, size_t count, std::vector<T>& out) {
  const std::optional<std::string> file = read_file_if_present(path);
  if (!file) return false;
  const std::string& bytes = *file;
  if (bytes.size() != header.size() + count * sizeof(T)) return false;
  if (bytes.compare(0, header.size(), header) != 0) return false;
  out.resize(count);
  if (count > 0) std::memcpy(out.data(), bytes.data() + header.size(), count * sizeof(T));
  return true;
}


}  // namespace loom

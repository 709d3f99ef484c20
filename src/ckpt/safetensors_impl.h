// Private to the ckpt layer: what the safetensors reader (safetensors.cpp) and writer
// (safetensors_write.cpp) share.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "loom/core/dtype.h"

namespace loom::safetensors_detail {

inline constexpr const char* kMetadataKey = "__metadata__";
// Bytes checksummed per step while reading or writing: small enough to stay in L2 between the copy and
// the checksum, large enough that the system calls cost nothing.
inline constexpr size_t kChunkBytes = size_t(1) << 20;

// The reference library's dtype order; the writer puts higher ranks first.
int dtype_rank(DType dt);
// 8 lowercase hex digits: how checksums are written.
std::string hex8(uint32_t v);

}  // namespace loom::safetensors_detail

// The safetensors writer (format and guarantees in include/loom/ckpt/safetensors.h): header, data, and
// the per-tensor checksums computed chunk by chunk as the data goes out, so the file is never read back.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <nlohmann/json.hpp>
#include <set>

#include "loom/ckpt/safetensors.h"
#include "loom/core/crc32c.h"
#include "loom/core/file_io.h"
#include "safetensors_impl.h"

namespace loom {

using safetensors_detail::dtype_rank;
using safetensors_detail::hex8;
using safetensors_detail::kChunkBytes;
using safetensors_detail::kMetadataKey;

namespace {

bool pwrite_all(int fd, const void* src, size_t n, int64_t offset) {
  const char* p = static_cast<const char*>(src);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, off_t(offset));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= size_t(w);
    offset += w;
  }
  return true;
}

// The header text, padded to a multiple of 8. With `crcs` (one per tensor, in `order`) the checksum entry
// is added to the metadata; its size depends only on the names, never on the values.
std::string header_text(const std::string& path, const NamedTensors& tensors, const std::vector<size_t>& order,
                        const std::map<std::string, std::string>& metadata, const std::vector<uint32_t>* crcs) {
  std::map<std::string, std::string> meta = metadata;
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  try {
    if (crcs) {
      nlohmann::ordered_json c = nlohmann::ordered_json::object();
      for (size_t k = 0; k < order.size(); ++k) c[tensors[order[k]].first] = hex8((*crcs)[k]);
      meta[kSafetensorsChecksumKey] = c.dump();
    }
    if (!meta.empty()) {
      nlohmann::ordered_json m = nlohmann::ordered_json::object();
      for (const auto& [k, v] : meta) m[k] = v;
      header[kMetadataKey] = std::move(m);
    }
    int64_t offset = 0;
    for (size_t i : order) {
      const TensorView& t = tensors[i].second;
      nlohmann::ordered_json e = nlohmann::ordered_json::object();
      e["dtype"] = safetensors_dtype_name(t.dtype());
      e["shape"] = std::vector<int64_t>(t.shape().begin(), t.shape().end());
      e["data_offsets"] = {offset, offset + t.nbytes()};
      offset += t.nbytes();
      header[tensors[i].first] = std::move(e);
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    return text;
  } catch (const nlohmann::json::exception& e) {
    user_error("writing safetensors file '", path, "': a tensor name or metadata string is not valid UTF-8 (",
               e.what(), ")");
  }
}

}  // namespace

void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata, bool checksums) {
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    if (name.empty() || name == kMetadataKey)
      user_error("writing safetensors file '", path, "': invalid tensor name '", name, "'");
    if (!seen.insert(name).second)
      user_error("writing safetensors file '", path, "': tensor '", name, "' given twice");
    LOOM_CHECK(t.device().is_cpu(), "[safetensors] tensor '", name, "' must be in host memory, got ", t.desc());
    LOOM_CHECK(t.defined() || t.nbytes() == 0, "[safetensors] tensor '", name, "' has no data");
  }
  if (checksums && metadata.count(kSafetensorsChecksumKey))
    user_error("writing safetensors file '", path, "': the metadata key '", kSafetensorsChecksumKey,
               "' is reserved for the checksums the writer records");
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const int ra = dtype_rank(tensors[a].second.dtype()), rb = dtype_rank(tensors[b].second.dtype());
    return ra != rb ? ra > rb : tensors[a].first < tensors[b].first;
  });

  // With checksums the header goes out first with every CRC zero (fixed-width hex, so the final header
  // has the same size), the data follows (each chunk checksummed just before it is written), and the
  // header with the real CRCs is written over the first one.
  std::vector<uint32_t> crcs(order.size(), 0);
  const std::string text = header_text(path, tensors, order, metadata, checksums ? &crcs : nullptr);
  unsigned char len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = uint8_t(uint64_t(text.size()) >> (8 * i));

  write_file_atomic(path, [&](int fd) {
    bool ok = write_all(fd, len_bytes, 8) && write_all(fd, text.data(), text.size());
    for (size_t k = 0; ok && k < order.size(); ++k) {
      const TensorView& t = tensors[order[k]].second;
      const char* p = static_cast<const char*>(t.raw());
      if (!checksums) {
        ok = write_all(fd, p, size_t(t.nbytes()));
        continue;
      }
      for (int64_t done = 0; ok && done < t.nbytes();) {
        const size_t n = size_t(std::min<int64_t>(t.nbytes() - done, int64_t(kChunkBytes)));
        crcs[k] = crc32c_extend(crcs[k], p + done, n);
        ok = write_all(fd, p + done, n);
        done += int64_t(n);
      }
    }
    if (ok && checksums) {
      const std::string final_text = header_text(path, tensors, order, metadata, &crcs);
      LOOM_CHECK(final_text.size() == text.size(), "[safetensors] checksummed header of ", path, " changed size");
      ok = pwrite_all(fd, final_text.data(), final_text.size(), 8);
    }
    return ok;
  });
}

}  // namespace loom

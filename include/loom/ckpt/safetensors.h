// Safetensors files: reader (validating, read-into-memory or memory-mapped) and atomic writer.
//
// Format: u64 little-endian N, then N bytes of UTF-8 JSON
//   {"__metadata__": {str: str}, "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}}
// then the data region; offsets are relative to its start. A file is accepted only if the header is valid
// JSON of exactly that form, every dtype is a known safetensors dtype, numel(shape) * dtype size equals
// end - begin, and the tensors tile the data region exactly (no gaps, no overlaps, nothing past the end).
// Every error is a UserError naming the file and, where there is one, the tensor.
//
// Checksums: the writer records the CRC-32C of every tensor's bytes (core/crc32c.h) in the "__metadata__"
// entry "loom.crc32c", a JSON object as text, {"<tensor>": "<8 lowercase hex digits>", ...} in file order
// (other readers see one more string of metadata and ignore it). The CRCs are computed chunk by chunk as
// the data is written, and the header, whose size does not depend on their values, is rewritten in place
// at the end. The reader checks the entry at open (every tensor exactly once, well-formed values) and
// verifies a tensor's bytes whenever it reads them (read, read_into) or first maps them (map): a mismatch
// is a ChecksumError naming the file and the tensor. A file without the entry (another writer, or Loom
// before checksums) reads as before, unverified: has_checksums() says which. metadata() never shows the
// entry, so what a caller writes is what it reads back.
//
// The writer uses the layout of the reference safetensors library — compact JSON, "__metadata__" first,
// tensors ordered by dtype (widest first) then name, header padded with spaces to a multiple of 8 bytes —
// so with header padding every tensor is aligned to its element size and the bytes match what that
// library writes for the same tensors (without checksums). It writes `<path>.tmp`, fsyncs, then renames over `path`, so a
// crash leaves either the old file or the new one, never a torn one.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/check.h"
#include "loom/core/tensor.h"

namespace loom {

// The "__metadata__" key holding the per-tensor CRC-32C map (reserved: callers may not write it).
inline constexpr const char* kSafetensorsChecksumKey = "loom.crc32c";

// A tensor whose bytes do not match the checksum its file records. Callers that know more (which
// checkpoint, what else could be loaded instead) catch it and add that to the message.
class ChecksumError : public UserError {
 public:
  ChecksumError(const std::string& message, std::string path, std::string tensor)
      : UserError(message), path_(std::move(path)), tensor_(std::move(tensor)) {}
  const std::string& path() const { return path_; }
  const std::string& tensor() const { return tensor_; }

 private:
  std::string path_, tensor_;
};

// One tensor entry of a safetensors header.
struct SafetensorsInfo {
  std::string name;
  std::string dtype_str;      // as written in the file: "F32", "BF16", "F64", ...
  std::optional<DType> dtype; // the Loom dtype; empty for safetensors dtypes Loom has no type for (F64, U8, ...)
  Shape shape;
  int64_t begin = 0;  // byte offsets relative to the start of the data region
  int64_t end = 0;
  std::optional<uint32_t> crc32c;  // the recorded checksum of the bytes; empty in files without checksums
  int64_t nbytes() const { return end - begin; }
};

// Safetensors dtype name ("F32") <-> Loom dtype.
const char* safetensors_dtype_name(DType dt);
std::optional<DType> dtype_from_safetensors(const std::string& s);

class SafetensorsFile {
 public:
  enum class Mode {
    kRead,  // header parsed at open; tensor bytes read with pread() on demand
    kMmap,  // whole file mapped read-only; map() returns zero-copy views
  };

  // Opens and validates `path`. Throws UserError naming the file (and tensor) on any problem.
  static SafetensorsFile open(const std::string& path, Mode mode = Mode::kRead);

  SafetensorsFile();
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;

  const std::string& path() const;
  // Tensor names in data-offset order (the order they are stored in the file).
  const std::vector<std::string>& names() const;
  bool contains(const std::string& name) const;
  const SafetensorsInfo& info(const std::string& name) const;
  // "__metadata__" without the checksum entry.
  const std::map<std::string, std::string>& metadata() const;
  // Whether the file records a checksum for its tensors (then every tensor has one).
  bool has_checksums() const;
  int64_t header_bytes() const;  // N: the JSON header's length (data region starts at 8 + N)

  // Every read below verifies the tensor's checksum (when the file has checksums): ChecksumError on a
  // mismatch, the destination then holding the corrupt bytes.
  // A fresh CPU tensor holding a copy of the tensor's bytes (its own dtype and shape).
  Tensor read(const std::string& name) const;
  // Same, converted to `as`: any float dtype (F64 included) to any Loom float dtype (through f32; F64
  // to a 16/8-bit type therefore rounds twice), I32 <-> I64 (range-checked), or identity.
  Tensor read(const std::string& name, DType as) const;
  // Copies the tensor's bytes into `dst`, whose dtype and shape must match exactly (CPU memory).
  void read_into(const std::string& name, TensorView dst) const;
  // Zero-copy view into the mapping (Mode::kMmap only). The view is valid while this SafetensorsFile
  // (or a move of it) is alive; the tensor's data must be aligned to its element size. The first map()
  // of a tensor reads all of its bytes to verify them (once per tensor and open file; thread-safe).
  Tensor map(const std::string& name) const;
  // Reads the tensor's bytes and checks them against the recorded checksum (nothing without one).
  void verify(const std::string& name) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

using NamedTensors = std::vector<std::pair<std::string, TensorView>>;

// Writes CPU tensors to `path` atomically (via `<path>.tmp`, fsync, rename). Names must be unique,
// non-empty and not "__metadata__"; `metadata` may not use kSafetensorsChecksumKey. With `checksums` the
// CRC-32C of every tensor is recorded (see above); without, and with an empty `metadata`, the
// "__metadata__" entry is omitted.
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {}, bool checksums = true);

}  // namespace loom

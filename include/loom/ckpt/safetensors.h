// Safetensors files: reader (validating, read-into-memory or memory-mapped) and atomic writer.
//
// Format: u64 little-endian N, then N bytes of UTF-8 JSON
//   {"__metadata__": {str: str}, "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}}
// then the data region; offsets are relative to its start. A file is accepted only if the header is valid
// JSON of exactly that form, every dtype is a known safetensors dtype, numel(shape) * dtype size equals
// end - begin, and the tensors tile the data region exactly (no gaps, no overlaps, nothing past the end).
// Every error is a UserError naming the file and, where there is one, the tensor.
//
// The writer uses the layout of the reference safetensors library — compact JSON, "__metadata__" first,
// tensors ordered by dtype (widest first) then name, header padded with spaces to a multiple of 8 bytes —
// so with header padding every tensor is aligned to its element size and the bytes match what that
// library writes for the same tensors. It writes `<path>.tmp`, fsyncs, then renames over `path`, so a
// crash leaves either the old file or the new one, never a torn one.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/tensor.h"

namespace loom {

// One tensor entry of a safetensors header.
struct SafetensorsInfo {
  std::string name;
  std::string dtype_str;      // as written in the file: "F32", "BF16", "F64", ...
  std::optional<DType> dtype; // the Loom dtype; empty for safetensors dtypes Loom has no type for (F64, U8, ...)
  Shape shape;
  int64_t begin = 0;  // byte offsets relative to the start of the data region
  int64_t end = 0;
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
  const std::map<std::string, std::string>& metadata() const;
  int64_t header_bytes() const;  // N: the JSON header's length (data region starts at 8 + N)

  // A fresh CPU tensor holding a copy of the tensor's bytes (its own dtype and shape).
  Tensor read(const std::string& name) const;
  // Same, converted to `as`: any float dtype (F64 included) to any Loom float dtype (through f32; F64
  // to a 16/8-bit type therefore rounds twice), I32 <-> I64 (range-checked), or identity.
  Tensor read(const std::string& name, DType as) const;
  // Copies the tensor's bytes into `dst`, whose dtype and shape must match exactly (CPU memory).
  void read_into(const std::string& name, TensorView dst) const;
  // Zero-copy view into the mapping (Mode::kMmap only). The view is valid while this SafetensorsFile
  // (or a move of it) is alive; the tensor's data must be aligned to its element size.
  Tensor map(const std::string& name) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

using NamedTensors = std::vector<std::pair<std::string, TensorView>>;

// Writes CPU tensors to `path` atomically (via `<path>.tmp`, fsync, rename). Names must be unique,
// non-empty and not "__metadata__". An empty `metadata` omits the "__metadata__" entry.
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace loom

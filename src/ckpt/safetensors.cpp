// Safetensors reader (format and guarantees in include/loom/ckpt/safetensors.h; the writer is safetensors_write.cpp).
// The reader validates the whole header at open, so read()/map() only look up a checked entry; it never
// trusts a size from the file before comparing it with the file's real size. Errors are UserErrors
// because a bad checkpoint is something the user fixes (wrong path, truncated copy, foreign writer).
// Checksums are computed on the bytes while they are in cache: the writer checksums each chunk just
// before write(2) copies it out, the reader just after pread(2) or memcpy brought it in.
#include "loom/ckpt/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "loom/core/crc32c.h"
#include "loom/core/file_io.h"
#include "json_no_duplicates.h"
#include "safetensors_impl.h"

namespace loom {

namespace {

using Json = nlohmann::json;

// Same limit as the reference implementation: a larger header is a corrupt length field, not a header.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
using safetensors_detail::hex8;
using safetensors_detail::kChunkBytes;
using safetensors_detail::kMetadataKey;

struct StDtype {
  const char* name;
  int64_t size;
  std::optional<DType> loom;
  int rank;  // the reference library's dtype order; the writer puts higher ranks first
};

// Every dtype of the safetensors spec with a whole-byte element size.
const StDtype kStDtypes[] = {
    {"BOOL", 1, std::nullopt, 0},          {"U8", 1, std::nullopt, 4},
    {"I8", 1, std::nullopt, 5},            {"F8_E5M2", 1, DType::kF8E5M2, 6},
    {"F8_E4M3", 1, DType::kF8E4M3, 7},     {"F8_E8M0", 1, std::nullopt, 8},
    {"I16", 2, std::nullopt, 9},           {"U16", 2, DType::kU16, 10},
    {"F16", 2, DType::kF16, 11},           {"BF16", 2, DType::kBF16, 12},
    {"I32", 4, DType::kI32, 13},           {"U32", 4, std::nullopt, 14},
    {"F32", 4, DType::kF32, 15},           {"C64", 8, std::nullopt, 16},
    {"F64", 8, std::nullopt, 17},          {"I64", 8, DType::kI64, 18},
    {"U64", 8, std::nullopt, 19},
};

const StDtype* find_st_dtype(const std::string& s) {
  for (const StDtype& d : kStDtypes)
    if (s == d.name) return &d;
  return nullptr;
}

const StDtype& st_dtype_of(DType dt) {
  for (const StDtype& d : kStDtypes)
    if (d.loom == dt) return d;
  LOOM_FAIL("[safetensors] no safetensors name for dtype ", dtype_name(dt));
}

std::string known_dtype_list() {
  std::string s;
  for (const StDtype& d : kStDtypes) s += (s.empty() ? "" : ", ") + std::string(d.name);
  return s;
}

std::string errno_text() { return std::strerror(errno); }

// Reads exactly `n` bytes at `offset`; false on a short read (file shrank) or an I/O error.
bool pread_all(int fd, void* dst, size_t n, int64_t offset) {
  char* p = static_cast<char*>(dst);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, off_t(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= size_t(r);
    offset += r;
  }
  return true;
}

std::string offsets_str(int64_t b, int64_t e) { return detail::concat("[", b, ", ", e, "]"); }

// "0123abcd" -> its value; nullopt unless exactly 8 lowercase hex digits.
std::optional<uint32_t> parse_hex8(const std::string& s) {
  if (s.size() != 8) return std::nullopt;
  uint32_t v = 0;
  for (char c : s) {
    const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return std::nullopt;
    v = (v << 4) | uint32_t(d);
  }
  return v;
}

// A non-negative JSON integer that fits int64, or nullopt (negative, float, string, too large).
std::optional<int64_t> as_index(const Json& j) {
  if (!j.is_number_unsigned()) return std::nullopt;
  uint64_t v = j.get<uint64_t>();
  if (v > uint64_t(std::numeric_limits<int64_t>::max())) return std::nullopt;
  return int64_t(v);
}

}  // namespace

const char* safetensors_dtype_name(DType dt) { return st_dtype_of(dt).name; }

int safetensors_detail::dtype_rank(DType dt) { return st_dtype_of(dt).rank; }

std::string safetensors_detail::hex8(uint32_t v) {
  char b[9];
  std::snprintf(b, sizeof b, "%08x", v);
  return b;
}

std::optional<DType> dtype_from_safetensors(const std::string& s) {
  const StDtype* d = find_st_dtype(s);
  return d ? d->loom : std::nullopt;
}

// ---- reader -------------------------------------------------------------------------------------

struct SafetensorsFile::Impl {
  std::string path;
  Mode mode = Mode::kRead;
  int fd = -1;
  void* map_base = nullptr;
  size_t map_bytes = 0;
  int64_t header_bytes = 0;
  int64_t data_start = 0;  // 8 + N
  std::vector<std::string> names;
  std::unordered_map<std::string, SafetensorsInfo> infos;
  std::map<std::string, std::string> metadata;
  bool has_checksums = false;
  mutable std::mutex verified_mu;
  mutable std::unordered_set<std::string> verified;  // tensors map() has checked

  ~Impl() {
    if (map_base) ::munmap(map_base, map_bytes);
    if (fd >= 0) ::close(fd);
  }

  template <typename... Args>
  [[noreturn]] void fail(const Args&... args) const {
    user_error("safetensors file '", path, "': ", args...);
  }
  template <typename... Args>
  [[noreturn]] void fail_tensor(const std::string& name, const Args&... args) const {
    user_error("safetensors file '", path, "': tensor '", name, "': ", args...);
  }

  const SafetensorsInfo& lookup(const std::string& name) const {
    auto it = infos.find(name);
    if (it == infos.end()) {
      std::string some;
      for (size_t i = 0; i < names.size() && i < 5; ++i) some += (i ? ", " : "") + names[i];
      if (names.size() > 5) some += ", ...";
      fail("no tensor named '", name, "' (", names.size(), " tensors: ", some, ")");
    }
    return it->second;
  }

  void parse_header(const std::string& text, int64_t data_size);
  void parse_entry(const std::string& name, const Json& v, int64_t data_size);
  void check_tiling(int64_t data_size);
  void parse_checksums();
  // Copies the tensor's bytes to dst (nullptr: reads them only) and verifies them.
  void copy_bytes(const SafetensorsInfo& info, void* dst) const;
  void check_crc(const SafetensorsInfo& info, uint32_t actual) const;
};

void SafetensorsFile::Impl::parse_entry(const std::string& name, const Json& v, int64_t data_size) {
  if (name.empty()) fail("a tensor has an empty name");
  if (!v.is_object()) fail_tensor(name, "entry must be a JSON object, got ", v.type_name());
  for (auto it = v.begin(); it != v.end(); ++it)
    if (it.key() != "dtype" && it.key() != "shape" && it.key() != "data_offsets")
      fail_tensor(name, "unknown field '", it.key(), "' (expected dtype, shape, data_offsets)");
  for (const char* field : {"dtype", "shape", "data_offsets"})
    if (!v.contains(field)) fail_tensor(name, "missing field '", field, "'");

  SafetensorsInfo info;
  info.name = name;
  const Json& jd = v["dtype"];
  if (!jd.is_string()) fail_tensor(name, "dtype must be a string, got ", jd.dump());
  info.dtype_str = jd.get<std::string>();
  const StDtype* st = find_st_dtype(info.dtype_str);
  if (!st) fail_tensor(name, "unknown dtype '", info.dtype_str, "' (known: ", known_dtype_list(), ")");
  info.dtype = st->loom;

  const Json& js = v["shape"];
  if (!js.is_array()) fail_tensor(name, "shape must be an array of non-negative integers, got ", js.dump());
  if (js.size() > size_t(Shape::kMaxDims))
    fail_tensor(name, "shape ", js.dump(), " has ", js.size(), " dims; Loom tensors have at most ", Shape::kMaxDims);
  std::vector<int64_t> dims;
  for (const Json& d : js) {
    std::optional<int64_t> x = as_index(d);
    if (!x) fail_tensor(name, "shape ", js.dump(), " has a dim that is not a non-negative integer");
    dims.push_back(*x);
  }
  int64_t numel = 1;
  if (std::find(dims.begin(), dims.end(), 0) != dims.end()) numel = 0;
  for (int64_t x : dims) {
    if (numel == 0) break;
    if (numel > std::numeric_limits<int64_t>::max() / st->size / x)
      fail_tensor(name, "shape ", js.dump(), " is too large");
    numel *= x;
  }
  info.shape = Shape(std::span<const int64_t>(dims));

  const Json& jo = v["data_offsets"];
  if (!jo.is_array() || jo.size() != 2 || !as_index(jo[0]) || !as_index(jo[1]))
    fail_tensor(name, "data_offsets must be [begin, end] with non-negative integers, got ", jo.dump());
  info.begin = *as_index(jo[0]);
  info.end = *as_index(jo[1]);
  if (info.end < info.begin)
    fail_tensor(name, "data_offsets ", offsets_str(info.begin, info.end), " end before they begin");
  if (info.end > data_size)
    fail_tensor(name, "data_offsets ", offsets_str(info.begin, info.end), " run past the end of the data region (",
                data_size, " bytes; file truncated?)");
  const int64_t need = numel * st->size;
  if (need != info.nbytes())
    fail_tensor(name, "shape ", info.shape.str(), " with dtype ", info.dtype_str, " needs ", need,
                " bytes but data_offsets ", offsets_str(info.begin, info.end), " span ", info.nbytes());
  infos.emplace(name, std::move(info));
}

// The tensors must tile the data region exactly: sorted by offset, each starts where the previous ends.
void SafetensorsFile::Impl::check_tiling(int64_t data_size) {
  std::vector<const SafetensorsInfo*> order;
  for (const auto& [name, info] : infos) order.push_back(&info);
  std::sort(order.begin(), order.end(), [](const SafetensorsInfo* a, const SafetensorsInfo* b) {
    return std::tie(a->begin, a->end, a->name) < std::tie(b->begin, b->end, b->name);
  });
  int64_t expected = 0;
  const SafetensorsInfo* prev = nullptr;
  for (const SafetensorsInfo* t : order) {
    if (t->begin < expected)
      fail_tensor(t->name, "data_offsets ", offsets_str(t->begin, t->end), " overlap tensor '", prev->name, "' at ",
                  offsets_str(prev->begin, prev->end));
    if (t->begin > expected)
      fail("bytes [", expected, ", ", t->begin, ") of the data region belong to no tensor (gap before tensor '",
           t->name, "')");
    expected = t->end;
    prev = t;
    names.push_back(t->name);
  }
  if (expected != data_size)
    fail("data region is ", data_size, " bytes but the tensors cover only ", expected, " (", data_size - expected,
         " trailing bytes belong to no tensor)");
}

// The checksum entry of __metadata__ (written by write_safetensors): a JSON object naming every tensor
// once, each with 8 lowercase hex digits.
void SafetensorsFile::Impl::parse_checksums() {
  const auto it = metadata.find(kSafetensorsChecksumKey);
  if (it == metadata.end()) return;
  const std::string where = detail::concat("__metadata__ entry \"", kSafetensorsChecksumKey, "\"");
  std::string duplicate;
  Json j;
  try {
    j = ckpt_io::parse_json_noting_duplicates(it->second, &duplicate);
  } catch (const Json::exception& e) {
    fail(where, " is not valid JSON: ", e.what());
  }
  if (!duplicate.empty()) fail(where, " lists tensor '", duplicate, "' twice");
  if (!j.is_object()) fail(where, " must be a JSON object {tensor: crc32c}, got ", j.type_name());
  for (auto c = j.begin(); c != j.end(); ++c) {
    auto info = infos.find(c.key());
    if (info == infos.end()) fail(where, " names tensor '", c.key(), "', which the file does not hold");
    const std::optional<uint32_t> v = c.value().is_string() ? parse_hex8(c.value().get<std::string>()) : std::nullopt;
    if (!v) fail_tensor(c.key(), where, " has ", c.value().dump(), "; expected 8 lowercase hex digits");
    info->second.crc32c = *v;
  }
  for (const std::string& name : names)
    if (!infos.at(name).crc32c) fail_tensor(name, "no checksum in the ", where, ", which lists the other tensors");
  metadata.erase(it);
  has_checksums = true;
}

void SafetensorsFile::Impl::check_crc(const SafetensorsInfo& info, uint32_t actual) const {
  if (!info.crc32c || *info.crc32c == actual) return;
  throw ChecksumError(
      detail::concat("safetensors file '", path, "': tensor '", info.name, "': checksum mismatch: its ",
                     info.nbytes(), " bytes have CRC-32C ", hex8(actual), " but the file records ",
                     hex8(*info.crc32c), " (the file was damaged on disk or in a copy, or changed after it was "
                     "written)"),
      path, info.name);
}

void SafetensorsFile::Impl::parse_header(const std::string& text, int64_t data_size) {
  if (text.empty() || text[0] != '{') fail("header does not start with '{' (not a safetensors file?)");
  std::string duplicate;
  Json j;
  try {
    j = ckpt_io::parse_json_noting_duplicates(text, &duplicate);
  } catch (const Json::exception& e) {
    fail("header is not valid JSON: ", e.what());
  }
  if (!duplicate.empty()) fail("header has the key '", duplicate, "' twice");
  if (!j.is_object()) fail("header must be a JSON object, got ", j.type_name());

  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == kMetadataKey) {
      if (!it.value().is_object()) fail("__metadata__ must be an object of strings, got ", it.value().type_name());
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        if (!m.value().is_string())
          fail("__metadata__ value of '", m.key(), "' must be a string, got ", m.value().dump());
        metadata.emplace(m.key(), m.value().get<std::string>());
      }
      continue;
    }
    parse_entry(it.key(), it.value(), data_size);
  }
  check_tiling(data_size);
  parse_checksums();
}

void SafetensorsFile::Impl::copy_bytes(const SafetensorsInfo& info, void* dst) const {
  const bool check = info.crc32c.has_value();
  if (info.nbytes() == 0 || (!dst && !check)) return check_crc(info, 0);
  std::vector<char> scratch(dst || map_base ? 0 : std::min(size_t(info.nbytes()), kChunkBytes));
  uint32_t crc = 0;
  for (int64_t done = 0; done < info.nbytes();) {
    const size_t n = size_t(std::min<int64_t>(info.nbytes() - done, int64_t(kChunkBytes)));
    const int64_t at = data_start + info.begin + done;
    char* out = dst ? static_cast<char*>(dst) + done : scratch.data();
    if (map_base) {
      const char* src = static_cast<const char*>(map_base) + at;
      if (dst) std::memcpy(out, src, n);
      else out = const_cast<char*>(src);  // only read
    } else {
      errno = 0;
      if (!pread_all(fd, out, n, at))
        fail_tensor(info.name, "reading ", info.nbytes(), " bytes at offset ", data_start + info.begin,
                    " failed: ", errno ? errno_text() : "file is shorter than when it was opened");
    }
    if (check) crc = crc32c_extend(crc, out, n);
    done += int64_t(n);
  }
  if (check) check_crc(info, crc);
}

SafetensorsFile::SafetensorsFile() = default;
SafetensorsFile::~SafetensorsFile() = default;
SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;

SafetensorsFile SafetensorsFile::open(const std::string& path, Mode mode) {
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->mode = mode;
  impl->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (impl->fd < 0) user_error("cannot open safetensors file '", path, "': ", errno_text());
  struct stat st {};
  if (::fstat(impl->fd, &st) != 0) impl->fail("stat failed: ", errno_text());
  if (!S_ISREG(st.st_mode)) impl->fail("not a regular file");
  const int64_t file_size = st.st_size;
  if (file_size < 8) impl->fail("file is ", file_size, " bytes, too short for the 8-byte header length");

  unsigned char len_bytes[8];
  errno = 0;
  if (!pread_all(impl->fd, len_bytes, 8, 0)) impl->fail("cannot read the header length: ", errno_text());
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];  // little-endian on any host
  if (n < 2 || n > kMaxHeaderBytes || n > uint64_t(file_size - 8))
    impl->fail("header length ", n, " is invalid for a file of ", file_size, " bytes (need 2 <= N <= ",
               std::min<int64_t>(int64_t(kMaxHeaderBytes), file_size - 8), ")");
  impl->header_bytes = int64_t(n);
  impl->data_start = 8 + int64_t(n);

  std::string text(n, '\0');
  errno = 0;
  if (!pread_all(impl->fd, text.data(), n, 8)) impl->fail("cannot read the ", n, "-byte header: ", errno_text());
  impl->parse_header(text, file_size - impl->data_start);

  if (mode == Mode::kMmap) {
    void* p = ::mmap(nullptr, size_t(file_size), PROT_READ, MAP_PRIVATE, impl->fd, 0);
    if (p == MAP_FAILED) impl->fail("mmap of ", file_size, " bytes failed: ", errno_text());
    impl->map_base = p;
    impl->map_bytes = size_t(file_size);
    ::close(impl->fd);  // the mapping keeps the file alive
    impl->fd = -1;
  }
  SafetensorsFile f;
  f.impl_ = std::move(impl);
  return f;
}

const std::string& SafetensorsFile::path() const { return impl_->path; }
const std::vector<std::string>& SafetensorsFile::names() const { return impl_->names; }
bool SafetensorsFile::contains(const std::string& name) const { return impl_->infos.count(name) != 0; }
const SafetensorsInfo& SafetensorsFile::info(const std::string& name) const { return impl_->lookup(name); }
const std::map<std::string, std::string>& SafetensorsFile::metadata() const { return impl_->metadata; }
bool SafetensorsFile::has_checksums() const { return impl_->has_checksums; }
int64_t SafetensorsFile::header_bytes() const { return impl_->header_bytes; }

Tensor SafetensorsFile::read(const std::string& name) const {
  const SafetensorsInfo& info = impl_->lookup(name);
  if (!info.dtype)
    impl_->fail_tensor(name, "dtype ", info.dtype_str, " has no Loom type; read(name, as) converts F64 to a float "
                       "type and integer types to I32/I64");
  Tensor t = Tensor::empty(info.shape, *info.dtype);
  impl_->copy_bytes(info, t.raw());
  return t;
}

namespace {

// One element of a float source as double (exact for every listed format).
double float_at(const std::string& dt, const void* base, int64_t i) {
  if (dt == "F64") { double v; std::memcpy(&v, static_cast<const char*>(base) + 8 * i, 8); return v; }
  if (dt == "F32") { float v; std::memcpy(&v, static_cast<const char*>(base) + 4 * i, 4); return v; }
  if (dt == "BF16" || dt == "F16") {
    uint16_t v;
    std::memcpy(&v, static_cast<const char*>(base) + 2 * i, 2);
    return dt == "BF16" ? bf16_to_f32(v) : f16_to_f32(v);
  }
  uint8_t v = static_cast<const uint8_t*>(base)[i];
  return dt == "F8_E4M3" ? fp8_e4m3_to_f32(v) : fp8_e5m2_to_f32(v);
}

bool is_float_source(const std::string& dt) {
  return dt == "F64" || dt == "F32" || dt == "BF16" || dt == "F16" || dt == "F8_E4M3" || dt == "F8_E5M2";
}

// One element of an integer source; nullopt if it does not fit int64 (U64 above 2^63 - 1).
std::optional<int64_t> int_at(const std::string& dt, const void* base, int64_t i) {
  const char* p = static_cast<const char*>(base);
  auto load = [&](auto v) { std::memcpy(&v, p + sizeof(v) * i, sizeof(v)); return v; };
  if (dt == "I8") return load(int8_t{});
  if (dt == "U8" || dt == "BOOL") return load(uint8_t{});
  if (dt == "I16") return load(int16_t{});
  if (dt == "U16") return load(uint16_t{});
  if (dt == "I32") return load(int32_t{});
  if (dt == "U32") return load(uint32_t{});
  if (dt == "I64") return load(int64_t{});
  uint64_t v = load(uint64_t{});
  if (v > uint64_t(std::numeric_limits<int64_t>::max())) return std::nullopt;
  return int64_t(v);
}

bool is_int_source(const std::string& dt) {
  return dt == "I8" || dt == "U8" || dt == "BOOL" || dt == "I16" || dt == "U16" || dt == "I32" || dt == "U32" ||
         dt == "I64" || dt == "U64";
}

}  // namespace

Tensor SafetensorsFile::read(const std::string& name, DType as) const {
  const SafetensorsInfo& info = impl_->lookup(name);
  if (info.dtype == as) return read(name);
  const bool to_int = as == DType::kI32 || as == DType::kI64;
  const bool ok = (dtype_is_float(as) && is_float_source(info.dtype_str)) || (to_int && is_int_source(info.dtype_str));
  if (!ok)
    impl_->fail_tensor(name, "cannot convert dtype ", info.dtype_str, " to ", dtype_name(as),
                       " (float to float and integer to i32/i64 only)");
  std::vector<char> raw(size_t(info.nbytes()));
  impl_->copy_bytes(info, raw.data());
  Tensor t = Tensor::empty(info.shape, as);
  const int64_t n = info.shape.numel();
  for (int64_t i = 0; i < n; ++i) {
    if (to_int) {
      std::optional<int64_t> v = int_at(info.dtype_str, raw.data(), i);
      if (!v || (as == DType::kI32 && (*v < std::numeric_limits<int32_t>::min() ||
                                       *v > std::numeric_limits<int32_t>::max())))
        impl_->fail_tensor(name, "element ", i, " does not fit ", dtype_name(as));
      if (as == DType::kI32) t.data<int32_t>()[i] = int32_t(*v);
      else t.data<int64_t>()[i] = *v;
      continue;
    }
    const float f = float(float_at(info.dtype_str, raw.data(), i));
    switch (as) {
      case DType::kF32: t.data<float>()[i] = f; break;
      case DType::kBF16: t.data<uint16_t>()[i] = f32_to_bf16(f); break;
      case DType::kF16: t.data<uint16_t>()[i] = f32_to_f16(f); break;
      case DType::kF8E4M3: t.data<uint8_t>()[i] = f32_to_fp8_e4m3(f); break;
      case DType::kF8E5M2: t.data<uint8_t>()[i] = f32_to_fp8_e5m2(f); break;
      default: LOOM_FAIL("[safetensors] unreachable target ", dtype_name(as));
    }
  }
  return t;
}

void SafetensorsFile::read_into(const std::string& name, TensorView dst) const {
  const SafetensorsInfo& info = impl_->lookup(name);
  if (!info.dtype || *info.dtype != dst.dtype() || info.shape != dst.shape())
    impl_->fail_tensor(name, "stored as ", info.dtype_str, info.shape.str(), " but the destination is ", dst.desc());
  LOOM_CHECK(dst.device().is_cpu(), "[safetensors] read_into needs host memory, got ", dst.desc());
  impl_->copy_bytes(info, dst.raw());
}

Tensor SafetensorsFile::map(const std::string& name) const {
  const SafetensorsInfo& info = impl_->lookup(name);
  if (!impl_->map_base) impl_->fail_tensor(name, "map() needs the file opened with Mode::kMmap");
  if (!info.dtype) impl_->fail_tensor(name, "dtype ", info.dtype_str, " has no Loom type; use read(name, as)");
  char* p = static_cast<char*>(impl_->map_base) + impl_->data_start + info.begin;
  if (reinterpret_cast<uintptr_t>(p) % dtype_size(*info.dtype) != 0)
    impl_->fail_tensor(name, "data at file offset ", impl_->data_start + info.begin, " is not aligned to ",
                       dtype_size(*info.dtype), " bytes; use read() instead of map()");
  if (info.crc32c) {
    std::lock_guard<std::mutex> lock(impl_->verified_mu);
    if (!impl_->verified.count(name)) {
      impl_->copy_bytes(info, nullptr);
      impl_->verified.insert(name);
    }
  }
  return Tensor::wrap(p, info.shape, *info.dtype);
}

void SafetensorsFile::verify(const std::string& name) const { impl_->copy_bytes(impl_->lookup(name), nullptr); }

}  // namespace loom

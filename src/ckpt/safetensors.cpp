// Safetensors reader and writer (format and guarantees in include/loom/ckpt/safetensors.h).
// The reader validates the whole header at open, so read()/map() only look up a checked entry; it never
// trusts a size from the file before comparing it with the file's real size. Errors are UserErrors
// because a bad checkpoint is something the user fixes (wrong path, truncated copy, foreign writer).
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
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>

#include "loom/core/file_io.h"
#include "json_no_duplicates.h"

namespace loom {

namespace {

using Json = nlohmann::json;

// Same limit as the reference implementation: a larger header is a corrupt length field, not a header.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";

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

// A non-negative JSON integer that fits int64, or nullopt (negative, float, string, too large).
std::optional<int64_t> as_index(const Json& j) {
  if (!j.is_number_unsigned()) return std::nullopt;
  uint64_t v = j.get<uint64_t>();
  if (v > uint64_t(std::numeric_limits<int64_t>::max())) return std::nullopt;
  return int64_t(v);
}

}  // namespace

const char* safetensors_dtype_name(DType dt) { return st_dtype_of(dt).name; }

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
  void copy_bytes(const SafetensorsInfo& info, void* dst) const;
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
}

void SafetensorsFile::Impl::copy_bytes(const SafetensorsInfo& info, void* dst) const {
  if (info.nbytes() == 0) return;
  if (map_base) {
    std::memcpy(dst, static_cast<const char*>(map_base) + data_start + info.begin, size_t(info.nbytes()));
    return;
  }
  errno = 0;
  if (!pread_all(fd, dst, size_t(info.nbytes()), data_start + info.begin))
    fail_tensor(info.name, "reading ", info.nbytes(), " bytes at offset ", data_start + info.begin,
                " failed: ", errno ? errno_text() : "file is shorter than when it was opened");
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
  return Tensor::wrap(p, info.shape, *info.dtype);
}

// ---- writer -------------------------------------------------------------------------------------

void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    if (name.empty() || name == kMetadataKey)
      user_error("writing safetensors file '", path, "': invalid tensor name '", name, "'");
    if (!seen.insert(name).second)
      user_error("writing safetensors file '", path, "': tensor '", name, "' given twice");
    LOOM_CHECK(t.device().is_cpu(), "[safetensors] tensor '", name, "' must be in host memory, got ", t.desc());
    LOOM_CHECK(t.defined() || t.nbytes() == 0, "[safetensors] tensor '", name, "' has no data");
  }
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const int ra = st_dtype_of(tensors[a].second.dtype()).rank, rb = st_dtype_of(tensors[b].second.dtype()).rank;
    return ra != rb ? ra > rb : tensors[a].first < tensors[b].first;
  });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
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
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    user_error("writing safetensors file '", path, "': a tensor name or metadata string is not valid UTF-8 (",
               e.what(), ")");
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = uint8_t(uint64_t(text.size()) >> (8 * i));

  write_file_atomic(path, [&](int fd) {
    bool ok = write_all(fd, len_bytes, 8) && write_all(fd, text.data(), text.size());
    for (size_t k = 0; ok && k < order.size(); ++k) {
      const TensorView& t = tensors[order[k]].second;
      ok = write_all(fd, t.raw(), size_t(t.nbytes()));
    }
    return ok;
  });
}

}  // namespace loom

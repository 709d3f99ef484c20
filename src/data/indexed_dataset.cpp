// Megatron MMapIndexedDataset writer and reader (format in include/loom/data/indexed_dataset.h).
// Writer: tokens stream to <prefix>.bin.tmp.<pid>.<n>, the index stays in memory until finalize() writes
// <prefix>.idx.tmp..., then .bin is renamed before .idx, so an .idx under its final name always has its
// complete .bin. Reader: every header field, count, pointer and document index is checked against the
// file sizes before any token is touched, so a corrupt or truncated file is a UserError, never a crash;
// inspect() runs the same checks through a ProblemSink that collects every problem instead (data check).
// The .idx arrays start at byte 34 (not aligned for int32/int64), so they are copied out of the map into
// aligned vectors; the .bin stays memory-mapped (pointers are multiples of the item size, so aligned).
#include "loom/data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>

#include "loom/core/check.h"

namespace loom {

namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr uint64_t kVersion = 1;
constexpr size_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;  // magic, version, dtype code, S, D+1

const char* dtype_name(IndexDType dt) { return index_dtype_name(dt); }

}  // namespace

const char* index_dtype_name(IndexDType dt) {
  switch (dt) {
    case IndexDType::kU8: return "uint8";
    case IndexDType::kI8: return "int8";
    case IndexDType::kI16: return "int16";
    case IndexDType::kI32: return "int32";
    case IndexDType::kI64: return "int64";
    case IndexDType::kF64: return "float64";
    case IndexDType::kF32: return "float32";
    case IndexDType::kU16: return "uint16";
  }
  return "?";
}

namespace {

// Token ids are integers; the float codes exist in Megatron's enum but never hold token data.
bool is_token_dtype(uint8_t code) { return code >= 1 && code <= 8 && code != 6 && code != 7; }

std::string errno_text() { return std::strerror(errno); }

// Range of token ids each integer dtype can store.
void token_range(IndexDType dt, int64_t& lo, int64_t& hi) {
  switch (dt) {
    case IndexDType::kU8: lo = 0, hi = 255; return;
    case IndexDType::kI8: lo = -128, hi = 127; return;
    case IndexDType::kI16: lo = -32768, hi = 32767; return;
    case IndexDType::kU16: lo = 0, hi = 65535; return;
    default: lo = std::numeric_limits<int32_t>::min(), hi = std::numeric_limits<int32_t>::max(); return;
  }
}

template <typename T>
void append_le(std::vector<char>& buf, T v) {
  // x86/ARM Linux hosts are little-endian, which the format requires; memcpy keeps it alias-safe.
  static_assert(std::endian::native == std::endian::little, "indexed dataset I/O assumes little-endian");
  const size_t at = buf.size();
  buf.resize(at + sizeof(T));
  std::memcpy(buf.data() + at, &v, sizeof(T));
}

// Encodes n tokens into dtype `dt` little-endian bytes at dst.
void encode_tokens(IndexDType dt, const int32_t* src, size_t n, char* dst) {
  auto put = [&](auto tag) {
    using T = decltype(tag);
    for (size_t i = 0; i < n; ++i) {
      const T v = T(src[i]);
      std::memcpy(dst + i * sizeof(T), &v, sizeof(T));
    }
  };
  switch (dt) {
    case IndexDType::kU8: put(uint8_t{}); break;
    case IndexDType::kI8: put(int8_t{}); break;
    case IndexDType::kI16: put(int16_t{}); break;
    case IndexDType::kU16: put(uint16_t{}); break;
    case IndexDType::kI32: put(int32_t{}); break;
    case IndexDType::kI64: put(int64_t{}); break;
    default: LOOM_FAIL("[indexed_dataset] cannot store token ids as ", dtype_name(dt));
  }
}

std::string temp_name(const std::string& final_path) {
  static std::atomic<uint64_t> counter{0};
  return final_path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
}

void write_all(std::FILE* f, const char* data, size_t n, const std::string& path) {
  if (n && std::fwrite(data, 1, n, f) != n) user_error("cannot write ", path, ": ", errno_text());
}

}  // namespace

size_t index_dtype_size(IndexDType dt) {
  switch (dt) {
    case IndexDType::kU8:
    case IndexDType::kI8: return 1;
    case IndexDType::kI16:
    case IndexDType::kU16: return 2;
    case IndexDType::kI32:
    case IndexDType::kF32: return 4;
    case IndexDType::kI64:
    case IndexDType::kF64: return 8;
  }
  LOOM_FAIL("[indexed_dataset] unknown dtype code ", int(dt));
}

IndexDType index_dtype_for_vocab(int64_t vocab_size) {
  return vocab_size < 65500 ? IndexDType::kU16 : IndexDType::kI32;
}

// ---- writer ------------------------------------------------------------------------------------

struct IndexedDatasetWriter::Impl {
  std::string prefix, bin_tmp, idx_tmp;
  IndexDType dtype;
  size_t itemsize;
  int64_t lo = 0, hi = 0;
  std::FILE* bin = nullptr;
  std::vector<int32_t> lengths;
  std::vector<int64_t> doc_indices{0};
  std::vector<char> scratch;
  bool finalized = false;

  ~Impl() {
    if (bin) std::fclose(bin);
    if (!finalized) {
      std::remove(bin_tmp.c_str());
      std::remove(idx_tmp.c_str());
    }
  }
};

IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix, IndexDType dtype) : impl_(std::make_unique<Impl>()) {
  LOOM_CHECK(is_token_dtype(uint8_t(dtype)), "[indexed_dataset] token files need an integer dtype, got ",
             dtype_name(dtype));
  Impl& w = *impl_;
  w.prefix = std::move(prefix);
  w.dtype = dtype;
  w.itemsize = index_dtype_size(dtype);
  token_range(dtype, w.lo, w.hi);
  w.bin_tmp = temp_name(w.prefix + ".bin");
  w.idx_tmp = temp_name(w.prefix + ".idx");
  w.bin = std::fopen(w.bin_tmp.c_str(), "wb");
  if (!w.bin) user_error("cannot create ", w.prefix, ".bin (temporary ", w.bin_tmp, "): ", errno_text());
  std::setvbuf(w.bin, nullptr, _IOFBF, size_t(1) << 20);
}

IndexedDatasetWriter::~IndexedDatasetWriter() = default;

void IndexedDatasetWriter::add_sequence(std::span<const int32_t> tokens) {
  Impl& w = *impl_;
  LOOM_CHECK(!w.finalized, "[indexed_dataset] add_sequence after finalize on ", w.prefix);
  if (tokens.size() > size_t(std::numeric_limits<int32_t>::max()))
    user_error(w.prefix, ".idx: a sequence of ", tokens.size(), " tokens does not fit the int32 length field");
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < w.lo || tokens[i] > w.hi)
      user_error(w.prefix, ".bin: token id ", tokens[i], " does not fit the file's dtype ", dtype_name(w.dtype),
                 " (range [", w.lo, ", ", w.hi, "])");
  w.scratch.resize(tokens.size() * w.itemsize);
  encode_tokens(w.dtype, tokens.data(), tokens.size(), w.scratch.data());
  write_all(w.bin, w.scratch.data(), w.scratch.size(), w.bin_tmp);
  w.lengths.push_back(int32_t(tokens.size()));
}

void IndexedDatasetWriter::end_document() {
  Impl& w = *impl_;
  LOOM_CHECK(!w.finalized, "[indexed_dataset] end_document after finalize on ", w.prefix);
  w.doc_indices.push_back(int64_t(w.lengths.size()));
}

void IndexedDatasetWriter::finalize() {
  Impl& w = *impl_;
  LOOM_CHECK(!w.finalized, "[indexed_dataset] finalize called twice on ", w.prefix);
  LOOM_CHECK(w.doc_indices.back() == int64_t(w.lengths.size()), "[indexed_dataset] ", w.prefix, ": ",
             int64_t(w.lengths.size()) - w.doc_indices.back(), " sequences added after the last end_document()");
  const int close_rc = std::fclose(w.bin);
  w.bin = nullptr;
  if (close_rc != 0) user_error("cannot write ", w.bin_tmp, ": ", errno_text());

  const size_t S = w.lengths.size(), D1 = w.doc_indices.size();
  std::vector<char> idx;
  idx.reserve(kHeaderBytes + S * 12 + D1 * 8);
  idx.insert(idx.end(), kMagic, kMagic + 9);
  append_le<uint64_t>(idx, kVersion);
  append_le<uint8_t>(idx, uint8_t(w.dtype));
  append_le<uint64_t>(idx, S);
  append_le<uint64_t>(idx, D1);
  for (int32_t len : w.lengths) append_le<int32_t>(idx, len);
  int64_t ptr = 0;  // Megatron's pointers: running byte offsets of each sequence in .bin
  for (int32_t len : w.lengths) {
    append_le<int64_t>(idx, ptr);
    ptr += int64_t(len) * int64_t(w.itemsize);
  }
  for (int64_t d : w.doc_indices) append_le<int64_t>(idx, d);

  std::FILE* f = std::fopen(w.idx_tmp.c_str(), "wb");
  if (!f) user_error("cannot create ", w.prefix, ".idx (temporary ", w.idx_tmp, "): ", errno_text());
  const bool ok = std::fwrite(idx.data(), 1, idx.size(), f) == idx.size();
  if (std::fclose(f) != 0 || !ok) user_error("cannot write ", w.idx_tmp, ": ", errno_text());

  const std::string bin_final = w.prefix + ".bin", idx_final = w.prefix + ".idx";
  if (std::rename(w.bin_tmp.c_str(), bin_final.c_str()) != 0)
    user_error("cannot rename ", w.bin_tmp, " to ", bin_final, ": ", errno_text());
  if (std::rename(w.idx_tmp.c_str(), idx_final.c_str()) != 0) {
    const std::string why = errno_text();
    std::remove(bin_final.c_str());  // a .bin without its .idx is not a dataset
    user_error("cannot rename ", w.idx_tmp, " to ", idx_final, ": ", why);
  }
  w.finalized = true;
}

// ---- reader ------------------------------------------------------------------------------------

namespace {

// A read-only mapping of a whole file; size 0 maps nothing.
struct MappedFile {
  const char* data = nullptr;
  size_t size = 0;

  MappedFile() = default;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (data) ::munmap(const_cast<char*>(data), size);
  }

  void open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) user_error("cannot open ", path, ": ", errno_text());
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const std::string why = errno_text();
      ::close(fd);
      user_error("cannot stat ", path, ": ", why);
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      user_error(path, " is not a regular file");
    }
    size = size_t(st.st_size);
    if (size > 0) {
      void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const std::string why = errno_text();
        ::close(fd);
        user_error("cannot memory-map ", path, ": ", why);
      }
      data = static_cast<const char*>(p);
    }
    ::close(fd);
  }
};

template <typename T>
T load_le(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Where the reader's checks go: open() throws at the first problem; inspect() (collect = true) lists them
// all, at most kPerField per field so that one bad length does not bury the rest under a cascade.
struct ProblemSink {
  static constexpr int kPerField = 5;
  bool collect = false;
  std::vector<std::string> problems;
  std::vector<std::pair<std::string, int64_t>> counts;  // (field, problems seen)

  template <typename... Args>
  void report(const std::string& field, const Args&... args) {
    if (!collect) user_error(args...);
    auto it = std::find_if(counts.begin(), counts.end(), [&](const auto& c) { return c.first == field; });
    if (it == counts.end()) it = counts.insert(counts.end(), {field, 0});
    if (++it->second <= kPerField) problems.push_back(detail::concat(args...));
  }
  void summarize(const std::string& idx_path) {
    for (const auto& [field, n] : counts)
      if (n > kPerField)
        problems.push_back(detail::concat(idx_path, ": ", n - kPerField, " more problems with field '", field, "'"));
  }
};

class MMapIndexedDataset final : public IndexedDataset {
 public:
  // sink.collect: record problems instead of throwing; the dataset is usable only when none was found.
  MMapIndexedDataset(const std::string& prefix, ProblemSink& sink) : prefix_(prefix) {
    const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
    MappedFile idx;
    idx.open(idx_path);
    bin_.open(bin_path);
    if (parse_index(idx, idx_path, sink)) validate(idx_path, bin_path, sink);
    sink.summarize(idx_path);
  }

  IndexDType dtype() const override { return dtype_; }
  int64_t num_sequences() const override { return int64_t(lengths_.size()); }
  std::span<const int32_t> sequence_lengths() const override { return lengths_; }
  std::span<const int64_t> document_indices() const override { return doc_indices_; }
  const std::string& prefix() const override { return prefix_; }

  void read(int64_t seq, int64_t offset, int64_t length, int32_t* out) const override {
    LOOM_CHECK(seq >= 0 && seq < num_sequences(), "[indexed_dataset] sequence index in [0, ", num_sequences(),
               "), got ", seq, " (", prefix_, ")");
    LOOM_CHECK(offset >= 0 && length >= 0 && offset <= lengths_[seq] - length, "[indexed_dataset] range [",
               offset, ", ", offset, " + ", length, ") outside sequence ", seq, " of length ", lengths_[seq],
               " (", prefix_, ")");
    const char* src = bin_.data + pointers_[seq] + offset * int64_t(itemsize_);
    auto get = [&](auto tag) {
      using T = decltype(tag);
      for (int64_t i = 0; i < length; ++i) out[i] = int32_t(load_le<T>(src + i * int64_t(sizeof(T))));
    };
    switch (dtype_) {
      case IndexDType::kU8: get(uint8_t{}); break;
      case IndexDType::kI8: get(int8_t{}); break;
      case IndexDType::kI16: get(int16_t{}); break;
      case IndexDType::kU16: get(uint16_t{}); break;
      case IndexDType::kI32: get(int32_t{}); break;
      case IndexDType::kI64:
        for (int64_t i = 0; i < length; ++i) {
          const int64_t v = load_le<int64_t>(src + i * 8);
          if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max())
            user_error(prefix_, ".bin: token ", offset + i, " of sequence ", seq, " is ", v,
                       ", outside the int32 token id range");
          out[i] = int32_t(v);
        }
        break;
      default: LOOM_FAIL("[indexed_dataset] unreachable dtype");
    }
  }

 private:
  // false when the header or the array sizes are unusable (then nothing else can be checked).
  bool parse_index(const MappedFile& idx, const std::string& path, ProblemSink& sink) {
    auto fatal = [&](const std::string& field, const auto&... args) {
      sink.report(field, path, ": ", args...);
      return false;
    };
    if (idx.size < kHeaderBytes) return fatal("header", "truncated header (", idx.size, " bytes, need ", kHeaderBytes, ")");
    if (std::memcmp(idx.data, kMagic, 9) != 0)
      return fatal("magic", "field 'magic' is not \"MMIDIDX\\0\\0\" (not a Megatron mmap indexed dataset)");
    const uint64_t version = load_le<uint64_t>(idx.data + 9);
    if (version != kVersion) return fatal("version", "field 'version' is ", version, ", only version 1 is supported");
    const uint8_t code = idx.data[17];
    if (!is_token_dtype(code))
      return fatal("dtype", "field 'dtype' has code ", int(code),
                   ", expected a token id type: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16");
    dtype_ = IndexDType(code);
    itemsize_ = index_dtype_size(dtype_);
    const uint64_t S = load_le<uint64_t>(idx.data + 18);
    const uint64_t D1 = load_le<uint64_t>(idx.data + 26);
    // Sizes are checked by division first so that huge counts cannot overflow the products.
    const uint64_t body = idx.size - kHeaderBytes;
    if (S > body / 12)
      return fatal("sequence_count", "field 'sequence_count' = ", S, " needs ", S,
                   " * 12 bytes of arrays, but the file has ", body, " bytes after the header (truncated .idx?)");
    if (D1 > (body - S * 12) / 8)
      return fatal("document_count", "field 'document_count' = ", D1, " needs ", D1,
                   " * 8 bytes of document indices after the sequence arrays, but only ", body - S * 12,
                   " bytes remain (truncated .idx?)");
    const uint64_t expect = kHeaderBytes + S * 12 + D1 * 8;
    if (idx.size != expect)
      return fatal("size", "file is ", idx.size, " bytes, but sequence_count ", S, " and document_count ", D1, " give ",
                   expect, idx.size - expect == S ? " (multimodal sequence modes are not supported)" : "");
    if (D1 < 1) return fatal("document_count", "field 'document_count' is 0; it counts the leading 0 of document_indices");
    if (S > uint64_t(std::numeric_limits<int64_t>::max() / 16))
      return fatal("sequence_count", "field 'sequence_count' = ", S, " is too large");

    const char* p = idx.data + kHeaderBytes;
    lengths_.resize(S);
    pointers_.resize(S);
    doc_indices_.resize(D1);
    if (S) std::memcpy(lengths_.data(), p, S * 4);
    if (S) std::memcpy(pointers_.data(), p + S * 4, S * 8);
    std::memcpy(doc_indices_.data(), p + S * 12, D1 * 8);
    return true;
  }

  void validate(const std::string& idx_path, const std::string& bin_path, ProblemSink& sink) const {
    const int64_t S = int64_t(lengths_.size()), item = int64_t(itemsize_);
    const int64_t bin_size = int64_t(bin_.size);
    int64_t expect_ptr = 0;  // running byte offset; stays <= bin_size, so no overflow
    for (int64_t i = 0; i < S; ++i) {
      const int64_t len = lengths_[i], ptr = pointers_[i];
      if (len < 0) {
        sink.report("sequence_lengths", idx_path, ": field 'sequence_lengths[", i, "]' is negative (", len, ")");
        continue;
      }
      const int64_t nbytes = len * item;
      if (ptr < 0 || ptr > bin_size || nbytes > bin_size - ptr)
        sink.report("sequence_pointers", idx_path, ": field 'sequence_pointers[", i, "]' = ", ptr, " with length ",
                    len, " (", nbytes, " bytes) points past the end of ", bin_path, " (", bin_size, " bytes)");
      else if (ptr != expect_ptr)
        sink.report("sequence_pointers", idx_path, ": field 'sequence_pointers[", i, "]' = ", ptr, ", expected ",
                    expect_ptr, " (the running sum of sequence_lengths * ", item, " bytes; pointers must be contiguous ",
                    "and increasing)");
      // Past the end of the file, the sum would only repeat the size problem below.
      if (nbytes <= bin_size - expect_ptr) expect_ptr += nbytes;
      else expect_ptr = bin_size + 1;
    }
    if (expect_ptr != bin_size)
      sink.report("bin_size", bin_path, ": size is ", bin_size, " bytes, but the sequence_lengths in ", idx_path,
                  expect_ptr > bin_size ? " need more" : " sum to " + std::to_string(expect_ptr / item) + " tokens * " +
                  std::to_string(item) + " bytes = " + std::to_string(expect_ptr),
                  " (.idx and .bin do not belong together, or one is truncated)");
    if (doc_indices_[0] != 0)
      sink.report("document_indices", idx_path, ": field 'document_indices[0]' is ", doc_indices_[0], ", expected 0");
    for (size_t k = 1; k < doc_indices_.size(); ++k)
      if (doc_indices_[k] < doc_indices_[k - 1])
        sink.report("document_indices", idx_path, ": field 'document_indices[", k, "]' = ", doc_indices_[k],
                    " is less than entry ", k - 1, " (", doc_indices_[k - 1],
                    "); document indices must be non-decreasing");
    if (doc_indices_.back() != S)
      sink.report("document_indices", idx_path, ": field 'document_indices[", doc_indices_.size() - 1,
                  "]' (the last) is ", doc_indices_.back(), ", expected the sequence count ", S);
  }

  std::string prefix_;
  MappedFile bin_;
  IndexDType dtype_ = IndexDType::kU16;
  size_t itemsize_ = 2;
  std::vector<int32_t> lengths_;  // (S)
  std::vector<int64_t> pointers_;  // (S) byte offsets into .bin, validated
  std::vector<int64_t> doc_indices_;  // (D + 1)
};

}  // namespace

std::unique_ptr<IndexedDataset> IndexedDataset::open(const std::string& prefix) {
  ProblemSink sink;
  return std::make_unique<MMapIndexedDataset>(prefix, sink);
}

IndexInspection IndexedDataset::inspect(const std::string& prefix) {
  IndexInspection out;
  try {
    ProblemSink sink;
    sink.collect = true;
    auto ds = std::make_unique<MMapIndexedDataset>(prefix, sink);
    out.problems = std::move(sink.problems);
    if (out.problems.empty()) out.dataset = std::move(ds);
  } catch (const UserError& e) {  // a file that cannot be opened or mapped
    out.problems.push_back(e.what());
  }
  return out;
}

std::string locate_token(const IndexedDataset& ds, int64_t seq, int64_t offset) {
  const auto lengths = ds.sequence_lengths();
  const auto docs = ds.document_indices();
  // The document holding `seq`: the last k with docs[k] <= seq (empty documents repeat an entry).
  const int64_t doc = int64_t(std::upper_bound(docs.begin(), docs.end(), seq) - docs.begin()) - 1;
  int64_t in_file = offset, in_doc = offset;
  for (int64_t s = 0; s < seq; ++s) {
    in_file += lengths[size_t(s)];
    if (doc >= 0 && s >= docs[size_t(doc)]) in_doc += lengths[size_t(s)];
  }
  std::ostringstream os;
  os << ds.prefix() << ".bin: document " << doc << ", token " << in_doc << " of the document (token " << in_file
     << " of the file)";
  return os.str();
}

}  // namespace loom

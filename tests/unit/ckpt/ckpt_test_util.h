// Shared helpers of the checkpoint tests (tests/unit/ckpt; the e2e tests use the file surgery too): a
// fixture with a fresh directory per test, whole-file reads and writes, deterministic tensor bytes,
// byte-exact tensor comparison, the check that a call throws a UserError naming what it must name, and
// damaging a safetensors file the way disks and copies do (overwriting a tensor's bytes) or turning it
// into one written before checksums existed.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "loom/ckpt/safetensors.h"
#include "loom/core/check.h"
#include "loom/core/tensor.h"

namespace loom::ckpt_test {

// dir_ = <tmp>/loom_<suite>_<pid>_<test>, created empty before each test and removed after it. <tmp> is
// /dev/shm when writable (tmpfs keeps the many fsyncs of checkpoint writes cheap), else the temp dir.
// A test suite derives its own fixture from this one (`class FooTest : public TempDirTest {};`).
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path base = fs::is_directory("/dev/shm", ec) && ::access("/dev/shm", W_OK) == 0
                              ? fs::path("/dev/shm")
                              : fs::temp_directory_path();
    const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string("loom_") + info->test_suite_name() + "_" + std::to_string(::getpid()) + "_" +
                       info->name();
    std::replace(name.begin(), name.end(), '/', '_');  // parameterized names: "Prefix/Suite", "Test/0"
    dir_ = base / name;
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  // The path of `name` (a file or directory) inside the test directory.
  std::string file(const std::string& name) const { return (dir_ / name).string(); }

  std::filesystem::path dir_;
};

inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// A tensor whose bytes follow a simple pattern of (index, seed): distinct seeds give distinct contents.
inline Tensor make_bytes(Shape s, DType dt, int seed) {
  Tensor t = Tensor::empty(s, dt);
  auto* p = static_cast<uint8_t*>(t.raw());
  for (int64_t i = 0; i < t.nbytes(); ++i) p[i] = uint8_t(i * 29 + seed * 7 + 1);
  return t;
}

// Same dtype, shape and bytes.
inline bool same_bytes(const TensorView& a, const TensorView& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         (a.nbytes() == 0 || std::memcmp(a.raw(), b.raw(), size_t(a.nbytes())) == 0);
}

// Runs `f`, expects a UserError whose message contains every one of `parts`.
template <typename F>
void expect_user_error(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "expected a UserError mentioning '" << *parts.begin() << "'";
  } catch (const UserError& e) {
    for (const std::string& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "message: " << e.what() << "\nmissing: " << p;
  }
}

// Overwrites `bytes` at `offset` into tensor `name`'s data in the safetensors file at `path` (in place,
// as a bad disk block or a broken copy would).
inline void overwrite_tensor_bytes(const std::string& path, const std::string& name, int64_t offset,
                                   const std::string& bytes) {
  int64_t at = 0;
  {
    const SafetensorsFile f = SafetensorsFile::open(path);
    const SafetensorsInfo& info = f.info(name);
    ASSERT_LE(offset + int64_t(bytes.size()), info.nbytes()) << name << " in " << path;
    at = 8 + f.header_bytes() + info.begin + offset;
  }
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f.good()) << path;
  f.seekp(at);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

// The bytes of a safetensors file as Loom wrote it before checksums: the header without the checksum entry
// (and, in a sharded checkpoint's shard, its index without the metadata.json checksum); the tensor bytes
// unchanged. Other writers' files (which have no such entry) come back as they are.
inline std::string without_checksums(const std::string& bytes) {
  EXPECT_GE(bytes.size(), 8u);
  if (bytes.size() < 8) return bytes;
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(bytes[size_t(i)]);
  nlohmann::ordered_json h = nlohmann::ordered_json::parse(bytes.substr(8, n));
  if (!h.contains("__metadata__") || !h["__metadata__"].contains(kSafetensorsChecksumKey)) return bytes;
  auto& m = h["__metadata__"];
  m.erase(kSafetensorsChecksumKey);
  if (m.contains("loom_sharded_index")) {
    nlohmann::ordered_json idx = nlohmann::ordered_json::parse(m["loom_sharded_index"].get<std::string>());
    idx.erase("metadata_crc32c");
    m["loom_sharded_index"] = idx.dump();
  }
  if (m.empty()) h.erase("__metadata__");
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char(uint8_t(uint64_t(text.size()) >> (8 * i)));
  return out + text + bytes.substr(8 + n);
}

// Rewrites the safetensors file at `path` without its checksums (see without_checksums).
inline void strip_checksums(const std::string& path) { write_file(path, without_checksums(read_file(path))); }

// `count` little-endian f32 NaNs as bytes.
inline std::string nan_bytes(size_t count) {
  std::string out;
  const uint32_t nan = 0x7FC00000u;
  for (size_t i = 0; i < count; ++i) out.append(reinterpret_cast<const char*>(&nan), 4);
  return out;
}

}  // namespace loom::ckpt_test

// Shared helpers of the checkpoint tests (tests/unit/ckpt): a fixture with a fresh directory per test,
// whole-file reads and writes, deterministic tensor bytes, byte-exact tensor comparison, and the check that
// a call throws a UserError naming what it must name.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <sstream>
#include <string>

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

}  // namespace loom::ckpt_test

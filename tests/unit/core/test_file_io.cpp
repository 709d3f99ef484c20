// core/file_io: whole-file reads name the file and the reason; atomic writes replace a file whole, leave
// no temporary behind (also on failure), and concurrent writers of one path never mix their bytes.
#include "loom/core/file_io.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "loom/core/check.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

class FileIoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("loom_file_io_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.push_back(e.path().filename().string());
    return out;
  }
  fs::path dir_;
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST_F(FileIoTest, ReadsWholeFilesAndNamesWhatFails) {
  std::ofstream(path("a.bin"), std::ios::binary) << std::string("ab\0cd", 5);
  EXPECT_EQ(read_file(path("a.bin"), "test file"), std::string("ab\0cd", 5));
  EXPECT_EQ(read_file_if_present(path("a.bin")).value(), std::string("ab\0cd", 5));
  EXPECT_EQ(error_of([&] { read_file(path("missing"), "--vocab-file"); }),
            "--vocab-file '" + path("missing") + "': cannot open: it does not exist");
  EXPECT_NE(error_of([&] { read_file(dir_.string(), "--config"); }).find("is not a regular file"), std::string::npos);
  EXPECT_NE(error_of([&] { read_file(path("a.bin"), "HF config", 4); }).find("is 5 bytes; at most 4"),
            std::string::npos);
  EXPECT_FALSE(read_file_if_present(path("missing")).has_value());
  std::ofstream(path("empty"));
  EXPECT_EQ(read_file(path("empty"), "x"), "");
}

TEST_F(FileIoTest, AtomicWritesReplaceWholeAndLeaveNothingBehind) {
  write_file_atomic(path("f"), std::string_view("first"));
  write_file_atomic(path("f"), std::string_view("second, longer"));
  EXPECT_EQ(read_file(path("f"), "f"), "second, longer");
  EXPECT_EQ(names(), std::vector<std::string>{"f"});
  // A failing body: the old file stays, the temporary goes, the error names the path.
  EXPECT_NE(error_of([&] { write_file_atomic(path("f"), [](int) { return false; }); }).find("writing '" + path("f")),
            std::string::npos);
  EXPECT_EQ(read_file(path("f"), "f"), "second, longer");
  EXPECT_EQ(names(), std::vector<std::string>{"f"});
  EXPECT_FALSE(try_write_file_atomic(path("f"), [](int) { return false; }));
  EXPECT_FALSE(try_write_file_atomic(path("no/such/dir/f"), [](int) { return true; }));
  EXPECT_NE(error_of([&] { write_file_atomic(path("no/such/dir/f"), std::string_view("x")); }).find("cannot create"),
            std::string::npos);
  EXPECT_EQ(names(), std::vector<std::string>{"f"});
}

TEST_F(FileIoTest, ConcurrentWritersOfOnePathNeverMix) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      const std::string body(100000, char('a' + t));
      for (int i = 0; i < 20; ++i) EXPECT_TRUE(try_write_file_atomic(path("shared"), [&](int fd) {
        return write_all(fd, body.data(), body.size());
      }));
    });
  for (std::thread& th : threads) th.join();
  const std::string got = read_file(path("shared"), "shared");
  ASSERT_EQ(got.size(), 100000u);
  EXPECT_EQ(got, std::string(100000, got[0]));  // one writer's bytes, whole
  EXPECT_EQ(names(), std::vector<std::string>{"shared"});
}

TEST(FileIo, LeftoverNames) {
  EXPECT_TRUE(is_atomic_write_leftover("latest.txt.tmp", "latest.txt"));
  EXPECT_TRUE(is_atomic_write_leftover("latest.txt.tmp.123.4", "latest.txt"));
  EXPECT_FALSE(is_atomic_write_leftover("latest.txt", "latest.txt"));
  EXPECT_FALSE(is_atomic_write_leftover("latest.txt.tmpx", "latest.txt"));
  EXPECT_FALSE(is_atomic_write_leftover("other.txt.tmp", "latest.txt"));
}

}  // namespace
}  // namespace loom

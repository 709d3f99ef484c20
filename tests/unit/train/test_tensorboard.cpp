// TensorBoard event files checked by an independent Python decoder (tests/golden/tb_decode.py: its own
// bitwise CRC-32C and protobuf parser), and the JSONL metrics writer checked by nlohmann's parser.
// The decoder must run: a missing python3 fails these tests rather than skipping them.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loom/core/check.h"
#include "loom/train/metrics_jsonl.h"
#include "loom/train/tensorboard.h"

using namespace loom;
namespace fs = std::filesystem;

namespace {

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("loom_tb_" + std::to_string(getpid()) + "_" + info->test_suite_name() + "_" + info->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

struct RunResult {
  int status = -1;  // exit code, or -1 if the process did not exit normally
  std::string output;
};

RunResult run(const std::string& cmd) {
  RunResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

std::string decoder_cmd(const std::string& file, bool with_stderr) {
  return std::string("/usr/bin/python3 '") + LOOM_SOURCE_DIR + "/tests/golden/tb_decode.py' '" + file + "'" +
         (with_stderr ? " 2>&1" : "");
}

// Runs the decoder and returns one parsed JSON object per event; fails the test if it does not exit 0.
std::vector<nlohmann::json> decode(const std::string& file) {
  const RunResult r = run(decoder_cmd(file, false));
  EXPECT_EQ(r.status, 0) << "tb_decode.py failed on " << file << ":\n" << r.output;
  std::vector<nlohmann::json> events;
  std::istringstream in(r.output);
  std::string line;
  while (std::getline(in, line)) events.push_back(nlohmann::json::parse(line));
  return events;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f << bytes;
}

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::string> lines;
  std::string line;
  while (std::getline(f, line)) lines.push_back(line);
  return lines;
}

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

}  // namespace

TEST(Crc32c, StandardVectors) {
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(""), 0u);
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);  // RFC 3720 B.4: 32 bytes of zeros
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);  // RFC 3720 B.4: 32 bytes of 0xFF
  const uint32_t c = 0xE3069283u;
  EXPECT_EQ(masked_crc32c("123456789"), static_cast<uint32_t>(((c >> 15) | (c << 17)) + 0xa282ead8u));
}

TEST(TensorBoardWriter, EventsDecodeIndependently) {
  TempDir tmp;
  const std::string dir = (tmp.path() / "runs" / "nested").string();  // parents do not exist yet
  struct Scalar {
    std::string tag;
    double value;
    int64_t step;
  };
  std::vector<Scalar> scalars;
  const int64_t n = 12;
  for (int64_t s = 0; s <= n; ++s) {
    scalars.push_back({"lm loss", 10.0 / (1.0 + static_cast<double>(s)), s});
    scalars.push_back({"lm loss vs samples", -0.125 * static_cast<double>(s) - 1e-3, s * 32});
  }
  scalars.push_back({"tiny", 1.5e-40, 3});  // float32 subnormal
  scalars.push_back({"large", 3.0e38, 4});
  scalars.push_back({"negative", -123456.789, 5});
  scalars.push_back({"big step", 0.1, int64_t{1} << 40});
  scalars.push_back({"negative step", 2.0, -7});
  const std::string args_text = "  num_layers ..... 12\n  \"lr\": 6e-4 | café ∑\n";
  const double t0 = now_seconds();
  std::string path;
  {
    TensorBoardWriter w(dir);
    path = w.path();
    for (const Scalar& s : scalars) w.add_scalar(s.tag, s.value, s.step);
    w.add_text("arguments", args_text, 0);
    w.add_scalar("not finite", std::numeric_limits<double>::infinity(), 1);
    w.add_scalar("not a number", std::nan(""), 2);
  }  // the destructor flushes
  const double t1 = now_seconds();

  EXPECT_EQ(fs::path(path).parent_path(), fs::path(dir));
  const std::string name = fs::path(path).filename().string();
  EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
  std::string pid_suffix = ".";
  pid_suffix += std::to_string(getpid());
  EXPECT_TRUE(name.ends_with(pid_suffix)) << name;

  const std::vector<nlohmann::json> ev = decode(path);
  ASSERT_EQ(ev.size(), scalars.size() + 4);
  EXPECT_EQ(ev[0].at("file_version"), "brain.Event:2");
  EXPECT_FALSE(ev[0].contains("scalars"));
  for (const auto& e : ev) {
    EXPECT_GE(e.at("wall_time").get<double>(), t0 - 1.0);
    EXPECT_LE(e.at("wall_time").get<double>(), t1 + 1.0);
  }
  for (size_t i = 0; i < scalars.size(); ++i) {
    const nlohmann::json& e = ev[i + 1];
    SCOPED_TRACE(scalars[i].tag + " step " + std::to_string(scalars[i].step));
    EXPECT_FALSE(e.contains("file_version"));
    EXPECT_EQ(e.at("step").get<int64_t>(), scalars[i].step);
    ASSERT_EQ(e.at("scalars").size(), 1u);
    EXPECT_TRUE(e.at("texts").empty());
    // simple_value is a float32: the decoded value is exactly the float rounding of what was written.
    EXPECT_EQ(e.at("scalars").at(scalars[i].tag).get<double>(),
              static_cast<double>(static_cast<float>(scalars[i].value)));
  }
  const nlohmann::json& text = ev[scalars.size() + 1];
  EXPECT_EQ(text.at("step").get<int64_t>(), 0);
  EXPECT_TRUE(text.at("scalars").empty());
  EXPECT_EQ(text.at("texts").at("arguments").get<std::string>(), args_text);
  EXPECT_EQ(ev[scalars.size() + 2].at("scalars").at("not finite"), "inf");
  EXPECT_EQ(ev[scalars.size() + 3].at("scalars").at("not a number"), "nan");
}

TEST(TensorBoardWriter, FlushMakesEventsVisibleWhileOpen) {
  TempDir tmp;
  TensorBoardWriter w(tmp.path().string());
  w.add_scalar("lm loss", 4.25, 1);
  w.flush();
  const std::vector<nlohmann::json> ev = decode(w.path());
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[1].at("scalars").at("lm loss").get<double>(), 4.25);
  EXPECT_EQ(ev[1].at("step").get<int64_t>(), 1);
}

TEST(TensorBoardWriter, DecoderRejectsCorruptFiles) {
  TempDir tmp;
  std::string path;
  {
    TensorBoardWriter w(tmp.path().string());
    for (int64_t s = 0; s < 5; ++s) w.add_scalar("lm loss", 1.0 + static_cast<double>(s), s);
    path = w.path();
  }
  const std::string good = read_file(path);
  ASSERT_GT(good.size(), 100u);
  ASSERT_EQ(run(decoder_cmd(path, true)).status, 0);

  const std::string bad = (tmp.path() / "corrupt.tfevents").string();
  // One flipped bit in the data of the last record (its last 4 bytes are the CRC, the 4 before them the
  // float value), one in the first record's length, and a truncated file.
  std::string data = good;
  data[data.size() - 6] ^= 0x01;
  write_file(bad, data);
  RunResult r = run(decoder_cmd(bad, true));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("data CRC mismatch"), std::string::npos) << r.output;

  data = good;
  data[0] ^= 0x01;
  write_file(bad, data);
  r = run(decoder_cmd(bad, true));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("length CRC mismatch"), std::string::npos) << r.output;

  write_file(bad, good.substr(0, good.size() - 3));
  r = run(decoder_cmd(bad, true));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("truncated"), std::string::npos) << r.output;
}

TEST(TensorBoardWriter, SecondWriterGetsItsOwnFile) {
  TempDir tmp;
  TensorBoardWriter a(tmp.path().string());
  TensorBoardWriter b(tmp.path().string());
  EXPECT_NE(a.path(), b.path());
  a.add_scalar("x", 1.0, 1);
  b.add_scalar("x", 2.0, 1);
  a.flush();
  b.flush();
  EXPECT_EQ(decode(a.path()).at(1).at("scalars").at("x").get<double>(), 1.0);
  EXPECT_EQ(decode(b.path()).at(1).at("scalars").at("x").get<double>(), 2.0);
}

TEST(TensorBoardWriter, UnusableDirIsUserErrorNamingIt) {
  TempDir tmp;
  const std::string file = (tmp.path() / "plain_file").string();
  write_file(file, "x");
  const std::string dir = file + "/tb";
  try {
    TensorBoardWriter w(dir);
    FAIL() << "expected UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(dir), std::string::npos) << e.what();
  }
}

TEST(MetricsJsonl, LinesParseWithKeysInOrderAndExactNumbers) {
  TempDir tmp;
  const std::string path = (tmp.path() / "a" / "b" / "metrics.jsonl").string();  // parents created
  const std::vector<std::pair<std::string, double>> row = {
      {"iteration", 10},
      {"lm loss", 0.1},
      {"learning rate", 6e-4},
      {"tiny", 4.9e-324},
      {"huge", 1.7976931348623157e308},
      {"negative", -2.5},
      {"big int", 123456789012345.0},
      {"nan", std::nan("")},
      {"inf", -std::numeric_limits<double>::infinity()},
      {"quote\" back\\slash\nnewline\ttab\x01 café", 1.0 / 3.0},
  };
  MetricsJsonlWriter w(path, false);
  w.write(row);
  w.write({{"iteration", 11}});
  // Flushed per line: both lines are on disk while the writer is still open.
  const std::vector<std::string> lines = read_lines(path);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[1], "{\"iteration\":11}");
  const auto j = nlohmann::ordered_json::parse(lines[0]);
  ASSERT_EQ(j.size(), row.size());
  size_t i = 0;
  for (const auto& [key, value] : j.items()) {
    SCOPED_TRACE(row[i].first);
    EXPECT_EQ(key, row[i].first);
    if (std::isfinite(row[i].second)) {
      ASSERT_TRUE(value.is_number());
      EXPECT_EQ(value.get<double>(), row[i].second);  // round-trips bit for bit
    } else {
      EXPECT_TRUE(value.is_null());
    }
    ++i;
  }
  EXPECT_NE(lines[0].find("\"iteration\":10,"), std::string::npos) << lines[0];
}

TEST(MetricsJsonl, JsonNumberIsShortestRoundTrip) {
  EXPECT_EQ(json_number(0.1), "0.1");
  EXPECT_EQ(json_number(5.0), "5");
  EXPECT_EQ(json_number(-0.0), "-0");
  EXPECT_EQ(json_number(std::nan("")), "null");
  EXPECT_EQ(json_number(std::numeric_limits<double>::infinity()), "null");
  for (double v : {1e-300, 6.02214076e23, 1.0 / 7.0, -3.4028234663852886e38})
    EXPECT_EQ(std::stod(json_number(v)), v);
}

TEST(MetricsJsonl, AppendKeepsEarlierLinesAndTruncateDoesNot) {
  TempDir tmp;
  const std::string path = (tmp.path() / "metrics.jsonl").string();
  {
    MetricsJsonlWriter w(path, false);
    w.write({{"iteration", 1}, {"lm loss", 5.0}});
    w.write({{"iteration", 2}, {"lm loss", 4.0}});
  }
  {
    MetricsJsonlWriter w(path, true);
    w.write({{"iteration", 3}, {"lm loss", 3.0}});
  }
  std::vector<std::string> lines = read_lines(path);
  ASSERT_EQ(lines.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(nlohmann::json::parse(lines[i]).at("iteration"), i + 1);
  {
    MetricsJsonlWriter w(path, false);
    w.write({{"iteration", 9}});
  }
  lines = read_lines(path);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], "{\"iteration\":9}");
}

TEST(MetricsJsonl, BadPathIsUserErrorNamingIt) {
  TempDir tmp;
  const std::string file = (tmp.path() / "plain_file").string();
  write_file(file, "x");
  for (const std::string& path : {file + "/sub/metrics.jsonl", file + "/metrics.jsonl"}) {
    try {
      MetricsJsonlWriter w(path, true);
      FAIL() << "expected UserError for " << path;
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
  }
  // A directory where the file should be.
  try {
    MetricsJsonlWriter w(tmp.path().string(), false);
    FAIL() << "expected UserError for a directory";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(tmp.path().string()), std::string::npos) << e.what();
  }
}

namespace loom {
namespace {

// --tensorboard-queue-size: records reach the file once that many are pending (SummaryWriter's max_queue);
// without a queue size only flush() writes them. The stdio buffer (4 KiB+) would hold these small records.
TEST(TensorBoardWriter, QueueSizeWritesOutEveryNRecords) {
  TempDir tmp;
  const auto size_of = [](const std::string& p) { return std::filesystem::file_size(p); };
  TensorBoardWriter queued((tmp.path() / "q").string(), 3);
  const auto start = size_of(queued.path());
  queued.add_scalar("a", 1.0, 1);
  queued.add_scalar("a", 2.0, 2);
  EXPECT_EQ(size_of(queued.path()), start);  // two pending
  queued.add_scalar("a", 3.0, 3);
  const auto after3 = size_of(queued.path());
  EXPECT_GT(after3, start);
  queued.add_scalar("a", 4.0, 4);
  EXPECT_EQ(size_of(queued.path()), after3);  // the count restarts after each write-out
  TensorBoardWriter unqueued((tmp.path() / "u").string());
  const auto u0 = size_of(unqueued.path());
  for (int i = 0; i < 10; ++i) unqueued.add_scalar("a", double(i), i);
  EXPECT_EQ(size_of(unqueued.path()), u0);
  unqueued.flush();
  EXPECT_GT(size_of(unqueued.path()), u0);
}

}  // namespace
}  // namespace loom

// Checkpoint directories: round trip, tracker written last, re-saving an iteration (both the
// RENAME_EXCHANGE swap and the rename-aside path, including a crash between its two renames), cleanup of
// crashed saves that never touches foreign files, malformed trackers, the checked loader's errors, and a
// fork + SIGKILL test: a child saves checkpoints in a loop and is killed at random instants; after every
// kill the tracker must name a checkpoint whose every file holds exactly the content of that iteration.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "ckpt_test_util.h"
#include "loom/ckpt/checkpoint.h"

namespace loom {
namespace {

using namespace ckpt_test;

namespace fs = std::filesystem;

class CheckpointTest : public ckpt_test::TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    root_ = (dir_ / "save" / "run1").string();  // parents created by begin_checkpoint
  }
  std::string root_;
};

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Bytes derived from (iteration, salt, stream), so a checkpoint can be checked against what it must hold.
Tensor generated(Shape s, DType dt, int64_t iteration, int64_t salt, uint64_t stream) {
  Tensor t = Tensor::empty(s, dt);
  const uint64_t seed = splitmix64((uint64_t(iteration) << 24) ^ (uint64_t(salt) << 8) ^ stream);
  auto* p = static_cast<uint8_t*>(t.raw());
  int64_t i = 0;
  for (; i + 8 <= t.nbytes(); i += 8) {
    const uint64_t v = splitmix64(seed + uint64_t(i));
    std::memcpy(p + i, &v, 8);
  }
  for (; i < t.nbytes(); ++i) p[i] = uint8_t(splitmix64(seed + uint64_t(i)));
  return t;
}

// One checkpoint's content: two files of tensors plus metadata.json, all derived from (iteration, salt).
struct Generated {
  Tensor w, b, m, step;
  Generated(int64_t iteration, int64_t salt, int64_t scale = 1)
      : w(generated({64 * scale, 64}, DType::kF32, iteration, salt, 1)),
        b(generated({128 * scale}, DType::kBF16, iteration, salt, 2)),
        m(generated({64 * scale, 128}, DType::kF32, iteration, salt, 3)),
        step(generated({1}, DType::kI64, iteration, salt, 4)) {}
  NamedTensors model() const { return {{"decoder.weight", w}, {"decoder.bias", b}}; }
  NamedTensors optimizer() const { return {{"exp_avg", m}, {"step", step}}; }
};

std::string metadata_json(int64_t iteration, int64_t salt) {
  return "{\"iteration\": " + std::to_string(iteration) + ", \"salt\": " + std::to_string(salt) + "}";
}

void save_generated(const std::string& root, int64_t iteration, int64_t salt, int64_t scale = 1,
                    bool use_exchange = true) {
  const std::string staging = begin_checkpoint(root, iteration);
  const Generated g(iteration, salt, scale);
  const std::map<std::string, std::string> meta = {{"salt", std::to_string(salt)}};
  write_checkpoint_tensors(staging, "model.safetensors", g.model(), meta);
  write_checkpoint_tensors(staging, "optimizer.safetensors", g.optimizer(), meta);
  write_checkpoint_text(staging, "metadata.json", metadata_json(iteration, salt));
  if (use_exchange) commit_checkpoint(root, iteration);
  else detail::commit_checkpoint_without_exchange(root, iteration);
}

// Checks that `dir` holds exactly the checkpoint of `iteration` written with some salt in [1, max_salt]
// (every file with the same salt: no mixing of two saves). Returns the salt.
int64_t verify_generated(const std::string& dir, int64_t iteration, int64_t max_salt, int64_t scale = 1) {
  long long it = -1, salt = -1;
  const std::string meta = read_file(dir + "/metadata.json");
  EXPECT_EQ(std::sscanf(meta.c_str(), "{\"iteration\": %lld, \"salt\": %lld}", &it, &salt), 2) << meta;
  EXPECT_EQ(it, iteration) << dir;
  EXPECT_GE(salt, 1);
  EXPECT_LE(salt, max_salt);
  const Generated want(iteration, salt, scale);
  Generated got(0, 0, scale);
  for (const auto& [file, into, expect] :
       {std::tuple{"model.safetensors", got.model(), want.model()},
        std::tuple{"optimizer.safetensors", got.optimizer(), want.optimizer()}}) {
    SafetensorsFile f = SafetensorsFile::open(dir + "/" + file);
    EXPECT_EQ(f.metadata().at("salt"), std::to_string(salt)) << file;
    load_tensors_checked(f, into);
    for (size_t i = 0; i < into.size(); ++i)
      EXPECT_TRUE(same_bytes(into[i].second, expect[i].second)) << dir << "/" << file << ": " << into[i].first;
  }
  return salt;
}

// Names in root that a finished commit or cleanup must not leave behind.
std::vector<std::string> leftovers(const std::string& root, const std::string& except = "") {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string n = e.path().filename().string();
    const bool temp = n.find(".loom-staging") != std::string::npos || n.find(".loom-old") != std::string::npos ||
                      n.find(".tmp") != std::string::npos;
    if (temp && e.path().string() != except) out.push_back(n);
  }
  return out;
}

TEST_F(CheckpointTest, DirNames) {
  EXPECT_EQ(checkpoint_dir("/ck", 100), "/ck/iter_0000100");
  EXPECT_EQ(checkpoint_dir("/ck", 0), "/ck/iter_0000000");
  EXPECT_EQ(checkpoint_dir("/ck", 123456789), "/ck/iter_123456789");
  EXPECT_EQ(checkpoint_staging_dir("/ck", 7), "/ck/iter_0000007.loom-staging");
  EXPECT_EQ(checkpoint_tracker_path("/ck"), "/ck/latest_checkpointed_iteration.txt");
}

// The committed checkpoints of a root (what a damaged-checkpoint error offers instead): iter_<digits>
// directories only, never staging or rename-aside leftovers or files; the hint leaves out the damaged one.
TEST_F(CheckpointTest, ListsOtherCheckpointsForTheDamagedOne) {
  EXPECT_TRUE(list_checkpoint_iterations(root_).empty());  // does not exist yet
  for (int64_t it : {30, 5, 12345678, 20}) {
    begin_checkpoint(root_, it);
    commit_checkpoint(root_, it);
  }
  begin_checkpoint(root_, 40);  // a save in progress
  fs::create_directory(root_ + "/iter_0000050.loom-old");
  fs::create_directory(root_ + "/iter_12");  // too few digits: not Megatron's name
  write_file(root_ + "/iter_0000060", "a file");
  EXPECT_EQ(list_checkpoint_iterations(root_), (std::vector<int64_t>{5, 20, 30, 12345678}));
  EXPECT_EQ(other_checkpoints_hint(checkpoint_dir(root_, 20)),
            "other checkpoints in " + root_ + ": iterations 5, 30, 12345678 (resume from one with loom train --load " +
                root_ + " --ckpt-step N; loom generate and loom convert take its directory, e.g. " +
                checkpoint_dir(root_, 12345678) + ")");
  EXPECT_NE(other_checkpoints_hint(checkpoint_dir(root_, 30) + ".loom-old/").find("iterations 5, 20, 12345678 "),
            std::string::npos);
  const std::string lone = (dir_ / "lone").string();
  begin_checkpoint(lone, 3);
  commit_checkpoint(lone, 3);
  EXPECT_EQ(other_checkpoints_hint(checkpoint_dir(lone, 3)), "there is no other checkpoint in " + lone +
                                                                 " to fall back to");
}

TEST_F(CheckpointTest, RoundTrip) {
  EXPECT_FALSE(read_latest_checkpoint(root_).has_value());  // root does not even exist yet
  save_generated(root_, 100, 5);
  EXPECT_EQ(leftovers(root_), std::vector<std::string>{});
  EXPECT_FALSE(fs::exists(checkpoint_staging_dir(root_, 100)));
  EXPECT_EQ(read_file(checkpoint_tracker_path(root_)), "100");  // exactly what Megatron writes

  const auto latest = read_latest_checkpoint(root_);
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->iteration, 100);
  EXPECT_FALSE(latest->release);
  EXPECT_EQ(latest->dir, checkpoint_dir(root_, 100));
  EXPECT_EQ(read_file(latest->dir + "/metadata.json"), metadata_json(100, 5));
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(latest->dir)) files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{"metadata.json", "model.safetensors", "optimizer.safetensors"}));

  // Bit-exact restore into fresh buffers.
  const Generated want(100, 5);
  Generated got(0, 0);
  load_tensors_checked(SafetensorsFile::open(latest->dir + "/model.safetensors"), got.model());
  load_tensors_checked(SafetensorsFile::open(latest->dir + "/optimizer.safetensors"), got.optimizer());
  EXPECT_TRUE(same_bytes(got.w, want.w));
  EXPECT_TRUE(same_bytes(got.b, want.b));
  EXPECT_TRUE(same_bytes(got.m, want.m));
  EXPECT_TRUE(same_bytes(got.step, want.step));
  EXPECT_FALSE(same_bytes(Generated(100, 6).w, want.w));  // the content really depends on the salt
}

TEST_F(CheckpointTest, TrackerUpdatedLast) {
  save_generated(root_, 50, 1);
  const Generated g(100, 1);
  const std::string staging = begin_checkpoint(root_, 100);
  EXPECT_EQ(staging, checkpoint_staging_dir(root_, 100));
  write_checkpoint_tensors(staging, "model.safetensors", g.model(), {{"salt", "1"}});
  write_checkpoint_tensors(staging, "optimizer.safetensors", g.optimizer(), {{"salt", "1"}});
  write_checkpoint_text(staging, "metadata.json", metadata_json(100, 1));

  // Everything written, nothing committed: loaders still see iteration 50, whole.
  auto latest = read_latest_checkpoint(root_);
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->iteration, 50);
  EXPECT_EQ(latest->dir, checkpoint_dir(root_, 50));
  verify_generated(latest->dir, 50, 1);
  EXPECT_FALSE(fs::exists(checkpoint_dir(root_, 100)));

  commit_checkpoint(root_, 100);
  latest = read_latest_checkpoint(root_);
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->iteration, 100);
  EXPECT_FALSE(fs::exists(staging));
  verify_generated(latest->dir, 100, 1);
  verify_generated(checkpoint_dir(root_, 50), 50, 1);  // earlier checkpoints stay
}

TEST_F(CheckpointTest, CommitWithoutBeginFails) {
  expect_user_error([&] { commit_checkpoint(root_, 3); }, {"iter_0000003.loom-staging", "does not exist"});
}

TEST_F(CheckpointTest, ResavingAnIterationReplacesIt) {
  for (bool exchange : {true, false}) {
    SCOPED_TRACE(exchange ? "RENAME_EXCHANGE" : "rename aside");
    fs::remove_all(root_);
    save_generated(root_, 7, 1, 1, exchange);
    write_file(checkpoint_dir(root_, 7) + "/only_in_old.txt", "x");
    save_generated(root_, 9, 1, 1, exchange);
    // Re-save 7 while the tracker names 9, then again while it names 7 (the case a crash must not break).
    save_generated(root_, 7, 2, 1, exchange);
    EXPECT_EQ(read_latest_checkpoint(root_)->iteration, 7);
    EXPECT_EQ(verify_generated(checkpoint_dir(root_, 7), 7, 2), 2);
    save_generated(root_, 7, 3, 2, exchange);  // different shapes, too
    EXPECT_EQ(read_latest_checkpoint(root_)->iteration, 7);
    EXPECT_EQ(verify_generated(checkpoint_dir(root_, 7), 7, 3, 2), 3);
    EXPECT_FALSE(fs::exists(checkpoint_dir(root_, 7) + "/only_in_old.txt"));
    EXPECT_EQ(leftovers(root_), std::vector<std::string>{});
    verify_generated(checkpoint_dir(root_, 9), 9, 1);
  }
}

TEST_F(CheckpointTest, CrashDuringRenameAsideKeepsOldLoadable) {
  save_generated(root_, 7, 1);
  const std::string final_dir = checkpoint_dir(root_, 7);
  // State after a crash between "final -> .loom-old" and "staging -> final" of a re-save of 7.
  const Generated g(7, 2);
  const std::string staging = begin_checkpoint(root_, 7);
  write_checkpoint_tensors(staging, "model.safetensors", g.model());
  fs::rename(final_dir, final_dir + ".loom-old");

  auto latest = read_latest_checkpoint(root_);  // readers find the complete old copy
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->iteration, 7);
  EXPECT_EQ(latest->dir, final_dir + ".loom-old");
  verify_generated(latest->dir, 7, 1);

  // The next save puts it back under its name and drops the half-written staging dir.
  const std::string next = begin_checkpoint(root_, 8);
  EXPECT_EQ(leftovers(root_, next), std::vector<std::string>{});
  latest = read_latest_checkpoint(root_);
  EXPECT_EQ(latest->dir, final_dir);
  EXPECT_EQ(verify_generated(final_dir, 7, 2), 1);

  // State after a crash between "staging -> final" and removing .loom-old: the old copy is garbage.
  fs::create_directory(final_dir + ".loom-old");
  write_file(final_dir + ".loom-old/model.safetensors", "stale");
  begin_checkpoint(root_, 8);
  EXPECT_FALSE(fs::exists(final_dir + ".loom-old"));
  EXPECT_EQ(verify_generated(final_dir, 7, 2), 1);
}

TEST_F(CheckpointTest, BeginCleansOnlyItsOwnLeftovers) {
  save_generated(root_, 7, 1);
  auto mkdir_with_file = [&](const std::string& name) {
    fs::create_directories(root_ + "/" + name);
    write_file(root_ + "/" + name + "/model.safetensors.tmp", "partial");
  };
  // Leftovers of crashed saves.
  mkdir_with_file("iter_0000003.loom-staging");
  mkdir_with_file("iter_12345678.loom-staging");
  mkdir_with_file("iter_0000011.loom-staging");  // the iteration about to be saved
  write_file(root_ + "/latest_checkpointed_iteration.txt.tmp", "9");         // Loom 0.1.0's temporary name
  write_file(root_ + "/latest_checkpointed_iteration.txt.tmp.4242.0", "9");  // today's (pid, counter)
  // Everything else is the user's and must survive.
  const std::vector<std::string> foreign = {"iter_0000005.tmp", "iter_abc.loom-staging", "iter_123.loom-staging",
                                            "xiter_0000003.loom-staging", "iter_0000003.loom-staging.bak",
                                            "release"};
  for (const std::string& n : foreign) mkdir_with_file(n);
  write_file(root_ + "/notes.txt", "keep me");

  const std::string staging = begin_checkpoint(root_, 11);
  EXPECT_TRUE(fs::is_directory(staging));
  EXPECT_TRUE(fs::is_empty(staging));  // the stale one of this iteration is gone, not reused
  EXPECT_FALSE(fs::exists(root_ + "/iter_0000003.loom-staging"));
  EXPECT_FALSE(fs::exists(root_ + "/iter_12345678.loom-staging"));
  EXPECT_FALSE(fs::exists(root_ + "/latest_checkpointed_iteration.txt.tmp"));
  EXPECT_FALSE(fs::exists(root_ + "/latest_checkpointed_iteration.txt.tmp.4242.0"));
  for (const std::string& n : foreign) EXPECT_TRUE(fs::exists(root_ + "/" + n + "/model.safetensors.tmp")) << n;
  EXPECT_EQ(read_file(root_ + "/notes.txt"), "keep me");
  verify_generated(checkpoint_dir(root_, 7), 7, 1);
  EXPECT_EQ(read_latest_checkpoint(root_)->iteration, 7);
}

TEST_F(CheckpointTest, WriteRejectsPathsAsFileNames) {
  const std::string staging = begin_checkpoint(root_, 1);
  for (const std::string bad : {"", ".", "..", "sub/model.safetensors", "../escape.json"})
    expect_user_error([&] { write_checkpoint_text(staging, bad, "x"); }, {"'" + bad + "'", "plain file name"});
  expect_user_error([&] { write_checkpoint_tensors(staging, "a/b", {}); }, {"'a/b'"});
}

TEST_F(CheckpointTest, TrackerParsing) {
  fs::create_directories(root_);
  EXPECT_FALSE(read_latest_checkpoint(root_).has_value());  // root without a tracker: fresh start
  const std::string tracker = checkpoint_tracker_path(root_);
  fs::create_directories(checkpoint_dir(root_, 42));

  write_file(tracker, " 42\n");  // whitespace around the number is fine (Megatron strips it too)
  auto latest = read_latest_checkpoint(root_);
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->iteration, 42);
  EXPECT_EQ(latest->dir, checkpoint_dir(root_, 42));

  write_file(tracker, "release");
  expect_user_error([&] { read_latest_checkpoint(root_); }, {tracker, "'release'", root_ + "/release"});
  fs::create_directories(root_ + "/release");
  latest = read_latest_checkpoint(root_);
  ASSERT_TRUE(latest.has_value());
  EXPECT_TRUE(latest->release);
  EXPECT_EQ(latest->iteration, 0);
  EXPECT_EQ(latest->dir, root_ + "/release");

  write_file(tracker, "");
  expect_user_error([&] { read_latest_checkpoint(root_); }, {tracker, "is empty"});
  write_file(tracker, " \n");
  expect_user_error([&] { read_latest_checkpoint(root_); }, {tracker, "is empty"});
  for (const std::string bad : {"abc", "-3", "+3", "12abc", "4 2", "1.5", "99999999999999999999999"})
    expect_user_error([&] { write_file(tracker, bad); read_latest_checkpoint(root_); },
                      {tracker, "non-negative iteration number", "'" + bad + "'"});
  write_file(tracker, "43");
  expect_user_error([&] { read_latest_checkpoint(root_); },
                    {tracker, "iteration 43", checkpoint_dir(root_, 43), "does not exist"});
  fs::remove(tracker);
  fs::create_directory(tracker);
  expect_user_error([&] { read_latest_checkpoint(root_); }, {tracker, "not a regular file"});
}

class LoadCheckedTest : public CheckpointTest {
 protected:
  void SetUp() override {
    CheckpointTest::SetUp();
    path_ = (dir_ / "model.safetensors").string();
    w_ = generated({3, 5}, DType::kF32, 1, 1, 1);
    b_ = generated({4}, DType::kBF16, 1, 1, 2);
    write_safetensors(path_, {{"decoder.layers.0.mlp.linear_fc1.weight", w_}, {"decoder.bias", b_}});
  }
  std::string path_;
  Tensor w_, b_;
};

TEST_F(LoadCheckedTest, Mismatches) {
  const SafetensorsFile f = SafetensorsFile::open(path_);
  const std::string wname = "decoder.layers.0.mlp.linear_fc1.weight";
  Tensor w = Tensor::zeros({3, 5}, DType::kF32), b = Tensor::zeros({4}, DType::kBF16);

  Tensor w_shape = Tensor::zeros({5, 3}, DType::kF32);
  expect_user_error([&] { load_tensors_checked(f, {{"decoder.bias", b}, {wname, w_shape}}); },
                    {"checkpoint tensor " + wname + " in " + path_ + " has shape [3, 5] f32; this model expects [5, 3] f32"});
  // Checks run before copying: the bias listed first was not touched.
  EXPECT_TRUE(same_bytes(b, Tensor::zeros({4}, DType::kBF16)));

  Tensor w_dtype = Tensor::zeros({3, 5}, DType::kBF16);
  expect_user_error([&] { load_tensors_checked(f, {{wname, w_dtype}, {"decoder.bias", b}}); },
                    {wname, path_, "[3, 5] f32", "expects [3, 5] bf16"});

  Tensor extra_dst = Tensor::zeros({2}, DType::kF32);
  expect_user_error([&] { load_tensors_checked(f, {{wname, w}, {"decoder.bias", b}, {"decoder.final_norm", extra_dst}}); },
                    {path_, "no tensor decoder.final_norm", "expects [2] f32", "2 tensors"});

  expect_user_error([&] { load_tensors_checked(f, {{wname, w}}); },
                    {path_, "has tensor decoder.bias", "[4] bf16", "does not have"});
  EXPECT_TRUE(same_bytes(w, Tensor::zeros({3, 5}, DType::kF32)));

  // allow_extra loads a subset; a full match loads everything bit-exactly.
  load_tensors_checked(f, {{wname, w}}, /*allow_extra=*/true);
  EXPECT_TRUE(same_bytes(w, w_));
  Tensor w2 = Tensor::zeros({3, 5}, DType::kF32);
  load_tensors_checked(f, {{"decoder.bias", b}, {wname, w2}});
  EXPECT_TRUE(same_bytes(w2, w_));
  EXPECT_TRUE(same_bytes(b, b_));
}

// Kills a child process (SIGKILL) when the test leaves the scope, however it leaves it.
struct ChildGuard {
  pid_t pid = -1;
  ~ChildGuard() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

TEST_F(CheckpointTest, SurvivesKillNineAtRandomInstants) {
  constexpr int kRounds = 20;
  constexpr int64_t kScale = 64;  // ~3 MB of tensors per checkpoint
  std::mt19937 rng(20240611);
  std::uniform_int_distribution<int> delay_us(0, 50'000);
  std::optional<int64_t> prev;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const int64_t salt = round + 1;
    const int64_t start = prev ? *prev : 1;
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    ChildGuard child;
    child.pid = ::fork();
    ASSERT_GE(child.pid, 0);
    if (child.pid == 0) {
      // Child: re-save the tracker's iteration (exercises both replace paths), then keep saving new ones,
      // dropping old dirs so the disk use stays bounded. Tells the parent once start + 1 is committed.
      ::close(fds[0]);
      try {
        for (int64_t it = start;; ++it) {
          save_generated(root_, it, salt, kScale, /*use_exchange=*/round % 4 < 2);
          if (it == start + 1 && ::write(fds[1], "c", 1) != 1) ::_exit(4);
          if (it >= start + 2) fs::remove_all(checkpoint_dir(root_, it - 2));
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "saver child failed: %s\n", e.what());
        ::_exit(3);
      }
    }
    ::close(fds[1]);
    // Odd rounds let the child commit at least one new iteration first, so progress is guaranteed.
    if (round % 2 == 1) {
      char c = 0;
      EXPECT_EQ(::read(fds[0], &c, 1), 1) << "the saver child died before committing";
    }
    ::usleep(useconds_t(delay_us(rng)));
    ::kill(child.pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(child.pid, &status, 0), child.pid);
    child.pid = -1;
    ::close(fds[0]);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "saver child exited on its own: " << status;

    const auto latest = read_latest_checkpoint(root_);
    if (!latest) {
      ASSERT_FALSE(prev.has_value()) << "the tracker disappeared";
      continue;
    }
    EXPECT_FALSE(latest->release);
    EXPECT_GE(latest->iteration, prev.value_or(0));
    if (round % 2 == 1) {
      EXPECT_GE(latest->iteration, start + 1);
    }
    verify_generated(latest->dir, latest->iteration, salt, kScale);
    prev = latest->iteration;

    // The next save starts by clearing whatever the killed one left behind.
    const std::string staging = begin_checkpoint(root_, *prev + 1);
    EXPECT_EQ(leftovers(root_, staging), std::vector<std::string>{});
    EXPECT_TRUE(fs::is_empty(staging));
  }
  ASSERT_TRUE(prev.has_value());
  EXPECT_GE(*prev, kRounds / 2);
}

}  // namespace
}  // namespace loom

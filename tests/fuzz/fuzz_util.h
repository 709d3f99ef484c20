// Helpers shared by the libFuzzer targets in tests/fuzz: a violated invariant aborts (libFuzzer then
// saves the input as a crash), and so does failing to stage the input as a file, which would otherwise
// make the target silently test nothing.
#pragma once

#include <sched.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

namespace fuzz_util {

inline void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "invariant violated: %s\n", what);
    std::abort();
  }
}

inline void write_file(const std::string& path, std::string_view bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) std::abort();
  std::fclose(f);
}

// The target's scratch directory, one per process (`tag` names the target): on tmpfs when there is one,
// since rewriting files on a disk filesystem waits for writeback.
inline const std::filesystem::path& scratch_dir(const char* tag) {
  namespace fs = std::filesystem;
  static const fs::path d = (::access("/dev/shm", W_OK) == 0 ? fs::path("/dev/shm") : fs::temp_directory_path()) /
                            ("loom_fuzz_" + std::string(tag) + "_" + std::to_string(::getpid()));
  return d;
}

// The scratch directory for one input: emptied and created (with `sub` inside when given), removed
// afterwards (libFuzzer runs no atexit handlers).
class Scratch {
 public:
  explicit Scratch(std::filesystem::path dir, const char* sub = "") : dir_(std::move(dir)) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
    std::filesystem::create_directories(dir_ / sub);
  }
  ~Scratch() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

 private:
  std::filesystem::path dir_;
};

inline void write_file(const std::filesystem::path& path, const uint8_t* data, size_t n) {
  write_file(path.string(), std::string_view(reinterpret_cast<const char*>(data), n));
}

// Keeps the process, and the threads it starts later, on the CPU it runs on now. Code under test that
// hands work to another thread for every input (run_preprocess's worker pool: a thread started, a chunk
// handed over and back, a join) otherwise wakes an idle CPU at each hand-off, which on a VM costs more
// than the input itself: pinned, fuzz_jsonl runs about twice the inputs per second. The threads still
// run concurrently (preempted on one CPU). LOOM_FUZZ_NO_PIN=1 leaves the affinity alone.
inline void pin_to_current_cpu() {
  if (const char* v = std::getenv("LOOM_FUZZ_NO_PIN"); v && *v && *v != '0') return;
  const int cpu = sched_getcpu();
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  (void)sched_setaffinity(0, sizeof(set), &set);
}

}  // namespace fuzz_util

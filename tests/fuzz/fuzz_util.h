// Helpers shared by the libFuzzer targets in tests/fuzz: a violated invariant aborts (libFuzzer then
// saves the input as a crash), and so does failing to stage the input as a file, which would otherwise
// make the target silently test nothing.
#pragma once

#include <sched.h>

#include <cstdio>
#include <cstdlib>
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

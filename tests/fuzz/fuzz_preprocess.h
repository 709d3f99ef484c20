// Shared by the fuzz targets that feed arbitrary bytes to run_preprocess as a JSONL file (fuzz_jsonl,
// fuzz_sft_jsonl): staging the input and the invariant that a rejected input leaves no files behind.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <sstream>

#include "fuzz_util.h"
#include "loom/core/check.h"
#include "loom/data/preprocess.h"

namespace fuzz_util {

// Writes the bytes to dir/in.jsonl and returns a config reading it and writing under dir/out.
inline loom::PreprocessConfig jsonl_input(const std::filesystem::path& dir, const uint8_t* data, size_t n) {
  write_file(dir / "in.jsonl", data, n);
  loom::PreprocessConfig cfg;
  cfg.input = (dir / "in.jsonl").string();
  cfg.output_prefix = (dir / "out").string();
  return cfg;
}

// Runs preprocess; on a UserError (a bad line, a split without samples, ...) requires that nothing but the
// input is left in dir and returns false.
inline bool run_preprocess_checked(const loom::PreprocessConfig& cfg, const std::filesystem::path& dir,
                                   loom::PreprocessStats& stats) {
  std::ostringstream log;
  try {
    stats = loom::run_preprocess(cfg, log);
    return true;
  } catch (const loom::UserError&) {
    for (const auto& e : std::filesystem::directory_iterator(dir))
      require(e.path().filename() == "in.jsonl", "files left behind by a failed run");
    return false;
  }
}

}  // namespace fuzz_util

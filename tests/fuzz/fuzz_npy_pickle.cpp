// libFuzzer target: the restricted .npy / pickle reader (src/data/npy_pickle.cpp) and NpyPackedDataset on
// fuzzed files (seeds: object arrays np.save wrote with pickle protocols 2, 3 and 5, and an integer array).
// A UserError is the expected answer to a bad file; anything else escaping (a crash, a sanitizer report,
// a LOOM_CHECK) is a finding. A dataset that loads must give samples whose tokens and extras are in range.
#include <unistd.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "data/npy_pickle.h"
#include "fuzz_util.h"
#include "loom/core/check.h"
#include "loom/data/npy_packed_dataset.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = "/tmp/loom_fuzz_npy_" + std::to_string(::getpid()) + ".npy";
  fuzz_util::write_file(path, std::string_view(reinterpret_cast<const char*>(data), size));
  try {
    (void)loom::npy::load_npy(path);
  } catch (const loom::UserError&) {
  }
  try {
    const loom::NpyPackedDataset ds(path, 15, 4, 1, 0);
    std::vector<int32_t> w(16), pos(15), seg(15);
    std::vector<float> mask(15);
    for (int64_t i = 0; i < ds.size(); ++i) {
      ds.sample(i, w.data());
      fuzz_util::require(ds.extras(i, mask.data(), pos.data(), seg.data()), "extras");
      for (int j = 0; j < 15; ++j) {
        fuzz_util::require(w[size_t(j)] >= 0, "token id >= 0");
        fuzz_util::require(mask[size_t(j)] == 0.0f || mask[size_t(j)] == 1.0f, "mask is 0 or 1");
        fuzz_util::require(pos[size_t(j)] >= 0 && pos[size_t(j)] <= j, "position in [0, j]");
        fuzz_util::require(seg[size_t(j)] >= 0 && (j == 0 || seg[size_t(j)] >= seg[size_t(j - 1)]), "segments grow");
      }
    }
  } catch (const loom::UserError&) {
  }
  ::unlink(path.c_str());
  return 0;
}

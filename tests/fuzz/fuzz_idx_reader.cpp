// libFuzzer target: arbitrary .idx/.bin pairs through IndexedDataset::open and read. Input layout:
// u16 little-endian n, then n bytes of .bin (fewer if the input ends), then the rest is the .idx.
// A UserError from open() is the expected answer to a bad pair; a crash, a sanitizer report or a
// LOOM_CHECK is a finding. A pair that opens must keep the documented invariants, and every token of
// every sequence must be readable (int64 tokens outside int32 may be a UserError on read).
// The same pair also goes through IndexedDataset::inspect and `loom data check`'s scan
// (check_indexed_dataset), which must never throw: inspect finds a problem exactly when open() fails,
// and the scan's figures must agree with the opened dataset.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "loom/core/check.h"
#include "loom/data/data_check.h"
#include "loom/data/indexed_dataset.h"
#include "fuzz_util.h"

namespace {

using fuzz_util::require;
using fuzz_util::write_file;

// tmpfs when there is one: rewriting a just-mapped file on a disk filesystem waits for writeback.
const std::string& prefix() {
  static const std::string p = std::string(::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp") +
                               "/loom_fuzz_idx_" + std::to_string(::getpid());
  return p;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  size_t n_bin = size_t(data[0]) | (size_t(data[1]) << 8);
  if (n_bin > size - 2) n_bin = size - 2;
  write_file(prefix() + ".bin", data + 2, n_bin);
  write_file(prefix() + ".idx", data + 2 + n_bin, size - 2 - n_bin);

  struct Cleanup {  // libFuzzer does not run atexit handlers, so remove the files after each input
    ~Cleanup() {
      std::remove((prefix() + ".bin").c_str());
      std::remove((prefix() + ".idx").c_str());
    }
  } cleanup;
  const loom::IndexInspection inspection = loom::IndexedDataset::inspect(prefix());
  loom::DataCheckOptions check_opt;
  check_opt.vocab_size = 1000;
  check_opt.max_listed = 3;
  const loom::DataCheckReport report = loom::check_indexed_dataset(prefix(), check_opt);
  std::unique_ptr<loom::IndexedDataset> ds;
  try {
    ds = loom::IndexedDataset::open(prefix());
  } catch (const loom::UserError&) {
    require(!inspection.problems.empty() && !inspection.dataset, "inspect finds what open() rejects");
    require(!report.ok() && !report.scanned, "data check reports what open() rejects");
    return 0;
  }
  require(inspection.problems.empty() && inspection.dataset, "inspect accepts what open() accepts");
  require(report.scanned && report.documents == int64_t(ds->document_indices().size()) - 1 &&
              report.sequences == ds->num_sequences(),
          "data check counts");
  int64_t hist = 0;
  for (const int64_t h : report.length_histogram) hist += h;
  require(hist == report.documents, "every document in the length histogram");
  const int64_t S = ds->num_sequences();
  const auto lens = ds->sequence_lengths();
  const auto docs = ds->document_indices();
  require(int64_t(lens.size()) == S, "lengths size");
  require(!docs.empty() && docs.front() == 0 && docs.back() == S, "document index ends");
  int64_t total = 0;
  for (size_t k = 1; k < docs.size(); ++k) require(docs[k] >= docs[k - 1], "document indices sorted");
  for (int32_t l : lens) {
    require(l >= 0, "length >= 0");
    total += l;
  }
  require(total * int64_t(loom::index_dtype_size(ds->dtype())) == int64_t(n_bin), ".bin size");
  require(report.tokens == total, "data check token count");
  require(report.ok() == (report.ids_outside == 0 && total > 0 && report.documents > 0), "data check verdict");
  std::vector<int32_t> buf;
  for (int64_t s = 0; s < S; ++s) {
    buf.assign(size_t(lens[s]) + 1, -7);
    try {
      ds->read(s, 0, lens[s], buf.data());
      if (lens[s] >= 2) ds->read(s, 1, lens[s] - 2, buf.data());  // an inner window
    } catch (const loom::UserError&) {
      require(ds->dtype() == loom::IndexDType::kI64, "read UserError only for int64 tokens");
    }
    require(buf[size_t(lens[s])] == -7, "read wrote past the requested length");
  }
  return 0;
}

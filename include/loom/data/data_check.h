// `loom data check`: one pass over a Megatron indexed dataset (.bin/.idx) before it is trained on. It
// reports the figures (documents, sequences, tokens, id range, a histogram of document lengths in
// power-of-two buckets) and every problem: the structural ones IndexedDataset::open rejects (sizes,
// pointers, document indices; all of them, via IndexedDataset::inspect), negative ids, ids at or above the
// vocabulary (file, document, offset and id of each, up to a limit, and a count), and an SFT loss mask
// (<prefix>_loss_mask) that does not match its tokens or holds values other than 0 and 1.
// Empty documents and empty sequences train nothing but break nothing (`loom preprocess` records an empty
// line as an empty document, as Megatron does): they are warnings, problems only with `strict`.
#pragma once
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace loom {

struct DataCheckOptions {
  int64_t vocab_size = 0;    // ids must be < vocab_size (0: unknown; ids are then only checked for >= 0)
  std::string vocab_source;  // names vocab_size in the report: "GPT2BPETokenizer", "--vocab-size"
  int64_t max_listed = 20;   // bad ids listed one by one per dataset; the rest are counted
  bool strict = false;       // warnings count as problems
};

struct DataCheckReport {
  std::string prefix;
  std::string dtype;  // the .bin's token type ("uint16", ...); empty when the index is unreadable
  bool scanned = false;  // the tokens were read (false when a structural problem made them untrustworthy)
  int64_t documents = 0, sequences = 0, tokens = 0;
  int64_t min_id = 0, max_id = 0;  // over every token (both 0 without tokens)
  int64_t empty_documents = 0, empty_sequences = 0;
  int64_t ids_outside = 0;  // negative or >= vocab_size
  int64_t longest_document = 0;
  // Documents by length: bucket 0 holds length 0, bucket b >= 1 lengths [2^(b-1), 2^b).
  std::vector<int64_t> length_histogram;
  bool loss_mask_checked = false;  // an SFT <prefix>_loss_mask was found and compared
  std::vector<std::string> problems;
  std::vector<std::string> warnings;
  bool ok() const { return problems.empty(); }
};

// `prefix` may also be given as <prefix>.bin or <prefix>.idx. Never throws for a bad dataset: what is
// wrong lands in problems (a missing file included).
DataCheckReport check_indexed_dataset(const std::string& prefix, const DataCheckOptions& opt);
// The report as `loom data check` prints it.
void print_data_check(const DataCheckReport& r, const DataCheckOptions& opt, std::ostream& os);

}  // namespace loom

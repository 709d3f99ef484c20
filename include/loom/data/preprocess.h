// `loom preprocess`: JSONL -> Megatron indexed datasets, the job of Megatron's tools/preprocess_data.py.
// Each input line is one JSON object; for every --json-keys key, its value (a string, or a list of
// strings = sentences, as Megatron accepts) is tokenized into one document of
// <output-prefix>_<key>_document.bin/.idx. As in Megatron: each non-empty sentence is one sequence,
// --append-eod adds the tokenizer's EOD to the last sequence of a non-empty document, and a document
// with no tokens is still recorded (a document with zero sequences, so document k is input line k).
// Output is byte-identical for any --workers: lines are tokenized in parallel chunks and written in
// input order. Files appear under their final names only after the whole input succeeded.
#pragma once
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "loom/data/tokenizer.h"

namespace loom {

struct PreprocessConfig {
  std::string input;                            // --input: JSONL file, one document per line
  std::vector<std::string> json_keys{"text"};   // --json-keys: one output pair per key
  std::string output_prefix;                    // --output-prefix
  TokenizerConfig tokenizer;                    // --tokenizer-type, --vocab-file, ...
  bool append_eod = false;                      // --append-eod
  int workers = 1;                              // --workers: tokenizer threads (>= 1)
  int64_t log_interval = 100;                   // --log-interval: documents between progress lines
  // --skip-bad-lines: skip (and count) lines that are not a JSON object, lack a key, hold a value that
  // is not a string / list of strings, or that the tokenizer rejects; by default such a line is an
  // error naming the input file and the line number.
  bool skip_bad_lines = false;

  void validate() const;  // UserError naming the flag
};

struct PreprocessStats {
  int64_t documents = 0;          // lines written (one document per key each)
  int64_t skipped_lines = 0;      // bad lines skipped under --skip-bad-lines
  int64_t bytes = 0;              // input bytes read
  std::vector<int64_t> tokens;    // per key, tokens written (EOD included)
  std::vector<std::string> outputs;  // per key, the output prefix <output-prefix>_<key>_document
};

// Runs the whole job; progress and summary lines go to `log`. Throws UserError (nothing written).
PreprocessStats run_preprocess(const PreprocessConfig& cfg, std::ostream& log);

}  // namespace loom

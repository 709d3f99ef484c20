// `loom preprocess`: JSONL -> Megatron indexed datasets, the job of Megatron's tools/preprocess_data.py.
// Each input line is one JSON object; for every --json-keys key, its value (a string, or a list of
// strings = sentences, as Megatron accepts) is tokenized into one document of
// <output-prefix>_<key>_document.bin/.idx. As in Megatron: each non-empty sentence is one sequence,
// --append-eod adds the tokenizer's EOD to the last sequence of a non-empty document, and a document
// with no tokens is still recorded (a document with zero sequences, so document k is input line k).
// Output is byte-identical for any --workers: lines are tokenized in parallel chunks and written in
// input order. Files appear under their final names only after the whole input succeeded. An input
// without documents, or whose documents hold no tokens (for any key), is an error: no empty dataset is
// written.
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
  // --sft: supervised fine-tuning samples. json_keys are the prompt and the answer (strings); each line
  // becomes one sequence, prompt tokens then answer tokens (then EOD with --append-eod), in
  // <output-prefix>_sft_document, and its loss mask (uint8: 1 for answer tokens and the EOD, 0 for the
  // prompt; all 1 without answer_only_loss) in <output-prefix>_sft_document_loss_mask. A line with no
  // answer tokens is bad (it would train nothing).
  bool sft = false;
  bool answer_only_loss = true;  // --answer-only-loss
  // --chat-template llama2|llama3|chatml (with --sft): each line's "messages" (or the one --json-keys key)
  // is a conversation rendered with the template (src/data/chat_template.h); the assistant's turns are
  // the answer.
  std::string chat_template;

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

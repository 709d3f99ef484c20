// Megatron's MMapIndexedDataset files: <prefix>.bin (token ids, back to back) and <prefix>.idx:
//   magic "MMIDIDX\0\0" (9 bytes), u64 version = 1, u8 dtype code (uint8=1 int8=2 int16=3 int32=4
//   int64=5 float64=6 float32=7 uint16=8), u64 sequence count S, u64 document count D+1,
//   int32 sequence lengths[S], int64 byte pointers[S], int64 document indices[D+1] (0 first; entry
//   k+1 is the sequence index where document k ends). All little-endian.
// The writer produces files Megatron reads unchanged; the reader validates every header field and
// the .bin size before use and memory-maps both files.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace loom {

enum class IndexDType : uint8_t { kU8 = 1, kI8 = 2, kI16 = 3, kI32 = 4, kI64 = 5, kF64 = 6, kF32 = 7, kU16 = 8 };
size_t index_dtype_size(IndexDType dt);
const char* index_dtype_name(IndexDType dt);  // numpy's name: "uint16", "int32", ...
// Megatron's choice: uint16 when the vocabulary is below 65500, else int32.
IndexDType index_dtype_for_vocab(int64_t vocab_size);

class IndexedDatasetWriter {
 public:
  // Writes <prefix>.bin/.idx through temporary names; nothing appears under the final names until
  // finalize() renames both.
  IndexedDatasetWriter(std::string prefix, IndexDType dtype);
  ~IndexedDatasetWriter();  // removes the temporaries when finalize() was not reached
  void add_sequence(std::span<const int32_t> tokens);  // one sequence (a document, for GPT data)
  void end_document();                                  // document boundary after the last sequence
  void finalize();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class IndexedDataset;

// Every problem of an .idx/.bin pair (for `loom data check`), not only the first.
struct IndexInspection {
  std::unique_ptr<IndexedDataset> dataset;  // null when any problem was found: the tokens cannot be trusted
  std::vector<std::string> problems;        // each names the file and the field, as open()'s errors do
};

class IndexedDataset {
 public:
  // Opens <prefix>.idx/.bin; UserError naming the file and the field for any inconsistency.
  static std::unique_ptr<IndexedDataset> open(const std::string& prefix);
  // The same checks, collected: at most a few problems per field (then a count of the rest).
  static IndexInspection inspect(const std::string& prefix);
  virtual ~IndexedDataset() = default;
  virtual IndexDType dtype() const = 0;
  virtual int64_t num_sequences() const = 0;
  virtual std::span<const int32_t> sequence_lengths() const = 0;
  virtual std::span<const int64_t> document_indices() const = 0;  // D + 1 entries
  // Copies `length` tokens of sequence `seq` starting at `offset` into out (converted to int32).
  virtual void read(int64_t seq, int64_t offset, int64_t length, int32_t* out) const = 0;
  virtual const std::string& prefix() const = 0;
};

// "<prefix>.bin: document D, token K of the document (token F of the file)" for token `offset` of sequence
// `seq` (D: the document holding the sequence; K counts the document's earlier sequences too). For error
// messages: it scans the index, O(sequences).
std::string locate_token(const IndexedDataset& ds, int64_t seq, int64_t offset);

}  // namespace loom

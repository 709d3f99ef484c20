// TensorBoard event-file writer (what Megatron writes under --tensorboard-dir), with no TensorFlow or
// protobuf dependency: the Event protos and the TFRecord framing are encoded by hand.
// File: <dir>/events.out.tfevents.<unix seconds>.<hostname>.<pid> — TensorBoard only reads files whose
// name contains "tfevents". Each record is
//   uint64 LE length | uint32 LE masked crc32c(length bytes) | Event bytes | uint32 LE masked crc32c(Event)
// and the first record is Event{wall_time, file_version: "brain.Event:2"}.
// Writes go through a stdio buffer; flush() (and the destructor) push them to the file. One writer is
// used from one thread (thread-compatible, not thread-safe).
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include "loom/core/crc32c.h"  // crc32c()

namespace loom {

// The TFRecord mask: rotate right by 15 and add 0xa282ead8, so that CRCs of data containing CRCs
// do not degenerate.
uint32_t masked_crc32c(std::string_view data);

class TensorBoardWriter {
 public:
  // Creates `dir` (and parents) if needed and opens a new event file in it (a ".N" suffix is added if a
  // file of that name already exists, e.g. two writers in one second). Writes the file_version record.
  // UserError naming `dir` if it cannot be created or the file cannot be written. max_queue > 0: the
  // records are written out (flushed) whenever that many are pending (SummaryWriter's max_queue,
  // Megatron's --tensorboard-queue-size); 0: only by flush().
  explicit TensorBoardWriter(const std::string& dir, int64_t max_queue = 0);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // Event{wall_time, step, summary{value{tag, simple_value}}}; the value is stored as float32, as
  // TensorBoard's scalar summaries are.
  void add_scalar(const std::string& tag, double value, int64_t step);
  // A text summary as torch.utils.tensorboard writes it: Summary.Value{tag, metadata{plugin_data{
  // plugin_name: "text"}}, tensor{dtype: DT_STRING, shape [1], string_val: [text]}}. The tag is used
  // as given (torch's add_text appends "/text_summary"; pass that suffix for identical tags).
  void add_text(const std::string& tag, const std::string& text, int64_t step);
  // Pushes buffered records to the file (fflush; no fsync). UserError on a write failure.
  void flush();
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& event);
  int64_t max_queue_ = 0;
  int64_t pending_ = 0;

  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace loom

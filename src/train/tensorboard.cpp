// TensorBoard event files written by hand: protobuf wire format (varints, length-delimited fields,
// fixed64 double, fixed32 float) for the few Event/Summary fields Loom uses, and TFRecord framing with
// masked CRC-32C. Field numbers are those of tensorflow/core/util/event.proto and
// tensorflow/core/framework/{summary,tensor,tensor_shape,types}.proto:
//   Event:            wall_time=1 double, step=2 int64, file_version=3 string, summary=5 Summary
//   Summary:          value=1 repeated Value
//   Summary.Value:    tag=1 string, simple_value=2 float, tensor=8 TensorProto, metadata=9 SummaryMetadata
//   SummaryMetadata:  plugin_data=1 PluginData{plugin_name=1 string}
//   TensorProto:      dtype=1 enum (DT_STRING=7), tensor_shape=2 TensorShapeProto{dim=2 Dim{size=1}},
//                     string_val=8 repeated bytes
// Fields are emitted in field-number order and proto3 defaults (step 0) are omitted, as protobuf's own
// serializers do, so the bytes match what torch.utils.tensorboard writes for the same event.
#include "loom/train/tensorboard.h"

#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>

#include "loom/core/check.h"

namespace loom {

namespace {

// ---- protobuf wire format -------------------------------------------------------------------------
enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_key(std::string& out, uint32_t field, WireType wt) { put_varint(out, (uint64_t{field} << 3) | wt); }

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void put_varint_field(std::string& out, uint32_t field, uint64_t v) {
  put_key(out, field, kVarint);
  put_varint(out, v);
}

void put_double_field(std::string& out, uint32_t field, double v) {
  put_key(out, field, kFixed64);
  put_le(out, std::bit_cast<uint64_t>(v), 8);
}

void put_float_field(std::string& out, uint32_t field, float v) {
  put_key(out, field, kFixed32);
  put_le(out, std::bit_cast<uint32_t>(v), 4);
}

// Strings, bytes and embedded messages share the length-delimited encoding.
void put_bytes_field(std::string& out, uint32_t field, std::string_view bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out.append(bytes);
}

double unix_seconds_now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

// Event{wall_time, step, summary{value}} for one Summary.Value.
std::string summary_event(int64_t step, const std::string& value) {
  std::string summary;
  put_bytes_field(summary, 1, value);
  std::string event;
  put_double_field(event, 1, unix_seconds_now());
  // int64 varints carry the two's complement, so a negative step takes 10 bytes (still valid).
  if (step != 0) put_varint_field(event, 2, static_cast<uint64_t>(step));
  put_bytes_field(event, 5, summary);
  return event;
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

}  // namespace

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir, int64_t max_queue) : max_queue_(max_queue) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    user_error("TensorBoard directory '", dir, "': cannot create it (", ec ? ec.message() : "not a directory",
               ")");
  const std::string base = (fs::path(dir) / ("events.out.tfevents." + std::to_string(std::time(nullptr)) + "." +
                                              host_name() + "." + std::to_string(getpid())))
                               .string();
  // "x" (exclusive create) so a second writer in the same second and process never truncates the first.
  for (int n = 0; n < 1000 && !file_; ++n) {
    path_ = n == 0 ? base : base + "." + std::to_string(n);
    file_ = std::fopen(path_.c_str(), "wbx");
    if (!file_ && errno != EEXIST) break;
  }
  if (!file_)
    user_error("TensorBoard directory '", dir, "': cannot create event file '", path_, "' (", std::strerror(errno),
               ")");
  std::string event;
  put_double_field(event, 1, unix_seconds_now());
  put_bytes_field(event, 3, "brain.Event:2");
  write_record(event);
  flush();  // an empty-looking directory while training runs would suggest the flag was ignored
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);  // fclose flushes; errors here cannot be reported from a destructor
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  std::string v;
  put_bytes_field(v, 1, tag);
  put_float_field(v, 2, static_cast<float>(value));
  write_record(summary_event(step, v));
}

void TensorBoardWriter::add_text(const std::string& tag, const std::string& text, int64_t step) {
  std::string dim;
  put_varint_field(dim, 1, 1);
  std::string shape;
  put_bytes_field(shape, 2, dim);
  std::string tensor;
  put_varint_field(tensor, 1, 7);  // DT_STRING
  put_bytes_field(tensor, 2, shape);
  put_bytes_field(tensor, 8, text);
  std::string plugin_data;
  put_bytes_field(plugin_data, 1, "text");
  std::string metadata;
  put_bytes_field(metadata, 1, plugin_data);
  std::string v;
  put_bytes_field(v, 1, tag);
  put_bytes_field(v, 8, tensor);
  put_bytes_field(v, 9, metadata);
  write_record(summary_event(step, v));
}

void TensorBoardWriter::write_record(const std::string& event) {
  std::string rec;
  rec.reserve(event.size() + 16);
  put_le(rec, event.size(), 8);
  put_le(rec, masked_crc32c(std::string_view(rec.data(), 8)), 4);
  rec.append(event);
  put_le(rec, masked_crc32c(event), 4);
  if (std::fwrite(rec.data(), 1, rec.size(), file_) != rec.size())
    user_error("cannot write TensorBoard event file '", path_, "' (", std::strerror(errno), ")");
  if (max_queue_ > 0 && ++pending_ >= max_queue_) flush();
}

void TensorBoardWriter::flush() {
  pending_ = 0;
  if (std::fflush(file_) != 0)
    user_error("cannot write TensorBoard event file '", path_, "' (", std::strerror(errno), ")");
}

}  // namespace loom

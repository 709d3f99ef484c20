// Safetensors reader/writer: round trips in every Loom dtype (read, read_into, mmap), conversions,
// atomic replace, one malformed file per validation rule (each error must name the file, the tensor
// where there is one, and the problem), the per-tensor checksums (recorded, verified by every kind of
// read, malformed entries rejected, files without them still read), and byte-for-byte agreement with an
// independent Python writer (tests/golden/fixtures/ckpt_python_writer.safetensors, from
// tests/golden/gen_safetensors_fixture.py).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <numbers>
#include <sstream>

#include "ckpt_test_util.h"
#include "loom/ckpt/safetensors.h"
#include "loom/core/crc32c.h"

namespace loom {
namespace {

using namespace ckpt_test;

namespace fs = std::filesystem;

class SafetensorsTest : public ckpt_test::TempDirTest {};

// A file with an arbitrary header (and optionally a lying length field) for the malformed cases.
void write_raw(const std::string& path, const std::string& header, size_t data_bytes, int64_t n_override = -1) {
  const uint64_t n = n_override >= 0 ? uint64_t(n_override) : header.size();
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = char(uint8_t(n >> (8 * i)));
  bytes += header;
  bytes += std::string(data_bytes, '\x5a');
  std::ofstream(path, std::ios::binary) << bytes;
}

Tensor make_f32(Shape s, float start) {
  Tensor t = Tensor::empty(s, DType::kF32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = start + 0.25f * float(i);
  return t;
}

TEST_F(SafetensorsTest, RoundTripAllDtypesBothModes) {
  std::vector<std::pair<std::string, Tensor>> owned = {
      {"w.f32", make_f32({3, 5}, -1.0f)},
      {"w.bf16", make_bytes({7}, DType::kBF16, 1)},
      {"w.f16", make_bytes({2, 3}, DType::kF16, 2)},
      {"w.e4m3", make_bytes({5}, DType::kF8E4M3, 3)},
      {"w.e5m2", make_bytes({1, 1, 3}, DType::kF8E5M2, 4)},
      {"ids.i32", make_bytes({4}, DType::kI32, 5)},
      {"ids.i64", make_bytes({2, 2}, DType::kI64, 6)},
      {"u16", make_bytes({3}, DType::kU16, 7)},
      {"scalar", make_f32({}, 9.5f)},
      {"empty", Tensor::empty({0, 4}, DType::kF32)},
      {"six.dims", make_f32({1, 2, 1, 2, 1, 2}, 0.0f)},
  };
  NamedTensors views;
  for (auto& [n, t] : owned) views.emplace_back(n, t.view());
  const std::map<std::string, std::string> meta = {{"iteration", "12"}, {"format", "loom"}};
  const std::string path = file("rt.safetensors");
  write_safetensors(path, views, meta);
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  int64_t data_bytes = 0;
  for (auto& [n, t] : owned) data_bytes += t.nbytes();
  for (auto mode : {SafetensorsFile::Mode::kRead, SafetensorsFile::Mode::kMmap}) {
    SafetensorsFile f = SafetensorsFile::open(path, mode);
    EXPECT_EQ(f.header_bytes() % 8, 0);
    EXPECT_EQ(int64_t(fs::file_size(path)), 8 + f.header_bytes() + data_bytes);
    EXPECT_EQ(f.metadata(), meta);
    ASSERT_EQ(f.names().size(), owned.size());
    // Widest dtypes first, so every tensor is aligned to its element size for map().
    EXPECT_EQ(f.names().front(), "ids.i64");
    EXPECT_EQ(f.names().back(), "w.e5m2");
    for (auto& [name, t] : owned) {
      ASSERT_TRUE(f.contains(name));
      const SafetensorsInfo& info = f.info(name);
      EXPECT_EQ(info.dtype, t.dtype()) << name;
      EXPECT_EQ(info.dtype_str, safetensors_dtype_name(t.dtype()));
      EXPECT_EQ(info.shape, t.shape()) << name;
      EXPECT_EQ(info.nbytes(), t.nbytes());
      EXPECT_TRUE(same_bytes(f.read(name), t)) << name;
      Tensor dst = Tensor::empty(t.shape(), t.dtype());
      f.read_into(name, dst);
      EXPECT_TRUE(same_bytes(dst, t)) << name;
      if (mode == SafetensorsFile::Mode::kMmap) {
        Tensor m = f.map(name);
        EXPECT_TRUE(same_bytes(m, t)) << name;
      } else {
        expect_user_error([&] { f.map(name); }, {path, name, "Mode::kMmap"});
      }
    }
  }
}

TEST_F(SafetensorsTest, MapOutlivesMoveAndReadIntoChecksShape) {
  Tensor t = make_f32({4, 4}, 1.0f);
  const std::string path = file("m.safetensors");
  write_safetensors(path, {{"t", t}});
  SafetensorsFile f = SafetensorsFile::open(path, SafetensorsFile::Mode::kMmap);
  Tensor m = f.map("t");
  SafetensorsFile g = std::move(f);  // the mapping moves with the file object
  EXPECT_TRUE(same_bytes(m, t));
  EXPECT_TRUE(g.metadata().empty());
  Tensor wrong = Tensor::empty({16}, DType::kF32);
  expect_user_error([&] { g.read_into("t", wrong); }, {path, "'t'", "F32(4, 4)", "f32(16)"});
  expect_user_error([&] { g.read("nope"); }, {path, "no tensor named 'nope'", "t"});
}

TEST_F(SafetensorsTest, AtomicReplaceAndWriterValidation) {
  const std::string path = file("a.safetensors");
  write_safetensors(path, {{"x", make_f32({100}, 0.0f)}});
  write_safetensors(path, {{"y", make_f32({2}, 3.0f)}}, {{"k", "v"}});
  SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.names(), std::vector<std::string>{"y"});
  EXPECT_EQ(f.read("y").data<float>()[1], 3.25f);
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  Tensor t = make_f32({2}, 0.0f);
  expect_user_error([&] { write_safetensors(file("d.safetensors"), {{"a", t}, {"a", t}}); }, {"'a'", "twice"});
  expect_user_error([&] { write_safetensors(file("d.safetensors"), {{"", t}}); }, {"invalid tensor name"});
  expect_user_error([&] { write_safetensors(file("d.safetensors"), {{"__metadata__", t}}); },
                    {"invalid tensor name '__metadata__'"});
  EXPECT_FALSE(fs::exists(file("d.safetensors")));
  expect_user_error([&] { write_safetensors(file("no/such/dir/x.safetensors"), {{"a", t}}); },
                    {"no/such/dir/x.safetensors.tmp"});
}

TEST_F(SafetensorsTest, ConvertingReads) {
  // An F64 tensor (no Loom dtype) and integer tensors, written raw.
  const double f64[3] = {1.0 / 3.0, -2.5, 1e300};
  const int64_t i64[2] = {7, int64_t(1) << 40};
  std::string header = R"({"d":{"dtype":"F64","shape":[3],"data_offsets":[0,24]},)"
                       R"("i":{"dtype":"I64","shape":[2],"data_offsets":[24,40]}})";
  const std::string path = file("conv.safetensors");
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = char(uint8_t(uint64_t(header.size()) >> (8 * i)));
  bytes += header;
  bytes.append(reinterpret_cast<const char*>(f64), 24);
  bytes.append(reinterpret_cast<const char*>(i64), 16);
  std::ofstream(path, std::ios::binary) << bytes;

  SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_FALSE(f.info("d").dtype.has_value());
  EXPECT_EQ(f.info("d").dtype_str, "F64");
  expect_user_error([&] { f.read("d"); }, {path, "'d'", "F64", "no Loom type"});
  Tensor d = f.read("d", DType::kF32);
  EXPECT_EQ(d.data<float>()[0], float(1.0 / 3.0));
  EXPECT_EQ(d.data<float>()[1], -2.5f);
  EXPECT_TRUE(std::isinf(d.data<float>()[2]));
  Tensor db = f.read("d", DType::kBF16);
  EXPECT_EQ(db.data<uint16_t>()[1], f32_to_bf16(-2.5f));
  Tensor i = f.read("i", DType::kI64);
  EXPECT_EQ(i.data<int64_t>()[1], int64_t(1) << 40);
  expect_user_error([&] { f.read("i", DType::kI32); }, {"'i'", "element 1", "i32"});
  expect_user_error([&] { f.read("i", DType::kF32); }, {"'i'", "cannot convert dtype I64 to f32"});
  expect_user_error([&] { f.read("d", DType::kI32); }, {"cannot convert dtype F64"});
}

// ---- malformed files: one per rule ----------------------------------------------------------------

struct BadCase {
  const char* label;
  std::string header;
  size_t data_bytes;
  int64_t n_override;
  std::vector<std::string> expect;  // substrings of the message besides the path
};

TEST_F(SafetensorsTest, MalformedFilesGiveSpecificErrors) {
  const std::string ok_a = R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]})";
  const std::vector<BadCase> cases = {
      {"length past file", "{" + ok_a + "}", 24, 1000, {"header length 1000", "invalid"}},
      {"length huge", "{" + ok_a + "}", 24, int64_t(1) << 40, {"header length 1099511627776"}},
      {"length tiny", "{" + ok_a + "}", 24, 1, {"header length 1 "}},
      {"not json", R"({"a":{"dtype":"F32",)", 0, -1, {"not valid JSON"}},
      {"not an object", R"([1, 2])", 0, -1, {"does not start with '{'"}},
      {"trailing garbage", "{" + ok_a + "}x", 24, -1, {"not valid JSON"}},
      {"unknown dtype", R"({"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", 8, -1,
       {"tensor 'a'", "unknown dtype 'F33'", "BF16"}},
      {"dtype not string", R"({"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", 8, -1,
       {"tensor 'a'", "dtype must be a string"}},
      {"size mismatch", R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 20, -1,
       {"tensor 'a'", "needs 24 bytes", "span 20"}},
      {"bf16 size mismatch", R"({"a":{"dtype":"BF16","shape":[4],"data_offsets":[0,16]}})", 16, -1,
       {"tensor 'a'", "needs 8 bytes"}},
      {"negative dim", R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, -1,
       {"tensor 'a'", "non-negative integer"}},
      {"float dim", R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8, -1,
       {"tensor 'a'", "non-negative integer"}},
      {"too many dims", R"({"a":{"dtype":"U8","shape":[1,1,1,1,1,1,1],"data_offsets":[0,1]}})", 1, -1,
       {"tensor 'a'", "7 dims"}},
      {"huge shape", R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8, -1,
       {"tensor 'a'", "too large"}},
      {"offsets reversed", R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8, -1,
       {"tensor 'a'", "end before they begin"}},
      {"offsets arity", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8, -1,
       {"tensor 'a'", "data_offsets must be [begin, end]"}},
      {"past end", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 12, -1,
       {"tensor 'a'", "past the end of the data region (12 bytes"}},
      {"overlap",
       R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
       16, -1, {"tensor 'b'", "overlap tensor 'a'"}},
      {"gap",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
       20, -1, {"bytes [8, 12)", "gap before tensor 'b'"}},
      {"gap at start", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12, -1,
       {"bytes [0, 4)", "tensor 'a'"}},
      {"trailing bytes", "{" + ok_a + "}", 30, -1, {"30 bytes", "cover only 24", "6 trailing bytes"}},
      {"duplicate tensor", "{" + ok_a + "," + ok_a + "}", 24, -1, {"key 'a' twice"}},
      {"duplicate field", R"({"a":{"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,8]}})", 8, -1,
       {"key 'dtype' twice"}},
      {"missing field", R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", 8, -1, {"tensor 'a'", "missing field 'shape'"}},
      {"unknown field", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", 8, -1,
       {"tensor 'a'", "unknown field 'x'"}},
      {"entry not object", R"({"a":[1,2]})", 0, -1, {"tensor 'a'", "must be a JSON object"}},
      {"metadata not string", R"({"__metadata__":{"step":12}})", 0, -1, {"__metadata__ value of 'step'", "12"}},
      {"metadata not object", R"({"__metadata__":"x"})", 0, -1, {"__metadata__ must be an object"}},
      {"empty name", R"({"":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, -1, {"empty name"}},
  };
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.label);
    const std::string path = file("bad.safetensors");
    write_raw(path, c.header, c.data_bytes, c.n_override);
    for (auto mode : {SafetensorsFile::Mode::kRead, SafetensorsFile::Mode::kMmap}) {
      try {
        SafetensorsFile::open(path, mode);
        ADD_FAILURE() << "opened a malformed file";
      } catch (const UserError& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("'" + path + "'"), std::string::npos) << msg;
        for (const std::string& p : c.expect) EXPECT_NE(msg.find(p), std::string::npos) << msg << "\nmissing: " << p;
      }
    }
  }
  // Files too short to hold a length, and files that do not exist.
  const std::string tiny = file("tiny.safetensors");
  std::ofstream(tiny, std::ios::binary) << "abc";
  expect_user_error([&] { SafetensorsFile::open(tiny); }, {tiny, "3 bytes, too short"});
  expect_user_error([&] { SafetensorsFile::open(file("missing.safetensors")); },
                    {"cannot open", "missing.safetensors", "No such file"});
  expect_user_error([&] { SafetensorsFile::open(dir_.string()); }, {"not a regular file"});
}

TEST_F(SafetensorsTest, AcceptsPaddingAndZeroSizedTensorsAtAnyBoundary) {
  // Header padded with spaces (as every reference writer does), an empty tensor sharing an offset.
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"z":{"dtype":"I32","shape":[3,0],"data_offsets":[8,8]},)"
      R"("b":{"dtype":"U16","shape":[1],"data_offsets":[8,10]}}      )";
  const std::string path = file("pad.safetensors");
  write_raw(path, header, 10);
  SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.names(), (std::vector<std::string>{"a", "z", "b"}));
  EXPECT_EQ(f.info("z").shape, Shape({3, 0}));
  EXPECT_EQ(f.read("b").data<uint16_t>()[0], 0x5a5a);
}

// ---- checksums ----------------------------------------------------------------------------------

// Every tensor's CRC-32C is recorded (computed while writing) and matches the bytes; the entry is hidden
// from metadata(); a file written without checksums reads the same, unverified.
TEST_F(SafetensorsTest, ChecksumsAreRecordedAndHiddenFromMetadata) {
  const Tensor a = make_f32({3, 700000}, 0.5f);  // several 1 MiB chunks
  const Tensor b = make_bytes({5}, DType::kBF16, 3);
  const Tensor e = Tensor::empty({0}, DType::kF32);
  const std::map<std::string, std::string> meta = {{"k", "v"}};
  const std::string path = file("c.safetensors");
  write_safetensors(path, {{"a", a}, {"b", b}, {"e", e}}, meta);
  for (auto mode : {SafetensorsFile::Mode::kRead, SafetensorsFile::Mode::kMmap}) {
    const SafetensorsFile f = SafetensorsFile::open(path, mode);
    EXPECT_TRUE(f.has_checksums());
    EXPECT_EQ(f.metadata(), meta);
    EXPECT_EQ(f.info("a").crc32c, crc32c(a.raw(), size_t(a.nbytes())));
    EXPECT_EQ(f.info("b").crc32c, crc32c(b.raw(), size_t(b.nbytes())));
    EXPECT_EQ(f.info("e").crc32c, 0u);
    for (const char* n : {"a", "b", "e"}) f.verify(n);
  }
  // The header names the checksums in the documented form.
  const std::string bytes = read_file(path);
  char want[64];
  std::snprintf(want, sizeof want, "\"loom.crc32c\":\"{\\\"a\\\":\\\"%08x\\\"", crc32c(a.raw(), size_t(a.nbytes())));
  EXPECT_NE(bytes.find(want), std::string::npos) << bytes.substr(0, 300);

  const std::string plain = file("plain.safetensors");
  write_safetensors(plain, {{"a", a}}, {}, /*checksums=*/false);
  const SafetensorsFile g = SafetensorsFile::open(plain, SafetensorsFile::Mode::kMmap);
  EXPECT_FALSE(g.has_checksums());
  EXPECT_FALSE(g.info("a").crc32c.has_value());
  EXPECT_TRUE(g.metadata().empty());
  EXPECT_TRUE(same_bytes(g.map("a"), a));
  expect_user_error([&] { write_safetensors(file("r.safetensors"), {{"a", a}}, {{"loom.crc32c", "{}"}}); },
                    {"r.safetensors", "loom.crc32c", "reserved"});
}

// 1 KiB of garbage, or NaNs, in the middle of a tensor: every read path reports a ChecksumError naming
// the file and the tensor; the other tensors still read.
TEST_F(SafetensorsTest, DamagedTensorFailsEveryReadPath) {
  const Tensor a = make_f32({64, 1024}, 1.0f), b = make_f32({16}, -2.0f);
  for (const std::string& garbage : {std::string(1024, '\x5a'), nan_bytes(256)}) {
    const std::string path = file("d.safetensors");
    write_safetensors(path, {{"a", a}, {"b", b}});
    overwrite_tensor_bytes(path, "a", a.nbytes() / 2, garbage);
    for (auto mode : {SafetensorsFile::Mode::kRead, SafetensorsFile::Mode::kMmap}) {
      const SafetensorsFile f = SafetensorsFile::open(path, mode);  // the header is intact
      const std::vector<std::string> parts = {path, "tensor 'a'", "checksum mismatch"};
      auto expect_damaged = [&](const std::function<void()>& read) {
        try {
          read();
          ADD_FAILURE() << "read a damaged tensor";
        } catch (const ChecksumError& e) {
          EXPECT_EQ(e.path(), path);
          EXPECT_EQ(e.tensor(), "a");
          for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
        }
      };
      expect_damaged([&] { f.read("a"); });
      expect_damaged([&] { f.read("a", DType::kBF16); });
      Tensor dst = Tensor::empty(a.shape(), a.dtype());
      expect_damaged([&] { f.read_into("a", dst); });
      expect_damaged([&] { f.verify("a"); });
      if (mode == SafetensorsFile::Mode::kMmap) {
        expect_damaged([&] { f.map("a"); });
        expect_damaged([&] { f.map("a"); });  // a failed check is not remembered as passed
      }
      EXPECT_TRUE(same_bytes(f.read("b"), b));
    }
  }
}

TEST_F(SafetensorsTest, MalformedChecksumEntriesAreRejected) {
  const std::string ok_a = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string ok_b = R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]})";
  auto header = [&](const std::string& crc_json) {
    return R"({"__metadata__":{"loom.crc32c":)" + nlohmann::json(crc_json).dump() + "}," + ok_a + "," + ok_b + "}";
  };
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"{", {"loom.crc32c", "not valid JSON"}},
      {"[1]", {"loom.crc32c", "must be a JSON object"}},
      {R"({"a":"00000000","a":"00000000","b":"00000000"})", {"lists tensor 'a' twice"}},
      {R"({"a":"00000000","b":"00000000","c":"00000000"})", {"names tensor 'c'", "does not hold"}},
      {R"({"a":"00000000"})", {"tensor 'b'", "no checksum"}},
      {R"({"a":"0000000","b":"00000000"})", {"tensor 'a'", "8 lowercase hex digits"}},
      {R"({"a":"0000000G","b":"00000000"})", {"tensor 'a'", "8 lowercase hex digits"}},
      {R"({"a":"ABCDEF01","b":"00000000"})", {"tensor 'a'", "8 lowercase hex digits"}},
      {R"({"a":12,"b":"00000000"})", {"tensor 'a'", "8 lowercase hex digits"}},
  };
  for (const auto& [crc_json, expect] : cases) {
    SCOPED_TRACE(crc_json);
    const std::string path = file("m.safetensors");
    write_raw(path, header(crc_json), 12);
    std::vector<std::string> parts = expect;
    parts.push_back(path);
    try {
      SafetensorsFile::open(path);
      ADD_FAILURE() << "opened a file with a malformed checksum entry";
    } catch (const UserError& e) {
      for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  }
}

// ---- compatibility with an independent writer ---------------------------------------------------

TEST(SafetensorsCompat, ReadsPythonWriterFileAndWritesIdenticalBytes) {
  const std::string path = std::string(LOOM_FIXTURE_DIR) + "/ckpt_python_writer.safetensors";
  SafetensorsFile f = SafetensorsFile::open(path);
  const std::map<std::string, std::string> meta = {
      {"format", "pt"}, {"note", "\xcf\x80 \xe2\x89\x88 3.14159"}, {"writer", "gen_safetensors_fixture.py"}};
  EXPECT_EQ(f.metadata(), meta);

  // The same tensors built from the generator's formulas.
  Tensor a = Tensor::empty({2, 3}, DType::kF32);
  for (int i = 0; i < 6; ++i) a.data<float>()[i] = float((i - 2.5) * 0.37);
  const float b_vals[5] = {float(1.0 / 3.0), float(std::numbers::pi), -2.75f, 1e-3f, 65504.5f};
  Tensor b = Tensor::empty({5}, DType::kBF16);
  for (int i = 0; i < 5; ++i) b.data<uint16_t>()[i] = f32_to_bf16(b_vals[i]);
  const float c_vals[4] = {0.1f, -1.5f, 6.1e-5f, 1000.25f};
  Tensor c = Tensor::empty({2, 2}, DType::kF16);
  for (int i = 0; i < 4; ++i) c.data<uint16_t>()[i] = f32_to_f16(c_vals[i]);
  Tensor d = Tensor::empty({4}, DType::kI32);
  const int32_t d_vals[4] = {-2, 0, 7, 2147483647};
  std::memcpy(d.raw(), d_vals, 16);
  Tensor e = Tensor::empty({3}, DType::kI64);
  const int64_t e_vals[3] = {-1, int64_t(1) << 40, 5};
  std::memcpy(e.raw(), e_vals, 24);
  Tensor u = Tensor::empty({3}, DType::kU16);
  const uint16_t u_vals[3] = {0, 1, 65535};
  std::memcpy(u.raw(), u_vals, 6);
  Tensor g = Tensor::empty({4}, DType::kF8E4M3);
  const float g_vals[4] = {1.0f, -1.0f, 448.0f, 0.001953125f};
  for (int i = 0; i < 4; ++i) g.data<uint8_t>()[i] = f32_to_fp8_e4m3(g_vals[i]);
  Tensor h = Tensor::empty({3}, DType::kF8E5M2);
  const float h_vals[3] = {1.0f, 57344.0f, -0.0f};
  for (int i = 0; i < 3; ++i) h.data<uint8_t>()[i] = f32_to_fp8_e5m2(h_vals[i]);
  Tensor scalar = Tensor::empty({}, DType::kF32);
  scalar.data<float>()[0] = 42.0f;
  Tensor empty = Tensor::empty({0, 3}, DType::kF32);
  Tensor w = Tensor::empty({1}, DType::kF32);
  w.data<float>()[0] = -7.25f;

  const NamedTensors mine = {{"a.f32", a}, {"b.bf16", b}, {"c.f16", c}, {"d.i32", d}, {"e.i64", e},
                             {"f.u16", u}, {"g.f8e4m3", g}, {"h.f8e5m2", h}, {"scalar", scalar},
                             {"empty", empty}, {"w\xc3\xa4rme", w}};
  ASSERT_EQ(f.names().size(), mine.size());
  for (const auto& [name, t] : mine) {
    ASSERT_TRUE(f.contains(name)) << name;
    EXPECT_TRUE(same_bytes(f.read(name), t)) << name;
  }
  // Decoded values, not just bytes: the python side computed them independently.
  EXPECT_EQ(f.read("b.bf16", DType::kF32).data<float>()[2], -2.75f);
  EXPECT_NEAR(f.read("b.bf16", DType::kF32).data<float>()[1], std::numbers::pi, 1e-2);
  EXPECT_EQ(f.read("g.f8e4m3", DType::kF32).data<float>()[2], 448.0f);
  EXPECT_EQ(f.read("h.f8e5m2", DType::kF32).data<float>()[1], 57344.0f);
  EXPECT_EQ(f.read("e.i64").data<int64_t>()[1], int64_t(1) << 40);

  const fs::path out = fs::temp_directory_path() / ("loom_st_compat_" + std::to_string(::getpid()) + ".safetensors");
  write_safetensors(out.string(), mine, meta, /*checksums=*/false);
  const std::string ours = read_file(out.string()), theirs = read_file(path);
  fs::remove(out);
  EXPECT_EQ(ours.size(), theirs.size());
  EXPECT_TRUE(ours == theirs) << "Loom's writer and the Python writer disagree on the bytes";
}

}  // namespace
}  // namespace loom

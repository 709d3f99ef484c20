// libFuzzer target: arbitrary bytes as the small files that decide what a checkpoint load reads. Byte 0
// picks what the rest is (mod 4):
//   0  latest_checkpointed_iteration.txt of a root holding iter_0000005, iter_0000010.loom-old and release/
//      (read_latest_checkpoint, then list_checkpoint_iterations and other_checkpoints_hint of what it names)
//   1  metadata.json of a checkpoint directory next to a valid one-rank shard_00000.safetensors
//   2  u16 LE n, n bytes of metadata.json, the rest shard_00000.safetensors (both files of a checkpoint: the
//      piece index, the per-tensor checksums and the metadata.json checksum, together)
//   3  one safetensors file on its own, opened read and mapped (the header, the "loom.crc32c" entry)
// Bad input must end in a UserError. What opens must be self-consistent: every tensor of a ShardedCheckpoint
// reads (or fails with a UserError) the same way twice, and a safetensors tensor that reads without a
// ChecksumError has the bytes its recorded CRC-32C says.
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "loom/ckpt/checkpoint.h"
#include "loom/ckpt/safetensors.h"
#include "loom/ckpt/sharded.h"
#include "loom/core/check.h"
#include "loom/core/crc32c.h"

namespace fs = std::filesystem;

namespace {

using fuzz_util::require;

const fs::path& dir() { return fuzz_util::scratch_dir("ckpt"); }

struct ScratchDir : fuzz_util::Scratch {
  ScratchDir() : Scratch(dir(), "ck") {}
};


// A valid one-rank shard: a whole (2, 3) f32 tensor and half of a (4) bf16 one (no metadata.json checksum).
void write_valid_shard(const fs::path& ck) {
  loom::Tensor a = loom::Tensor::empty({2, 3}, loom::DType::kF32), b = loom::Tensor::empty({2}, loom::DType::kBF16);
  for (int i = 0; i < 6; ++i) a.data<float>()[i] = float(i) - 2.5f;
  b.data<uint16_t>()[0] = 0x3f80;
  b.data<uint16_t>()[1] = 0xc000;
  loom::TensorPiece pa, pb;
  pa.name = "a";
  pa.global_shape = loom::Shape{2, 3};
  pa.data = a;
  pb.name = "b";
  pb.global_shape = loom::Shape{4};
  pb.partition_dim = 0;
  pb.ranges = {{0, 2}};
  pb.data = b;
  loom::write_shard(ck.string(), 0, {pa, pb});
}

void exercise_checkpoint(const std::string& ck_dir) {
  const loom::ShardedCheckpoint ck = loom::ShardedCheckpoint::open(ck_dir);
  require(ck.world_size() >= 1, "positive world size");
  (void)ck.checksum_note();
  for (const std::string& name : ck.tensor_names()) {
    const loom::Shape& g = ck.global_shape(name);
    require(ck.num_saved_pieces(name) >= 1, "a saved tensor has a piece");
    if (g.numel() > (int64_t(1) << 20)) continue;  // a huge global shape of tiny pieces: a coverage gap anyway
    std::string first, second;
    for (std::string* out : {&first, &second}) {
      try {
        const loom::Tensor t = ck.read_full(name, loom::DType::kF32);
        *out = std::string(static_cast<const char*>(t.raw()), size_t(t.nbytes()));
      } catch (const loom::UserError& e) {
        *out = std::string("error: ") + e.what();
      }
    }
    require(first == second, "a tensor reads the same way twice");
  }
}

void exercise_safetensors(const std::string& path) {
  for (auto mode : {loom::SafetensorsFile::Mode::kRead, loom::SafetensorsFile::Mode::kMmap}) {
    const loom::SafetensorsFile f = loom::SafetensorsFile::open(path, mode);
    require(!f.metadata().count(loom::kSafetensorsChecksumKey), "checksum entry hidden");
    for (const std::string& name : f.names()) {
      const loom::SafetensorsInfo& info = f.info(name);
      require(info.crc32c.has_value() == f.has_checksums(), "every tensor has a checksum or none does");
      if (!info.dtype) continue;
      try {
        const loom::Tensor t = mode == loom::SafetensorsFile::Mode::kMmap ? f.map(name) : f.read(name);
        require(t.nbytes() == info.nbytes(), "read size");
        if (info.crc32c) require(loom::crc32c(t.raw(), size_t(t.nbytes())) == *info.crc32c, "verified bytes");
      } catch (const loom::ChecksumError& e) {
        require(info.crc32c.has_value() && e.tensor() == name && e.path() == path, "checksum error names the tensor");
      } catch (const loom::UserError&) {  // unaligned map()
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int mode = data[0] % 4;
  const uint8_t* p = data + 1;
  size_t n = size - 1;
  const ScratchDir scratch;
  const fs::path root = dir(), ck = dir() / "ck";
  try {
    if (mode == 0) {
      fs::create_directories(root / "iter_0000005");
      fs::create_directories(root / "iter_0000010.loom-old");
      fs::create_directories(root / "release");
      fuzz_util::write_file(loom::checkpoint_tracker_path(root.string()), p, n);
      const std::optional<loom::LatestCheckpoint> latest = loom::read_latest_checkpoint(root.string());
      require(latest.has_value(), "an existing tracker names a checkpoint or fails");
      require(latest->iteration >= 0 && fs::is_directory(latest->dir), "the named directory exists");
      require(latest->release || latest->dir == loom::checkpoint_dir(root.string(), latest->iteration) ||
                  latest->dir == loom::checkpoint_dir(root.string(), latest->iteration) + ".loom-old",
              "the dir of the iteration");
      (void)loom::other_checkpoints_hint(latest->dir);
      require(loom::list_checkpoint_iterations(root.string()) == std::vector<int64_t>{5}, "committed dirs only");
      return 0;
    }
    if (mode == 1) {
      write_valid_shard(ck);
      fuzz_util::write_file(ck / "metadata.json", p, n);
    } else if (mode == 2) {
      size_t len = n >= 2 ? size_t(p[0] | (p[1] << 8)) : 0;
      p += std::min<size_t>(n, 2);
      n -= std::min<size_t>(n, 2);
      len = std::min(len, n);
      fuzz_util::write_file(ck / "metadata.json", p, len);
      fuzz_util::write_file(ck / "shard_00000.safetensors", p + len, n - len);
    } else {
      fuzz_util::write_file(ck / "x.safetensors", p, n);
      exercise_safetensors((ck / "x.safetensors").string());
      return 0;
    }
    (void)loom::is_sharded_checkpoint(ck.string());
    exercise_checkpoint(ck.string());
  } catch (const loom::UserError&) {
  }
  return 0;
}

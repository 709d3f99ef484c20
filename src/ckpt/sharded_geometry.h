// Private to the ckpt layer: the piece geometry shared by the sharded writer (sharded_write.cpp) and
// reader (sharded_read.cpp). Resharding works in the global tensor's row-major flat index space: a piece
// (saved or wanted) is a list of runs, each a stretch of consecutive global flat indices that is also
// consecutive in the piece's data. Along the partition dim a box is (outer, concatenated ranges, inner), so
// for every outer index and range the range's rows form one run of range.size * inner elements; the ZeRO
// flat window clips that list.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/ckpt/sharded.h"

namespace loom::sharded_detail {

inline constexpr const char* kMetadataName = "metadata.json";
inline constexpr const char* kShardedKey = "sharded_checkpoint";
inline constexpr const char* kIndexKey = "loom_sharded_index";
inline constexpr const char* kFormat = "loom-sharded";
// In shard 0's piece index: the CRC-32C of metadata.json (8 hex digits; absent in older checkpoints).
inline constexpr const char* kMetadataCrcKey = "metadata_crc32c";
inline constexpr int kVersion = 1;

// A piece's geometry with the window resolved; `problem` is set when it is malformed.
struct Geometry {
  int64_t outer = 1, inner = 1, global_d = 1, local_d = 1;  // (outer, local_d, inner) box layout
  int64_t box = 0;
  int64_t flat_begin = 0, flat_end = 0;
  std::string problem;
};

Geometry geometry(const Shape& g, int partition_dim, const std::vector<BoxRange>& ranges, int64_t flat_begin,
                  int64_t flat_end);

// Consecutive global flat indices [global, global + len) held at data offsets [local, local + len).
struct Run {
  int64_t global = 0;
  int64_t local = 0;
  int64_t len = 0;
  int piece = 0;  // saved runs: which saved piece of the tensor
};

// The runs of a box window, in data order, adjacent runs merged.
std::vector<Run> box_runs(const Geometry& g, int partition_dim, const std::vector<BoxRange>& ranges, int piece);

// "(i, j, k)": the coordinates of a row-major flat index (error messages).
std::string coords(const Shape& g, int64_t flat);
// "[a, b), [c, d)" or "the whole tensor".
std::string ranges_str(const std::vector<BoxRange>& ranges);

// n elements from src (dtype s) to dst (dtype d): a byte copy when equal, else through f32 (every Loom
// float dtype is exact in f32, so widening is exact and narrowing rounds once, to nearest even).
void convert(const void* src, DType s, void* dst, DType d, int64_t n);

// LOOM_CHECKs a saved or target piece against its geometry (`what`: "saved" / "target").
void check_piece(const TensorPiece& p, const Geometry& g, const char* what);

}  // namespace loom::sharded_detail

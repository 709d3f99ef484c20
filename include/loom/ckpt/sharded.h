// Sharded checkpoints that load into any parallel layout (resharding).
//
// Every rank saves the pieces of tensors it holds; a reader fills pieces of another layout (different
// TP split, ZeRO ranges, dtype) from whatever saved pieces overlap them. Directory (inside the atomic
// iter_XXXXXXX dir of checkpoint.h):
//   metadata.json                  rank 0: the caller's metadata object plus
//                                  "sharded_checkpoint": {"format": "loom-sharded", "version": 1,
//                                   "world_size": N, "layout": {caller's layout, e.g. {"tp":2,"zero":"optim"}}}
//   shard_00000.safetensors ...    one per rank, written by that rank (possibly with no tensors). Each piece
//                                  is one 1-D tensor of (flat_end - flat_begin) elements in its own dtype; the
//                                  piece index (JSON list: name, dtype, global_shape, partition_dim, ranges,
//                                  flat_begin, flat_end, key) is the "loom_sharded_index" entry of the
//                                  safetensors "__metadata__", so one file per rank is written atomically
//                                  and a reader gets every index by reading headers only.
//
// A piece's BOX is the global tensor restricted, along partition_dim, to the concatenated `ranges` (all of
// the tensor when partition_dim is -1), laid out row-major as (outer, sum of range sizes, inner). The piece
// holds elements [flat_begin, flat_end) of that box's flattening (ZeRO shards a box by flat ranges).
//
// Replicas: the caller decides who writes what. Data-parallel replicas hold identical model pieces, so
// only dp_rank 0 should pass model pieces (unless ZeRO shards them: then every dp rank passes its flat
// range); optimizer state is passed by whoever owns it. The reader tolerates duplicates (overlapping
// saved elements are taken from any one piece; they are assumed equal).
//
// One reader for every Loom checkpoint: open() also reads the single-file format that single processes of
// Loom 0.1.0 wrote (metadata.json "files": model.safetensors, optimizer.safetensors as "<param>.exp_avg",
// fp8_state.safetensors) as a world of one whose every tensor is one whole piece, under this format's
// names ("optimizer.exp_avg.<param>"), so it too loads into any layout.
//
// Checksums: each shard records the CRC-32C of every piece (safetensors.h, "loom.crc32c"), and shard 0's
// piece index also that of metadata.json ("metadata_crc32c"). open() verifies metadata.json; a piece is
// verified, whole, the first time a read needs any part of it. A mismatch is a ChecksumError naming the
// checkpoint directory, the file and the tensor, and the other checkpoints of the same root that could be
// loaded instead. Checkpoints written before checksums load unverified (checksum_note() says so).
//
// Reading cost: open() reads metadata.json and every shard's header (no tensor data). Data is read
// through a read-only memory map of each shard actually needed, opened once per ShardedCheckpoint; every
// piece that overlaps a target is read once in full (to verify it), and only the overlapping bytes are
// copied.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/core/tensor.h"
#include "loom/dist/communicator.h"

namespace loom {

// Global indices [start, start + size) along a partition dim. Same fields as nn's ShardRange, under another
// name because ckpt cannot see nn and a translation unit may include both headers.
struct BoxRange {
  int64_t start = 0;
  int64_t size = 0;
};

// A piece of one tensor: what a rank saves, or what a reader wants filled.
struct TensorPiece {
  std::string name;                // e.g. "decoder.layers.3.mlp.linear_fc1.weight", "optimizer.exp_avg.<name>"
  Shape global_shape;              // the full tensor
  int partition_dim = -1;          // -1: the box is the whole tensor
  std::vector<BoxRange> ranges;    // with partition_dim >= 0: global indices along it held by the box, concatenated
  int64_t flat_begin = 0;          // [flat_begin, flat_end) of the box's row-major flattening
  int64_t flat_end = -1;           // -1: the end of the box
  TensorView data;                 // CPU, contiguous, (flat_end - flat_begin) elements of a float dtype (any shape)
};

// Elements in the piece's box (the product of global_shape with partition_dim reduced to the ranges).
int64_t piece_box_numel(const TensorPiece& p);

// ---- writing ----------------------------------------------------------------------------------------

// "shard_00003.safetensors"
std::string shard_file_name(int rank);

// Any rank, between begin_checkpoint and commit_checkpoint: writes <staging>/shard_<rank>.safetensors with
// `pieces` (empty pieces are skipped; a rank with nothing to save still writes its file, so a reader can
// tell a missing shard from an empty one). Malformed pieces (ranges out of bounds, data size not the flat
// window, non-CPU or non-float data) fail a LOOM_CHECK naming the piece. Rank 0 passes the text of
// metadata.json (sharded_metadata_text) so that its checksum is recorded; empty: none recorded.
void write_shard(const std::string& staging, int rank, const std::vector<TensorPiece>& pieces,
                 const std::string& metadata_text = "");

// Rank 0, between begin_checkpoint and commit_checkpoint: writes <staging>/metadata.json. `layout_json`
// and `metadata_json` are JSON objects (text); the caller's object must not have the key
// "sharded_checkpoint". UserError when either is not a JSON object.
void write_sharded_metadata(const std::string& staging, int world_size, const std::string& layout_json,
                            const std::string& metadata_json);
// The text write_sharded_metadata writes (same checks).
std::string sharded_metadata_text(int world_size, const std::string& layout_json, const std::string& metadata_json);

// The whole save, collective over `world` (every rank calls it with its own pieces): rank 0 begins the
// checkpoint of `iteration` under `root`, every rank writes its shard (rank 0 also metadata.json), rank 0
// commits (staging dir renamed into place, tracker written last). Between the steps the ranks agree on
// success with an all-reduce, so when any rank fails every rank throws (the failing rank its own error,
// the others a UserError saying which step failed elsewhere) and the previous checkpoint stays current.
void save_sharded_checkpoint(const std::string& root, int64_t iteration, const std::vector<TensorPiece>& pieces,
                             const std::string& layout_json, const std::string& metadata_json,
                             const Communicator& world);

// Same with a caller-provided barrier over all `world_size` ranks (no failure agreement: a rank that
// throws leaves the others waiting in the barrier, as any collective would).
void save_sharded_checkpoint(const std::string& root, int64_t iteration, const std::vector<TensorPiece>& pieces,
                             const std::string& layout_json, const std::string& metadata_json, int rank,
                             int world_size, const std::function<void()>& barrier);

// ---- reading ----------------------------------------------------------------------------------------

// True when <dir>/metadata.json exists and has a "sharded_checkpoint" object.
bool is_sharded_checkpoint(const std::string& dir);

class ShardedCheckpoint {
 public:
  // Reads <dir>/metadata.json and the header (piece index) of every shard it names (or of the files of a
  // single-file checkpoint). UserError naming the file on a missing or unreadable metadata.json or shard,
  // a corrupt header or index, or pieces of one tensor that disagree on its global shape.
  static ShardedCheckpoint open(const std::string& dir);

  ShardedCheckpoint();
  ~ShardedCheckpoint();
  ShardedCheckpoint(ShardedCheckpoint&&) noexcept;
  ShardedCheckpoint& operator=(ShardedCheckpoint&&) noexcept;

  const std::string& dir() const;
  int world_size() const;
  const std::string& layout_json() const;    // the "layout" object as compact JSON text
  const std::string& metadata_json() const;  // the whole metadata.json text
  // "" when every file records checksums, else a one-line note for the log that the checkpoint (written
  // before Loom recorded checksums) loads unverified.
  std::string checksum_note() const;
  std::vector<std::string> tensor_names() const;  // sorted
  bool contains(const std::string& name) const;
  const Shape& global_shape(const std::string& name) const;  // UserError when absent
  int num_saved_pieces(const std::string& name) const;      // pieces over all shards (duplicates included)

  // Fills every target's data from the saved pieces that overlap it, converting dtypes (to narrower types
  // by round-to-nearest-even). All targets are checked first, so a failed call leaves every destination
  // untouched: UserError for a tensor the checkpoint lacks, a global shape mismatch (naming the tensor and
  // both shapes) or target elements no saved piece covers (naming the tensor and the missing range);
  // LOOM_CHECK for malformed targets.
  void read(const std::vector<TensorPiece>& targets) const;
  void read(const TensorPiece& target) const;
  // The whole tensor in dtype `as`, shaped global_shape(name).
  Tensor read_full(const std::string& name, DType as) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom

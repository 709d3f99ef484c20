// Checkpoint directories in Megatron's layout, committed atomically.
//
//   <root>/iter_0000100/                  one committed checkpoint (iteration zero-padded to 7 digits)
//   <root>/latest_checkpointed_iteration.txt   the tracker: "100" (no newline, as Megatron writes it), or
//                                         "release" meaning <root>/release/ (read only; Loom never writes it)
//
// A save is split so that several ranks can write into one checkpoint (the caller places the barriers):
//   rank 0:     staging = begin_checkpoint(root, it)      -> <root>/iter_0000100.loom-staging
//   every rank: write_checkpoint_tensors/text(checkpoint_staging_dir(root, it), "file", ...)
//   rank 0:     commit_checkpoint(root, it)
// The staging name is fixed (not random) so every rank can compute it without a broadcast.
//
// Crash safety (kill -9 or power loss at any instant):
//  - every file is written as <file>.tmp, fsynced and renamed; the staging dir is fsynced before it is
//    renamed to its final name; the root is fsynced; only then is the tracker replaced (tmp + fsync +
//    rename + fsync root). So the tracker only ever names a complete, durable checkpoint.
//  - re-saving an iteration whose dir exists swaps staging and final with renameat2(RENAME_EXCHANGE) where
//    the filesystem supports it. Elsewhere (NFS, Lustre) the old dir is first renamed to
//    <root>/iter_0000100.loom-old and the staging dir then takes the final name; a crash between the two
//    renames leaves only the .loom-old dir, which read_latest_checkpoint() then reports as the checkpoint's
//    dir and the next begin_checkpoint() renames back. Either way the tracker always names a loadable dir.
//  - begin_checkpoint() removes leftovers of crashed saves: every <root>/iter_<digits>.loom-staging, every
//    .loom-old whose final dir exists, and <root>/latest_checkpointed_iteration.txt.tmp. Nothing else in
//    <root> is ever deleted.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loom/ckpt/safetensors.h"

namespace loom {

// root/iter_0000100 (more digits past 9,999,999, like Megatron's "iter_{:07d}").
std::string checkpoint_dir(const std::string& root, int64_t iteration);
// root/iter_0000100.loom-staging: where a save of `iteration` is written before commit_checkpoint().
std::string checkpoint_staging_dir(const std::string& root, int64_t iteration);
// root/latest_checkpointed_iteration.txt
std::string checkpoint_tracker_path(const std::string& root);

// Rank 0 only. Creates root (and its parents) if needed, cleans up leftovers of crashed saves (see above;
// a stale staging dir of this same iteration included) and creates an empty staging dir. Returns its path.
std::string begin_checkpoint(const std::string& root, int64_t iteration);

// Any rank, between begin and commit: writes one file into the staging dir, durably (fsynced) and
// atomically. `filename` is a plain file name (no '/').
void write_checkpoint_tensors(const std::string& staging, const std::string& filename, const NamedTensors& tensors,
                              const std::map<std::string, std::string>& metadata = {});
void write_checkpoint_text(const std::string& staging, const std::string& filename, const std::string& text);

// Rank 0 only, after every rank has written its files: makes the staging dir the checkpoint of `iteration`
// (replacing an existing one) and then, last, points the tracker at it.
void commit_checkpoint(const std::string& root, int64_t iteration);

struct LatestCheckpoint {
  int64_t iteration = 0;  // 0 for "release", as Megatron does
  std::string dir;        // the dir to load from (normally checkpoint_dir(root, iteration))
  bool release = false;   // the tracker said "release"
};

// The tracker of `root`: nullopt when root or its tracker file does not exist (a fresh start). A tracker
// that is empty, not a non-negative integer or "release", or names a dir that does not exist is a
// UserError naming the tracker file. Never modifies anything (every rank may call it at once).
std::optional<LatestCheckpoint> read_latest_checkpoint(const std::string& root);

// The iterations of the committed checkpoints in `root` (its iter_<digits> directories), ascending; empty
// when root cannot be listed.
std::vector<int64_t> list_checkpoint_iterations(const std::string& root);

// For errors about a damaged checkpoint directory `dir` (normally <root>/iter_XXXXXXX): one sentence naming
// the other checkpoints of its root and how to load one instead (loom train --ckpt-step N; generate and
// convert take an iter_XXXXXXX directory), or saying that there is none.
std::string other_checkpoints_hint(const std::string& dir);

// Copies each tensor of `into` (name -> CPU destination) from `file`. Every name must exist with exactly
// the destination's dtype and shape, and (unless allow_extra) the file must hold no other tensor; the first
// problem is a UserError naming the tensor, the file, what the checkpoint has and what is expected. All
// these checks run before any byte is copied, so such a failed load leaves every destination untouched; a
// damaged tensor (ChecksumError) is found as its bytes are copied, after the tensors before it.
void load_tensors_checked(const SafetensorsFile& file, const NamedTensors& into, bool allow_extra = false);

namespace detail {
// commit_checkpoint with the RENAME_EXCHANGE swap disabled, so tests can exercise the rename-aside path
// that filesystems without it take.
void commit_checkpoint_without_exchange(const std::string& root, int64_t iteration);
}  // namespace detail

}  // namespace loom

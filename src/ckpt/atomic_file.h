// Durable file writes shared by the ckpt layer (safetensors, Megatron checkpoints, HF directories).
// Invariant: a file published with write_file_atomic is either absent/old or complete and fsynced, and
// the rename that publishes it is itself made durable by syncing the parent directory.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

namespace loom::ckpt_io {

// Writes all `n` bytes, retrying on EINTR and short writes; false (errno set) on an error.
bool write_all(int fd, const void* src, size_t n);

// fsyncs a directory so the entries created, renamed or removed in it survive a power loss.
// EINVAL (a filesystem that cannot sync directories) is accepted; other failures are user errors.
void fsync_dir(const std::string& dir);

// Writes `path` as <path>.tmp, fsyncs it, renames it over `path` and syncs the parent directory.
// `write_body(fd)` writes the contents and returns false on a failed write. On failure the .tmp file
// is removed and a user error names `path`.
void write_file_atomic(const std::string& path, const std::function<bool(int fd)>& write_body);

}  // namespace loom::ckpt_io

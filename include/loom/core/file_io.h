// Whole-file reads and durable writes: the one copy of each in Loom (checkpoints, datasets' index
// caches, tokenizer and config files all go through these).
// Invariant of write_file_atomic: the file at `path` is either absent/old or complete and fsynced, and
// the rename that publishes it is itself made durable by syncing the parent directory. The temporary
// file is "<path>.tmp.<pid>.<n>" (unique per process and call), so ranks writing the same path at once
// never interleave their bytes; readers never see it under `path`.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace loom {

// A log file opened for writing ("wb", or "ab" with append), its parent directories created first.
// UserError "<what> '<path>': cannot create directory '<parent>' (<reason>)" or "...: cannot open for
// writing (<reason>)". The caller owns the FILE*.
std::FILE* open_log_file(const std::string& path, std::string_view what, bool append = false);

// The bytes of `path`. UserError "<what> '<path>': cannot open: it does not exist" (or the reason: not a
// regular file, permissions, a read error, larger than max_bytes when max_bytes >= 0).
std::string read_file(const std::string& path, std::string_view what, int64_t max_bytes = -1);
// The bytes of `path`, or nullopt when it cannot be opened or read (optional files: caches).
std::optional<std::string> read_file_if_present(const std::string& path);

// Writes all `n` bytes to `fd`, retrying on EINTR and short writes; false (errno set) on an error.
bool write_all(int fd, const void* src, size_t n);
// fsyncs a directory so the entries created, renamed or removed in it survive a power loss. EINVAL (a
// filesystem that cannot sync directories) is accepted; other failures are UserErrors.
void fsync_dir(const std::string& dir);

// Writes `path` through a temporary file in the same directory: `write_body(fd)` writes the contents
// (false on a failed write), then fsync, rename over `path`, fsync of the directory. On failure the
// temporary file is removed and a UserError names `path` and the reason.
void write_file_atomic(const std::string& path, const std::function<bool(int fd)>& write_body);
void write_file_atomic(const std::string& path, std::string_view bytes);
// The same, returning false (nothing left behind) instead of throwing: for files the caller can do
// without, such as caches.
bool try_write_file_atomic(const std::string& path, const std::function<bool(int fd)>& write_body);

// True when `name` is a temporary file of write_file_atomic for a file named `target_name` (or of Loom
// 0.1.0's writer, which used "<target_name>.tmp").
bool is_atomic_write_leftover(std::string_view name, std::string_view target_name);

}  // namespace loom

// Whole-file reads and tmp + fsync + rename + fsync-dir writes (see include/loom/core/file_io.h).
#include "loom/core/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <cerrno>
#include <cstring>

#include "loom/core/check.h"

namespace loom {

namespace {

std::string errno_text() { return std::strerror(errno); }

std::atomic<uint64_t> g_tmp_counter{0};

std::string tmp_name(const std::string& path) {
  return path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(g_tmp_counter.fetch_add(1));
}

std::string parent_dir(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

// Reads the whole file into `out`; an empty string on success, else why it failed.
std::string read_into(const std::string& path, int64_t max_bytes, std::string& out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? "cannot open: it does not exist" : "cannot open: " + errno_text();
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return "cannot open: it is not a regular file";
  }
  if (max_bytes >= 0 && st.st_size > max_bytes) {
    ::close(fd);
    return "is " + std::to_string(st.st_size) + " bytes; at most " + std::to_string(max_bytes) + " are expected";
  }
  out.resize(size_t(st.st_size));
  size_t got = 0;
  for (;;) {  // to the end, even if the file grew since fstat
    if (got == out.size()) out.resize(out.size() + 65536);
    const ssize_t r = ::read(fd, out.data() + got, out.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const std::string why = "read error (" + errno_text() + ")";
      ::close(fd);
      return why;
    }
    if (r == 0) break;
    got += size_t(r);
  }
  out.resize(got);
  ::close(fd);
  return "";
}

// fsync of a directory; an empty string on success (EINVAL: a filesystem that cannot sync directories),
// else the reason.
std::string sync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return "cannot open directory '" + dir + "' to sync it: " + errno_text();
  std::string why;
  if (::fsync(fd) != 0 && errno != EINVAL) why = "syncing directory '" + dir + "' failed: " + errno_text();
  ::close(fd);
  return why;
}

// The atomic write; an empty string on success, else the reason (nothing is left behind).
std::string write_atomic(const std::string& path, const std::function<bool(int fd)>& write_body) {
  const std::string tmp = tmp_name(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return "cannot create '" + tmp + "': " + errno_text();
  bool ok = write_body(fd) && ::fsync(fd) == 0;
  std::string why = ok ? "" : errno_text();
  ok = (::close(fd) == 0) && ok;
  if (ok && ::rename(tmp.c_str(), path.c_str()) != 0) ok = false;
  if (!ok) {
    if (why.empty()) why = errno_text();
    ::unlink(tmp.c_str());
    return why;
  }
  return "";
}

}  // namespace

std::string read_file(const std::string& path, std::string_view what, int64_t max_bytes) {
  std::string out;
  const std::string why = read_into(path, max_bytes, out);
  if (!why.empty()) user_error(what, " '", path, "': ", why);
  return out;
}

std::optional<std::string> read_file_if_present(const std::string& path) {
  std::string out;
  if (!read_into(path, -1, out).empty()) return std::nullopt;
  return out;
}

bool write_all(int fd, const void* src, size_t n) {
  const char* p = static_cast<const char*>(src);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= size_t(w);
  }
  return true;
}

void fsync_dir(const std::string& dir) {
  const std::string why = sync_dir(dir);
  if (!why.empty()) user_error(why);
}

void write_file_atomic(const std::string& path, const std::function<bool(int fd)>& write_body) {
  const std::string why = write_atomic(path, write_body);
  if (!why.empty()) user_error("writing '", path, "' failed: ", why);
  fsync_dir(parent_dir(path));
}

void write_file_atomic(const std::string& path, std::string_view bytes) {
  write_file_atomic(path, [&](int fd) { return write_all(fd, bytes.data(), bytes.size()); });
}

bool try_write_file_atomic(const std::string& path, const std::function<bool(int fd)>& write_body) {
  if (!write_atomic(path, write_body).empty()) return false;
  sync_dir(parent_dir(path));  // best effort: the file is complete either way
  return true;
}

bool is_atomic_write_leftover(std::string_view name, std::string_view target_name) {
  const std::string plain = std::string(target_name) + ".tmp";  // Loom 0.1.0's fixed temporary name
  if (name == plain) return true;
  const std::string prefix = plain + ".";
  return name.size() > prefix.size() && name.compare(0, prefix.size(), prefix) == 0;
}

std::FILE* open_log_file(const std::string& path, std::string_view what, bool append) {
  namespace fs = std::filesystem;
  const fs::path parent = fs::path(path).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    fs::create_directories(parent, ec);
    if (ec || !fs::is_directory(parent))
      user_error(what, " '", path, "': cannot create directory '", parent.string(), "' (",
                 ec ? ec.message() : "not a directory", ")");
  }
  std::FILE* f = std::fopen(path.c_str(), append ? "ab" : "wb");
  if (!f) user_error(what, " '", path, "': cannot open for writing (", std::strerror(errno), ")");
  return f;
}

}  // namespace loom

// tmp + fsync + rename + fsync-dir writes (see atomic_file.h); the one copy of this sequence in Loom.
#include "atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "loom/core/check.h"

namespace loom::ckpt_io {

namespace {
std::string errno_text() { return std::strerror(errno); }
}  // namespace

bool write_all(int fd, const void* src, size_t n) {
  const char* p = static_cast<const char*>(src);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= size_t(w);
  }
  return true;
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) user_error("cannot open directory '", dir, "' to sync it: ", errno_text());
  if (::fsync(fd) != 0 && errno != EINVAL) {
    const std::string why = errno_text();
    ::close(fd);
    user_error("syncing directory '", dir, "' failed: ", why);
  }
  ::close(fd);
}

void write_file_atomic(const std::string& path, const std::function<bool(int fd)>& write_body) {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) user_error("cannot create '", tmp, "': ", errno_text());
  bool ok = write_body(fd) && ::fsync(fd) == 0;
  const std::string why = ok ? "" : errno_text();
  ok = (::close(fd) == 0) && ok;
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string reason = why.empty() ? errno_text() : why;
    ::unlink(tmp.c_str());
    user_error("writing '", path, "' failed: ", reason);
  }
  const size_t slash = path.rfind('/');
  fsync_dir(slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash)));
}

}  // namespace loom::ckpt_io

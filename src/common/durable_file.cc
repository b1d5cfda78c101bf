#include "common/durable_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>

#include "common/errno.h"

namespace strata {

Status WriteFileDurable(const std::string& path, std::string_view text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoToStatus(errno, fmt::format("create {}", path));
  Status st;
  size_t done = 0;
  while (done < text.size() && st.ok()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      st = ErrnoToStatus(errno, fmt::format("write {}", path));
    } else {
      done += static_cast<size_t>(n);
    }
  }
  if (st.ok() && ::fsync(fd) != 0) st = ErrnoToStatus(errno, fmt::format("fsync {}", path));
  // Closed whatever happened; a close error matters only when all else went well.
  if (::close(fd) != 0 && st.ok()) st = ErrnoToStatus(errno, fmt::format("close {}", path));
  return st;
}

Status FsyncPath(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, fmt::format("open {} to fsync it", path));
  Status st;
  if (::fsync(fd) != 0) st = ErrnoToStatus(errno, fmt::format("fsync {}", path));
  (void)::close(fd);
  return st;
}

}  // namespace strata

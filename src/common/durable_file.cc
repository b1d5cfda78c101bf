#include "common/durable_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>

#include "common/errno.h"

namespace strata {

Status WriteFileDurable(const std::string& path, std::string_view text) {
  // errno is read before anything (fmt::format may allocate) can change it.
  auto failed = [&path](const char* call) {
    const int err = errno;
    return ErrnoToStatus(err, fmt::format("{} {}", call, path));
  };
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return failed("create");
  Status st;
  size_t done = 0;
  while (done < text.size() && st.ok()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      st = failed("write");
    } else if (n == 0) {
      st = DataLossError(fmt::format("write {}: no progress at byte {} of {}", path, done,
                                     text.size()));
    } else {
      done += static_cast<size_t>(n);
    }
  }
  if (st.ok() && ::fsync(fd) != 0) st = failed("fsync");
  // Closed whatever happened; a close error matters only when all else went well.
  if (::close(fd) != 0 && st.ok()) st = failed("close");
  return st;
}

Status FsyncPath(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    return ErrnoToStatus(err, fmt::format("open {} to fsync it", path));
  }
  Status st;
  if (::fsync(fd) != 0) {
    const int err = errno;
    st = ErrnoToStatus(err, fmt::format("fsync {}", path));
  }
  (void)::close(fd);
  return st;
}

}  // namespace strata

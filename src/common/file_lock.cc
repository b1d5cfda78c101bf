#include "common/file_lock.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <ctime>
#include <fstream>
#include <sstream>
#include <utility>

#include "common/errno.h"
#include "common/log.h"

// Locks stay outside the file seam (strata/file_system.h): flock() belongs to the descriptor,
// which the seam does not expose, and a lock file's few bytes (who holds it) are a message to
// the user, not data that must survive a crash.

namespace strata {

namespace {

// This process's command line, arguments separated by spaces (at most 200 characters).
std::string CommandLine() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (char& c : raw) {
    if (c == '\0') c = ' ';
  }
  while (!raw.empty() && raw.back() == ' ') raw.pop_back();
  if (raw.size() > 200) raw = raw.substr(0, 197) + "...";
  return raw;
}

std::string HostName() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) return "?";
  return host;
}

std::string ReadAll(int fd) {
  std::string out;
  char buf[512];
  off_t at = 0;
  for (;;) {
    const ssize_t n = ::pread(fd, buf, sizeof(buf), at);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
    at += n;
    if (out.size() > 4096) break;
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\0')) out.pop_back();
  return out;
}

}  // namespace

Result<FileLock> FileLock::Acquire(const std::string& path, std::string_view what,
                                   std::string lock_file) {
  const std::string lock_path = lock_file.empty() ? path + ".lock" : std::move(lock_file);
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
      return ErrnoToStatus(errno, fmt::format("create the lock file {} of the {} {}", lock_path,
                                              what, path));
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      const std::string holder = ReadAll(fd);
      ::close(fd);
      if (err == EWOULDBLOCK) {
        return FailedPreconditionError(fmt::format(
            "the {} {} is in use by another process: {} (lock file {}); give each run its own "
            "path, or stop that process",
            what, path, holder.empty() ? "a process that has not written its name yet" : holder,
            lock_path));
      }
      return ErrnoToStatus(err, fmt::format("lock {}", lock_path));
    }
    // Still the file at the path? (Its holder may have removed it between our open and flock.)
    struct stat by_fd {}, by_path {};
    if (::fstat(fd, &by_fd) != 0 || ::stat(lock_path.c_str(), &by_path) != 0 ||
        by_fd.st_ino != by_path.st_ino || by_fd.st_dev != by_path.st_dev) {
      ::close(fd);
      continue;
    }
    const std::string previous = ReadAll(fd);
    if (!previous.empty()) {
      STRATA_LOG(info, core,
                 "{}: taking over the lock left by a process that has ended ({})", lock_path,
                 previous);
    }
    // localtime_r, not localtime: localtime's buffer is shared by every thread, and several
    // ranks of one process (an in-process world) lock their files at the same time. The time
    // zone is read once, under a static's initialisation, before the first conversion.
    static const bool time_zone_read = [] {
      ::tzset();
      return true;
    }();
    (void)time_zone_read;
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    ::localtime_r(&now, &local);
    char when[64] = {};
    std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S", &local);
    const std::string me = fmt::format("pid {} ({}) on host {} since {}", ::getpid(), CommandLine(),
                                       HostName(), when);
    if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) < 0) {
      const int err = errno;
      ::close(fd);
      return ErrnoToStatus(err, fmt::format("write {}", lock_path));
    }
    FileLock lock;
    lock.fd_ = fd;
    lock.lock_path_ = lock_path;
    return lock;
  }
  return UnavailableError(fmt::format("{}: could not take the lock (it kept being replaced)", lock_path));
}

FileLock::FileLock(FileLock&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), lock_path_(std::move(other.lock_path_)) {}

FileLock& FileLock::operator=(FileLock&& other) noexcept {
  if (this != &other) {
    Release();
    fd_ = std::exchange(other.fd_, -1);
    lock_path_ = std::move(other.lock_path_);
  }
  return *this;
}

void FileLock::Release() {
  if (fd_ < 0) return;
  ::unlink(lock_path_.c_str());  // while still holding it: nobody can be between open and flock
  ::close(fd_);                  // drops the lock
  fd_ = -1;
}

}  // namespace strata

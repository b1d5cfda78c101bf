// FileLock: one process at a time owns a path (an offload swap file, a checkpoint directory).
//
// Acquire takes an exclusive, non-blocking flock on a lock file (for a path P, the file P.lock
// beside it) and writes the holder's pid, host and command line into it. A second process asking
// for the same lock is refused at once with FailedPrecondition naming the path and the holder, as
// read from the lock file ("held by pid 4242 (strata train ...) on host n1 since ..."). The
// kernel drops a flock when its process dies, however it dies, so a lock file left by a killed
// run is simply taken over by the next one (which logs that it did). Release (or the destructor)
// removes the lock file and then drops the lock; Acquire checks after locking that the file it
// locked is still the one at the path, so a holder removing it at that moment cannot leave two
// owners.
//
// flock works across processes on one machine and, on Linux, over NFS (as an fcntl lock on the
// server). Locks are per open file description: two FileLocks on one path in one process also
// exclude each other.
#pragma once

#include <string>
#include <string_view>

#include "strata/status.h"

namespace strata {

class FileLock {
 public:
  // Locks `lock_file` (default: `path` + ".lock"). `what` and `path` name the owned thing in
  // errors ("NVMe offload file /nvme/strata.rank0.param.swap").
  static Result<FileLock> Acquire(const std::string& path, std::string_view what,
                                  std::string lock_file = "");

  FileLock() = default;
  ~FileLock() { Release(); }
  FileLock(FileLock&& other) noexcept;
  FileLock& operator=(FileLock&& other) noexcept;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

  void Release();
  bool held() const { return fd_ >= 0; }
  const std::string& lock_path() const { return lock_path_; }

 private:
  int fd_ = -1;
  std::string lock_path_;
};

}  // namespace strata

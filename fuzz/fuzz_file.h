// A scratch file in /dev/shm (or TMPDIR) for fuzz targets whose parser reads a file: each input
// is written to it before the parser opens it.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

namespace strata::fuzz {

inline std::string ScratchPath(const char* extension) {
  const char* dir = std::getenv("STRATA_FUZZ_TMP");
  std::string base = dir != nullptr ? dir : (access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp");
  return base + "/strata-fuzz-" + std::to_string(::getpid()) + extension;
}

// Replaces the file's contents with the input; false when it cannot be written.
inline bool WriteScratch(const std::string& path, const uint8_t* data, size_t size) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return done == size;
}

}  // namespace strata::fuzz

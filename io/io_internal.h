// Pieces shared by the BlockStore backends: request validation and error messages, so that every
// backend rejects the same requests with the same words.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>

#include "common/clock.h"
#include "strata/block_store.h"

namespace strata::io::internal {

// Checks one request against the file it targets: non-zero length, buffer and callback present,
// not a write to a read-only file, and under direct I/O offset, length and buffer address all
// multiples of the alignment. `where` names the file in messages (its path, or its paths).
Status ValidateRequest(const IoRequest& request, const FileInfo& info, std::string_view where);

// "read of 1048576 bytes at offset 4096 in /mnt/nvme0/x". For a piece of a striped or split
// request, FileStore prefixes the error with the same description of the whole request.
std::string DescribeTransfer(IoOp op, std::string_view path, uint64_t offset, uint64_t length);

// A logical file's paths for messages: "/a/x" or "/a/x (striped with /b/x, /c/x)".
std::string DescribePaths(const FileInfo& info);

// Checks a FileSpec's shape (at least one path, no empty path, a stripe unit that is a positive
// multiple of 4096 when striping, no path given twice).
Status ValidateFileSpec(const FileSpec& spec);

// StoreStats::busy_ns: the time during which at least one logical request was outstanding (from
// Submit until its callback returned), as iostat's %util is a disk's. Enter when a request is
// accepted, Leave after its callback; both take a mutex, so that an end and a new start racing on
// two threads cannot lose or double-count an interval.
class BusyClock {
 public:
  // Times on `clock` (RealClock() when null), which must outlive it.
  explicit BusyClock(Clock* clock = nullptr) : clock_(clock != nullptr ? clock : &RealClock()) {}
  void Enter();
  void Leave();
  // Closed intervals plus the open one, if a request is outstanding now.
  uint64_t TotalNs() const;

 private:
  Clock* const clock_;
  mutable std::mutex mu_;
  int64_t active_ = 0;
  int64_t since_ns_ = 0;
  uint64_t busy_ns_ = 0;
};

}  // namespace strata::io::internal

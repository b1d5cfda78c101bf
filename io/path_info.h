// Facts about the storage behind a path: its filesystem, free space, O_DIRECT support, and the
// queue limits of its block device (from sysfs). Used to size requests, by `strata env`, and in
// error messages.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "strata/status.h"

namespace strata::io {

// Limits of a block device's request queue, from /sys/dev/block/<major>:<minor>/queue (the
// parent disk's queue for a partition).
struct QueueLimits {
  std::string device;              // "nvme0n1", "vda"
  uint32_t max_segments = 0;       // memory segments per request
  uint64_t max_segment_size = 0;   // bytes per segment
  uint64_t max_sectors_kb = 0;     // KiB per request (the current limit)
  uint64_t max_hw_sectors_kb = 0;  // KiB per request the hardware allows
  uint32_t logical_block_size = 0;
  uint32_t physical_block_size = 0;
  uint32_t nr_requests = 0;        // queue depth of the scheduler
  bool rotational = false;
  std::string scheduler;           // the active one, e.g. "none", "mq-deadline"

  // The largest request (bytes) the device takes in one command when its buffer is made of
  // `contiguous_bytes`-sized physically contiguous pieces (4096 for ordinary pages, 2 MiB for
  // huge pages). A multiple of 4096; 0 when unknown.
  uint64_t MaxRequestBytes(uint64_t contiguous_bytes) const;
};

struct PathInfo {
  std::string path;
  std::string filesystem;       // "ext4", "xfs", "tmpfs", ... or "0x<magic>"
  uint64_t free_bytes = 0;      // available to this user
  uint64_t total_bytes = 0;
  std::optional<bool> o_direct; // whether a file here can be opened with O_DIRECT (unset: unknown)
  std::optional<QueueLimits> queue;  // unset for filesystems without a block device
  int numa_node = -1;           // of the block device; -1 when unknown or single-node
};

// Describes `path` (a file or a directory; for a file that does not exist yet, its directory).
// `probe_direct` creates and removes a small temporary file to test O_DIRECT.
Result<PathInfo> DescribePath(const std::string& path, bool probe_direct);

// The queue limits of the block device holding `path`, or nullopt (tmpfs, overlay, ...).
std::optional<QueueLimits> QueueLimitsForPath(const std::string& path);

// Name of the filesystem type for a statfs f_type.
std::string FilesystemName(int64_t f_type);

// Free bytes for an unprivileged writer at `path` (statvfs f_bavail * f_frsize).
Result<uint64_t> FreeBytes(const std::string& path);

}  // namespace strata::io

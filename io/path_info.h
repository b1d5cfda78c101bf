// Facts about the storage behind a path: its filesystem, free space, O_DIRECT support, and the
// queue limits of its block device (from sysfs). Used to size requests, by `strata env`, and in
// error messages.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

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
  uint32_t nr_requests = 0;  // queue depth of the scheduler
  bool rotational = false;
  std::string scheduler;  // the active one, e.g. "none", "mq-deadline"

  // The largest request (bytes) the device takes in one command when its buffer is made of
  // `contiguous_bytes`-sized physically contiguous pieces (4096 for ordinary pages, 2 MiB for
  // huge pages). A multiple of 4096; 0 when unknown.
  uint64_t MaxRequestBytes(uint64_t contiguous_bytes) const;
};

struct PathInfo {
  std::string path;
  std::string filesystem;   // "ext4", "xfs", "tmpfs", ... or "0x<magic>"
  uint64_t free_bytes = 0;  // available to this user
  uint64_t total_bytes = 0;
  std::optional<bool> o_direct;  // whether a file here can be opened with O_DIRECT (unset: unknown)
  std::optional<QueueLimits> queue;  // unset for filesystems without a block device
  int numa_node = -1;                // of the block device; -1 when unknown or single-node
};

// Describes `path` (a file or a directory; for a file that does not exist yet, its directory,
// which must exist). PathInfo::path is `path` as given. `probe_direct` tests O_DIRECT: an
// existing file is opened O_RDONLY|O_DIRECT; for a directory a uniquely named temporary file is
// created with O_DIRECT, one aligned 4 KiB block written to it, and the file removed. EINVAL
// means "no"; other failures (a read-only directory, ...) leave o_direct unset.
// Errors: NotFound naming the path when neither it nor its parent exists; the errno-derived
// error of statfs/statvfs otherwise. Loads the hwloc topology for numa_node (see io/numa.h).
// Thread safety: may be called from any thread.
Result<PathInfo> DescribePath(const std::string& path, bool probe_direct);

// The queue limits of the block device holding `path`, or nullopt (tmpfs, overlay, ...).
std::optional<QueueLimits> QueueLimitsForPath(const std::string& path);

// The block device behind a path, as sysfs describes it. Shared by the queue limits above and by
// NUMA placement (io/numa.h), which looks the backing disks up in the hwloc topology.
struct BlockDevice {
  std::string name;       // the device the filesystem is on: "vda1", "nvme0n1p2", "dm-0"
  std::string disk;       // the device whose queue/ applies: a partition's parent disk, or `name`
  std::string sysfs_dir;  // the sysfs directory of `disk` (it holds queue/)
  // The physical disks underneath: `disk` itself, or for device-mapper and md devices the whole
  // disks found by following slaves/ (a partition is replaced by its disk). May be empty when a
  // stacked device lists no slaves.
  std::vector<std::string> backing_disks;
};

// Finds the block device holding `path` (for a path that does not exist, its parent directory):
// stat() st_dev -> /sys/dev/block/<major>:<minor>. Filesystems on anonymous devices (btrfs)
// are resolved through the mount source in /proc/self/mountinfo. nullopt when there is no block
// device (tmpfs, overlay, NFS, ...) or sysfs is not mounted.
std::optional<BlockDevice> BlockDeviceForPath(const std::string& path);

// Reads the queue limits of a block device from its sysfs directory (BlockDevice::sysfs_dir).
// nullopt when the directory has no queue/.
std::optional<QueueLimits> ReadQueueLimits(const BlockDevice& device);

// Name of the filesystem type for a statfs f_type.
std::string FilesystemName(int64_t f_type);

// Free bytes for an unprivileged writer at `path` (statvfs f_bavail * f_frsize).
Result<uint64_t> FreeBytes(const std::string& path);

}  // namespace strata::io

#include "io/path_info.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string_view>

#include "common/errno.h"
#include "common/proc_files.h"
#include "io/numa.h"

namespace strata::io {

namespace {

namespace fs = std::filesystem;

// `path` without trailing slashes ("/" stays "/").
std::string StripTrailingSlashes(std::string path) {
  while (path.size() > 1 && path.back() == '/')
    path.pop_back();
  return path;
}

// The directory part of `path`; "." for a bare name.
std::string ParentDirectory(const std::string& path) {
  std::string parent = fs::path(path).parent_path().string();
  return parent.empty() ? std::string(".") : parent;
}

// What to look at for `path`: the path itself when it exists, else its parent directory when
// that exists (a file about to be created). NotFound naming `path` otherwise.
Result<std::string> ExistingPathOrParent(const std::string& path) {
  if (path.empty()) return InvalidArgumentError("an empty path was given");
  struct stat st {};
  if (stat(path.c_str(), &st) == 0) return path;
  int err = errno;
  if (err != ENOENT) return ErrnoToStatus(err, path);
  // "dir/" names a directory, which cannot be a file about to be created.
  if (path.back() == '/') return ErrnoToStatus(ENOENT, path);
  std::string parent = ParentDirectory(StripTrailingSlashes(path));
  struct stat parent_st {};
  if (stat(parent.c_str(), &parent_st) != 0 || !S_ISDIR(parent_st.st_mode)) {
    return ErrnoToStatus(ENOENT, path);
  }
  return parent;
}

// The directory that holds `existing` (itself when it is a directory).
std::string DirectoryOf(const std::string& existing) {
  struct stat st {};
  if (stat(existing.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return existing;
  return ParentDirectory(existing);
}

bool Exists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0;
}

std::string BaseName(const std::string& path) {
  return fs::path(StripTrailingSlashes(path)).filename().string();
}

std::optional<std::string> RealPath(const std::string& path) {
  std::unique_ptr<char, decltype(&std::free)> resolved(realpath(path.c_str(), nullptr), &std::free);
  if (!resolved) return std::nullopt;
  return std::string(resolved.get());
}

// For a partition's sysfs directory, the directory of its whole disk; otherwise `dir` itself.
std::string WholeDiskDir(const std::string& dir) {
  if (Exists(dir + "/partition")) return fs::path(dir).parent_path().string();
  return dir;
}

// The physical disks under a (possibly stacked) device: follows slaves/ of device-mapper and md
// devices down to devices that have none.
void CollectBackingDisks(const std::string& disk_dir, int depth, std::vector<std::string>* out) {
  std::vector<std::string> slaves;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(disk_dir + "/slaves", ec)) {
    slaves.push_back(entry.path().string());
  }
  if (slaves.empty() || depth >= 8) {
    std::string name = BaseName(disk_dir);
    if (std::find(out->begin(), out->end(), name) == out->end()) out->push_back(name);
    return;
  }
  std::sort(slaves.begin(), slaves.end());
  for (const std::string& slave : slaves) {
    auto real = RealPath(slave);
    if (!real) continue;
    CollectBackingDisks(WholeDiskDir(*real), depth + 1, out);
  }
}

// For a filesystem on an anonymous device (st_dev major 0, e.g. btrfs), the block device named
// as its mount source in /proc/self/mountinfo.
std::optional<dev_t> MountSourceDevice(dev_t anonymous) {
  auto text = procfs::ReadSmallFile("/proc/self/mountinfo", size_t{16} << 20);
  if (!text) return std::nullopt;
  const std::string want = fmt::format("{}:{}", major(anonymous), minor(anonymous));
  std::string_view all = *text;
  for (std::string_view line : procfs::Lines(all)) {
    // "36 35 0:45 / /mnt rw,relatime shared:1 - btrfs /dev/sdb1 rw,..."
    size_t f1 = line.find(' ');
    size_t f2 = f1 == std::string_view::npos ? f1 : line.find(' ', f1 + 1);
    size_t f3 = f2 == std::string_view::npos ? f2 : line.find(' ', f2 + 1);
    if (f3 == std::string_view::npos || line.substr(f2 + 1, f3 - f2 - 1) != want) continue;
    size_t sep = line.find(" - ");
    if (sep == std::string_view::npos) continue;
    std::string_view rest = line.substr(sep + 3);  // "btrfs /dev/sdb1 rw,..."
    size_t sp1 = rest.find(' ');
    if (sp1 == std::string_view::npos) continue;
    std::string_view source = rest.substr(sp1 + 1);
    source = source.substr(0, source.find(' '));
    if (source.empty() || source.front() != '/') return std::nullopt;
    struct stat st {};
    if (stat(std::string(source).c_str(), &st) != 0 || !S_ISBLK(st.st_mode)) return std::nullopt;
    return st.st_rdev;
  }
  return std::nullopt;
}

std::optional<bool> ProbeDirectFile(const std::string& file) {
  int fd = open(file.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd >= 0) {
    close(fd);
    return true;
  }
  if (errno == EINVAL) return false;
  return std::nullopt;
}

std::optional<bool> ProbeDirectDirectory(const std::string& dir) {
  static std::atomic<unsigned> counter{0};
  const std::string name =
      fmt::format("{}/.strata-odirect-probe.{}.{}", dir, getpid(), counter.fetch_add(1));
  int fd = open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) {
    if (errno == EINVAL) return false;
    return std::nullopt;  // read-only, no permission, ...: cannot tell
  }
  // Some filesystems accept the flag at open and refuse the I/O: write one aligned block.
  std::optional<bool> result;
  void* block = std::aligned_alloc(4096, 4096);
  if (block != nullptr) {
    std::memset(block, 0, 4096);
    ssize_t n = pwrite(fd, block, 4096, 0);
    if (n == 4096) {
      result = true;
    } else if (n < 0 && errno == EINVAL) {
      result = false;
    }
    std::free(block);
  }
  close(fd);
  unlink(name.c_str());
  return result;
}

uint32_t ReadU32(const std::string& path) {
  return static_cast<uint32_t>(procfs::ReadUintFile(path).value_or(0));
}

}  // namespace

uint64_t QueueLimits::MaxRequestBytes(uint64_t contiguous_bytes) const {
  if (contiguous_bytes == 0 || max_sectors_kb == 0 || max_segments == 0 || max_segment_size == 0) {
    return 0;
  }
  const uint64_t per_segment = std::min(contiguous_bytes, max_segment_size);
  const uint64_t by_segments = uint64_t{max_segments} * per_segment;
  const uint64_t by_sectors = max_sectors_kb * 1024;
  return std::min(by_sectors, by_segments) / 4096 * 4096;
}

std::string FilesystemName(int64_t f_type) {
  struct Entry {
    uint32_t magic;
    const char* name;
  };
  // Magic numbers from linux/magic.h and the filesystems' own headers.
  static constexpr Entry kNames[] = {
      {0xEF53, "ext4"},  // ext2, ext3 and ext4 share the magic
      {0x58465342, "xfs"},      {0x9123683E, "btrfs"},     {0x01021994, "tmpfs"},
      {0x858458F6, "ramfs"},    {0x794C7630, "overlay"},   {0x6969, "nfs"},
      {0x2FC12FC1, "zfs"},      {0xF2F52010, "f2fs"},      {0xCA451A4E, "bcachefs"},
      {0x65735546, "fuse"},     {0xFE534D42, "smb2"},      {0xFF534D42, "cifs"},
      {0x01021997, "9p"},       {0x00C36400, "ceph"},      {0x0BD00BD0, "lustre"},
      {0x47504653, "gpfs"},     {0x3153464A, "jfs"},       {0x52654973, "reiserfs"},
      {0x4D44, "vfat"},         {0x2011BAB0, "exfat"},     {0x5346544E, "ntfs"},
      {0x73717368, "squashfs"}, {0x958458F6, "hugetlbfs"}, {0x9FA0, "proc"},
      {0x62656572, "sysfs"},    {0x63677270, "cgroup2"},   {0x1CD1, "devpts"},
      {0x61756673, "aufs"},
  };
  const auto magic = static_cast<uint32_t>(f_type);
  for (const Entry& e : kNames) {
    if (e.magic == magic) return e.name;
  }
  return fmt::format("0x{:x}", magic);
}

Result<uint64_t> FreeBytes(const std::string& path) {
  struct statvfs vfs {};
  if (statvfs(path.c_str(), &vfs) != 0) return ErrnoToStatus(errno, "statvfs " + path);
  return uint64_t{vfs.f_bavail} * vfs.f_frsize;
}

std::optional<BlockDevice> BlockDeviceForPath(const std::string& path) {
  Result<std::string> existing = ExistingPathOrParent(path);
  if (!existing.ok()) return std::nullopt;
  struct stat st {};
  if (stat(existing->c_str(), &st) != 0) return std::nullopt;
  dev_t dev = st.st_dev;
  if (major(dev) == 0) {
    auto source = MountSourceDevice(dev);
    if (!source) return std::nullopt;
    dev = *source;
  }
  auto dir = RealPath(fmt::format("/sys/dev/block/{}:{}", major(dev), minor(dev)));
  if (!dir) return std::nullopt;
  BlockDevice device;
  device.name = BaseName(*dir);
  device.sysfs_dir = WholeDiskDir(*dir);
  device.disk = BaseName(device.sysfs_dir);
  CollectBackingDisks(device.sysfs_dir, 0, &device.backing_disks);
  return device;
}

std::optional<QueueLimits> ReadQueueLimits(const BlockDevice& device) {
  const std::string q = device.sysfs_dir + "/queue/";
  if (!Exists(q)) return std::nullopt;
  QueueLimits limits;
  limits.device = device.disk;
  limits.max_segments = ReadU32(q + "max_segments");
  limits.max_segment_size = procfs::ReadUintFile(q + "max_segment_size").value_or(0);
  limits.max_sectors_kb = procfs::ReadUintFile(q + "max_sectors_kb").value_or(0);
  limits.max_hw_sectors_kb = procfs::ReadUintFile(q + "max_hw_sectors_kb").value_or(0);
  limits.logical_block_size = ReadU32(q + "logical_block_size");
  limits.physical_block_size = ReadU32(q + "physical_block_size");
  limits.nr_requests = ReadU32(q + "nr_requests");
  limits.rotational = procfs::ReadUintFile(q + "rotational").value_or(0) != 0;
  // Stacked devices (dm, md) have no scheduler file; "none" is what they do.
  auto scheduler = procfs::ReadSmallFile(q + "scheduler", 4096);
  limits.scheduler = scheduler ? procfs::ActiveChoice(*scheduler).value_or("unknown") : "none";
  return limits;
}

std::optional<QueueLimits> QueueLimitsForPath(const std::string& path) {
  auto device = BlockDeviceForPath(path);
  if (!device) return std::nullopt;
  return ReadQueueLimits(*device);
}

Result<PathInfo> DescribePath(const std::string& path, bool probe_direct) {
  STRATA_ASSIGN_OR_RETURN(std::string target, ExistingPathOrParent(path));
  PathInfo info;
  info.path = path;

  struct statfs sfs {};
  if (statfs(target.c_str(), &sfs) != 0) return ErrnoToStatus(errno, "statfs " + target);
  info.filesystem = FilesystemName(static_cast<int64_t>(sfs.f_type));

  struct statvfs vfs {};
  if (statvfs(target.c_str(), &vfs) != 0) return ErrnoToStatus(errno, "statvfs " + target);
  info.free_bytes = uint64_t{vfs.f_bavail} * vfs.f_frsize;
  info.total_bytes = uint64_t{vfs.f_blocks} * vfs.f_frsize;

  if (probe_direct) {
    struct stat st {};
    if (stat(target.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      info.o_direct = ProbeDirectFile(target);
    } else {
      info.o_direct = ProbeDirectDirectory(DirectoryOf(target));
    }
  }

  if (auto device = BlockDeviceForPath(target)) info.queue = ReadQueueLimits(*device);
  info.numa_node = NumaNodeOfPath(target);
  return info;
}

}  // namespace strata::io

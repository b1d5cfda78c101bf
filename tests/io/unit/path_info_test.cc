#include "io/path_info.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/statfs.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "test_support.h"

namespace strata::io {
namespace {

using strata::testing::TempDir;
using ::testing::HasSubstr;

TEST(FilesystemNameTest, KnownMagics) {
  EXPECT_EQ(FilesystemName(0xEF53), "ext4");
  EXPECT_EQ(FilesystemName(0x58465342), "xfs");
  EXPECT_EQ(FilesystemName(0x9123683E), "btrfs");
  EXPECT_EQ(FilesystemName(0x01021994), "tmpfs");
  EXPECT_EQ(FilesystemName(0x858458F6), "ramfs");
  EXPECT_EQ(FilesystemName(0x794C7630), "overlay");
  EXPECT_EQ(FilesystemName(0x6969), "nfs");
  EXPECT_EQ(FilesystemName(0x2FC12FC1), "zfs");
  EXPECT_EQ(FilesystemName(0xF2F52010), "f2fs");
}

TEST(FilesystemNameTest, SignExtendedMagicStillMatches) {
  // Some ABIs hand f_type over as a signed 32-bit value.
  EXPECT_EQ(FilesystemName(static_cast<int32_t>(0x9123683E)), "btrfs");
  EXPECT_EQ(FilesystemName(static_cast<int32_t>(0xF2F52010)), "f2fs");
}

TEST(FilesystemNameTest, UnknownIsHex) {
  EXPECT_EQ(FilesystemName(0x12345), "0x12345");
}

TEST(QueueLimitsTest, MaxRequestBytesArithmetic) {
  QueueLimits q;
  q.max_segments = 254;
  q.max_segment_size = 4294967295;  // what virtio-blk reports
  q.max_sectors_kb = 4096;
  // 254 scattered 4 KiB pages: 1016 KiB; 2 MiB pages: capped by max_sectors_kb.
  EXPECT_EQ(q.MaxRequestBytes(4096), 254u * 4096);
  EXPECT_EQ(q.MaxRequestBytes(2 << 20), 4096u * 1024);

  // A small max_segment_size caps what one huge page contributes.
  q.max_segments = 128;
  q.max_segment_size = 65536;
  q.max_sectors_kb = 1 << 20;
  EXPECT_EQ(q.MaxRequestBytes(2 << 20), 128u * 65536);
  EXPECT_EQ(q.MaxRequestBytes(4096), 128u * 4096);

  // Rounded down to 4 KiB.
  q.max_segments = 3;
  q.max_segment_size = 1 << 20;
  EXPECT_EQ(q.MaxRequestBytes(5000), 12288u);  // 15000 -> 12288
}

TEST(QueueLimitsTest, MaxRequestBytesUnknownIsZero) {
  QueueLimits q;
  EXPECT_EQ(q.MaxRequestBytes(4096), 0u);
  q.max_segments = 254;
  q.max_segment_size = 65536;
  EXPECT_EQ(q.MaxRequestBytes(4096), 0u);  // max_sectors_kb unknown
  q.max_sectors_kb = 512;
  EXPECT_EQ(q.MaxRequestBytes(0), 0u);
  EXPECT_EQ(q.MaxRequestBytes(4096), 512u * 1024);
}

TEST(DescribePathTest, TempDirFacts) {
  TempDir dir;
  Result<PathInfo> info = DescribePath(dir.path().string(), /*probe_direct=*/true);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->path, dir.path().string());

  struct statfs sfs {};
  ASSERT_EQ(statfs(dir.path().c_str(), &sfs), 0);
  EXPECT_EQ(info->filesystem, FilesystemName(static_cast<int64_t>(sfs.f_type)));
  EXPECT_FALSE(info->filesystem.empty());
  EXPECT_GT(info->total_bytes, 0u);
  EXPECT_LE(info->free_bytes, info->total_bytes);

  Result<uint64_t> free_bytes = FreeBytes(dir.path().string());
  ASSERT_TRUE(free_bytes.ok()) << free_bytes.status().ToString();
  // Other tests write concurrently; allow 1 GiB of drift.
  EXPECT_NEAR(static_cast<double>(*free_bytes), static_cast<double>(info->free_bytes),
              static_cast<double>(1 << 30));

  // The probe tells yes or no for a writable directory and leaves nothing behind.
  EXPECT_TRUE(info->o_direct.has_value());
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  EXPECT_GE(info->numa_node, -1);
}

TEST(DescribePathTest, WithoutProbeDirectIsUnknown) {
  TempDir dir;
  Result<PathInfo> info = DescribePath(dir.path().string(), /*probe_direct=*/false);
  ASSERT_TRUE(info.ok());
  EXPECT_FALSE(info->o_direct.has_value());
}

TEST(DescribePathTest, ExistingFile) {
  TempDir dir;
  std::string file = dir.file("data.bin");
  std::ofstream(file) << "x";
  Result<PathInfo> info = DescribePath(file, /*probe_direct=*/true);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->path, file);
  EXPECT_TRUE(info->o_direct.has_value());
}

TEST(DescribePathTest, FileNotYetCreatedDescribesItsDirectory) {
  TempDir dir;
  Result<PathInfo> parent = DescribePath(dir.path().string(), false);
  Result<PathInfo> info = DescribePath(dir.file("not-yet.bin"), false);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  ASSERT_TRUE(parent.ok());
  EXPECT_EQ(info->path, dir.file("not-yet.bin"));
  EXPECT_EQ(info->filesystem, parent->filesystem);
  EXPECT_EQ(info->total_bytes, parent->total_bytes);
  EXPECT_FALSE(std::filesystem::exists(dir.file("not-yet.bin")));
}

TEST(DescribePathTest, MissingPathIsNotFoundNamingIt) {
  TempDir dir;
  const std::string missing = dir.file("no-such-dir/file.bin");
  Result<PathInfo> info = DescribePath(missing, true);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(info.status().message(), HasSubstr(missing));

  // A trailing slash names a directory, which cannot be "a file about to be created".
  Result<PathInfo> dir_info = DescribePath(dir.file("no-such-dir") + "/", false);
  ASSERT_FALSE(dir_info.ok());
  EXPECT_EQ(dir_info.status().code(), StatusCode::kNotFound);

  Result<uint64_t> free_bytes = FreeBytes(missing);
  ASSERT_FALSE(free_bytes.ok());
  EXPECT_EQ(free_bytes.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(free_bytes.status().message(), HasSubstr(missing));
}

TEST(DescribePathTest, EmptyPathIsInvalid) {
  Result<PathInfo> info = DescribePath("", false);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), StatusCode::kInvalidArgument);
}

TEST(QueueLimitsForPathTest, BuildDirectoryOnABlockDevice) {
  TempDir dir;  // in the build tree (or $STRATA_TEST_DIR): meant to be a real disk
  std::optional<BlockDevice> device = BlockDeviceForPath(dir.path().string());
  if (!device) {
    GTEST_SKIP() << dir.path() << " is not on a local block device (tmpfs, overlay, NFS?)";
  }
  EXPECT_FALSE(device->name.empty());
  EXPECT_FALSE(device->disk.empty());
  EXPECT_TRUE(std::filesystem::exists(device->sysfs_dir + "/queue"));
  EXPECT_FALSE(device->backing_disks.empty());

  std::optional<QueueLimits> q = QueueLimitsForPath(dir.path().string());
  ASSERT_TRUE(q.has_value());
  EXPECT_EQ(q->device, device->disk);
  EXPECT_GT(q->max_segments, 0u);
  EXPECT_GT(q->max_segment_size, 0u);
  EXPECT_GT(q->max_sectors_kb, 0u);
  EXPECT_GE(q->max_hw_sectors_kb, q->max_sectors_kb);
  EXPECT_GE(q->logical_block_size, 512u);
  EXPECT_GE(q->physical_block_size, q->logical_block_size);
  EXPECT_FALSE(q->scheduler.empty());
  EXPECT_GT(q->MaxRequestBytes(4096), 0u);
  EXPECT_GE(q->MaxRequestBytes(2 << 20), q->MaxRequestBytes(4096));

  Result<PathInfo> info = DescribePath(dir.path().string(), false);
  ASSERT_TRUE(info.ok());
  ASSERT_TRUE(info->queue.has_value());
  EXPECT_EQ(info->queue->device, q->device);
  EXPECT_EQ(info->queue->max_segments, q->max_segments);
}

TEST(QueueLimitsForPathTest, TmpfsHasNoBlockDevice) {
  const std::string shm = "/dev/shm";
  struct statfs sfs {};
  if (statfs(shm.c_str(), &sfs) != 0 ||
      FilesystemName(static_cast<int64_t>(sfs.f_type)) != "tmpfs") {
    GTEST_SKIP() << "/dev/shm is not a tmpfs here";
  }
  EXPECT_FALSE(BlockDeviceForPath(shm).has_value());
  EXPECT_FALSE(QueueLimitsForPath(shm).has_value());
  Result<PathInfo> info = DescribePath(shm, false);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->filesystem, "tmpfs");
  EXPECT_FALSE(info->queue.has_value());
  EXPECT_EQ(info->numa_node, -1);
}

TEST(QueueLimitsForPathTest, MissingPathHasNone) {
  EXPECT_FALSE(QueueLimitsForPath("/nonexistent-strata-dir/x/y").has_value());
  EXPECT_FALSE(BlockDeviceForPath("/nonexistent-strata-dir/x/y").has_value());
}

}  // namespace
}  // namespace strata::io

// ReadPcieLink, PcieGeneration and PcieBytesPerSecond: the PCIe facts `strata env` and the GPU
// check report, read from a fake sysfs device directory.
#include <gtest/gtest.h>

#include <fstream>
#include <initializer_list>
#include <string>
#include <utility>

#include "device/gpu_info.h"
#include "test_support.h"

namespace strata::device {
namespace {

// A fake sysfs device directory holding `files` (name, content).
void WriteFiles(const testing::TempDir& dir,
                std::initializer_list<std::pair<const char*, const char*>> files) {
  for (const auto& [name, text] : files)
    std::ofstream(dir.file(name)) << text;
}

TEST(PcieLinkTest, ReadsSpeedWidthAndNumaNode) {
  testing::TempDir dir;
  WriteFiles(dir, {{"current_link_speed", "2.5 GT/s PCIe\n"},  // an idle GPU trains its link down
                   {"current_link_width", "16\n"},
                   {"max_link_speed", "32.0 GT/s PCIe\n"},
                   {"max_link_width", "16\n"},
                   {"numa_node", "1\n"}});
  const PcieLink link = ReadPcieLink(dir.path().string());
  EXPECT_DOUBLE_EQ(link.current_gts, 2.5);
  EXPECT_EQ(link.current_width, 16);
  EXPECT_DOUBLE_EQ(link.max_gts, 32.0);
  EXPECT_EQ(link.max_width, 16);
  EXPECT_EQ(link.numa_node, 1);
}

TEST(PcieLinkTest, OlderKernelsWriteNoSuffix) {
  testing::TempDir dir;
  WriteFiles(dir, {{"max_link_speed", "8 GT/s\n"}, {"max_link_width", "8\n"}});
  const PcieLink link = ReadPcieLink(dir.path().string());
  EXPECT_DOUBLE_EQ(link.max_gts, 8.0);
  EXPECT_EQ(link.max_width, 8);
}

TEST(PcieLinkTest, UnknownValuesStayUnknown) {
  testing::TempDir dir;
  // What virtual machines show: no speed, an impossible width, no NUMA information.
  WriteFiles(dir, {{"current_link_speed", "Unknown\n"},
                   {"current_link_width", "255\n"},
                   {"max_link_speed", "garbage GT\n"},
                   {"numa_node", "-1\n"}});
  const PcieLink link = ReadPcieLink(dir.path().string());
  EXPECT_EQ(link.current_gts, 0);
  EXPECT_EQ(link.current_width, 0);
  EXPECT_EQ(link.max_gts, 0);
  EXPECT_EQ(link.max_width, 0);  // file absent
  EXPECT_EQ(link.numa_node, -1);

  const PcieLink none = ReadPcieLink(dir.file("no-such-device"));
  EXPECT_EQ(none.max_gts, 0);
  EXPECT_EQ(none.numa_node, -1);
}

TEST(PcieLinkTest, GenerationsAndLimits) {
  EXPECT_EQ(PcieGeneration(2.5), 1);
  EXPECT_EQ(PcieGeneration(5.0), 2);
  EXPECT_EQ(PcieGeneration(8.0), 3);
  EXPECT_EQ(PcieGeneration(16.0), 4);
  EXPECT_EQ(PcieGeneration(32.0), 5);
  EXPECT_EQ(PcieGeneration(64.0), 6);
  EXPECT_EQ(PcieGeneration(0), 0);
  EXPECT_EQ(PcieGeneration(12.0), 0);
  // Gen5 x16: 32 GT/s x 16 lanes x 128/130 / 8 = 63.0 GB/s per direction.
  EXPECT_NEAR(PcieBytesPerSecond(32.0, 16), 63.015e9, 0.01e9);
  // Gen4 x16: 31.5 GB/s; gen3 x16: 15.75 GB/s; gen2 x8 (8b/10b): 4 GB/s.
  EXPECT_NEAR(PcieBytesPerSecond(16.0, 16), 31.51e9, 0.01e9);
  EXPECT_NEAR(PcieBytesPerSecond(8.0, 16), 15.75e9, 0.01e9);
  EXPECT_NEAR(PcieBytesPerSecond(5.0, 8), 4.0e9, 0.001e9);
  EXPECT_EQ(PcieBytesPerSecond(32.0, 0), 0);
  EXPECT_EQ(PcieBytesPerSecond(0, 16), 0);
}

}  // namespace
}  // namespace strata::device

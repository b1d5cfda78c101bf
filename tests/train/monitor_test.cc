#include "train/monitor.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "test_support.h"

namespace strata::train {
namespace {

using strata::testing::TempDir;

std::string ReadAll(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(MonitorTest, Crc32cMatchesTheCastagnoliCheckValues) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);  // the polynomial's standard check value
  EXPECT_EQ(Crc32c(""), 0u);
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8A9136AAu);  // RFC 3720 B.4: 32 bytes of zeros
  EXPECT_EQ(MaskedCrc32c("123456789"), ((0xE3069283u >> 15) | (0xE3069283u << 17)) + 0xA282EAD8u);
}

TEST(MonitorTest, NothingIsWrittenUnlessEnabled) {
  Config config;
  auto monitors = CreateMonitors(config);
  ASSERT_TRUE(monitors.ok()) << monitors.status().ToString();
  EXPECT_TRUE(monitors->empty());
}

// Every record of the event file is framed as TFRecord (lengths and checksums hold), and the CSV
// files hold a header and one row per event.
TEST(MonitorTest, WritesFramedEventsAndOneCsvPerTag) {
  TempDir dir;
  Config config;
  config.tensorboard = {.enabled = true, .output_path = dir.file("tb"), .job_name = "job"};
  config.csv_monitor = {.enabled = true, .output_path = dir.file("csv"), .job_name = "job"};
  auto monitors = CreateMonitors(config);
  ASSERT_TRUE(monitors.ok()) << monitors.status().ToString();
  ASSERT_EQ(monitors->size(), 2u);
  for (int step = 1; step <= 3; ++step) {
    for (auto& m : *monitors) {
      ASSERT_TRUE(m->Write({{"Train/Samples/train_loss", 2.5 / step, step * 8},
                            {"Train/Strata/step_s", 0.25, step}})
                      .ok());
    }
  }
  const std::string events = ReadAll((*monitors)[0]->where());
  size_t at = 0;
  int records = 0;
  while (at < events.size()) {
    ASSERT_LE(at + 12, events.size());
    uint64_t len = 0;
    std::memcpy(&len, events.data() + at, 8);
    uint32_t len_crc = 0, data_crc = 0;
    std::memcpy(&len_crc, events.data() + at + 8, 4);
    EXPECT_EQ(len_crc, MaskedCrc32c(std::string_view(events.data() + at, 8)));
    ASSERT_LE(at + 12 + len + 4, events.size());
    std::memcpy(&data_crc, events.data() + at + 12 + len, 4);
    EXPECT_EQ(data_crc, MaskedCrc32c(std::string_view(events.data() + at + 12, len)));
    at += 12 + len + 4;
    ++records;
  }
  EXPECT_EQ(records, 1 + 3 * 2);  // the file version, then two scalars per step
  EXPECT_NE(events.find("brain.Event:2"), std::string::npos);
  EXPECT_NE(events.find("Train/Samples/train_loss"), std::string::npos);

  const auto csv = std::filesystem::path(dir.file("csv")) / "job";
  EXPECT_EQ(ReadAll(csv / "Train_Samples_train_loss.csv"),
            "step,train_loss\n8,2.5\n16,1.25\n24,0.8333333333333334\n");
  EXPECT_EQ(ReadAll(csv / "Train_Strata_step_s.csv"), "step,step_s\n1,0.25\n2,0.25\n3,0.25\n");
}

TEST(MonitorTest, BadJobNamesAndUnwritablePathsAreErrors) {
  TempDir dir;
  Config config;
  config.csv_monitor = {.enabled = true, .output_path = dir.file("csv"), .job_name = "a/b"};
  auto bad = CreateMonitors(config);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("csv_monitor.job_name \"a/b\""), std::string::npos)
      << bad.status().ToString();
  {
    std::ofstream f(dir.file("file"));
    f << "x";
  }
  config.csv_monitor.job_name = "job";
  config.csv_monitor.output_path = dir.file("file");  // a file, not a directory
  auto unwritable = CreateMonitors(config);
  ASSERT_FALSE(unwritable.ok());
  EXPECT_NE(unwritable.status().message().find("csv_monitor: cannot create"), std::string::npos)
      << unwritable.status().ToString();
}

}  // namespace
}  // namespace strata::train

#include "io/uring_probe.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <string>

namespace strata::io {
namespace {

using ::testing::HasSubstr;

const std::set<std::string> kProbedFlags = {"SQPOLL",       "SINGLE_ISSUER", "COOP_TASKRUN",
                                            "TASKRUN_FLAG", "DEFER_TASKRUN", "SUBMIT_ALL",
                                            "CQSIZE"};

int ReadSysctl() {
  std::ifstream in("/proc/sys/kernel/io_uring_disabled");
  int v = -1;
  if (in >> v) return v;
  return -1;
}

TEST(UringProbeTest, SysctlIsReported) {
  UringSupport s = ProbeUring();
  EXPECT_EQ(s.disabled_sysctl, ReadSysctl());
  if (s.disabled_sysctl == 2) {
    EXPECT_FALSE(s.available);
  }
}

TEST(UringProbeTest, UnavailableExplainsWhy) {
  UringSupport s = ProbeUring();
  if (s.available) {
    EXPECT_TRUE(s.error.empty()) << s.error;
    GTEST_SKIP() << "io_uring is available here";
  }
  EXPECT_THAT(s.error, HasSubstr("io_uring_setup"));
  EXPECT_TRUE(s.setup_flags_ok.empty());
  EXPECT_FALSE(s.register_buffers);
}

TEST(UringProbeTest, EveryFlagIsClassifiedOnce) {
  UringSupport s = ProbeUring();
  if (!s.available) GTEST_SKIP() << "io_uring unavailable: " << s.error;
  std::set<std::string> seen;
  for (const auto& f : s.setup_flags_ok) {
    EXPECT_TRUE(kProbedFlags.count(f)) << f;
    EXPECT_TRUE(seen.insert(f).second) << f;
  }
  for (const auto& f : s.setup_flags_rejected) {
    EXPECT_TRUE(kProbedFlags.count(f)) << f;
    EXPECT_TRUE(seen.insert(f).second) << f;
  }
  EXPECT_EQ(seen, kProbedFlags);
}

TEST(UringProbeTest, FeaturesAreNamed) {
  UringSupport s = ProbeUring();
  if (!s.available) GTEST_SKIP() << "io_uring unavailable: " << s.error;
  // Every kernel that Strata's io_uring backend supports (5.11+) has these.
  std::set<std::string> features(s.features.begin(), s.features.end());
  EXPECT_TRUE(features.count("SINGLE_MMAP"));
  EXPECT_TRUE(features.count("NODROP"));
  EXPECT_TRUE(features.count("FAST_POLL"));
  for (const auto& f : s.features)
    EXPECT_FALSE(f.empty());
}

TEST(UringProbeTest, CompanionFlagsAreConsistent) {
  UringSupport s = ProbeUring();
  if (!s.available) GTEST_SKIP() << "io_uring unavailable: " << s.error;
  std::set<std::string> ok(s.setup_flags_ok.begin(), s.setup_flags_ok.end());
  // TASKRUN_FLAG is tried with COOP_TASKRUN and DEFER_TASKRUN with SINGLE_ISSUER: a kernel that
  // accepts the pair accepts the companion alone.
  if (ok.count("TASKRUN_FLAG")) {
    EXPECT_TRUE(ok.count("COOP_TASKRUN"));
  }
  if (ok.count("DEFER_TASKRUN")) {
    EXPECT_TRUE(ok.count("SINGLE_ISSUER"));
  }
}

TEST(UringProbeTest, RegistrationWorksWhereTheKernelIsRecent) {
  UringSupport s = ProbeUring();
  if (!s.available) GTEST_SKIP() << "io_uring unavailable: " << s.error;
  std::set<std::string> features(s.features.begin(), s.features.end());
  if (!features.count("RSRC_TAGS")) GTEST_SKIP() << "kernel before 5.13: no sparse file tables";
  EXPECT_TRUE(s.register_files);
  // A 64 KiB buffer fits any memlock limit worth having (the default is 8 MiB).
  EXPECT_TRUE(s.register_buffers);
}

TEST(UringProbeTest, Repeatable) {
  UringSupport a = ProbeUring();
  UringSupport b = ProbeUring();
  EXPECT_EQ(a.available, b.available);
  EXPECT_EQ(a.setup_flags_ok, b.setup_flags_ok);
  EXPECT_EQ(a.features, b.features);
  EXPECT_EQ(a.register_buffers, b.register_buffers);
}

}  // namespace
}  // namespace strata::io

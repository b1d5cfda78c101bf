// The `strata` binary end to end: global flags, usage errors and `strata env`.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>

#include <cstddef>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

#include "cli_test_util.h"
#include "strata/version.h"
#include "test_support.h"

namespace strata::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(CliTest, VersionPrintsVersionAndBuild) {
  CommandResult r = RunStrata({"--version"});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("strata " + std::string(Version())));
  EXPECT_THAT(r.out, HasSubstr(GetBuildInfo().build_type));
  EXPECT_EQ(r.err, "");
}

TEST(CliTest, HelpListsCommands) {
  CommandResult r = RunStrata({"--help"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("env"));
  EXPECT_THAT(r.out, HasSubstr("nvme-bench"));
  EXPECT_THAT(r.out, HasSubstr("--version"));
}

TEST(CliTest, SubcommandHelp) {
  CommandResult r = RunStrata({"env", "--help"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("--path"));
  EXPECT_THAT(r.out, HasSubstr("--json"));
}

TEST(CliTest, NoSubcommandIsUsageError) {
  CommandResult r = RunStrata({});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("a command is required"));
  EXPECT_THAT(r.err, HasSubstr("env"));  // the help lists the commands
}

TEST(CliTest, UnknownCommandIsOneLine) {
  CommandResult r = RunStrata({"frobnicate"});
  EXPECT_EQ(r.exit_code, 2);
  auto lines = NonEmptyLines(r.err);
  ASSERT_EQ(lines.size(), 1u) << r.err;
  EXPECT_THAT(lines[0], HasSubstr("'frobnicate' is not a strata command"));
  EXPECT_EQ(r.out, "");
}

TEST(CliTest, UnknownFlagIsUsageError) {
  CommandResult top = RunStrata({"--no-such-flag"});
  EXPECT_EQ(top.exit_code, 2);
  EXPECT_THAT(top.err, HasSubstr("--no-such-flag"));

  CommandResult r = RunStrata({"env", "--no-such-flag"});
  EXPECT_EQ(r.exit_code, 2);
  auto lines = NonEmptyLines(r.err);
  ASSERT_EQ(lines.size(), 1u) << r.err;
  EXPECT_THAT(lines[0], HasSubstr("strata env: error:"));
  EXPECT_THAT(lines[0], HasSubstr("--no-such-flag"));
}

TEST(CliTest, MissingOptionValueIsUsageError) {
  CommandResult r = RunStrata({"env", "--path"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--path"));
}

TEST(CliTest, NvmeBenchHasHelp) {
  CommandResult r = RunStrata({"nvme-bench", "--help"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("nvme-bench"));
}

TEST(EnvCommandTest, HumanOutputHasEverySection) {
  TempDir dir;
  CommandResult r = RunStrata({"env", "--path", dir.path().string()});
  ASSERT_FALSE(r.timed_out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* section :
       {"strata ", "\ncpu\n", "\nmemory\n", "\ngpu\n", "\nio_uring\n", "\npath "}) {
    EXPECT_THAT(r.out, HasSubstr(section)) << r.out;
  }
  for (const char* key : {"build", "isa", "topology", "memlock", "thp", "hugetlbfs", "test region",
                          "filesystem", "O_DIRECT", "numa node"}) {
    EXPECT_THAT(r.out, HasSubstr(key)) << r.out;
  }
  EXPECT_THAT(r.out, HasSubstr(dir.path().string()));
  // GPUs are either listed or their absence is explained; nothing crashes without a driver.
  EXPECT_TRUE(r.out.find("gpus") != std::string::npos || r.out.find("gpu 0") != std::string::npos)
      << r.out;
  EXPECT_THAT(r.err, Not(HasSubstr("error")));
}

TEST(EnvCommandTest, JsonHasTheSameFacts) {
  TempDir dir;
  CommandResult r = RunStrata({"env", "--json", "--path", dir.path().string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded()) << "not JSON:\n" << r.out;
  for (const char* key :
       {"strata", "system", "cpu", "numa", "memory", "huge_pages", "gpu", "io_uring", "paths"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["strata"]["version"], std::string(Version()));
  EXPECT_TRUE(j["cpu"]["isa"].is_object());
  EXPECT_GT(j["memory"]["total_bytes"].get<uint64_t>(), 0u);
  EXPECT_TRUE(j["memory"]["memlock"].contains("soft_bytes"));
  EXPECT_TRUE(j["huge_pages"].contains("thp_mode"));
  EXPECT_TRUE(j["huge_pages"]["test_region"].is_object());
  EXPECT_TRUE(j["io_uring"]["available"].is_boolean());
  EXPECT_TRUE(j["io_uring"]["setup_flags_ok"].is_array());
  EXPECT_TRUE(j["gpu"]["devices"].is_array());
  if (j["gpu"]["devices"].empty()) {
    EXPECT_FALSE(j["gpu"]["none_reason"].get<std::string>().empty());
  }
  ASSERT_EQ(j["paths"].size(), 1u);
  const auto& p = j["paths"][0];
  EXPECT_EQ(p["path"], dir.path().string());
  EXPECT_FALSE(p["filesystem"].get<std::string>().empty());
  EXPECT_GT(p["total_bytes"].get<uint64_t>(), 0u);
  EXPECT_TRUE(p.contains("queue"));
  if (!p["queue"].is_null()) {
    EXPECT_GT(p["queue"]["max_segments"].get<uint64_t>(), 0u);
    EXPECT_GE(p["queue"]["max_request_bytes_2m_pages"].get<uint64_t>(),
              p["queue"]["max_request_bytes_4k_pages"].get<uint64_t>());
  }
}

TEST(EnvCommandTest, MissingPathIsOneLineNamingIt) {
  CommandResult r = RunStrata({"env", "--path", "/nonexistent/strata-env-test"});
  EXPECT_EQ(r.exit_code, 2);
  auto lines = NonEmptyLines(r.err);
  ASSERT_EQ(lines.size(), 1u) << r.err;
  EXPECT_THAT(lines[0], HasSubstr("/nonexistent/strata-env-test"));
  EXPECT_THAT(lines[0], HasSubstr("strata env: error:"));
  EXPECT_EQ(r.out, "");
}

TEST(EnvCommandTest, MissingPathFailsEvenAfterAGoodOne) {
  TempDir dir;
  CommandResult r = RunStrata(
      {"env", "--json", "--path", dir.path().string(), "--path", dir.file("missing-subdir/x")});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("missing-subdir"));
  EXPECT_EQ(r.out, "");
}

#if defined(__x86_64__)
constexpr uint32_t kAuditArch = AUDIT_ARCH_X86_64;
#elif defined(__aarch64__)
constexpr uint32_t kAuditArch = AUDIT_ARCH_AARCH64;
#else
constexpr uint32_t kAuditArch = 0;
#endif

// A seccomp program that fails io_uring_setup with EPERM, as many container runtimes do.
sock_filter kDenyIoUringFilter[] = {
    BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
    BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kAuditArch, 1, 0),
    BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
    BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
    BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
    BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
};

// Runs in the forked child before exec.
bool InstallSeccomp(const void* program) {
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return false;
  return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, program) == 0;
}

TEST(EnvCommandTest, ReportsIoUringBlockedBySeccomp) {
  if (kAuditArch == 0) GTEST_SKIP() << "no seccomp filter for this architecture in the test";
  const sock_fprog program{static_cast<unsigned short>(std::size(kDenyIoUringFilter)),
                           kDenyIoUringFilter};
  CommandResult r =
      RunStrata({"env", "--json"}, std::chrono::seconds(60), {}, &InstallSeccomp, &program);
  ASSERT_NE(r.exit_code, 126) << "the seccomp filter could not be installed";
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["io_uring"]["available"], false);
  EXPECT_THAT(j["io_uring"]["error"].get<std::string>(), HasSubstr("EPERM"));
  EXPECT_TRUE(j["io_uring"]["setup_flags_ok"].empty());

  CommandResult human = RunStrata({"env"}, std::chrono::seconds(60), {}, &InstallSeccomp, &program);
  ASSERT_EQ(human.exit_code, 0) << human.err;
  EXPECT_THAT(human.out, HasSubstr("no: io_uring_setup: Operation not permitted (EPERM)"));
  EXPECT_THAT(human.out, HasSubstr("pread/pwrite"));
}

TEST(RunStrataTest, TimeoutKillsTheChild) {
  CommandResult r = RunCommand("/bin/sleep", {"30"}, std::chrono::milliseconds(200));
  EXPECT_TRUE(r.timed_out);
  EXPECT_NE(r.exit_code, 0);
}

TEST(RunStrataTest, CapturesBothStreamsAndExitCode) {
  CommandResult r = RunCommand("/bin/sh", {"-c", "echo out; echo err >&2; exit 3"});
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_EQ(r.out, "out\n");
  EXPECT_EQ(r.err, "err\n");
  EXPECT_FALSE(r.timed_out);
}

}  // namespace
}  // namespace strata::testing

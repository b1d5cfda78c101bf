// `strata nvme-bench` end to end: real runs on small files (results, verify, striping, cleanup,
// the --tune file loading as a config) and bad input (one clear line, a usage exit code, never a
// crash or a hang).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cli_test_util.h"
#include "strata/config.h"
#include "test_support.h"

namespace strata::testing {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

size_t CountEntries(const std::filesystem::path& dir) {
  size_t n = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    (void)entry;
    ++n;
  }
  return n;
}

// Exactly one non-empty line on stderr, starting with the command's prefix.
void ExpectOneErrorLine(const CommandResult& r, const std::string& needle) {
  std::vector<std::string> lines = NonEmptyLines(r.err);
  ASSERT_EQ(lines.size(), 1u) << r.err;
  EXPECT_THAT(lines[0], HasSubstr("strata nvme-bench: error: ")) << r.err;
  EXPECT_THAT(lines[0], HasSubstr(needle)) << r.err;
}

TEST(NvmeBenchTest, SmallRunReportsBothPhasesAndCleansUp) {
  TempDir dir;
  CommandResult r = RunStrata({"nvme-bench", "--path", dir.path().string(), "--size", "8M",
                               "--block", "1M", "--qd", "4", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json out = json::parse(r.out);
  ASSERT_EQ(out["results"].size(), 1u);
  const json& res = out["results"][0];
  EXPECT_EQ(res["block"], 1 << 20);
  EXPECT_EQ(res["queue_depth"], 4);
  ASSERT_EQ(res["phases"].size(), 2u);
  EXPECT_EQ(res["phases"][0]["op"], "write");
  EXPECT_EQ(res["phases"][1]["op"], "read");
  for (const json& p : res["phases"]) {
    EXPECT_EQ(p["bytes"], 8 << 20);
    EXPECT_EQ(p["requests"], 8);
    EXPECT_GT(p["gb_per_s"].get<double>(), 0);
    EXPECT_GT(p["latency_us"]["p99"].get<double>(), 0);
    EXPECT_GE(p["latency_us"]["p99"].get<double>(), p["latency_us"]["p50"].get<double>());
  }
  // The table went to stderr (stdout is only JSON), and the bench file is gone.
  EXPECT_THAT(r.err, HasSubstr("GB/s is 10^9 bytes per second"));
  EXPECT_EQ(CountEntries(dir.path()), 0u);
}

TEST(NvmeBenchTest, HumanTableOnStdout) {
  TempDir dir;
  CommandResult r = RunStrata(
      {"nvme-bench", "--path", dir.path().string(), "--size", "4M", "--rw", "write", "--qd", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("GB/s"));
  EXPECT_THAT(r.out, HasSubstr("p99 µs"));
  EXPECT_THAT(r.out, HasSubstr("write  seq"));
}

TEST(NvmeBenchTest, VerifyRandomOrderStripedOverThreeDirectories) {
  TempDir a, b, c;
  CommandResult r =
      RunStrata({"nvme-bench", "--path", a.path().string(), "--path", b.path().string(), "--path",
                 c.path().string(), "--size", "6M", "--block", "256K", "--stripe-unit", "128K",
                 "--qd", "8", "--pattern", "rand", "--verify", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json out = json::parse(r.out);
  const json& phases = out["results"][0]["phases"];
  ASSERT_EQ(phases.size(), 2u);
  // 256 KiB requests over 128 KiB stripes: two device requests each.
  EXPECT_EQ(phases[1]["device_requests"], 2 * phases[1]["requests"].get<int>());
  EXPECT_EQ(CountEntries(a.path()) + CountEntries(b.path()) + CountEntries(c.path()), 0u);
}

TEST(NvmeBenchTest, VerifyWithATimeLimitChecksWhatWasWritten) {
  // Each phase stops at its deadline, so the read phase may reach blocks the write phase did not;
  // it verifies exactly the blocks that hold the pattern and never reports false data loss.
  TempDir dir;
  CommandResult r =
      RunStrata({"nvme-bench", "--path", dir.path().string(), "--size", "256M", "--block", "1M",
                 "--qd", "4", "--pattern", "rand", "--verify", "--runtime", "0.2", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json out = json::parse(r.out);
  const json& phases = out["results"][0]["phases"];
  ASSERT_EQ(phases.size(), 2u);
  EXPECT_GT(phases[1]["verified_blocks"].get<int>(), 0);
  EXPECT_LE(phases[1]["verified_blocks"].get<int>(), phases[1]["requests"].get<int>());
}

TEST(NvmeBenchTest, ReadOnlyRunLaysTheFileOutFirstAndVerifies) {
  TempDir dir;
  CommandResult r = RunStrata({"nvme-bench", "--path", dir.path().string(), "--size", "4M", "--rw",
                               "read", "--verify", "--backend", "posix", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json out = json::parse(r.out);
  EXPECT_EQ(out["results"][0]["backend"], "posix");
  ASSERT_EQ(out["results"][0]["phases"].size(), 1u);
  EXPECT_EQ(out["results"][0]["phases"][0]["op"], "read");
  // The untimed layout pass wrote the pattern everywhere, so every block was checked.
  EXPECT_EQ(out["results"][0]["phases"][0]["verified_blocks"], 4);
}

TEST(NvmeBenchTest, KeepLeavesTheFileAndAnExistingFileIsReused) {
  TempDir dir;
  CommandResult r = RunStrata(
      {"nvme-bench", "--path", dir.path().string(), "--size", "2M", "--rw", "write", "--keep"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_EQ(CountEntries(dir.path()), 1u);
  const std::string file = std::filesystem::directory_iterator(dir.path())->path().string();
  EXPECT_EQ(std::filesystem::file_size(file), 2u << 20);
  // A file given as --path is used as it is and never removed.
  r = RunStrata({"nvme-bench", "--path", file, "--size", "2M", "--rw", "read"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(std::filesystem::exists(file));
}

TEST(NvmeBenchTest, TuneWritesALoadableConfig) {
  TempDir dir;
  const std::string tuned = dir.file("tuned.json");
  TempDir data;
  CommandResult r =
      RunStrata({"nvme-bench", "--path", data.path().string(), "--size", "4M", "--block", "256K,1M",
                 "--qd", "2,4", "--threads", "1", "--tune", "--tune-file", tuned, "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json out = json::parse(r.out);
  EXPECT_EQ(out["results"].size(), 4u);  // 2 blocks x 2 depths x 1 thread
  ASSERT_TRUE(out.contains("best"));
  Result<Config> config = LoadConfigFile(tuned);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->aio.block_size, out["best"]["block"].get<uint64_t>());
  EXPECT_EQ(static_cast<int64_t>(config->aio.queue_depth),
            out["best"]["queue_depth"].get<int64_t>());
  EXPECT_EQ(static_cast<int64_t>(config->strata.io.threads), 1);
  EXPECT_THAT(r.err, HasSubstr("best: block"));
}

TEST(NvmeBenchTest, TraceRecordsEveryMeasuredRequest) {
  TempDir data;
  TempDir out_dir;
  const std::string trace_path = out_dir.file("bench-trace.json");
  CommandResult r = RunStrata({"nvme-bench", "--path", data.path().string(), "--size", "8M",
                               "--block", "1M", "--qd", "2", "--threads", "2", "--pattern", "rand",
                               "--trace", trace_path, "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("trace: wrote " + trace_path));
  EXPECT_EQ(json::parse(r.out)["trace_file"], trace_path);

  std::vector<char> bytes = ReadWholeFile(trace_path);
  const json doc = json::parse(std::string(bytes.begin(), bytes.end()));
  EXPECT_EQ(doc["displayTimeUnit"], "ms");
  std::map<int, std::string> tracks;  // tid -> name
  for (const json& e : doc["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") tracks[e["tid"]] = e["args"]["name"];
  }
  // One track per in-flight slot (2 threads x qd 2), and one for the phases.
  std::set<std::string> names;
  for (const auto& [tid, name] : tracks)
    names.insert(name);
  EXPECT_EQ(names, (std::set<std::string>{"io slot 0", "io slot 1", "io slot 2", "io slot 3",
                                          "nvme-bench"}));

  std::map<std::string, std::set<uint64_t>> offsets;            // op -> offsets transferred
  std::map<int, std::vector<std::pair<double, double>>> spans;  // tid -> (ts, end) of requests
  std::vector<std::string> phases;
  for (const json& e : doc["traceEvents"]) {
    if (e["ph"] != "X") continue;
    ASSERT_TRUE(tracks.count(e["tid"].get<int>())) << e.dump();
    EXPECT_GE(e["ts"].get<double>(), 0.0);
    EXPECT_GE(e["dur"].get<double>(), 0.0);
    if (e["cat"] == "bench") {
      phases.push_back(e["name"]);
      continue;
    }
    EXPECT_EQ(e["cat"], "io") << e.dump();
    EXPECT_THAT(tracks[e["tid"]], ::testing::StartsWith("io slot ")) << e.dump();
    EXPECT_EQ(e["args"]["bytes"], 1 << 20);
    const auto offset = e["args"]["offset"].get<uint64_t>();
    EXPECT_EQ(offset % (1 << 20), 0u);
    EXPECT_LT(offset, 8u << 20);
    offsets[e["name"]].insert(offset);
    const double ts = e["ts"].get<double>();
    spans[e["tid"]].push_back({ts, ts + e["dur"].get<double>()});
  }
  // Every block once per measured phase; the untimed lay-out pass is not traced.
  ASSERT_EQ(offsets.size(), 2u);
  EXPECT_EQ(offsets["write"].size(), 8u);
  EXPECT_EQ(offsets["read"].size(), 8u);
  size_t requests = 0;
  for (auto& [tid, list] : spans) {
    requests += list.size();
    // A slot's requests run back to back: no two overlap on one track (1 ns slack for rounding).
    std::sort(list.begin(), list.end());
    for (size_t i = 1; i < list.size(); ++i)
      EXPECT_LE(list[i - 1].second, list[i].first + 1e-3) << "track " << tracks[tid];
  }
  EXPECT_EQ(requests, 16u);
  EXPECT_THAT(phases, ::testing::ElementsAre("write block 1 MiB qd 2 threads 2",
                                             "read block 1 MiB qd 2 threads 2"));
}

TEST(NvmeBenchTest, TraceIntoAMissingDirectoryFailsBeforeRunning) {
  TempDir data;
  CommandResult r = RunStrata({"nvme-bench", "--path", data.path().string(), "--size", "4M",
                               "--trace", "/nonexistent/strata/trace.json"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  ExpectOneErrorLine(r, "--trace /nonexistent/strata/trace.json");
  EXPECT_EQ(CountEntries(data.path()), 0u);
}

TEST(NvmeBenchTest, MissingPathIsOneLine) {
  CommandResult r = RunStrata({"nvme-bench", "--path", "/nonexistent/strata-bench"});
  EXPECT_EQ(r.exit_code, 2);
  ExpectOneErrorLine(r, "--path /nonexistent/strata-bench: No such file or directory");
}

TEST(NvmeBenchTest, SizeThatIsNotANumberIsOneLine) {
  TempDir dir;
  CommandResult r = RunStrata({"nvme-bench", "--path", dir.path().string(), "--size", "lots"});
  EXPECT_EQ(r.exit_code, 2);
  std::vector<std::string> lines = NonEmptyLines(r.err);
  ASSERT_EQ(lines.size(), 1u) << r.err;
  EXPECT_THAT(lines[0], HasSubstr("--size"));
  EXPECT_THAT(lines[0], HasSubstr("'lots' is not a byte size"));
}

TEST(NvmeBenchTest, BlockNotAMultipleOf4KiBIsOneLine) {
  TempDir dir;
  CommandResult r = RunStrata({"nvme-bench", "--path", dir.path().string(), "--block", "1000"});
  EXPECT_EQ(r.exit_code, 2);
  ExpectOneErrorLine(r, "--block 1000: must be a positive multiple of 4 KiB (4096 bytes)");
}

TEST(NvmeBenchTest, SeveralValuesNeedSweep) {
  TempDir dir;
  CommandResult r = RunStrata({"nvme-bench", "--path", dir.path().string(), "--qd", "4,8"});
  EXPECT_EQ(r.exit_code, 2);
  ExpectOneErrorLine(r, "need --sweep");
}

TEST(NvmeBenchTest, SizeSmallerThanBlockIsOneLine) {
  TempDir dir;
  CommandResult r =
      RunStrata({"nvme-bench", "--path", dir.path().string(), "--size", "64K", "--block", "1M"});
  EXPECT_EQ(r.exit_code, 2);
  ExpectOneErrorLine(r, "is smaller than --block 1 MiB");
}

TEST(NvmeBenchTest, BadChoiceIsUsageError) {
  TempDir dir;
  CommandResult r = RunStrata({"nvme-bench", "--path", dir.path().string(), "--rw", "sideways"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(NonEmptyLines(r.err).size(), 1u) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--rw"));
}

TEST(NvmeBenchTest, ReadOnlyDirectoryIsOneLine) {
  TempDir dir;
  bool mounted = false;
  if (IsRoot()) {
    // Root writes through permission bits, so use a read-only mount instead.
    if (::mount("strata-ro", dir.path().c_str(), "tmpfs", MS_RDONLY, nullptr) != 0) {
      GTEST_SKIP() << "cannot mount a read-only tmpfs here: " << std::strerror(errno);
    }
    mounted = true;
  } else {
    std::filesystem::permissions(
        dir.path(), std::filesystem::perms::owner_read | std::filesystem::perms::owner_exec);
  }
  CommandResult r = RunStrata({"nvme-bench", "--path", dir.path().string(), "--size", "4M"});
  if (mounted) ::umount2(dir.path().c_str(), MNT_DETACH);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  ExpectOneErrorLine(r, "cannot open " + dir.path().string());
  EXPECT_TRUE(r.err.find("Read-only file system") != std::string::npos ||
              r.err.find("Permission denied") != std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace strata::testing

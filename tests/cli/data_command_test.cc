// `strata data synth` end to end: the file it writes (size, format, determinism, ids in vocab),
// its final line, and bad input (one clear line, a usage exit code, nothing left behind).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "test_support.h"

namespace strata::testing {
namespace {

using ::testing::HasSubstr;

void ExpectOneErrorLine(const CommandResult& r, const std::string& needle) {
  EXPECT_EQ(r.exit_code, 2) << r.err;
  std::vector<std::string> lines = NonEmptyLines(r.err);
  ASSERT_EQ(lines.size(), 1u) << r.err;
  EXPECT_THAT(lines[0], HasSubstr("strata data synth: error: ")) << r.err;
  EXPECT_THAT(lines[0], HasSubstr(needle)) << r.err;
}

std::vector<uint16_t> ReadUint16(const std::string& path, size_t offset) {
  std::vector<char> bytes = ReadWholeFile(path);
  std::vector<uint16_t> out((bytes.size() - offset) / 2);
  std::memcpy(out.data(), bytes.data() + offset, out.size() * 2);
  return out;
}

TEST(DataSynthTest, WritesRawTokensDeterministically) {
  TempDir dir;
  const std::string a = dir.file("a.bin");
  const std::string b = dir.file("b.bin");
  const std::string c = dir.file("c.bin");
  CommandResult r =
      RunStrata({"data", "synth", "--out", a, "--tokens", "10k", "--vocab", "500", "--seed", "4"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("wrote 10000 tokens (vocab 500, seed 4, uint16 raw) to " + a));
  EXPECT_EQ(r.err, "");
  EXPECT_EQ(std::filesystem::file_size(a), 20000u);
  ASSERT_EQ(
      RunStrata({"data", "synth", "--out", b, "--tokens", "10000", "--vocab", "500", "--seed", "4"})
          .exit_code,
      0);
  ASSERT_EQ(
      RunStrata({"data", "synth", "--out", c, "--tokens", "10000", "--vocab", "500", "--seed", "5"})
          .exit_code,
      0);
  EXPECT_EQ(ReadWholeFile(a), ReadWholeFile(b));
  EXPECT_NE(ReadWholeFile(a), ReadWholeFile(c));
  for (uint16_t t : ReadUint16(a, 0))
    ASSERT_LT(t, 500);
  // Only the three outputs: no temporary files left behind.
  size_t entries = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    (void)entry;
    ++entries;
  }
  EXPECT_EQ(entries, 3u);
}

TEST(DataSynthTest, WritesNpyWithTheRequestedDtype) {
  TempDir dir;
  const std::string path = dir.file("t.npy");
  CommandResult r = RunStrata({"data", "synth", "--out", path, "--tokens", "1000", "--vocab",
                               "70000", "--dtype", "uint32"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<char> bytes = ReadWholeFile(path);
  ASSERT_GT(bytes.size(), 4000u);
  EXPECT_EQ(std::string(bytes.data(), 6), "\x93NUMPY");
  const size_t header = 10 + (static_cast<unsigned char>(bytes[8]) |
                              (static_cast<size_t>(static_cast<unsigned char>(bytes[9])) << 8));
  EXPECT_EQ(header % 64, 0u);
  const std::string dict(bytes.data() + 10, header - 10);
  EXPECT_THAT(dict, HasSubstr("'descr': '<u4'"));
  EXPECT_THAT(dict, HasSubstr("'shape': (1000,)"));
  EXPECT_EQ(bytes.size(), header + 4000);
  // A vocab above 65536 picks uint32 by itself.
  CommandResult autodtype = RunStrata(
      {"data", "synth", "--out", dir.file("u.bin"), "--tokens", "10", "--vocab", "70000"});
  ASSERT_EQ(autodtype.exit_code, 0) << autodtype.err;
  EXPECT_THAT(autodtype.out, HasSubstr("uint32"));
  EXPECT_EQ(std::filesystem::file_size(dir.file("u.bin")), 40u);
}

TEST(DataSynthTest, BadFlagsAreOneLineUsageErrors) {
  TempDir dir;
  const std::string out = dir.file("x.bin");
  ExpectOneErrorLine(
      RunStrata({"data", "synth", "--out", dir.file("x.txt"), "--tokens", "10", "--vocab", "10"}),
      ".bin");
  ExpectOneErrorLine(RunStrata({"data", "synth", "--out", out, "--tokens", "ten", "--vocab", "10"}),
                     "--tokens 'ten'");
  ExpectOneErrorLine(RunStrata({"data", "synth", "--out", out, "--tokens", "0", "--vocab", "10"}),
                     "--tokens '0'");
  ExpectOneErrorLine(RunStrata({"data", "synth", "--out", out, "--tokens", "10", "--vocab", "0"}),
                     "--vocab 0");
  ExpectOneErrorLine(RunStrata({"data", "synth", "--out", out, "--tokens", "10", "--vocab", "-4"}),
                     "--vocab -4");
  ExpectOneErrorLine(RunStrata({"data", "synth", "--out", out, "--tokens", "10", "--vocab", "70000",
                                "--dtype", "uint16"}),
                     "does not fit --dtype uint16");
  ExpectOneErrorLine(RunStrata({"data", "synth", "--out", out, "--tokens", "10", "--vocab", "10",
                                "--dtype", "float"}),
                     "--dtype");
  ExpectOneErrorLine(RunStrata({"data", "synth", "--tokens", "10", "--vocab", "10"}), "--out");
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));

  CommandResult no_sub = RunStrata({"data"});
  EXPECT_EQ(no_sub.exit_code, 2);
  EXPECT_EQ(NonEmptyLines(no_sub.err).size(), 1u) << no_sub.err;
}

TEST(DataSynthTest, MissingDirectoryNamesThePath) {
  TempDir dir;
  const std::string missing = dir.file("no/such/dir/x.bin");
  CommandResult r =
      RunStrata({"data", "synth", "--out", missing, "--tokens", "10", "--vocab", "10"});
  ExpectOneErrorLine(r, missing);
  EXPECT_THAT(r.err, HasSubstr("No such file or directory"));
}

TEST(DataSynthTest, ReadOnlyDirectoryNamesThePath) {
  if (IsRoot()) GTEST_SKIP() << "root writes into a read-only directory";
  TempDir dir;
  const std::filesystem::path ro = dir.path() / "ro";
  std::filesystem::create_directory(ro);
  ASSERT_EQ(::chmod(ro.c_str(), 0555), 0);
  CommandResult denied = RunStrata(
      {"data", "synth", "--out", (ro / "x.bin").string(), "--tokens", "10", "--vocab", "10"});
  ::chmod(ro.c_str(), 0755);
  ExpectOneErrorLine(denied, (ro / "x.bin").string());
  EXPECT_THAT(denied.err, HasSubstr("Permission denied"));
}

TEST(DataSynthTest, HelpListsTheCommand) {
  CommandResult r = RunStrata({"--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, HasSubstr("data"));
  CommandResult synth = RunStrata({"data", "synth", "--help"});
  EXPECT_EQ(synth.exit_code, 0);
  EXPECT_THAT(synth.out, HasSubstr("--vocab"));
  EXPECT_THAT(synth.out, HasSubstr("Markov"));
}

}  // namespace
}  // namespace strata::testing

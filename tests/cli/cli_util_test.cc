#include "cli/cli_util.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace strata::cli {
namespace {

using ::testing::HasSubstr;

// Everything written to a temporary FILE*.
class CapturedFile {
 public:
  CapturedFile() : file_(std::tmpfile()) {}
  ~CapturedFile() {
    if (file_ != nullptr) std::fclose(file_);
  }
  std::FILE* get() const { return file_; }
  std::string Text() const {
    std::fflush(file_);
    std::string out;
    std::rewind(file_);
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), file_)) > 0)
      out.append(buf, n);
    std::fseek(file_, 0, SEEK_END);
    return out;
  }

 private:
  std::FILE* file_;
};

TEST(ExitCodeTest, UsageErrorsAreTwoOthersOne) {
  EXPECT_EQ(ExitCodeFor(Status::Ok()), 0);
  EXPECT_EQ(ExitCodeFor(InvalidArgumentError("x")), 2);
  EXPECT_EQ(ExitCodeFor(NotFoundError("x")), 2);
  EXPECT_EQ(ExitCodeFor(PermissionDeniedError("x")), 2);
  EXPECT_EQ(ExitCodeFor(FailedPreconditionError("x")), 2);
  EXPECT_EQ(ExitCodeFor(ResourceExhaustedError("x")), 1);
  EXPECT_EQ(ExitCodeFor(DataLossError("x")), 1);
  EXPECT_EQ(ExitCodeFor(InternalError("x")), 1);
  EXPECT_EQ(ExitCodeFor(UnimplementedError("x")), 1);
}

TEST(ExitCodeTest, ReportErrorReturnsTheCode) {
  // The line goes to stderr; here only the returned code is checked (the CLI tests check text).
  EXPECT_EQ(ReportError("env", NotFoundError("--path /x: missing")), 2);
  EXPECT_EQ(ReportError("", DataLossError("EIO")), 1);
}

TEST(TableTest, AlignsColumns) {
  Table t({"size", "GB/s"}, {Table::kLeft, Table::kRight});
  t.AddRow({"4 KiB", "0.41"});
  t.AddRow({"1 MiB", "12.50"});
  EXPECT_EQ(t.Render(),
            "size    GB/s\n"
            "-----  -----\n"
            "4 KiB   0.41\n"
            "1 MiB  12.50\n");
}

TEST(TableTest, NoHeaderShortRowsIndentAndNoTrailingBlanks) {
  Table t;
  t.AddRow({"key", "value"});
  t.AddRow({"longer key"});
  EXPECT_EQ(t.Render("  "),
            "  key         value\n"
            "  longer key\n");
}

TEST(TableTest, CountsUtf8CodePoints) {
  Table t({"lat", "x"});
  t.set_rule(false);
  t.AddRow({"5 µs", "a"});
  t.AddRow({"10 ms", "b"});
  EXPECT_EQ(t.Render(),
            "lat    x\n"
            "5 µs   a\n"
            "10 ms  b\n");
  EXPECT_EQ(DisplayWidth("µs"), 2u);
}

TEST(TableTest, PrintWritesRender) {
  CapturedFile f;
  Table t({"a"});
  t.AddRow({"1"});
  t.Print(f.get());
  EXPECT_EQ(f.Text(), t.Render());
}

TEST(ByteSizeTest, TransformsToBytes) {
  CLI::App app("test");
  uint64_t size = 0;
  std::vector<uint64_t> sizes;
  app.add_option("--size", size)->transform(ByteSize());
  app.add_option("--sizes", sizes)->delimiter(',')->transform(ByteSize());
  app.parse(std::vector<std::string>{"--sizes=4K,1MiB,2GB", "--size=4MiB"});
  EXPECT_EQ(size, uint64_t{4} << 20);
  EXPECT_EQ(sizes, (std::vector<uint64_t>{4096, 1 << 20, 2000000000}));
}

TEST(ByteSizeTest, RejectsWithParseByteSizeMessage) {
  CLI::App app("test");
  uint64_t size = 0;
  app.add_option("--size", size)->transform(ByteSize());
  try {
    app.parse(std::vector<std::string>{"--size=12Q"});
    FAIL() << "12Q was accepted";
  } catch (const CLI::ValidationError& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("--size"));
    EXPECT_THAT(std::string(e.what()), HasSubstr("'12Q' is not a byte size"));
  }
}

TEST(ProgressLineTest, TerminalRewritesOneLine) {
  CapturedFile f;
  {
    ProgressLine p(f.get(), std::chrono::seconds(5), ProgressLine::Mode::kTerminal);
    EXPECT_TRUE(p.terminal());
    p.Update("10%");
    p.Update("20%");
    p.Finish("done");
  }
  EXPECT_EQ(f.Text(), "\r10%\033[K\r20%\033[K\rdone\033[K\n");
}

TEST(ProgressLineTest, TerminalLineIsEndedOnDestruction) {
  CapturedFile f;
  {
    ProgressLine p(f.get(), std::chrono::seconds(5), ProgressLine::Mode::kTerminal);
    p.Update("half");
  }
  EXPECT_EQ(f.Text(), "\rhalf\033[K\n");
}

TEST(ProgressLineTest, TerminalClearErasesTheLine) {
  CapturedFile f;
  ProgressLine p(f.get(), std::chrono::seconds(5), ProgressLine::Mode::kTerminal);
  p.Update("x");
  p.Clear();
  p.Clear();  // nothing on screen: no output
  EXPECT_EQ(f.Text(), "\rx\033[K\r\033[K");
}

TEST(ProgressLineTest, LinesModeThrottles) {
  CapturedFile f;
  ProgressLine p(f.get(), std::chrono::hours(1), ProgressLine::Mode::kLines);
  EXPECT_FALSE(p.terminal());
  p.Update("first");   // printed: nothing was printed yet
  p.Update("second");  // within the interval: dropped
  p.Finish("done");    // always printed
  EXPECT_EQ(f.Text(), "first\ndone\n");
}

TEST(ProgressLineTest, LinesModeWithZeroIntervalPrintsEveryUpdate) {
  CapturedFile f;
  ProgressLine p(f.get(), std::chrono::milliseconds(0), ProgressLine::Mode::kLines);
  p.Update("a");
  p.Update("b");
  EXPECT_EQ(f.Text(), "a\nb\n");
}

TEST(ProgressLineTest, AutoModeOnAFileIsLines) {
  CapturedFile f;
  ProgressLine p(f.get());
  EXPECT_FALSE(p.terminal());
}

}  // namespace
}  // namespace strata::cli

#include "train/report.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "test_support.h"

namespace strata::train {
namespace {

using strata::testing::TempDir;

size_t Count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

void WriteMetrics(const std::string& path, int steps, bool nvme) {
  std::ofstream out(path);
  for (int i = 1; i <= steps; ++i) {
    out << "{\"step\": " << i << ", \"loss\": " << 5.0 - 0.1 * i
        << ", \"tokens_per_s\": 1000, \"step_s\": 0.5, \"compute_s\": 0.3, \"exposed_comm_s\": "
           "0.1, \"exposed_io_s\": 0.05, \"exposed_optimizer_s\": 0.05, \"nvme_read_bytes\": "
        << (nvme ? 1 << 20 : 0) << ", \"nvme_write_bytes\": 0, \"device_peak_bytes\": 1048576, "
           "\"host_peak_bytes\": 2048}\n";
  }
}

TEST(ReportTest, OnePageWithEveryChart) {
  TempDir dir;
  const std::string metrics = dir.file("m.jsonl");
  WriteMetrics(metrics, 12, /*nvme=*/true);
  auto html = RenderReport({.metrics_path = metrics, .title = "run <1>"});
  ASSERT_TRUE(html.ok()) << html.status().ToString();
  for (const char* title : {"<h2>Loss</h2>", "<h2>Tokens per second</h2>",
                            "<h2>Step time split</h2>", "<h2>NVMe bytes per step</h2>",
                            "<h2>Peak memory per tier</h2>"}) {
    EXPECT_NE(html->find(title), std::string::npos) << title;
  }
  EXPECT_EQ(Count(*html, "<svg "), 5u);
  EXPECT_EQ(Count(*html, "<polyline"), 1u + 1u + 2u + 2u);  // loss, tok/s, nvme x2, memory x2
  // The bars, then the legends' swatches (loss 1, tokens/s 1, split 4, NVMe 2, memory 2).
  EXPECT_EQ(Count(*html, "<rect x="), 12u * 4u + 1u + 1u + 4u + 2u + 2u);
  EXPECT_NE(html->find("<title>run &lt;1&gt;</title>"), std::string::npos);  // escaped
  EXPECT_NE(html->find("4.9000 &rarr; 3.8000"), std::string::npos);
  EXPECT_EQ(html->find("<script"), std::string::npos);  // self-contained, static
  EXPECT_EQ(html->find("http://") , html->find("http://www.w3.org/2000/svg"));  // nothing fetched
}

TEST(ReportTest, ResumedRunsKeepTheLastRowOfAStepAndNoNvmeSaysSo) {
  TempDir dir;
  const std::string metrics = dir.file("m.jsonl");
  WriteMetrics(metrics, 4, /*nvme=*/false);
  {
    std::ofstream out(metrics, std::ios::app);
    out << "{\"step\": 4, \"loss\": 1.25}\n";  // a resumed run rewrote step 4
  }
  auto html = RenderReport({.metrics_path = metrics});
  ASSERT_TRUE(html.ok()) << html.status().ToString();
  EXPECT_NE(html->find("(4 steps)"), std::string::npos);
  EXPECT_NE(html->find("&rarr; 1.2500"), std::string::npos);
  EXPECT_NE(html->find("No NVMe traffic"), std::string::npos);
  EXPECT_EQ(Count(*html, "<svg "), 4u);
}

TEST(ReportTest, BadInputNamesTheFileAndLine) {
  TempDir dir;
  auto missing = RenderReport({.metrics_path = dir.file("none.jsonl")});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("none.jsonl: cannot open"), std::string::npos);
  const std::string bad = dir.file("bad.jsonl");
  {
    std::ofstream out(bad);
    out << "{\"step\": 1, \"loss\": 2}\n\nnot json\n";
  }
  auto parsed = RenderReport({.metrics_path = bad});
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("bad.jsonl:3: not a step"), std::string::npos)
      << parsed.status().ToString();
  const std::string empty = dir.file("empty.jsonl");
  { std::ofstream out(empty); }
  EXPECT_NE(RenderReport({.metrics_path = empty}).status().message().find("no steps"),
            std::string::npos);
  WriteMetrics(bad, 2, false);
  const std::string trace = dir.file("t.json");
  {
    std::ofstream out(trace);
    out << "{broken";
  }
  auto t = RenderReport({.metrics_path = bad, .trace_path = trace});
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("not a Chrome trace"), std::string::npos);
  // The written page replaces the target whole; an unwritable target leaves nothing behind.
  EXPECT_TRUE(WriteReport({.metrics_path = bad}, dir.file("r.html")).ok());
  EXPECT_FALSE(WriteReport({.metrics_path = bad}, dir.file("no/such/dir/r.html")).ok());
}

}  // namespace
}  // namespace strata::train

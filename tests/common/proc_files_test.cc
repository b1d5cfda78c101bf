#include "common/proc_files.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace strata::procfs {
namespace {

std::vector<std::string> Collect(std::string_view text) {
  std::vector<std::string> out;
  for (std::string_view line : Lines(text))
    out.emplace_back(line);
  return out;
}

TEST(LinesTest, SplitsOnNewlinesWithoutThem) {
  EXPECT_EQ(Collect("a\nbb\n\nccc"), (std::vector<std::string>{"a", "bb", "", "ccc"}));
  EXPECT_EQ(Collect("one\n"), (std::vector<std::string>{"one"}));
  EXPECT_TRUE(Collect("").empty());
  EXPECT_EQ(Collect("\n"), (std::vector<std::string>{""}));
}

TEST(MeminfoFieldTest, FindsTheKeyOnItsOwnLine) {
  const std::string text =
      "MemTotal:       24684092 kB\nHugePages_Total:      80\nHugepagesize:    2048 kB\n";
  EXPECT_EQ(MeminfoField(text, "MemTotal"), 24684092u);
  EXPECT_EQ(MeminfoField(text, "HugePages_Total"), 80u);
  EXPECT_EQ(MeminfoField(text, "Hugepagesize"), 2048u);
  EXPECT_FALSE(MeminfoField(text, "HugePages").has_value());  // a prefix is not the key
  EXPECT_FALSE(MeminfoField(text, "Missing").has_value());
}

}  // namespace
}  // namespace strata::procfs

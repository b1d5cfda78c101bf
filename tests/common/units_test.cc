#include "common/units.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace strata {
namespace {

using ::testing::HasSubstr;

uint64_t Parse(std::string_view text) {
  Result<uint64_t> r = ParseByteSize(text);
  EXPECT_TRUE(r.ok()) << text << ": " << r.status().ToString();
  return r.value_or(~uint64_t{0});
}

Status ParseError(std::string_view text) {
  Result<uint64_t> r = ParseByteSize(text);
  EXPECT_FALSE(r.ok()) << "'" << text << "' was accepted as " << r.value_or(0);
  return r.ok() ? Status::Ok() : r.status();
}

TEST(ParseByteSizeTest, PlainAndScientific) {
  EXPECT_EQ(Parse("0"), 0u);
  EXPECT_EQ(Parse("1048576"), 1048576u);
  EXPECT_EQ(Parse("5e8"), 500000000u);
  EXPECT_EQ(Parse("1E3"), 1000u);
  EXPECT_EQ(Parse("2.5e3"), 2500u);
  EXPECT_EQ(Parse("1e+3"), 1000u);
}

TEST(ParseByteSizeTest, BinaryUnits) {
  EXPECT_EQ(Parse("1K"), 1024u);
  EXPECT_EQ(Parse("512K"), 512u * 1024);
  EXPECT_EQ(Parse("4MiB"), 4u << 20);
  EXPECT_EQ(Parse("4M"), 4u << 20);
  EXPECT_EQ(Parse("2G"), uint64_t{2} << 30);
  EXPECT_EQ(Parse("2GiB"), uint64_t{2} << 30);
  EXPECT_EQ(Parse("1T"), uint64_t{1} << 40);
  EXPECT_EQ(Parse("1TiB"), uint64_t{1} << 40);
  EXPECT_EQ(Parse("10B"), 10u);
}

TEST(ParseByteSizeTest, DecimalUnits) {
  EXPECT_EQ(Parse("1kB"), 1000u);
  EXPECT_EQ(Parse("2MB"), 2000000u);
  EXPECT_EQ(Parse("2GB"), 2000000000u);
  EXPECT_EQ(Parse("3TB"), uint64_t{3000000000000});
}

TEST(ParseByteSizeTest, UnitCaseDoesNotMatter) {
  EXPECT_EQ(Parse("4mib"), 4u << 20);
  EXPECT_EQ(Parse("4MIB"), 4u << 20);
  EXPECT_EQ(Parse("1k"), 1024u);
  EXPECT_EQ(Parse("1b"), 1u);
  // "KB" is the decimal kB in any case; only K and KiB are binary.
  EXPECT_EQ(Parse("1KB"), 1000u);
}

TEST(ParseByteSizeTest, FractionsThatAreWholeBytes) {
  EXPECT_EQ(Parse("1.5K"), 1536u);
  EXPECT_EQ(Parse("0.5MiB"), 512u * 1024);
  EXPECT_EQ(Parse("1.25GB"), 1250000000u);
}

TEST(ParseByteSizeTest, RejectsMalformedTextNamingIt) {
  for (const char* bad : {"", "abc", "-1", "1 K", " 1K", "1K ", "12Q", "K", "1KK", "0x10", "nan",
                          "inf", ".5K", "1e", "1,5K", "+1"}) {
    Status st = ParseError(bad);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(st.message(), HasSubstr("'" + std::string(bad) + "'")) << bad;
  }
  Status st = ParseError("12Q");
  EXPECT_THAT(st.message(), HasSubstr("is not a byte size"));
  EXPECT_THAT(st.message(), HasSubstr("expected"));
  EXPECT_THAT(st.message(), HasSubstr("4MiB"));
}

TEST(ParseByteSizeTest, RejectsFractionalBytes) {
  Status st = ParseError("1.5");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("not a whole number of bytes"));
  EXPECT_THAT(ParseError("1.1K").message(), HasSubstr("'1.1K'"));
  EXPECT_THAT(ParseError("0.1").message(), HasSubstr("whole number"));
}

TEST(ParseByteSizeTest, RejectsTooLarge) {
  EXPECT_THAT(ParseError("18446744073709551616").message(), HasSubstr("too large"));
  EXPECT_THAT(ParseError("16777216T").message(), HasSubstr("too large"));  // 2^64
  EXPECT_THAT(ParseError("1e30").message(), HasSubstr("'1e30'"));
  EXPECT_FALSE(ParseByteSize("1e999999").ok());  // overflows to infinity
  EXPECT_EQ(Parse("16777215T"), (uint64_t{16777215}) << 40);
}

TEST(ParseByteSizeListTest, ParsesEachElement) {
  Result<std::vector<uint64_t>> r = ParseByteSizeList("256K,1M,4M");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, (std::vector<uint64_t>{256 * 1024, 1 << 20, 4 << 20}));
  Result<std::vector<uint64_t>> one = ParseByteSizeList("1e9");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(*one, std::vector<uint64_t>{1000000000});
}

TEST(ParseByteSizeListTest, RejectsBadOrEmptyElements) {
  Result<std::vector<uint64_t>> bad = ParseByteSizeList("1M,bad,4M");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("'bad'"));
  EXPECT_FALSE(ParseByteSizeList("").ok());
  EXPECT_FALSE(ParseByteSizeList("1M,,2M").ok());
  EXPECT_FALSE(ParseByteSizeList("1M,").ok());
  EXPECT_FALSE(ParseByteSizeList(",1M").ok());
}

TEST(FormatBytesTest, BinaryUnitsWithTwoDecimals) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1), "1 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1024), "1.00 KiB");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(512 * 1024), "512.00 KiB");
  EXPECT_EQ(FormatBytes(1 << 20), "1.00 MiB");
  EXPECT_EQ(FormatBytes(uint64_t{3} << 30), "3.00 GiB");
  EXPECT_EQ(FormatBytes(uint64_t{1} << 40), "1.00 TiB");
  EXPECT_EQ(FormatBytes(uint64_t{1} << 50), "1.00 PiB");
  // Beyond PiB the number grows instead of the unit.
  EXPECT_EQ(FormatBytes(uint64_t{1} << 60), "1024.00 PiB");
}

TEST(FormatBytesTest, ExactForm) {
  EXPECT_EQ(FormatBytesExact(0), "0 B");
  EXPECT_EQ(FormatBytesExact(1536), "1536 B");
  EXPECT_EQ(FormatBytesExact(4096), "4 KiB");
  EXPECT_EQ(FormatBytesExact(1 << 20), "1 MiB");
  EXPECT_EQ(FormatBytesExact(1536 * 1024), "1536 KiB");
  EXPECT_EQ(FormatBytesExact(uint64_t{3} << 30), "3 GiB");
  EXPECT_EQ(FormatBytesExact(uint64_t{1} << 40), "1 TiB");
  EXPECT_EQ(FormatBytesExact(uint64_t{1} << 50), "1024 TiB");
}

TEST(FormatBytesTest, RoundTripsThroughParse) {
  for (uint64_t v : {uint64_t{4096}, uint64_t{1} << 20, uint64_t{1536}, uint64_t{7} << 30}) {
    std::string text = FormatBytesExact(v);
    text.erase(text.find(' '), 1);  // "4 KiB" -> "4KiB"
    EXPECT_EQ(Parse(text), v) << text;
  }
}

TEST(AlignmentTest, RoundUpAndIsAligned) {
  static_assert(RoundUp(0, 4096) == 0);
  EXPECT_EQ(RoundUp(1, 4096), 4096u);
  EXPECT_EQ(RoundUp(4096, 4096), 4096u);
  EXPECT_EQ(RoundUp(4097, 4096), 8192u);
  EXPECT_EQ(RoundUp(10, 3), 12u);  // any positive alignment
  EXPECT_EQ(RoundUp(7, 1), 7u);
  EXPECT_TRUE(IsAligned(0, 4096));
  EXPECT_TRUE(IsAligned(8192, 4096));
  EXPECT_FALSE(IsAligned(4095, 4096));
  EXPECT_TRUE(IsAligned(12, 3));
}

}  // namespace
}  // namespace strata

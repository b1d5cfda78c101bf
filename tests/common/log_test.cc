#include "common/log.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

namespace strata::log {
namespace {

using ::testing::HasSubstr;

// Each test starts from "info everywhere" and leaves it that way.
class LogTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(Configure("info").ok()); }
  void TearDown() override { ASSERT_TRUE(Configure("info").ok()); }
};

TEST_F(LogTest, GlobalLevel) {
  ASSERT_TRUE(Configure("debug").ok());
  EXPECT_TRUE(Enabled(Subsystem::io, Level::debug));
  EXPECT_TRUE(Enabled(Subsystem::config, Level::error));
  EXPECT_FALSE(Enabled(Subsystem::io, Level::trace));

  ASSERT_TRUE(Configure("off").ok());
  EXPECT_FALSE(Enabled(Subsystem::core, Level::error));
  EXPECT_FALSE(Enabled(Subsystem::bench, Level::error));
}

TEST_F(LogTest, EmptySpecMeansInfo) {
  ASSERT_TRUE(Configure("trace").ok());
  ASSERT_TRUE(Configure("").ok());
  EXPECT_TRUE(Enabled(Subsystem::io, Level::info));
  EXPECT_FALSE(Enabled(Subsystem::io, Level::debug));
}

TEST_F(LogTest, PerSubsystemOverrides) {
  ASSERT_TRUE(Configure("warn,io=debug").ok());
  EXPECT_TRUE(Enabled(Subsystem::io, Level::debug));
  EXPECT_FALSE(Enabled(Subsystem::io, Level::trace));
  EXPECT_FALSE(Enabled(Subsystem::config, Level::info));
  EXPECT_TRUE(Enabled(Subsystem::config, Level::warn));
  EXPECT_FALSE(Enabled(Subsystem::device, Level::info));
}

TEST_F(LogTest, OverridesWinWhateverTheirPosition) {
  ASSERT_TRUE(Configure("io=trace,error").ok());
  EXPECT_TRUE(Enabled(Subsystem::io, Level::trace));
  EXPECT_FALSE(Enabled(Subsystem::core, Level::warn));
  EXPECT_TRUE(Enabled(Subsystem::core, Level::error));
}

TEST_F(LogTest, SpacesAndEmptyPartsAreTolerated) {
  ASSERT_TRUE(Configure(" warn , io=debug ,").ok());
  EXPECT_TRUE(Enabled(Subsystem::io, Level::debug));
  EXPECT_FALSE(Enabled(Subsystem::cli, Level::info));
}

TEST_F(LogTest, SynonymsForLevels) {
  ASSERT_TRUE(Configure("warning").ok());
  EXPECT_TRUE(Enabled(Subsystem::core, Level::warn));
  EXPECT_FALSE(Enabled(Subsystem::core, Level::info));
  ASSERT_TRUE(Configure("none").ok());
  EXPECT_FALSE(Enabled(Subsystem::core, Level::error));
}

TEST_F(LogTest, BadLevelIsRejectedAndLevelsAreKept) {
  ASSERT_TRUE(Configure("warn,io=debug").ok());
  Status st = Configure("verbose");
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("'verbose' is not a level"));
  EXPECT_THAT(st.message(), HasSubstr("STRATA_LOG_LEVEL"));
  // Unchanged.
  EXPECT_TRUE(Enabled(Subsystem::io, Level::debug));
  EXPECT_FALSE(Enabled(Subsystem::config, Level::info));
}

TEST_F(LogTest, BadSubsystemIsRejectedWithTheList) {
  Status st = Configure("info,disk=debug");
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("'disk' is not a subsystem"));
  EXPECT_THAT(st.message(), HasSubstr("io"));
  EXPECT_THAT(st.message(), HasSubstr("bench"));
  EXPECT_FALSE(Enabled(Subsystem::io, Level::debug));
}

TEST_F(LogTest, BadLevelForASubsystemNamesBoth) {
  Status st = Configure("io=loud");
  ASSERT_FALSE(st.ok());
  EXPECT_THAT(st.message(), HasSubstr("'loud'"));
  EXPECT_THAT(st.message(), HasSubstr("io"));
  EXPECT_FALSE(Configure("io=").ok());
  EXPECT_FALSE(Configure("=debug").ok());
}

TEST_F(LogTest, NamesRoundTrip) {
  for (int i = 0; i < static_cast<int>(Subsystem::kCount); ++i) {
    auto sub = static_cast<Subsystem>(i);
    EXPECT_EQ(ParseSubsystem(SubsystemName(sub)), sub);
  }
  for (Level level :
       {Level::trace, Level::debug, Level::info, Level::warn, Level::error, Level::off}) {
    EXPECT_EQ(ParseLevel(LevelName(level)), level);
  }
  EXPECT_EQ(ParseLevel("loud"), std::nullopt);
  EXPECT_EQ(ParseSubsystem("disk"), std::nullopt);
  EXPECT_EQ(ParseLevel("INFO"), std::nullopt);  // names are lower case
}

TEST_F(LogTest, DisabledMessagesAreNotFormatted) {
  int evaluated = 0;
  auto expensive = [&] {
    ++evaluated;
    return 42;
  };
  STRATA_LOG(debug, io, "value {}", expensive());
  EXPECT_EQ(evaluated, 0);
  ASSERT_TRUE(Configure("off,io=debug").ok());
  STRATA_LOG(debug, io, "value {}", expensive());
  EXPECT_EQ(evaluated, 1);
  STRATA_LOG(debug, config, "value {}", expensive());
  EXPECT_EQ(evaluated, 1);
}

TEST_F(LogTest, LogOnceLogsOnce) {
  ASSERT_TRUE(Configure("off,bench=info").ok());
  int evaluated = 0;
  auto count = [&] { return ++evaluated; };
  for (int i = 0; i < 3; ++i)
    STRATA_LOG_ONCE(info, bench, "log_test: once {}", count());
  EXPECT_EQ(evaluated, 1);
}

}  // namespace
}  // namespace strata::log

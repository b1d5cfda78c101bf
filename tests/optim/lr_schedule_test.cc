// LrSchedule against numbers worked out by hand from DeepSpeed's formulas (lr_schedule.h). The
// schedule index is i = last_batch_iteration + step, so with the default -1 the first step
// (step 0) has i = -1: DeepSpeed's "not started" value.
#include "optim/lr_schedule.h"

#include <gtest/gtest.h>

#include "device/device_test_util.h"

namespace strata::optim {
namespace {

constexpr double kTol = 1e-15;

SchedulerConfig Warmup(SchedulerType type, double min_lr, double max_lr, int64_t steps,
                       WarmupType warmup) {
  SchedulerConfig s;
  s.type = type;
  s.warmup_min_lr = min_lr;
  s.warmup_max_lr = max_lr;
  s.warmup_num_steps = steps;
  s.warmup_type = warmup;
  return s;
}

OptimizerConfig Optimizer(double lr) {
  OptimizerConfig o;
  o.lr = lr;
  return o;
}

TEST(LrScheduleTest, ConstantIsTheOptimizerLr) {
  ASSERT_OK_AND_ASSIGN(LrSchedule s, LrSchedule::Create(SchedulerConfig{}, Optimizer(0.01)));
  EXPECT_EQ(s.type(), SchedulerType::kConstant);
  for (const int64_t step : {0, 1, 10, 1000000})
    EXPECT_EQ(s.LrAt(step), 0.01);
}

TEST(LrScheduleTest, WarmupLrLog) {
  // min 0, max 0.01, W = 10: lr(i) = 0.01 * ln(i + 1) / ln(10) for i < 10, then 0.01.
  ASSERT_OK_AND_ASSIGN(LrSchedule s, LrSchedule::Create(Warmup(SchedulerType::kWarmupLR, 0.0, 0.01,
                                                               10, WarmupType::kLog),
                                                        Optimizer(0.5)));
  EXPECT_EQ(s.LrAt(0), 0.0);                            // i = -1: warmup_min_lr
  EXPECT_EQ(s.LrAt(1), 0.0);                            // i = 0: ln 1 = 0
  EXPECT_NEAR(s.LrAt(2), 0.0030102999566398118, kTol);  // i = 1: 0.01 * ln 2 / ln 10
  EXPECT_NEAR(s.LrAt(5), 0.006989700043360187, kTol);   // i = 4: 0.01 * ln 5 / ln 10
  EXPECT_NEAR(s.LrAt(10), 0.01, kTol);                  // i = 9: ln 10 / ln 10
  EXPECT_EQ(s.LrAt(11), 0.01);                          // i = 10: past warmup
  EXPECT_EQ(s.LrAt(1000000), 0.01);
}

TEST(LrScheduleTest, WarmupLrLogOverTheDefaultThousandSteps) {
  // min 1e-4, max 1.1e-3: i = 99 gives 1e-4 + 1e-3 * ln(100) / ln(1000) = 1e-4 + 1e-3 * 2/3.
  ASSERT_OK_AND_ASSIGN(LrSchedule s, LrSchedule::Create(Warmup(SchedulerType::kWarmupLR, 1e-4,
                                                               1.1e-3, 1000, WarmupType::kLog),
                                                        Optimizer(0.5)));
  EXPECT_NEAR(s.LrAt(100), 0.0007666666666666668, kTol);
  EXPECT_NEAR(s.LrAt(0), 1e-4, kTol);
}

TEST(LrScheduleTest, WarmupLrLinear) {
  // min 0.001, max 0.011, W = 4: lr(i) = 0.001 + 0.01 * i / 4.
  ASSERT_OK_AND_ASSIGN(LrSchedule s, LrSchedule::Create(Warmup(SchedulerType::kWarmupLR, 0.001,
                                                               0.011, 4, WarmupType::kLinear),
                                                        Optimizer(0.5)));
  EXPECT_NEAR(s.LrAt(0), 0.001, kTol);   // i = -1
  EXPECT_NEAR(s.LrAt(1), 0.001, kTol);   // i = 0
  EXPECT_NEAR(s.LrAt(2), 0.0035, kTol);  // i = 1
  EXPECT_NEAR(s.LrAt(4), 0.0085, kTol);  // i = 3
  EXPECT_NEAR(s.LrAt(5), 0.011, kTol);   // i = 4 = W
  EXPECT_NEAR(s.LrAt(50), 0.011, kTol);
}

TEST(LrScheduleTest, WarmupOfOneStepIsTwoAsInDeepSpeed) {
  // warmup_num_steps 1 is raised to W = 2: i = 0 -> min, i = 1 -> halfway, i = 2 -> max.
  ASSERT_OK_AND_ASSIGN(LrSchedule s, LrSchedule::Create(Warmup(SchedulerType::kWarmupLR, 0.0, 0.2,
                                                               1, WarmupType::kLinear),
                                                        Optimizer(0.5)));
  EXPECT_EQ(s.LrAt(1), 0.0);
  EXPECT_NEAR(s.LrAt(2), 0.1, kTol);
  EXPECT_NEAR(s.LrAt(3), 0.2, kTol);
}

TEST(LrScheduleTest, LastBatchIterationOffsetsTheIndex) {
  SchedulerConfig c = Warmup(SchedulerType::kWarmupLR, 0.001, 0.011, 4, WarmupType::kLinear);
  c.last_batch_iteration = 2;  // resumed after 3 scheduler steps: the next step uses i = 2
  ASSERT_OK_AND_ASSIGN(LrSchedule s, LrSchedule::Create(c, Optimizer(0.5)));
  EXPECT_NEAR(s.LrAt(0), 0.006, kTol);   // i = 2: 0.001 + 0.01 * 2 / 4
  EXPECT_NEAR(s.LrAt(1), 0.0085, kTol);  // i = 3
  EXPECT_NEAR(s.LrAt(2), 0.011, kTol);   // i = 4
}

TEST(LrScheduleTest, WarmupDecayLr) {
  // min 0, max 0.1, W = 10 (linear), T = 110: after warmup lr(i) = 0.1 * (110 - i) / 100.
  SchedulerConfig c = Warmup(SchedulerType::kWarmupDecayLR, 0.0, 0.1, 10, WarmupType::kLinear);
  c.total_num_steps = 110;
  ASSERT_OK_AND_ASSIGN(LrSchedule s, LrSchedule::Create(c, Optimizer(0.5)));
  EXPECT_EQ(s.LrAt(0), 0.0);             // i = -1
  EXPECT_NEAR(s.LrAt(6), 0.05, kTol);    // i = 5: warmup halfway
  EXPECT_NEAR(s.LrAt(11), 0.1, kTol);    // i = 10: (110 - 10) / 100 = 1
  EXPECT_NEAR(s.LrAt(61), 0.05, kTol);   // i = 60: 50 / 100
  EXPECT_NEAR(s.LrAt(101), 0.01, kTol);  // i = 100: 10 / 100
  EXPECT_EQ(s.LrAt(111), 0.0);           // i = 110 = T
  EXPECT_EQ(s.LrAt(500), 0.0);           // clamped at 0 past T
}

TEST(LrScheduleTest, WarmupDecayLrStartsFromTheMinimum) {
  SchedulerConfig c = Warmup(SchedulerType::kWarmupDecayLR, 0.002, 0.012, 5, WarmupType::kLinear);
  c.total_num_steps = 15;
  ASSERT_OK_AND_ASSIGN(LrSchedule s, LrSchedule::Create(c, Optimizer(0.5)));
  EXPECT_NEAR(s.LrAt(0), 0.002, kTol);
  EXPECT_NEAR(s.LrAt(6), 0.012, kTol);   // i = 5: (15 - 5) / 10 = 1
  EXPECT_NEAR(s.LrAt(11), 0.007, kTol);  // i = 10: 0.002 + 0.01 * 5 / 10
  EXPECT_NEAR(s.LrAt(16), 0.002, kTol);  // i = 15: decays to warmup_min_lr
}

TEST(LrScheduleTest, WarmupCosineLr) {
  // lr 0.01, W = 10 (linear), warmup_min_ratio 0.1, cos_min_ratio 1e-4, T = 110.
  SchedulerConfig c;
  c.type = SchedulerType::kWarmupCosineLR;
  c.warmup_num_steps = 10;
  c.warmup_type = WarmupType::kLinear;
  c.warmup_min_ratio = 0.1;
  c.cos_min_ratio = 1e-4;
  c.total_num_steps = 110;
  ASSERT_OK_AND_ASSIGN(LrSchedule s, LrSchedule::Create(c, Optimizer(0.01)));
  EXPECT_EQ(s.LrAt(0), 0.0);             // i = -1: DeepSpeed sets 0 before the start
  EXPECT_NEAR(s.LrAt(1), 0.001, kTol);   // i = 0: ratio 0.1
  EXPECT_NEAR(s.LrAt(6), 0.0055, kTol);  // i = 5: 0.1 + 0.9 * 0.5
  // i = 10: progress (10 - 10 + 1) / 100 = 0.01; ratio 1e-4 + 0.9999 * (1 + cos(0.01 pi)) / 2.
  EXPECT_NEAR(s.LrAt(11), 0.009997533048548475, kTol);
  // i = 34: progress 0.25; ratio 1e-4 + 0.9999 * (1 + cos(pi / 4)) / 2.
  EXPECT_NEAR(s.LrAt(35), 0.008535680352542145, kTol);
  EXPECT_NEAR(s.LrAt(60), 0.0050005, kTol);  // i = 59: progress 0.5
  EXPECT_NEAR(s.LrAt(110), 1e-6, kTol);      // i = 109: progress 1: cos_min_ratio * lr
  EXPECT_NEAR(s.LrAt(1000), 1e-6, kTol);     // clamped: stays at the floor
}

TEST(LrScheduleTest, WarmupCosineLrLogWarmup) {
  SchedulerConfig c;
  c.type = SchedulerType::kWarmupCosineLR;
  c.warmup_num_steps = 10;
  c.warmup_type = WarmupType::kLog;
  c.warmup_min_ratio = 0.1;
  c.total_num_steps = 100;
  ASSERT_OK_AND_ASSIGN(LrSchedule s, LrSchedule::Create(c, Optimizer(0.01)));
  // i = 3: 0.01 * (0.1 + 0.9 * ln 4 / ln 10).
  EXPECT_NEAR(s.LrAt(4), 0.006418539921951661, kTol);
}

TEST(LrScheduleTest, UnresolvedTotalStepsIsFailedPrecondition) {
  for (const SchedulerType type : {SchedulerType::kWarmupDecayLR, SchedulerType::kWarmupCosineLR}) {
    SchedulerConfig c;
    c.type = type;
    c.total_num_steps = std::nullopt;
    const Result<LrSchedule> s = LrSchedule::Create(c, Optimizer(0.01));
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(s.status().message().find("total_num_steps"), std::string::npos);
  }
  // WarmupLR does not need it.
  SchedulerConfig c;
  c.type = SchedulerType::kWarmupLR;
  EXPECT_OK(LrSchedule::Create(c, Optimizer(0.01)));
}

TEST(LrScheduleTest, ValuesALoadedConfigNeverHoldsAreInvalidArgument) {
  SchedulerConfig c;
  c.type = SchedulerType::kWarmupLR;
  c.warmup_num_steps = 0;
  EXPECT_EQ(LrSchedule::Create(c, Optimizer(0.01)).status().code(), StatusCode::kInvalidArgument);
  c.warmup_num_steps = 10;
  c.warmup_max_lr = -1;
  EXPECT_EQ(LrSchedule::Create(c, Optimizer(0.01)).status().code(), StatusCode::kInvalidArgument);
  c = SchedulerConfig{};
  c.type = SchedulerType::kWarmupDecayLR;
  c.total_num_steps = 0;
  EXPECT_EQ(LrSchedule::Create(c, Optimizer(0.01)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(LrSchedule::Create(SchedulerConfig{}, Optimizer(-0.1)).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::optim

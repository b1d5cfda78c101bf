// LossScaler's scale trajectory against sequences worked out by hand from DeepSpeed's
// DynamicLossScaler.update_scale (loss_scaler.h), and HasInfOrNan.
#include "optim/loss_scaler.h"

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

#include "device/device_test_util.h"

namespace strata::optim {
namespace {

Fp16Config Dynamic(int power, int window, int hysteresis, bool consecutive, double min_scale) {
  Fp16Config c;
  c.enabled = true;
  c.loss_scale = 0.0;
  c.initial_scale_power = power;
  c.loss_scale_window = window;
  c.hysteresis = hysteresis;
  c.consecutive_hysteresis = consecutive;
  c.min_loss_scale = min_scale;
  return c;
}

struct Expected {
  bool overflow;
  bool skip;
  float scale_after;
};

void RunTrajectory(LossScaler& scaler, const std::vector<Expected>& steps) {
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(scaler.Update(steps[i].overflow), steps[i].skip) << "step " << i;
    EXPECT_EQ(scaler.scale(), steps[i].scale_after) << "step " << i;
  }
}

TEST(LossScalerTest, DynamicWithHysteresis) {
  // 2^4 = 16, window 3, hysteresis 2. The scale doubles when (iteration - last overflow - 1) is
  // a positive multiple of 3; the first overflow only uses up hysteresis, later ones halve (the
  // hysteresis is refilled only when the scale grows).
  ASSERT_OK_AND_ASSIGN(LossScaler scaler, LossScaler::Create(Dynamic(4, 3, 2, false, 1.0)));
  EXPECT_TRUE(scaler.dynamic());
  EXPECT_EQ(scaler.scale(), 16.0f);
  RunTrajectory(scaler, {
                            {false, false, 16},  // it 0: stable 0
                            {false, false, 16},  // it 1: stable 1
                            {false, false, 16},  // it 2: stable 2
                            {false, false, 32},  // it 3: stable 3 -> x2, hysteresis 2
                            {true, true, 32},    // it 4: hysteresis 2 -> 1
                            {true, true, 16},    // it 5: hysteresis 1 -> halve
                            {true, true, 8},     // it 6: still 1 -> halve
                            {false, false, 8},   // it 7: stable 0
                            {false, false, 8},   // it 8: stable 1
                            {false, false, 8},   // it 9: stable 2
                            {false, false, 16},  // it 10: stable 3 -> x2, hysteresis 2
                            {true, true, 16},    // it 11: hysteresis 2 -> 1
                            {false, false, 16},  // it 12: stable 0
                            {true, true, 8},     // it 13: hysteresis 1 -> halve
                        });
  EXPECT_EQ(scaler.state().iteration, 14);
  EXPECT_EQ(scaler.state().last_overflow_iteration, 13);
}

TEST(LossScalerTest, ConsecutiveHysteresisRefillsOnEveryGoodStep) {
  // 2^3 = 8, window 2, hysteresis 2, consecutive: any good step refills the hysteresis, so only
  // two overflows in a row halve the scale.
  ASSERT_OK_AND_ASSIGN(LossScaler scaler, LossScaler::Create(Dynamic(3, 2, 2, true, 1.0)));
  RunTrajectory(scaler, {
                            {false, false, 8},   // it 0: stable 0
                            {false, false, 8},   // it 1: stable 1
                            {false, false, 16},  // it 2: stable 2 -> x2
                            {true, true, 16},    // it 3: hysteresis 2 -> 1
                            {false, false, 16},  // it 4: refilled to 2; stable 0
                            {true, true, 16},    // it 5: 2 -> 1
                            {true, true, 8},     // it 6: 1 -> halve
                            {false, false, 8},   // it 7: stable 0
                            {false, false, 8},   // it 8: stable 1
                            {false, false, 16},  // it 9: stable 2 -> x2
                        });
}

TEST(LossScalerTest, NoHysteresisHalvesAtOnceAndStopsAtTheMinimum) {
  // 2^2 = 4, window 1000, hysteresis 1, min 1.
  ASSERT_OK_AND_ASSIGN(LossScaler scaler, LossScaler::Create(Dynamic(2, 1000, 1, false, 1.0)));
  RunTrajectory(scaler, {{true, true, 2}, {true, true, 1}, {true, true, 1}, {true, true, 1}});
  EXPECT_EQ(scaler.overflows_at_min_scale(), 2);  // DeepSpeed would have raised at the first
  EXPECT_FALSE(scaler.Update(false));
}

TEST(LossScalerTest, HalvingStopsAtANonPowerOfTwoMinimum) {
  ASSERT_OK_AND_ASSIGN(LossScaler scaler, LossScaler::Create(Dynamic(2, 1000, 1, false, 3.0)));
  RunTrajectory(scaler, {{true, true, 3}, {true, true, 3}});
  EXPECT_EQ(scaler.overflows_at_min_scale(), 1);
}

TEST(LossScalerTest, DefaultConfigStartsAt65536) {
  Fp16Config c;
  c.enabled = true;
  ASSERT_OK_AND_ASSIGN(LossScaler scaler, LossScaler::Create(c));
  EXPECT_EQ(scaler.scale(), 65536.0f);
  for (int i = 0; i < 1000; ++i)
    ASSERT_FALSE(scaler.Update(false));
  EXPECT_EQ(scaler.scale(), 65536.0f);  // it 999: stable 999
  EXPECT_FALSE(scaler.Update(false));   // it 1000: stable 1000 -> x2
  EXPECT_EQ(scaler.scale(), 131072.0f);
}

TEST(LossScalerTest, StaticScaleNeverChangesButOverflowsAreSkipped) {
  Fp16Config c;
  c.enabled = true;
  c.loss_scale = 128.0;
  ASSERT_OK_AND_ASSIGN(LossScaler scaler, LossScaler::Create(c));
  EXPECT_FALSE(scaler.dynamic());
  EXPECT_TRUE(scaler.Update(true));
  EXPECT_FALSE(scaler.Update(false));
  for (int i = 0; i < 3000; ++i)
    (void)scaler.Update(i % 3 == 0);
  EXPECT_EQ(scaler.scale(), 128.0f);
}

TEST(LossScalerTest, DisabledFp16ScalesByOne) {
  ASSERT_OK_AND_ASSIGN(LossScaler scaler, LossScaler::Create(Fp16Config{}));
  EXPECT_EQ(scaler.scale(), 1.0f);
  EXPECT_TRUE(scaler.Update(true));
  EXPECT_EQ(scaler.scale(), 1.0f);
}

TEST(LossScalerTest, StateRoundTrips) {
  ASSERT_OK_AND_ASSIGN(LossScaler a, LossScaler::Create(Dynamic(4, 3, 2, false, 1.0)));
  for (const bool overflow : {false, true, false, false})
    (void)a.Update(overflow);
  ASSERT_OK_AND_ASSIGN(LossScaler b, LossScaler::Create(Dynamic(4, 3, 2, false, 1.0)));
  ASSERT_OK(b.Restore(a.state()));
  EXPECT_EQ(a.state(), b.state());
  for (const bool overflow : {true, true, false, false, false, false}) {
    EXPECT_EQ(a.Update(overflow), b.Update(overflow));
    EXPECT_EQ(a.scale(), b.scale());
  }
  LossScalerState bad = a.state();
  bad.scale = 0;
  EXPECT_EQ(b.Restore(bad).code(), StatusCode::kInvalidArgument);
  bad = a.state();
  bad.hysteresis_left = 3;
  EXPECT_EQ(b.Restore(bad).code(), StatusCode::kInvalidArgument);
}

TEST(LossScalerTest, InvalidConfigsAreRejected) {
  for (const Fp16Config& c : {Dynamic(16, 0, 2, false, 1.0), Dynamic(16, 1000, 0, false, 1.0),
                              Dynamic(16, 1000, 2, false, 0.0), Dynamic(200, 1000, 2, false, 1.0),
                              Dynamic(-1, 1000, 2, false, 1.0)}) {
    EXPECT_EQ(LossScaler::Create(c).status().code(), StatusCode::kInvalidArgument);
  }
  Fp16Config c = Dynamic(16, 1000, 2, false, 1.0);
  c.loss_scale = -1;
  const Result<LossScaler> s = LossScaler::Create(c);
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("fp16.loss_scale"), std::string::npos);
}

TEST(HasInfOrNanTest, FindsEveryNonFiniteValueAnywhere) {
  EXPECT_FALSE(HasInfOrNan(nullptr, 0));
  std::vector<float> x(10000);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = static_cast<float>(i) - 5000.0f;
  x[1] = FLT_MAX;
  x[2] = -FLT_MAX;
  x[3] = 1e-45f;  // subnormal
  x[4] = -0.0f;
  EXPECT_FALSE(HasInfOrNan(x.data(), x.size()));
  for (const float bad :
       {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
        std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::signaling_NaN()}) {
    for (const size_t at : {size_t{0}, size_t{7}, size_t{4095}, size_t{4096}, size_t{9999}}) {
      std::vector<float> y = x;
      y[at] = bad;
      EXPECT_TRUE(HasInfOrNan(y.data(), y.size())) << bad << " at " << at;
      EXPECT_FALSE(HasInfOrNan(y.data(), at)) << "only before " << at;
    }
  }
}

}  // namespace
}  // namespace strata::optim

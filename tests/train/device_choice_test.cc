// ChooseDevice: --device / strata.device with the local rank and the visible GPUs.
#include "train/device_choice.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace strata::train {
namespace {

using ::testing::HasSubstr;

device::GpuReport Gpus(int n) {
  device::GpuReport r;
  r.built_with_cuda = true;
  for (int i = 0; i < n; ++i) {
    device::GpuInfo g;
    g.index = i;
    g.name = "NVIDIA H100 80GB HBM3";
    g.memory_bytes = 80ull << 30;
    g.compute_major = 9;
    r.gpus.push_back(g);
  }
  if (n == 0) r.none_reason = "the CUDA driver reports no GPU";
  return r;
}

TEST(DeviceChoiceTest, CpuIsAlwaysTheCpu) {
  auto c = ChooseDevice(DeviceKind::kCpu, 0, 0, Gpus(8), std::nullopt);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->type, device::DeviceType::kCpu);
}

TEST(DeviceChoiceTest, AutoFallsBackToTheCpuAndSaysWhy) {
  auto c = ChooseDevice(DeviceKind::kAuto, 0, 0, Gpus(0), std::nullopt);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->type, device::DeviceType::kCpu);
  EXPECT_THAT(c->reason, HasSubstr("the CUDA driver reports no GPU"));
  auto g = ChooseDevice(DeviceKind::kAuto, 3, 3, Gpus(8), std::nullopt);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->type, device::DeviceType::kCuda);
  EXPECT_EQ(g->ordinal, 3);
  EXPECT_THAT(g->reason, HasSubstr("GPU 3 (NVIDIA H100"));
  EXPECT_THAT(g->reason, HasSubstr("local rank 3"));
}

TEST(DeviceChoiceTest, CudaWithoutADeviceIsAnError) {
  auto c = ChooseDevice(DeviceKind::kCuda, 0, 0, Gpus(0), std::nullopt);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("the CUDA driver reports no GPU"));
  EXPECT_THAT(c.status().message(), HasSubstr("--device cpu"));
}

TEST(DeviceChoiceTest, EachLocalRankTakesItsOwnDevice) {
  for (int lr = 0; lr < 4; ++lr) {
    auto c = ChooseDevice(DeviceKind::kCuda, 4 + lr, lr, Gpus(4), std::nullopt);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->ordinal, lr);
  }
}

TEST(DeviceChoiceTest, TwoRanksOnOneDeviceIsAnErrorNamingBoth) {
  auto c = ChooseDevice(DeviceKind::kCuda, 5, 5, Gpus(4), std::string("0,1,2,3"));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("rank 5 (local rank 5) has no GPU of its own"));
  EXPECT_THAT(c.status().message(), HasSubstr("share GPU 1 with local rank 1"));
  EXPECT_THAT(c.status().message(), HasSubstr("CUDA_VISIBLE_DEVICES=0,1,2,3"));
  // Without CUDA_VISIBLE_DEVICES, one GPU and a second local rank is the same error.
  auto one = ChooseDevice(DeviceKind::kCuda, 1, 1, Gpus(1), std::nullopt);
  ASSERT_FALSE(one.ok());
  EXPECT_THAT(one.status().message(), HasSubstr("share GPU 0 with local rank 0"));
}

TEST(DeviceChoiceTest, OneVisibleDevicePerRankIsALauncherBinding) {
  auto c = ChooseDevice(DeviceKind::kCuda, 2, 2, Gpus(1), std::string("2"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->ordinal, 0);
  EXPECT_THAT(c->reason, HasSubstr("CUDA_VISIBLE_DEVICES=2 (one GPU per rank)"));
}

TEST(DeviceChoiceTest, ParsesTheFlag) {
  EXPECT_EQ(*ParseDeviceKind("cuda"), DeviceKind::kCuda);
  EXPECT_EQ(*ParseDeviceKind("cpu"), DeviceKind::kCpu);
  EXPECT_EQ(*ParseDeviceKind("auto"), DeviceKind::kAuto);
  auto bad = ParseDeviceKind("gpu");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("--device gpu: expected cpu, cuda or auto"));
}

}  // namespace
}  // namespace strata::train

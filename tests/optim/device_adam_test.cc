// DeviceAdamStep: on the CPU device it is CpuAdamStep in stream order; on the CUDA device (tests
// named *Gpu*, skipped without one) the fused kernel gives the bits of the CPU scalar path: both
// run adam_element.h's operations, each rounded once (tolerance: 0 ulps).
#include "optim/device_adam.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "device/device_test_util.h"
#include "optim/adam.h"
#include "optim/adam_test_util.h"
#include "strata/device.h"

namespace strata::optim {
namespace {

using testing::MakeShard;
using testing::ShardData;

// A shard in a device's memory, filled from (and read back into) a ShardData.
class DeviceShard {
 public:
  DeviceShard(device::Device& dev, const ShardData& host) : dev_(dev), n_(host.n()) {}
  ~DeviceShard() {
    for (void* p : ptrs_)
      dev_.Free(p);
  }

  Status Upload(const ShardData& host, device::Stream& stream) {
    for (int k = 0; k < 5; ++k) {
      STRATA_ASSIGN_OR_RETURN(void* p, dev_.Alloc(Bytes(host, k)));
      ptrs_.push_back(p);
    }
    for (int k = 0; k < 5; ++k) {
      STRATA_RETURN_IF_ERROR(dev_.CopyAsync(ptrs_[k], HostPtr(const_cast<ShardData&>(host), k),
                                            Bytes(host, k), device::CopyKind::kHostToDevice,
                                            stream));
    }
    return dev_.Synchronize(stream);
  }

  Status Download(ShardData& host, device::Stream& stream) {
    for (int k = 0; k < 5; ++k) {
      STRATA_RETURN_IF_ERROR(dev_.CopyAsync(HostPtr(host, k), ptrs_[k], Bytes(host, k),
                                            device::CopyKind::kDeviceToHost, stream));
    }
    return dev_.Synchronize(stream);
  }

  AdamShard Shard(const ShardData& host) const {
    AdamShard s{static_cast<float*>(ptrs_[0]),
                static_cast<const float*>(ptrs_[1]),
                static_cast<float*>(ptrs_[2]),
                static_cast<float*>(ptrs_[3]),
                n_,
                nullptr,
                host.out_dtype};
    if (host.with_out) s.out16 = ptrs_[4];
    return s;
  }

 private:
  static size_t Bytes(const ShardData& host, int k) {
    return k < 4 ? host.n() * 4 : host.n() * device::DTypeSize(host.out_dtype);
  }
  static void* HostPtr(ShardData& host, int k) {
    switch (k) {
      case 0:
        return host.master.data();
      case 1:
        return host.grad.data();
      case 2:
        return host.m.data();
      case 3:
        return host.v.data();
      default:
        return host.out_dtype == device::DType::kF32 ? static_cast<void*>(host.out.data())
                                                     : static_cast<void*>(host.out16.data());
    }
  }

  device::Device& dev_;
  size_t n_;
  std::vector<void*> ptrs_;
};

TEST(DeviceAdamTest, CpuDeviceRunsCpuAdamStepInStreamOrder) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<device::Device> dev,
                       device::CreateDevice(device::DeviceOptions{}));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<device::Stream> stream, dev->CreateStream("optim"));
  const CpuAdamOptions cpu{BestIsa(), 2};
  for (const device::DType dtype : {device::DType::kBF16, device::DType::kF16}) {
    ShardData host = MakeShard(3 * kAdamMinChunkElements + 5, 7, true);
    host.EnableOut(dtype);
    ShardData expected = host;
    AdamHyper h;
    h.weight_decay = 0.01;
    h.step = 4;
    ASSERT_OK(CpuAdamStep(h, expected.Shard(), cpu));

    DeviceShard shard(*dev, host);
    ASSERT_OK(shard.Upload(host, *stream));
    AdamShard s = shard.Shard(host);
    ASSERT_OK(DeviceAdamStep(*dev, *stream, h, s, cpu));
    h.step = 1000;  // the task has its own copy of the hyper-parameters
    s.n = 0;        // ... and of the shard
    ShardData result = host;
    ASSERT_OK(shard.Download(result, *stream));
    testing::ExpectBitIdentical(result, expected, std::string(device::DTypeName(dtype)));
  }
}

TEST(DeviceAdamTest, BadArgumentsFailAtOnce) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<device::Device> dev,
                       device::CreateDevice(device::DeviceOptions{}));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<device::Stream> stream, dev->CreateStream("optim"));
  ShardData host = MakeShard(100, 1, false);
  AdamHyper bad;
  bad.eps = -1;
  EXPECT_EQ(DeviceAdamStep(*dev, *stream, bad, host.Shard(), CpuAdamOptions{}).code(),
            StatusCode::kInvalidArgument);
  AdamShard null_grad = host.Shard();
  null_grad.grad = nullptr;
  EXPECT_EQ(DeviceAdamStep(*dev, *stream, AdamHyper{}, null_grad, CpuAdamOptions{}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      DeviceAdamStep(*dev, *stream, AdamHyper{}, host.Shard(), CpuAdamOptions{Isa::kScalar, 0})
          .code(),
      StatusCode::kInvalidArgument);
  EXPECT_OK(dev->Synchronize(*stream));  // nothing was enqueued, no sticky error
}

// The CUDA kernel against CpuAdamStep(Isa::kScalar): the same bits for every decay mode, output
// type and a size that does not fill the last block.
TEST(DeviceAdamGpuTest, CudaKernelMatchesTheCpuScalarPathBitForBit) {
  device::DeviceOptions options;
  options.type = device::DeviceType::kCuda;
  Result<std::unique_ptr<device::Device>> created = device::CreateDevice(options);
  if (!created.ok()) {
    GTEST_SKIP() << "no CUDA device: " << created.status().ToString();
  }
  std::unique_ptr<device::Device> dev = std::move(created).value();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<device::Stream> stream, dev->CreateStream("optim"));
  struct Mode {
    bool decoupled;
    double weight_decay;
    bool bias_correction;
  };
  for (const Mode mode : {Mode{true, 0.01, true}, Mode{true, 0.0, true}, Mode{false, 0.1, true},
                          Mode{false, 0.1, false}}) {
    for (const device::DType dtype :
         {device::DType::kBF16, device::DType::kF16, device::DType::kF32}) {
      ShardData host = MakeShard(1000003, 31, true);
      host.EnableOut(dtype);
      AdamHyper h;
      h.decoupled = mode.decoupled;
      h.weight_decay = mode.weight_decay;
      h.bias_correction = mode.bias_correction;
      h.grad_scale = 0.5;
      h.step = 3;
      ShardData expected = host;
      ASSERT_OK(CpuAdamStep(h, expected.Shard(), CpuAdamOptions{Isa::kScalar, 1}));

      DeviceShard shard(*dev, host);
      ASSERT_OK(shard.Upload(host, *stream));
      ASSERT_OK(DeviceAdamStep(*dev, *stream, h, shard.Shard(host), CpuAdamOptions{}));
      ShardData result = host;
      ASSERT_OK(shard.Download(result, *stream));
      testing::ExpectBitIdentical(result, expected,
                                  std::string(device::DTypeName(dtype)) +
                                      (mode.decoupled ? " adamw" : " adam-l2") + " wd " +
                                      std::to_string(mode.weight_decay));
    }
  }
}

}  // namespace
}  // namespace strata::optim

// The Device seam's fakes: DeviceWrapper (forwards every call; a test overrides one) and the
// fault-injecting device (device/fault_device.h) over the CPU device — a failed allocation, a
// copy, host task or element-wise operation that fails as it runs (the sticky error, naming what
// failed and where) or when enqueued, and a copy made slow on a manual clock.
#include "device/fault_device.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "common/clock.h"
#include "device/device_test_util.h"
#include "device/device_wrapper.h"

namespace strata::device::testing {
namespace {

std::unique_ptr<Device> CpuDevice() {
  DeviceOptions options;
  options.memory_budget = uint64_t{16} << 20;
  auto device = CreateDevice(options);
  EXPECT_TRUE(device.ok()) << device.status().ToString();
  return device.ok() ? std::move(device).value() : nullptr;
}

// A wrapper that counts allocations and forwards everything.
class CountingDevice final : public DeviceWrapper {
 public:
  using DeviceWrapper::DeviceWrapper;
  Result<void*> Alloc(size_t bytes) override {
    allocs.fetch_add(1);
    return DeviceWrapper::Alloc(bytes);
  }
  std::atomic<int> allocs{0};
};

// One stream, one allocation; frees them in order.
struct Fixture {
  explicit Fixture(std::unique_ptr<Device> d) : device(std::move(d)) {
    auto s = device->CreateStream("up");
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    if (s.ok()) stream = std::move(s).value();
  }
  ~Fixture() {
    if (stream != nullptr) (void)device->Synchronize(*stream);
    stream.reset();
    for (void* p : memory)
      device->Free(p);
  }
  void* Alloc(size_t bytes) {
    auto p = device->Alloc(bytes);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    if (!p.ok()) return nullptr;
    memory.push_back(*p);
    return *p;
  }
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> stream;
  std::vector<void*> memory;
};

TEST(DeviceWrapperTest, ForwardsEveryCallAndATestOverridesOne) {
  auto counting = std::make_unique<CountingDevice>(CpuDevice());
  CountingDevice* counter = counting.get();
  Fixture f(std::move(counting));
  EXPECT_EQ(f.device->name(), "cpu:0");
  EXPECT_EQ(f.device->type(), DeviceType::kCpu);
  auto* x = static_cast<float*>(f.Alloc(64 * sizeof(float)));
  auto* y = static_cast<float*>(f.Alloc(64 * sizeof(float)));
  std::vector<float> host(64, 2.0f), back(64, 0.0f);
  ASSERT_OK(
      f.device->CopyAsync(x, host.data(), 64 * sizeof(float), CopyKind::kHostToDevice, *f.stream));
  ASSERT_OK(f.device->Fill(y, DType::kF32, 1.0f, 64, *f.stream));
  ASSERT_OK(f.device->Axpy(3.0f, x, y, DType::kF32, 64, *f.stream));  // y = 1 + 3 * 2
  ASSERT_OK(
      f.device->CopyAsync(back.data(), y, 64 * sizeof(float), CopyKind::kDeviceToHost, *f.stream));
  bool ran = false;
  ASSERT_OK(f.device->HostTask(
      *f.stream,
      [&] {
        ran = true;
        return Status::Ok();
      },
      "task"));
  ASSERT_OK(f.device->Synchronize(*f.stream));
  EXPECT_TRUE(ran);
  EXPECT_EQ(back[0], 7.0f);
  EXPECT_EQ(back[63], 7.0f);
  EXPECT_EQ(counter->allocs.load(), 2);
  EXPECT_EQ(f.device->memory_stats().allocs, 2u);  // the wrapped device's own counters
}

TEST(FaultDeviceTest, FailsTheNthAllocationWithResourceExhaustedNamingIt) {
  auto faults = std::make_shared<DeviceFaultInjector>();
  const size_t rule = faults->AddRule({.op = DeviceOp::kAlloc, .ordinals = {2}});
  auto device = CreateFaultInjectingDevice(CpuDevice(), faults);
  EXPECT_EQ(device->name(), "faulty(cpu:0)");
  std::vector<void*> got;
  for (int i = 0; i < 4; ++i) {
    Result<void*> p = device->Alloc(4096);
    if (i == 2) {
      ASSERT_FALSE(p.ok());
      EXPECT_EQ(p.status().code(), StatusCode::kResourceExhausted);
      EXPECT_EQ(p.status().message(),
                "faulty(cpu:0): Alloc of 4.00 KiB: injected fault (allocation #2)");
    } else {
      ASSERT_OK(p);
      got.push_back(*p);
    }
  }
  EXPECT_EQ(faults->hits(rule), 1u);
  EXPECT_EQ(faults->seen(DeviceOp::kAlloc), 4u);
  for (void* p : got)
    device->Free(p);
}

TEST(FaultDeviceTest, AFailedCopyIsTheStickyErrorNamingTheCopyAndItsStream) {
  auto faults = std::make_shared<DeviceFaultInjector>();
  faults->AddRule({.op = DeviceOp::kCopy, .copy_kind = CopyKind::kHostToDevice, .ordinals = {1}});
  Fixture f(CreateFaultInjectingDevice(CpuDevice(), faults));
  auto* x = static_cast<uint8_t*>(f.Alloc(4096));
  std::memset(x, 0, 4096);  // CPU device memory is host memory
  std::vector<uint8_t> host(4096, 7);
  // A d2h copy is not considered; the second h2d copy fails when the stream reaches it.
  ASSERT_OK(f.device->CopyAsync(host.data(), x, 16, CopyKind::kDeviceToHost, *f.stream));
  ASSERT_OK(f.device->CopyAsync(x, host.data(), 16, CopyKind::kHostToDevice, *f.stream));
  ASSERT_OK(f.device->Synchronize(*f.stream));
  Gate gate;  // holds the stream until everything below is enqueued
  ASSERT_OK(f.device->HostTask(
      *f.stream, [&] { return gate.Wait() ? Status::Ok() : InternalError("gate"); }, "gate"));
  ASSERT_OK(f.device->CopyAsync(x, host.data(), 4096, CopyKind::kHostToDevice, *f.stream));
  bool later_ran = false;
  ASSERT_OK(f.device->HostTask(
      *f.stream,
      [&] {
        later_ran = true;
        return Status::Ok();
      },
      "after"));
  gate.Open();
  const Status st = f.device->Synchronize(*f.stream);
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_EQ(st.message(),
            "stream 'up': host task 'h2d copy' failed: injected fault: h2d copy (copy #2 of this "
            "device) of 4096 B on stream 'up'");
  EXPECT_FALSE(later_ran) << "work after the failure ran";
  EXPECT_EQ(x[100], 0) << "the failed copy wrote";
}

TEST(FaultDeviceTest, FailWhenEnqueuedReturnsTheErrorAndEnqueuesNothing) {
  auto faults = std::make_shared<DeviceFaultInjector>();
  faults->AddRule(
      {.op = DeviceOp::kElementwise, .code = StatusCode::kUnavailable, .when = FailWhen::kEnqueue});
  Fixture f(CreateFaultInjectingDevice(CpuDevice(), faults));
  auto* x = static_cast<float*>(f.Alloc(64));
  const Status st = f.device->Fill(x, DType::kF32, 1.0f, 16, *f.stream);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_EQ(st.message(),
            "faulty(cpu:0): injected fault: fill (element-wise #0 of this device) of 16 elements "
            "on stream 'up'");
  EXPECT_OK(f.device->Synchronize(*f.stream));  // no sticky error
}

TEST(FaultDeviceTest, FailsTheHostTasksAChosenLabelNamesWithoutRunningThem) {
  auto faults = std::make_shared<DeviceFaultInjector>();
  faults->AddRule({.op = DeviceOp::kHostTask, .label_contains = "forward", .max_hits = 1});
  Fixture f(CreateFaultInjectingDevice(CpuDevice(), faults));
  int ran = 0;
  auto task = [&] {
    ++ran;
    return Status::Ok();
  };
  ASSERT_OK(f.device->HostTask(*f.stream, task, "backward"));
  ASSERT_OK(f.device->HostTask(*f.stream, task, "model forward"));
  const Status st = f.device->Synchronize(*f.stream);
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_NE(st.message().find("host task 'model forward' failed: injected fault: model forward "
                              "(host task #1 of this device)"),
            std::string_view::npos)
      << st.ToString();
  EXPECT_EQ(ran, 1);
}

TEST(FaultDeviceTest, OnlyStreamsWhoseNameMatchesAreConsidered) {
  auto faults = std::make_shared<DeviceFaultInjector>();
  const size_t rule = faults->AddRule({.op = DeviceOp::kCopy, .stream_contains = "comm"});
  Fixture f(CreateFaultInjectingDevice(CpuDevice(), faults));
  auto* x = static_cast<uint8_t*>(f.Alloc(64));
  uint8_t host[64] = {};
  ASSERT_OK(f.device->CopyAsync(x, host, 64, CopyKind::kHostToDevice, *f.stream));
  EXPECT_OK(f.device->Synchronize(*f.stream));
  EXPECT_EQ(faults->hits(rule), 0u);
  ASSERT_OK_AND_ASSIGN(auto comm, f.device->CreateStream("comm"));
  ASSERT_OK(f.device->CopyAsync(x, host, 64, CopyKind::kHostToDevice, *comm));
  EXPECT_EQ(f.device->Synchronize(*comm).code(), StatusCode::kInternal);
  EXPECT_EQ(faults->hits(rule), 1u);
}

TEST(FaultDeviceTest, ASlowCopyHoldsItsStreamUntilTheClockPassesTheDelay) {
  ManualClock clock;
  auto faults = std::make_shared<DeviceFaultInjector>(&clock);
  faults->AddRule(
      {.op = DeviceOp::kCopy, .kind = DeviceFaultKind::kSlow, .delay = std::chrono::seconds(5)});
  Fixture f(CreateFaultInjectingDevice(CpuDevice(), faults));
  auto* x = static_cast<uint8_t*>(f.Alloc(64));
  std::vector<uint8_t> host(64, 9);
  ASSERT_OK_AND_ASSIGN(auto copied, f.device->CreateEvent());
  ASSERT_OK(f.device->CopyAsync(x, host.data(), 64, CopyKind::kHostToDevice, *f.stream));
  ASSERT_OK(f.device->Record(*copied, *f.stream));
  ASSERT_TRUE(clock.AwaitSleepers(1));  // the delay started
  clock.Advance(std::chrono::seconds(4));
  ASSERT_OK_AND_ASSIGN(const bool early, f.device->Query(*copied));
  EXPECT_FALSE(early) << "the copy finished before its delay";
  clock.Advance(std::chrono::seconds(1));
  ASSERT_OK(f.device->Synchronize(*copied));
  EXPECT_EQ(x[63], 9);
}

}  // namespace
}  // namespace strata::device::testing

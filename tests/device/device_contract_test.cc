// The Device contract (strata/device.h), checked on every backend: cpu_device_test.cc
// instantiates these tests as Cpu/..., cuda_device_test.cc as Gpu/... (skipped without a GPU).
// Only the Device interface is used here, and only HostTask functions touch host memory, so the
// same test means the same thing on both backends.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <future>
#include <limits>
#include <numeric>
#include <thread>
#include <vector>

#include "device/device_test_util.h"
#include "test_support.h"

namespace strata::device::testing {

using std::chrono::milliseconds;

// ---- helpers (declared in device_test_util.h) ------------------------------------------------

namespace {
// The index of the first differing byte, or -1 when equal (a readable failure message).
long FirstDifference(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) return static_cast<long>(std::min(got.size(), want.size()));
  auto [g, w] = std::mismatch(got.begin(), got.end(), want.begin());
  return g == got.end() ? -1 : static_cast<long>(g - got.begin());
}
}  // namespace

std::vector<float> InterestingFloats() {
  const float two_m24 = std::ldexp(1.0f, -24);  // least fp16 subnormal
  return {0.0f, -0.0f, 1.0f, -1.0f, 0.1f, -3.14159265f, 1e-3f, 42.0f, -7.25f, 1e5f, -1e5f,
          // fp16 range edges: the largest finite, just below and at the overflow threshold
          65504.0f, std::nextafter(65520.0f, 0.0f), 65520.0f, -65520.0f, 65536.0f,
          // fp16 subnormals, the underflow threshold and subnormal ties
          two_m24, 3 * two_m24, std::ldexp(1.0f, -15), std::ldexp(1.0f, -14),
          std::ldexp(1.0f, -14) - two_m24, std::ldexp(1.0f, -25), -std::ldexp(1.0f, -25),
          std::nextafter(std::ldexp(1.0f, -25), 1.0f), std::ldexp(1.0f, -26), 2.5f * two_m24,
          3.5f * two_m24,
          // bf16 ties (to the even neighbour, both parities) and just above a tie
          1.0f + std::ldexp(1.0f, -8), 1.0f + 3 * std::ldexp(1.0f, -8),
          1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20),
          // fp16 ties
          1.0f + std::ldexp(1.0f, -11), 1.0f + 3 * std::ldexp(1.0f, -11), 2049.0f, 2051.0f,
          // fp32 extremes and subnormals
          FLT_MAX, -FLT_MAX, FLT_MIN, std::numeric_limits<float>::denorm_min(), 1e-40f,
          std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
          // NaNs: quiet, negative with payload, signalling, payload in the low bits only
          FromBits(0x7fc00000u), FromBits(0xffc00001u), FromBits(0x7f800001u),
          FromBits(0x7fa12345u)};
}

std::vector<uint8_t> EncodeAs(const std::vector<float>& values, DType dtype) {
  std::vector<uint8_t> out(values.size() * DTypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(&out[i * 4], &values[i], 4);
    } else {
      const uint16_t h = dtype == DType::kBF16 ? FloatToBf16(values[i]) : FloatToF16(values[i]);
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

std::vector<float> DecodeFrom(const std::vector<uint8_t>& bytes, DType dtype) {
  const size_t n = bytes.size() / DTypeSize(dtype);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(&out[i], &bytes[i * 4], 4);
    } else {
      uint16_t h;
      std::memcpy(&h, &bytes[i * 2], 2);
      out[i] = dtype == DType::kBF16 ? Bf16ToFloat(h) : F16ToFloat(h);
    }
  }
  return out;
}

std::vector<TraceEvent> WaitForTraceEvents(const TraceRecorder& recorder, size_t count) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  std::vector<TraceEvent> events = recorder.Events();
  while (events.size() < count && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(1));
    events = recorder.Events();
  }
  return events;
}

void DeviceContractTest::SetUp() {
  Open(kBudget);
}

void DeviceContractTest::TearDown() {
  Close();
}

void DeviceContractTest::Open(uint64_t budget, TraceRecorder* trace) {
  Close();
  DeviceOptions options;
  options.type = GetParam();
  options.memory_budget = budget;
  options.trace = trace;
  Result<std::unique_ptr<Device>> created = CreateDevice(options);
  if (!created.ok() && GetParam() == DeviceType::kCuda) {
    GTEST_SKIP() << "no CUDA device: " << created.status().ToString();
  }
  ASSERT_OK(created);
  device_ = std::move(created).value();
  ASSERT_OK_AND_ASSIGN(a_, device_->CreateStream("a"));
  ASSERT_OK_AND_ASSIGN(b_, device_->CreateStream("b"));
  ASSERT_OK_AND_ASSIGN(event_, device_->CreateEvent());
}

void DeviceContractTest::Close() {
  a_.reset();
  b_.reset();
  event_.reset();
  for (void* p : allocations_)
    device_->Free(p);
  allocations_.clear();
  device_.reset();
}

void DeviceContractTest::DrainStreams() {
  if (device_ == nullptr) return;
  // Errors (a test's sticky error) do not matter here, only that the work is finished.
  if (a_ != nullptr) device_->Synchronize(*a_).IgnoreError();
  if (b_ != nullptr) device_->Synchronize(*b_).IgnoreError();
}

void* DeviceContractTest::DeviceAlloc(size_t bytes) {
  Result<void*> p = device_->Alloc(bytes);
  if (!p.ok()) {
    ADD_FAILURE() << "Alloc(" << bytes << "): " << p.status().ToString();
    return nullptr;
  }
  allocations_.push_back(*p);
  return *p;
}

::testing::AssertionResult DeviceContractTest::Upload(void* device_dst, const void* host_src,
                                                      size_t bytes) {
  Status s = device_->CopyAsync(device_dst, host_src, bytes, CopyKind::kHostToDevice, *a_);
  if (s.ok()) s = device_->Synchronize(*a_);
  if (!s.ok()) return ::testing::AssertionFailure() << "upload: " << s.ToString();
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult DeviceContractTest::Download(void* host_dst, const void* device_src,
                                                        size_t bytes) {
  Status s = device_->CopyAsync(host_dst, device_src, bytes, CopyKind::kDeviceToHost, *a_);
  if (s.ok()) s = device_->Synchronize(*a_);
  if (!s.ok()) return ::testing::AssertionFailure() << "download: " << s.ToString();
  return ::testing::AssertionSuccess();
}

// ---- memory ----------------------------------------------------------------------------------

TEST_P(DeviceContractTest, BudgetIsExactInAlignmentUnits) {
  constexpr uint64_t kSmallBudget = uint64_t{1} << 20;
  ASSERT_NO_FATAL_FAILURE(Open(kSmallBudget));
  if (IsSkipped()) return;
  // Charges are requests rounded up to kDeviceAlignment: these two fill the budget exactly.
  ASSERT_OK_AND_ASSIGN(void* big, device().Alloc(kSmallBudget - kDeviceAlignment - 10));
  ASSERT_OK_AND_ASSIGN(void* small, device().Alloc(1));
  EXPECT_EQ(device().memory_stats().in_use, kSmallBudget);

  Result<void*> over = device().Alloc(1);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  const std::string message(over.status().message());
  EXPECT_NE(message.find("budget"), std::string::npos) << message;
  EXPECT_NE(message.find("1.00 MiB (1048576 B) of 1.00 MiB (1048576 B) in use"), std::string::npos)
      << message;
  EXPECT_NE(message.find("Alloc of 256 B exceeds"), std::string::npos) << message;

  device().Free(small);
  ASSERT_OK_AND_ASSIGN(void* again, device().Alloc(kDeviceAlignment));
  device().Free(again);
  device().Free(big);
  EXPECT_EQ(device().memory_stats().in_use, 0u);
  // Larger than the whole budget (and near SIZE_MAX, which must not wrap around).
  EXPECT_EQ(device().Alloc(kSmallBudget + 1).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(device().Alloc(std::numeric_limits<size_t>::max()).status().code(),
            StatusCode::kResourceExhausted);
  EXPECT_EQ(device().Alloc(0).status().code(), StatusCode::kInvalidArgument);
}

TEST_P(DeviceContractTest, StatsTrackAllocationsFreesAndPeak) {
  DeviceMemoryStats s0 = device().memory_stats();
  EXPECT_EQ(s0.budget, kBudget);
  EXPECT_EQ(s0.in_use, 0u);
  EXPECT_EQ(s0.allocs, 0u);

  ASSERT_OK_AND_ASSIGN(void* p1, device().Alloc(1000));  // charged 1024
  ASSERT_OK_AND_ASSIGN(void* p2, device().Alloc(4096));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p1) % kDeviceAlignment, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p2) % kDeviceAlignment, 0u);
  EXPECT_FALSE(device().Alloc(kBudget).ok());
  DeviceMemoryStats s1 = device().memory_stats();
  EXPECT_EQ(s1.in_use, 1024u + 4096u);
  EXPECT_EQ(s1.peak, 1024u + 4096u);
  EXPECT_EQ(s1.allocs, 2u);
  EXPECT_EQ(s1.failed_allocs, 1u);

  device().Free(p2);
  device().Free(nullptr);  // ignored
  DeviceMemoryStats s2 = device().memory_stats();
  EXPECT_EQ(s2.in_use, 1024u);
  EXPECT_EQ(s2.peak, 1024u + 4096u);
  device().ResetPeak();
  EXPECT_EQ(device().memory_stats().peak, 1024u);
  device().Free(p1);
  EXPECT_EQ(device().memory_stats().in_use, 0u);
}

// ---- copies ----------------------------------------------------------------------------------

TEST_P(DeviceContractTest, CopiesOfEveryKindAreByteExact) {
  for (size_t size : {size_t{1}, size_t{4095}, (size_t{1} << 20) + 3}) {
    SCOPED_TRACE("size " + std::to_string(size));
    // Host buffers at an odd offset: copies must not assume alignment.
    std::vector<char> source = strata::testing::PatternBytes(size + 1, size);
    std::vector<char> result(size + 1, 0);
    Drain drain(this);
    void* d1 = DeviceAlloc(size);
    void* d2 = DeviceAlloc(size);
    ASSERT_OK(device().CopyAsync(d1, source.data() + 1, size, CopyKind::kHostToDevice, a()));
    ASSERT_OK(device().CopyAsync(d2, d1, size, CopyKind::kDeviceToDevice, a()));
    ASSERT_OK(device().CopyAsync(result.data() + 1, d2, size, CopyKind::kDeviceToHost, a()));
    ASSERT_OK(device().Synchronize(a()));
    EXPECT_EQ(result[0], 0);
    EXPECT_TRUE(std::equal(source.begin() + 1, source.end(), result.begin() + 1));
  }
}

TEST_P(DeviceContractTest, CopyArgumentsAreValidated) {
  void* d = DeviceAlloc(64);
  char host[64] = {};
  Drain drain(this);
  EXPECT_EQ(device().CopyAsync(nullptr, host, 8, CopyKind::kHostToDevice, a()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device().CopyAsync(host, nullptr, 8, CopyKind::kDeviceToHost, a()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      device().CopyAsync(static_cast<char*>(d) + 8, d, 16, CopyKind::kDeviceToDevice, a()).code(),
      StatusCode::kInvalidArgument);                                        // overlapping
  EXPECT_OK(device().CopyAsync(d, host, 0, CopyKind::kHostToDevice, a()));  // nothing to do
  EXPECT_OK(device().Synchronize(a()));
}

// ---- ordering --------------------------------------------------------------------------------

TEST_P(DeviceContractTest, StreamRunsItemsInEnqueueOrder) {
  constexpr int kItems = 500;
  std::vector<int> order;  // written only by host tasks, read after Synchronize
  order.reserve(kItems);
  Drain drain(this);
  for (int i = 0; i < kItems; ++i) {
    ASSERT_OK(device().HostTask(
        a(),
        [&order, i] {
          order.push_back(i);
          return Status::Ok();
        },
        "append"));
  }
  // Device work is ordered too: the result depends on the order of fill, scale and axpy.
  constexpr size_t kN = 3000;
  float* x = static_cast<float*>(DeviceAlloc(kN * sizeof(float)));
  float* y = static_cast<float*>(DeviceAlloc(kN * sizeof(float)));
  ASSERT_OK(device().Fill(x, DType::kF32, 3.0f, kN, a()));
  ASSERT_OK(device().Fill(y, DType::kF32, 1.0f, kN, a()));
  ASSERT_OK(device().Scale(x, DType::kF32, 2.0f, kN, a()));    // x = 6
  ASSERT_OK(device().Axpy(0.5f, x, y, DType::kF32, kN, a()));  // y = 1 + 3 = 4
  ASSERT_OK(device().Scale(y, DType::kF32, -1.0f, kN, a()));   // y = -4
  ASSERT_OK(device().Fill(x, DType::kF32, 0.0f, kN, a()));     // x = 0, after the axpy
  ASSERT_OK(device().Synchronize(a()));

  std::vector<int> expected(kItems);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(order, expected);
  std::vector<float> hx(kN), hy(kN);
  ASSERT_TRUE(Download(hx.data(), x, kN * sizeof(float)));
  ASSERT_TRUE(Download(hy.data(), y, kN * sizeof(float)));
  EXPECT_EQ(std::count(hx.begin(), hx.end(), 0.0f), static_cast<long>(kN));
  EXPECT_EQ(std::count(hy.begin(), hy.end(), -4.0f), static_cast<long>(kN));
}

TEST_P(DeviceContractTest, WaitOrdersConsumerStreamAfterProducerEvent) {
  constexpr size_t kN = 1 << 16;
  float* buffer = static_cast<float*>(DeviceAlloc(kN * sizeof(float)));
  std::vector<float> host(kN);
  Drain drain(this);
  for (int round = 1; round <= 5; ++round) {
    // The producer is slow to start; without the Wait the consumer's copy would read the
    // previous round's values.
    ASSERT_OK(device().HostTask(
        a(),
        [] {
          std::this_thread::sleep_for(milliseconds(15));
          return Status::Ok();
        },
        "slow start"));
    ASSERT_OK(device().Fill(buffer, DType::kF32, static_cast<float>(round), kN, a()));
    ASSERT_OK(device().Record(event(), a()));
    ASSERT_OK(device().Wait(b(), event()));
    ASSERT_OK(
        device().CopyAsync(host.data(), buffer, kN * sizeof(float), CopyKind::kDeviceToHost, b()));
    ASSERT_OK(device().Synchronize(b()));
    EXPECT_EQ(std::count(host.begin(), host.end(), static_cast<float>(round)),
              static_cast<long>(kN))
        << "round " << round;
  }
}

TEST_P(DeviceContractTest, QueryAndSynchronizeFollowTheRecordedWork) {
  // Never recorded: complete, and waiting on it is a no-op.
  ASSERT_OK_AND_ASSIGN(bool done, device().Query(event()));
  EXPECT_TRUE(done);
  EXPECT_OK(device().Synchronize(event()));
  EXPECT_OK(device().Wait(b(), event()));

  Gate gate;
  std::atomic<bool> gate_timed_out{false};
  Gate second;
  Drain drain(this);
  ASSERT_OK(device().HostTask(
      a(),
      [&] {
        if (!gate.Wait()) gate_timed_out = true;
        return Status::Ok();
      },
      "held"));
  ASSERT_OK(device().Record(event(), a()));
  ASSERT_OK_AND_ASSIGN(done, device().Query(event()));
  EXPECT_FALSE(done);
  ASSERT_OK_AND_ASSIGN(auto later, device().CreateEvent());
  ASSERT_OK(device().Record(*later, b()));  // b is idle
  ASSERT_OK(device().Synchronize(*later));

  gate.Open();
  ASSERT_OK(device().Synchronize(event()));
  ASSERT_OK_AND_ASSIGN(done, device().Query(event()));
  EXPECT_TRUE(done);
  EXPECT_FALSE(gate_timed_out);

  // Re-recording replaces what the event captures.
  ASSERT_OK(device().HostTask(
      a(),
      [&] {
        second.Wait();
        return Status::Ok();
      },
      "held again"));
  ASSERT_OK(device().Record(event(), a()));
  ASSERT_OK_AND_ASSIGN(done, device().Query(event()));
  EXPECT_FALSE(done);
  second.Open();
  ASSERT_OK(device().Synchronize(a()));
  ASSERT_OK_AND_ASSIGN(done, device().Query(event()));
  EXPECT_TRUE(done);
}

TEST_P(DeviceContractTest, SynchronizeStreamWaitsForEverythingEnqueued) {
  std::atomic<int> finished{0};
  Drain drain(this);
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK(device().HostTask(
        a(),
        [&finished] {
          std::this_thread::sleep_for(milliseconds(10));
          finished.fetch_add(1);
          return Status::Ok();
        },
        "sleep"));
  }
  ASSERT_OK(device().Synchronize(a()));
  EXPECT_EQ(finished.load(), 3);
}

TEST_P(DeviceContractTest, DestroyingAStreamRunsItsQueuedWork) {
  constexpr size_t kN = 1024;
  float* x = static_cast<float*>(DeviceAlloc(kN * sizeof(float)));
  std::atomic<bool> ran{false};
  {
    ASSERT_OK_AND_ASSIGN(auto stream, device().CreateStream("short-lived"));
    ASSERT_OK(device().HostTask(
        *stream,
        [&ran] {
          std::this_thread::sleep_for(milliseconds(20));
          ran = true;
          return Status::Ok();
        },
        "slow"));
    ASSERT_OK(device().Fill(x, DType::kF32, 7.0f, kN, *stream));
  }  // destroyed here, with its work still queued
  EXPECT_TRUE(ran.load());
  std::vector<float> host(kN);
  ASSERT_TRUE(Download(host.data(), x, kN * sizeof(float)));
  EXPECT_EQ(std::count(host.begin(), host.end(), 7.0f), static_cast<long>(kN));
}

// ---- errors ----------------------------------------------------------------------------------

TEST_P(DeviceContractTest, HostTaskErrorIsStickyAndNamesStreamAndLabel) {
  std::atomic<bool> later_ran{false};
  // Held until everything is queued: once the error is set, enqueueing fails.
  Gate gate;
  char host[16] = {};
  Drain drain(this);
  ASSERT_OK(device().HostTask(
      a(),
      [&gate] {
        gate.Wait();
        return Status::Ok();
      },
      "held"));
  ASSERT_OK(device().HostTask(
      a(), [] { return DataLossError("checksum mismatch in shard 3"); }, "verify shard"));
  ASSERT_OK(device().HostTask(
      a(),
      [&later_ran] {
        later_ran = true;
        return Status::Ok();
      },
      "after the failure"));
  gate.Open();
  Status synced = device().Synchronize(a());
  ASSERT_FALSE(synced.ok());
  EXPECT_EQ(synced.code(), StatusCode::kDataLoss);
  EXPECT_EQ(synced.message(),
            "stream 'a': host task 'verify shard' failed: checksum mismatch in shard 3");
  EXPECT_FALSE(later_ran.load()) << "work queued after a failure must be skipped";

  // Every later call that reports asynchronous state returns it: on any stream or event.
  EXPECT_EQ(device().Synchronize(b()), synced);
  EXPECT_EQ(device().Synchronize(event()), synced);
  EXPECT_EQ(device().Query(event()).status(), synced);
  void* d = DeviceAlloc(16);
  EXPECT_EQ(device().CopyAsync(d, host, 16, CopyKind::kHostToDevice, b()), synced);
  EXPECT_EQ(device().Fill(d, DType::kF32, 1.0f, 4, b()), synced);
  EXPECT_EQ(device().HostTask(
                b(), [] { return Status::Ok(); }, "x"),
            synced);
}

TEST_P(DeviceContractTest, NotifyRunsAfterEarlierWorkInOrderWithTheStickyStatus) {
  std::atomic<int> step{0};
  ASSERT_OK(device().HostTask(
      a(),
      [&step] {
        std::this_thread::sleep_for(milliseconds(20));
        step = 1;
        return Status::Ok();
      },
      "slow"));
  std::mutex mu;
  std::vector<int> seen;  // step values observed by the callbacks, in call order
  std::promise<Status> last;
  Gate gate;
  std::promise<Status> after;
  Drain drain(this);
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK(device().Notify(a(), [&, i](const Status& status) {
      std::lock_guard lock(mu);
      seen.push_back(step.load() * 10 + i);
      if (i == 2) last.set_value(status);
    }));
  }
  std::future<Status> done = last.get_future();
  ASSERT_EQ(done.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_OK(done.get());
  {
    std::lock_guard lock(mu);
    EXPECT_EQ(seen, (std::vector<int>{10, 11, 12}));
  }

  // After a failure the callback still runs, and receives the error. The stream is held until
  // the Notify is queued (once the error is set, enqueueing fails).
  ASSERT_OK(device().HostTask(
      b(),
      [&gate] {
        gate.Wait();
        return Status::Ok();
      },
      "held"));
  ASSERT_OK(device().HostTask(
      b(), [] { return UnavailableError("no luck"); }, "fails"));
  ASSERT_OK(device().Notify(b(), [&after](const Status& status) { after.set_value(status); }));
  gate.Open();
  std::future<Status> failed = after.get_future();
  ASSERT_EQ(failed.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  Status status = failed.get();
  EXPECT_EQ(status.code(), StatusCode::kUnavailable);
  EXPECT_NE(status.message().find("no luck"), std::string::npos) << status.ToString();
}

// ---- element-wise ----------------------------------------------------------------------------

TEST_P(DeviceContractTest, CastMatchesTheScalarConversionsBitForBit) {
  // The interesting values, then a ramp so that n is not a multiple of any block size.
  std::vector<float> values = InterestingFloats();
  for (int i = 0; i < 1003; ++i)
    values.push_back(std::ldexp(static_cast<float>(i) - 501.3f, (i % 41) - 20));
  const size_t n = values.size();
  const DType kAll[] = {DType::kF32, DType::kBF16, DType::kF16};
  for (DType from : kAll) {
    // The device input is the values as `from` represents them.
    const std::vector<uint8_t> input = EncodeAs(values, from);
    void* x = DeviceAlloc(input.size());
    ASSERT_TRUE(Upload(x, input.data(), input.size()));
    const std::vector<float> as_from = DecodeFrom(input, from);
    for (DType to : kAll) {
      SCOPED_TRACE(std::string(DTypeName(from)) + " -> " + std::string(DTypeName(to)));
      const std::vector<uint8_t> expected = EncodeAs(as_from, to);
      void* y = DeviceAlloc(expected.size());
      ASSERT_OK(device().Cast(x, from, y, to, n, a()));
      std::vector<uint8_t> got(expected.size());
      ASSERT_TRUE(Download(got.data(), y, got.size()));
      for (size_t i = 0; i < n; ++i) {
        const size_t w = DTypeSize(to);
        ASSERT_EQ(0, std::memcmp(&got[i * w], &expected[i * w], w))
            << "element " << i << " (" << values[i] << ")";
      }
    }
  }
  // In place with the same dtype is allowed (and changes nothing); overlap otherwise is not.
  void* z = DeviceAlloc(64);
  EXPECT_OK(device().Cast(z, DType::kF32, z, DType::kF32, 16, a()));
  EXPECT_EQ(device().Cast(z, DType::kF32, z, DType::kBF16, 16, a()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device()
                .Cast(static_cast<char*>(z) + 1, DType::kF32, static_cast<char*>(z) + 32,
                      DType::kF32, 1, a())
                .code(),
            StatusCode::kInvalidArgument);  // misaligned fp32
  EXPECT_OK(device().Synchronize(a()));
}

TEST_P(DeviceContractTest, ScaleAxpyFillMatchAHostReference) {
  constexpr size_t kN = 4099;
  std::vector<float> xs(kN), ys(kN);
  for (size_t i = 0; i < kN; ++i) {
    xs[i] = std::sin(static_cast<float>(i)) * 100.0f;
    ys[i] = std::cos(static_cast<float>(i) * 0.37f) * 3.0f;
  }
  xs[0] = std::numeric_limits<float>::infinity();
  ys[1] = FromBits(0x7fc00000u);
  xs[2] = 60000.0f;  // fp16: scaled by 1.5 it overflows to Inf
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const std::vector<uint8_t> hx = EncodeAs(xs, dtype);
    const std::vector<uint8_t> hy = EncodeAs(ys, dtype);
    void* x = DeviceAlloc(hx.size());
    void* y = DeviceAlloc(hy.size());
    void* f = DeviceAlloc(hx.size());
    ASSERT_TRUE(Upload(x, hx.data(), hx.size()));
    ASSERT_TRUE(Upload(y, hy.data(), hy.size()));
    ASSERT_OK(device().Scale(x, dtype, 1.5f, kN, a()));
    ASSERT_OK(device().Axpy(-0.75f, x, y, dtype, kN, a()));
    ASSERT_OK(device().Fill(f, dtype, 0.1f, kN, a()));

    // Reference: the same fp32 operations, stored through the scalar conversions.
    std::vector<float> rx = DecodeFrom(hx, dtype);
    std::vector<float> ry = DecodeFrom(hy, dtype);
    // A NaN result is the NaN 0x7fffffff on every device (device.h).
    auto canonical = [](float r) { return std::isnan(r) ? FromBits(0x7fffffffu) : r; };
    for (size_t i = 0; i < kN; ++i)
      rx[i] = DecodeFrom(EncodeAs({canonical(rx[i] * 1.5f)}, dtype), dtype)[0];
    for (size_t i = 0; i < kN; ++i) {
      const float product = -0.75f * rx[i];
      ry[i] = canonical(ry[i] + product);
    }
    const std::vector<uint8_t> want_x = EncodeAs(rx, dtype);
    const std::vector<uint8_t> want_y = EncodeAs(ry, dtype);
    const std::vector<uint8_t> want_f = EncodeAs(std::vector<float>(kN, 0.1f), dtype);

    std::vector<uint8_t> got_x(hx.size()), got_y(hy.size()), got_f(hx.size());
    ASSERT_TRUE(Download(got_x.data(), x, got_x.size()));
    ASSERT_TRUE(Download(got_y.data(), y, got_y.size()));
    ASSERT_TRUE(Download(got_f.data(), f, got_f.size()));
    EXPECT_EQ(FirstDifference(got_x, want_x), -1);
    EXPECT_EQ(FirstDifference(got_y, want_y), -1);
    EXPECT_EQ(FirstDifference(got_f, want_f), -1);
    // Spot checks that do not depend on the reference code above.
    EXPECT_TRUE(std::isinf(DecodeFrom(got_x, dtype)[0]));
    EXPECT_TRUE(std::isnan(DecodeFrom(got_y, dtype)[1]));
    // ...and it is the canonical NaN, not the 0x7fc00000 that went in.
    if (dtype == DType::kF32) {
      uint32_t bits = 0;
      std::memcpy(&bits, got_y.data() + 4, 4);
      EXPECT_EQ(bits, 0x7fffffffu);
    } else {
      uint16_t bits = 0;
      std::memcpy(&bits, got_y.data() + 2, 2);
      EXPECT_EQ(bits, 0x7fffu);
    }
    if (dtype == DType::kF16) {
      EXPECT_TRUE(std::isinf(DecodeFrom(got_x, dtype)[2]));
    } else {
      EXPECT_NEAR(DecodeFrom(got_x, dtype)[2], 90000.0f, 900.0f);
    }
    if (dtype == DType::kF32) {
      EXPECT_EQ(DecodeFrom(got_f, dtype)[kN - 1], 0.1f);
    }
  }
}

TEST_P(DeviceContractTest, ElementwiseArgumentsAreValidated) {
  void* d = DeviceAlloc(64);
  EXPECT_EQ(device().Scale(nullptr, DType::kF32, 2.0f, 4, a()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device().Fill(static_cast<char*>(d) + 1, DType::kBF16, 1.0f, 4, a()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device().Axpy(1.0f, d, nullptr, DType::kF16, 4, a()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_OK(device().Fill(nullptr, DType::kF32, 1.0f, 0, a()));  // n = 0: nothing to do
  EXPECT_EQ(device().HostTask(a(), nullptr, "empty").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device().Notify(a(), nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_OK(device().Synchronize(a()));
}

TEST_P(DeviceContractTest, StreamsAndEventsOfAnotherDeviceAreRejected) {
  DeviceOptions options;
  options.memory_budget = 1 << 20;
  ASSERT_OK_AND_ASSIGN(auto other, CreateDevice(options));
  ASSERT_OK_AND_ASSIGN(auto foreign_stream, other->CreateStream("foreign"));
  ASSERT_OK_AND_ASSIGN(auto foreign_event, other->CreateEvent());
  void* d = DeviceAlloc(64);
  Status s = device().Fill(d, DType::kF32, 1.0f, 4, *foreign_stream);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("foreign"), std::string::npos) << s.ToString();
  EXPECT_EQ(device().Record(*foreign_event, a()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device().Wait(a(), *foreign_event).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device().Query(*foreign_event).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device().Synchronize(*foreign_stream).code(), StatusCode::kInvalidArgument);
}

// ---- host registration -----------------------------------------------------------------------

TEST_P(DeviceContractTest, RegisterHostKeepsBookAndRefusesOverlaps) {
  // Page-aligned, so that adjacent ranges share no page (CUDA pins whole pages).
  std::vector<char> memory(3 * 65536 + 4096);
  char* base = memory.data() + (4096 - reinterpret_cast<uintptr_t>(memory.data()) % 4096);
  ASSERT_OK(device().RegisterHost(base, 65536));
  ASSERT_OK(device().RegisterHost(base + 65536, 65536));  // adjacent is fine
  Status overlap = device().RegisterHost(base + 65536 + 4096, 100);
  EXPECT_EQ(overlap.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(overlap.message().find("overlaps"), std::string::npos) << overlap.ToString();
  EXPECT_EQ(device().RegisterHost(base - 100 + 65536 * 2, 200).code(),
            StatusCode::kInvalidArgument);  // straddles the end of the second range
  EXPECT_EQ(device().RegisterHost(nullptr, 100).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device().RegisterHost(base + 2 * 65536, 0).code(), StatusCode::kInvalidArgument);

  Status unknown = device().UnregisterHost(base + 10);  // inside, but not a start
  EXPECT_EQ(unknown.code(), StatusCode::kNotFound);
  EXPECT_OK(device().UnregisterHost(base));
  EXPECT_EQ(device().UnregisterHost(base).code(), StatusCode::kNotFound);
  // Registered memory works as a copy source and destination: the bytes make the round trip.
  void* d = DeviceAlloc(65536);
  for (size_t i = 0; i < 65536; ++i)
    base[65536 + i] = static_cast<char>(i * 7 + 3);
  ASSERT_OK(device().CopyAsync(d, base + 65536, 65536, CopyKind::kHostToDevice, a()));
  ASSERT_OK(device().RegisterHost(base + 2 * 65536, 65536));
  ASSERT_OK(device().CopyAsync(base + 2 * 65536, d, 65536, CopyKind::kDeviceToHost, a()));
  ASSERT_OK(device().Synchronize(a()));
  EXPECT_EQ(std::memcmp(base + 2 * 65536, base + 65536, 65536), 0);
  EXPECT_OK(device().UnregisterHost(base + 65536));
  EXPECT_OK(device().UnregisterHost(base + 2 * 65536));
}

// ---- tracing ---------------------------------------------------------------------------------

TEST_P(DeviceContractTest, OperationsAreTracedOnTheirStreamsTrack) {
  TraceRecorder recorder;
  ASSERT_NO_FATAL_FAILURE(Open(kBudget, &recorder));
  if (IsSkipped()) return;
  void* copied = DeviceAlloc(8192);
  void* filled = DeviceAlloc(8192);  // not `copied`: a and b are not ordered against each other
  std::vector<char> host(8192, 'x');
  Drain drain(this);
  ASSERT_OK(device().CopyAsync(copied, host.data(), 8192, CopyKind::kHostToDevice, a()));
  ASSERT_OK(device().Fill(filled, DType::kBF16, 2.0f, 4096, b()));
  ASSERT_OK(device().HostTask(
      a(),
      [] {
        std::this_thread::sleep_for(milliseconds(5));
        return Status::Ok();
      },
      "optimizer step"));
  ASSERT_OK(device().Synchronize(a()));
  ASSERT_OK(device().Synchronize(b()));

  const std::vector<TraceEvent> events = WaitForTraceEvents(recorder, 3);
  const std::vector<std::string> tracks = recorder.TrackNames();
  auto find = [&](std::string_view name) -> const TraceEvent* {
    for (const TraceEvent& e : events) {
      if (e.name == name) return &e;
    }
    return nullptr;
  };
  const TraceEvent* copy = find("h2d");
  const TraceEvent* fill = find("fill bf16");
  const TraceEvent* task = find("optimizer step");
  ASSERT_NE(copy, nullptr);
  ASSERT_NE(fill, nullptr);
  ASSERT_NE(task, nullptr);
  ASSERT_LT(copy->track, tracks.size());
  ASSERT_LT(fill->track, tracks.size());
  EXPECT_EQ(tracks[copy->track], "a");
  EXPECT_EQ(tracks[fill->track], "b");
  EXPECT_EQ(task->track, copy->track);
  EXPECT_EQ(copy->category, "copy");
  EXPECT_EQ(fill->category, "compute");
  EXPECT_EQ(task->category, "host");
  ASSERT_FALSE(copy->args.empty());
  EXPECT_EQ(copy->args[0].first, "bytes");
  EXPECT_EQ(copy->args[0].second, 8192.0);
  EXPECT_LE(copy->start_ns, copy->end_ns);
  EXPECT_GE(task->end_ns - task->start_ns, 4'000'000) << "the host task slept 5 ms";
}

}  // namespace strata::device::testing

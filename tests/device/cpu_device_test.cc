// The CPU device: the device contract (device_contract_test.cc) instantiated as Cpu/..., plus what
// only the CPU device promises: its default budget, operand range checks, the happens-before
// edges that ThreadSanitizer sees, deadlock refusal and run-time traces of host tasks.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <cstdlib>
#include <future>
#include <new>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "device/device_test_util.h"

namespace strata::device::testing {
namespace {

using std::chrono::milliseconds;

INSTANTIATE_TEST_SUITE_P(Cpu, DeviceContractTest, ::testing::Values(DeviceType::kCpu),
                         DeviceTypeParamName);

std::unique_ptr<Device> MakeCpuDevice(uint64_t budget = uint64_t{16} << 20,
                                      TraceRecorder* trace = nullptr) {
  DeviceOptions options;
  options.memory_budget = budget;
  options.trace = trace;
  Result<std::unique_ptr<Device>> device = CreateDevice(options);
  EXPECT_TRUE(device.ok()) << device.status().ToString();
  return device.ok() ? std::move(device).value() : nullptr;
}

TEST(CpuDeviceTest, DefaultBudgetIsAQuarterOfPhysicalMemory) {
  auto device = MakeCpuDevice(0);
  ASSERT_NE(device, nullptr);
  const uint64_t ram = static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) *
                       static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  EXPECT_EQ(device->memory_stats().budget, ram / 4);
  EXPECT_EQ(device->name(), "cpu:0");
  EXPECT_EQ(device->type(), DeviceType::kCpu);
}

TEST(CpuDeviceTest, BudgetMessageNamesDeviceBudgetInUseAndRequest) {
  DeviceOptions options;
  options.memory_budget = uint64_t{4} << 20;
  options.name = "cpu-test";
  ASSERT_OK_AND_ASSIGN(auto device, CreateDevice(options));
  ASSERT_OK_AND_ASSIGN(void* p, device->Alloc(uint64_t{3} << 20));
  Result<void*> over = device->Alloc((uint64_t{1} << 20) + 1);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().ToString(),
            "RESOURCE_EXHAUSTED: cpu-test: Alloc of 1.00 MiB (1048832 B) exceeds the memory "
            "budget: 3.00 MiB (3145728 B) of 4.00 MiB (4194304 B) in use");
  device->Free(p);
}

TEST(CpuDeviceTest, FreedBlocksAreReusedAndTheCacheYieldsToTheBudget) {
  auto device = MakeCpuDevice(uint64_t{1} << 20);
  void* a = std::move(device->Alloc(600 << 10)).value();
  device->Free(a);
  EXPECT_EQ(device->memory_stats().in_use, 0u);
  EXPECT_EQ(device->memory_stats().cached, uint64_t{600} << 10);
  void* b = std::move(device->Alloc(600 << 10)).value();
  EXPECT_EQ(b, a) << "a freed block of the same size is handed out again";
  device->Free(b);
  // 600 KiB cached + 700 KiB would exceed the 1 MiB budget: the cache gives way, and the whole
  // budget stays usable.
  Result<void*> c = device->Alloc(700 << 10);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  Result<void*> d = device->Alloc(300 << 10);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(device->memory_stats().in_use, uint64_t{1000} << 10);
  EXPECT_EQ(device->memory_stats().cached, 0u);
  device->Free(*c);
  device->Free(*d);
}

// The cache holds freed blocks only up to the peak in use: in use + cached never exceeds the
// most the callers held at once, whatever the budget, for any order of sizes.
TEST(CpuDeviceTest, TheCacheNeverHoldsMoreThanThePeakInUse) {
  auto device = MakeCpuDevice(uint64_t{64} << 20);
  auto check = [&](const char* when) {
    const DeviceMemoryStats s = device->memory_stats();
    EXPECT_LE(s.in_use + s.cached, s.peak) << when;
  };
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  void* a = std::move(device->Alloc(3 * kMiB)).value();
  void* b = std::move(device->Alloc(2 * kMiB)).value();
  device->Free(a);
  device->Free(b);
  check("both freed");
  EXPECT_EQ(device->memory_stats().cached, 5 * kMiB);
  // 4 MiB matches no cached block: without the cap, 5 MiB cached + 4 MiB in use would be held.
  void* c = std::move(device->Alloc(4 * kMiB)).value();
  check("a third size");
  EXPECT_EQ(device->memory_stats().peak, 5 * kMiB);
  device->Free(c);
  void* b2 = std::move(device->Alloc(2 * kMiB)).value();
  check("the second size again");
  // A random walk over four sizes, several blocks live at once.
  std::mt19937 rng(3);
  std::vector<void*> live;
  const uint64_t sizes[] = {kMiB, 3 * kMiB / 2, 5 * kMiB / 2, 4 * kMiB};
  live.push_back(b2);
  for (int i = 0; i < 400; ++i) {
    if (!live.empty() && (live.size() >= 6 || rng() % 2 == 0)) {
      const size_t k = rng() % live.size();
      device->Free(live[k]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      Result<void*> p = device->Alloc(sizes[rng() % 4]);
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      live.push_back(*p);
    }
    check("random walk");
  }
  EXPECT_GT(device->memory_stats().cached, 0u) << "blocks are still reused";
  for (void* p : live) device->Free(p);
  check("all freed");
}

TEST(CpuDeviceTest, MemoryIsPageAlignedForDirectIo) {
  auto device = MakeCpuDevice();
  ASSERT_NE(device, nullptr);
  for (size_t bytes : {size_t{1}, size_t{300}, size_t{4097}}) {
    ASSERT_OK_AND_ASSIGN(void* p, device->Alloc(bytes));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 4096, 0u);
    device->Free(p);
  }
}

TEST(CpuDeviceTest, FreeOfForeignPointerIsIgnored) {
  auto device = MakeCpuDevice();
  ASSERT_NE(device, nullptr);
  ASSERT_OK_AND_ASSIGN(void* p, device->Alloc(1024));
  int not_device_memory = 0;
  device->Free(&not_device_memory);
  device->Free(static_cast<char*>(p) + 256);  // inside, but not what Alloc returned
  EXPECT_EQ(device->memory_stats().in_use, 1024u);
  device->Free(p);
  EXPECT_EQ(device->memory_stats().in_use, 0u);
}

TEST(CpuDeviceTest, OperandsMustLieInsideOneAllocation) {
  std::vector<char> host(2000);  // declared before the stream, which drains when destroyed
  auto device = MakeCpuDevice();
  ASSERT_NE(device, nullptr);
  ASSERT_OK_AND_ASSIGN(auto stream, device->CreateStream("s"));
  ASSERT_OK_AND_ASSIGN(void* d, device->Alloc(1000));

  // One byte past the request (though inside the rounded charge) is out.
  Status past = device->CopyAsync(d, host.data(), 1001, CopyKind::kHostToDevice, *stream);
  EXPECT_EQ(past.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(past.message().find("h2d copy: destination"), std::string::npos) << past.ToString();
  EXPECT_EQ(device
                ->CopyAsync(static_cast<char*>(d) + 500, host.data(), 501, CopyKind::kHostToDevice,
                            *stream)
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_OK(device->CopyAsync(static_cast<char*>(d) + 500, host.data(), 500,
                              CopyKind::kHostToDevice, *stream));
  // Host memory where device memory is expected, and device memory given as host memory.
  EXPECT_EQ(device->CopyAsync(host.data(), d, 8, CopyKind::kDeviceToDevice, *stream).code(),
            StatusCode::kInvalidArgument);
  Status as_host =
      device->CopyAsync(d, static_cast<char*>(d) + 512, 8, CopyKind::kHostToDevice, *stream);
  EXPECT_EQ(as_host.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(as_host.message().find("is device memory"), std::string::npos) << as_host.ToString();
  EXPECT_EQ(device->Fill(host.data(), DType::kF32, 0.0f, 4, *stream).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device->Fill(d, DType::kF32, 0.0f, 251, *stream).code(),
            StatusCode::kInvalidArgument);  // 1004 bytes
  EXPECT_EQ(device->Cast(d, DType::kF32, host.data(), DType::kBF16, 4, *stream).code(),
            StatusCode::kInvalidArgument);
  EXPECT_OK(device->Synchronize(*stream));
  device->Free(d);
  // Freed memory is no longer device memory.
  EXPECT_EQ(device->Fill(d, DType::kF32, 0.0f, 1, *stream).code(), StatusCode::kInvalidArgument);
}

// Registered (pinned) host memory is not device memory until a tier manager that shares host
// memory says so (UseHostMemoryAsDeviceMemory); then it passes where device memory is expected.
TEST(CpuDeviceTest, RegisteredHostMemoryIsDeviceMemoryOnlyWhenShared) {
  std::vector<float> host(1024);  // declared before the stream, which drains when destroyed
  auto device = MakeCpuDevice();
  ASSERT_NE(device, nullptr);
  ASSERT_OK_AND_ASSIGN(auto stream, device->CreateStream("s"));
  ASSERT_OK(device->RegisterHost(host.data(), host.size() * sizeof(float)));
  Status before = device->Fill(host.data(), DType::kF32, 1.0f, host.size(), *stream);
  EXPECT_EQ(before.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(before.message().find("not inside one allocation"), std::string::npos)
      << before.ToString();
  ASSERT_OK(device->UseHostMemoryAsDeviceMemory());
  EXPECT_OK(device->Fill(host.data(), DType::kF32, 2.0f, host.size(), *stream));
  // Only inside the registered range.
  EXPECT_EQ(device->Fill(host.data(), DType::kF32, 0.0f, host.size() + 1, *stream).code(),
            StatusCode::kInvalidArgument);
  EXPECT_OK(device->Synchronize(*stream));
  EXPECT_EQ(host.front(), 2.0f);
  EXPECT_EQ(host.back(), 2.0f);
  EXPECT_OK(device->UnregisterHost(host.data()));
  EXPECT_EQ(device->Fill(host.data(), DType::kF32, 0.0f, 1, *stream).code(),
            StatusCode::kInvalidArgument);
}

// Host-memory producer and consumer on two streams, ordered only by events: the consumer must
// see every value the producer wrote, every time (and TSan must see no race). Without the second
// event the producer races ahead into the next round while the consumer still reads.
TEST(CpuDeviceTest, WaitOrdersHostTasksAcrossStreams) {
  std::vector<int> buffer(4096, 0);
  std::vector<int> sums;
  auto device = MakeCpuDevice();
  ASSERT_NE(device, nullptr);
  ASSERT_OK_AND_ASSIGN(auto producer, device->CreateStream("producer"));
  ASSERT_OK_AND_ASSIGN(auto consumer, device->CreateStream("consumer"));
  ASSERT_OK_AND_ASSIGN(auto written, device->CreateEvent());
  ASSERT_OK_AND_ASSIGN(auto consumed, device->CreateEvent());
  for (int round = 1; round <= 10; ++round) {
    // The next round's writes must also wait for this round's reads (write after read).
    ASSERT_OK(device->Wait(*producer, *consumed));
    ASSERT_OK(device->HostTask(
        *producer,
        [&buffer, round] {
          for (size_t i = 0; i < buffer.size(); ++i) {
            buffer[i] = round;
            if (i % 1024 == 0) std::this_thread::sleep_for(milliseconds(1));  // write slowly
          }
          return Status::Ok();
        },
        "produce"));
    ASSERT_OK(device->Record(*written, *producer));
    ASSERT_OK(device->Wait(*consumer, *written));
    ASSERT_OK(device->HostTask(
        *consumer,
        [&buffer, &sums] {
          sums.push_back(std::accumulate(buffer.begin(), buffer.end(), 0));
          return Status::Ok();
        },
        "consume"));
    ASSERT_OK(device->Record(*consumed, *consumer));
  }
  ASSERT_OK(device->Synchronize(*consumer));
  ASSERT_EQ(sums.size(), 10u);
  for (int round = 1; round <= 10; ++round)
    EXPECT_EQ(sums[round - 1], round * 4096) << "round " << round;
}

// The same producer and consumer without the Wait, in a child process: ThreadSanitizer must
// report the data race (which is the point of the CPU device's semantics). Only in TSan builds.
TEST(CpuDeviceTest, MissingWaitIsADataRaceUnderThreadSanitizer) {
#if !defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "needs a ThreadSanitizer build (-DSTRATA_SANITIZE=thread)";
#else
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto racy = [] {
    std::vector<int> buffer(64, 0);
    std::atomic<int> sum{0};
    auto device = MakeCpuDevice();
    auto producer = std::move(device->CreateStream("producer")).value();
    auto consumer = std::move(device->CreateStream("consumer")).value();
    (void)device->HostTask(
        *producer,
        [&buffer] {
          std::this_thread::sleep_for(milliseconds(20));
          for (int& v : buffer)
            v = 1;
          return Status::Ok();
        },
        "produce");
    (void)device->HostTask(
        *consumer,
        [&buffer, &sum] {
          sum = std::accumulate(buffer.begin(), buffer.end(), 0);
          return Status::Ok();
        },
        "consume (no wait)");
    (void)device->Synchronize(*producer);
    (void)device->Synchronize(*consumer);
    std::_Exit(0);  // TSan prints reports as it finds them; exit 0 so only stderr decides
  };
  // Exit status 0, or TSan's own (66) when TSAN_OPTIONS has halt_on_error=1 as in the presets:
  // the report on stderr is what decides.
  EXPECT_EXIT(racy(), [](int status) { return WIFEXITED(status); }, "ThreadSanitizer: data race");
#endif
}

TEST(CpuDeviceTest, SynchronizeFromTheStreamsOwnWorkIsRefused) {
  Gate gate, second;
  Status from_stream, from_event, own_future;
  auto device = MakeCpuDevice();
  ASSERT_NE(device, nullptr);
  ASSERT_OK_AND_ASSIGN(auto event, device->CreateEvent());
  ASSERT_OK_AND_ASSIGN(auto later, device->CreateEvent());
  ASSERT_OK_AND_ASSIGN(auto stream, device->CreateStream("s"));
  ASSERT_OK(device->HostTask(
      *stream,
      [&gate] {
        gate.Wait();
        return Status::Ok();
      },
      "held"));
  ASSERT_OK(device->Record(*event, *stream));
  ASSERT_OK(device->Notify(*stream, [&](const Status&) {
    from_stream = device->Synchronize(*stream);
    from_event = device->Synchronize(*event);  // already complete: fine
  }));
  gate.Open();
  ASSERT_OK(device->Synchronize(*stream));
  EXPECT_EQ(from_stream.code(), StatusCode::kFailedPrecondition) << from_stream.ToString();
  EXPECT_OK(from_event);

  // Waiting, from a stream's work, for an event that captures that very work is refused.
  ASSERT_OK(device->HostTask(
      *stream,
      [&second] {
        second.Wait();
        return Status::Ok();
      },
      "held again"));
  ASSERT_OK(device->HostTask(
      *stream,
      [&] {
        own_future = device->Synchronize(*later);
        return Status::Ok();
      },
      "sync on own future"));
  ASSERT_OK(device->Record(*later, *stream));
  second.Open();
  ASSERT_OK(device->Synchronize(*stream));
  EXPECT_EQ(own_future.code(), StatusCode::kFailedPrecondition) << own_future.ToString();
}

TEST(CpuDeviceTest, NotifyMayEnqueueMoreWork) {
  std::vector<float> host(16, 0.0f);
  std::promise<Status> enqueued;
  auto device = MakeCpuDevice();
  ASSERT_NE(device, nullptr);
  ASSERT_OK_AND_ASSIGN(auto stream, device->CreateStream("s"));
  ASSERT_OK_AND_ASSIGN(auto other, device->CreateStream("other"));
  ASSERT_OK_AND_ASSIGN(void* d, device->Alloc(64));
  ASSERT_OK(device->Fill(d, DType::kF32, 5.0f, 16, *stream));
  ASSERT_OK(device->Notify(*stream, [&](const Status&) {
    Status s = device->CopyAsync(host.data(), d, 64, CopyKind::kDeviceToHost, *other);
    enqueued.set_value(s);
  }));
  auto future = enqueued.get_future();
  ASSERT_EQ(future.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  ASSERT_OK(future.get());
  ASSERT_OK(device->Synchronize(*other));
  EXPECT_EQ(host, std::vector<float>(16, 5.0f));
  device->Free(d);
}

TEST(CpuDeviceTest, ExceptionInHostTaskBecomesAnInternalError) {
  auto device = MakeCpuDevice();
  ASSERT_NE(device, nullptr);
  ASSERT_OK_AND_ASSIGN(auto stream, device->CreateStream("s"));
  ASSERT_OK(device->HostTask(
      *stream,
      []() -> Status {
        std::vector<int> v;
        return v.at(3) == 0 ? Status::Ok() : Status::Ok();  // throws std::out_of_range
      },
      "throws"));
  Status status = device->Synchronize(*stream);
  EXPECT_EQ(status.code(), StatusCode::kInternal);
  EXPECT_NE(status.message().find("host task 'throws' failed: threw an exception"),
            std::string::npos)
      << status.ToString();
}

TEST(CpuDeviceTest, TraceHasRunTimesAndWaits) {
  TraceRecorder recorder;
  auto device = MakeCpuDevice(uint64_t{16} << 20, &recorder);
  ASSERT_NE(device, nullptr);
  ASSERT_OK_AND_ASSIGN(auto a, device->CreateStream("compute"));
  ASSERT_OK_AND_ASSIGN(auto b, device->CreateStream("copy"));
  ASSERT_OK_AND_ASSIGN(auto event, device->CreateEvent());
  ASSERT_OK(device->HostTask(
      *a,
      [] {
        std::this_thread::sleep_for(milliseconds(20));
        return Status::Ok();
      },
      "layer 3 forward"));
  ASSERT_OK(device->Record(*event, *a));
  ASSERT_OK(device->Wait(*b, *event));
  ASSERT_OK(device->Synchronize(*b));
  std::vector<TraceEvent> events = recorder.Events();
  std::vector<std::string> tracks = recorder.TrackNames();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].name, "layer 3 forward");
  EXPECT_EQ(tracks.at(events[0].track), "compute");
  EXPECT_GE(events[0].end_ns - events[0].start_ns, 20'000'000);
  EXPECT_EQ(events[1].name, "wait");
  EXPECT_EQ(events[1].category, "wait");
  EXPECT_EQ(tracks.at(events[1].track), "copy");
  EXPECT_GE(events[1].end_ns, events[0].end_ns) << "the wait ends after the awaited work";
}

TEST(CpuDeviceTest, UnnamedStreamsGetDistinctNames) {
  auto device = MakeCpuDevice();
  ASSERT_NE(device, nullptr);
  ASSERT_OK_AND_ASSIGN(auto s1, device->CreateStream(""));
  ASSERT_OK_AND_ASSIGN(auto s2, device->CreateStream(""));
  EXPECT_FALSE(s1->name().empty());
  EXPECT_NE(s1->name(), s2->name());
}

TEST(CpuDeviceTest, CudaDeviceFailsCleanlyWhenUnavailable) {
  DeviceOptions options;
  options.type = DeviceType::kCuda;
  Result<std::unique_ptr<Device>> device = CreateDevice(options);
#if defined(STRATA_WITH_CUDA)
  // With CUDA: either a GPU is there, or the reason is Unavailable (or too little free memory).
  if (!device.ok()) {
    EXPECT_TRUE(device.status().code() == StatusCode::kUnavailable ||
                device.status().code() == StatusCode::kResourceExhausted)
        << device.status().ToString();
  }
#else
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(device.status().message().find("built without CUDA"), std::string::npos);
#endif
}

}  // namespace
}  // namespace strata::device::testing

namespace strata::device::testing {
namespace {

// Each call adds SumSquaresHost of its range to the running sum (the engine's host-homed shards
// use the same function, so a unit's share of the norm has the same bits in either home).
// ZeRO++'s qwZ kernels: every element within half a step of its block's scale, exact zeros for
// an all-zero block, an outlier setting its block's scale alone, the 16-bit dtypes rounding the
// dequantized value once, and shapes that are not whole blocks refused.
TEST(CpuDeviceTest, Int8QuantizationStaysWithinHalfAStepPerBlock) {
  auto device = MakeCpuDevice();
  constexpr size_t kBlock = 2048;
  std::vector<float> x(4 * kBlock);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (float& v : x) v = normal(rng);
  std::fill(x.begin() + kBlock, x.begin() + 2 * kBlock, 0.0f);  // block 1: all zero
  x[2 * kBlock + 17] = 40.0f;                                    // block 2: one outlier
  x[3 * kBlock + 5] = std::numeric_limits<float>::quiet_NaN();   // block 3: a NaN element
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const std::vector<float> in = DecodeFrom(EncodeAs(x, dtype), dtype);  // what the device sees
    ASSERT_OK_AND_ASSIGN(Int8RoundTrip r, RoundTripInt8(*device, dtype, in, kBlock));
    const std::vector<float> y = DecodeFrom(r.y, dtype);
    for (size_t b = 0; b < 4; ++b) {
      float amax = 0.0f;
      for (size_t i = b * kBlock; i < (b + 1) * kBlock; ++i) amax = std::fmax(amax, std::fabs(in[i]));
      EXPECT_EQ(r.scales[b], amax / 127.0f) << "block " << b;
    }
    EXPECT_EQ(r.scales[1], 0.0f);
    EXPECT_EQ(r.scales[2], 40.0f / 127.0f);
    EXPECT_EQ(r.q[2 * kBlock + 17], 127);
    EXPECT_EQ(r.q[3 * kBlock + 5], 0) << "a NaN element quantizes to 0";
    const double ulp16 = dtype == DType::kF32 ? 0.0 : dtype == DType::kBF16 ? 1.0 / 256 : 1.0 / 2048;
    for (size_t i = 0; i < x.size(); ++i) {
      if (i == 3 * kBlock + 5) continue;
      const float scale = r.scales[i / kBlock];
      // Half a quantization step, plus the rounding of the result to the dtype.
      const double bound = scale / 2.0 * (1.0 + 1e-6) + (std::fabs(in[i]) + scale) * ulp16 + 1e-7;
      ASSERT_LE(std::fabs(static_cast<double>(y[i]) - in[i]), bound) << "element " << i;
      if (i / kBlock == 1) {
        ASSERT_EQ(y[i], 0.0f);
      }
      if (scale > 0.0f) {
        ASSERT_EQ(static_cast<float>(r.q[i]), std::rint(in[i] / scale)) << "element " << i;
      }
    }
  }
  void* buf = nullptr;
  ASSERT_OK_AND_ASSIGN(buf, device->Alloc(4 * kBlock));
  ASSERT_OK_AND_ASSIGN(auto s, device->CreateStream("bad"));
  const Status partial = device->QuantizeInt8(buf, DType::kF32, 100, 64, buf, static_cast<float*>(buf), *s);
  EXPECT_EQ(partial.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(partial.message().find("not a whole number of blocks of 64"), std::string::npos);
  device->Free(buf);
}

TEST(CpuDeviceTest, SumSquaresAddsTheHostSumOfEachCall) {
  auto device = MakeCpuDevice();
  std::vector<float> x(200007);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(static_cast<float>(i)) * 3.0f;
  double sequential = 0.5;
  for (float v : x) sequential += static_cast<double>(v) * v;
  const double want_whole = 0.5 + SumSquaresHost(x.data(), DType::kF32, x.size());
  double want_pieces = 0.5;
  for (size_t first = 0; first < x.size(); first += 99999) {
    want_pieces += SumSquaresHost(x.data() + first, DType::kF32, std::min<size_t>(99999, x.size() - first));
  }
  ASSERT_OK_AND_ASSIGN(double whole, SumSquaresInPieces(*device, x, x.size(), 0.5));
  ASSERT_OK_AND_ASSIGN(double pieces, SumSquaresInPieces(*device, x, 99999, 0.5));
  EXPECT_EQ(whole, want_whole);
  EXPECT_EQ(pieces, want_pieces) << "consecutive calls add to one running sum";
  EXPECT_NEAR(whole, sequential, 1e-12 * sequential);
  x[5000] = std::numeric_limits<float>::infinity();
  ASSERT_OK_AND_ASSIGN(double inf, SumSquaresInPieces(*device, x, 999, 0.0));
  EXPECT_TRUE(std::isinf(inf));
}

// The blocked sum's bits depend on the data alone, not on the threads that share the blocks.
TEST(CpuDeviceTest, SumSquaresHostIsTheSameForAnyThreadCount) {
  std::vector<float> x((size_t{3} << 20) + 5);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::cos(static_cast<float>(i) * 0.37f) * 1e-3f;
  const double one = SumSquaresHost(x.data(), DType::kF32, x.size(), 1);
  EXPECT_EQ(SumSquaresHost(x.data(), DType::kF32, x.size(), 2), one);
  EXPECT_EQ(SumSquaresHost(x.data(), DType::kF32, x.size(), 7), one);
  double sequential = 0.0;
  for (float v : x) sequential += static_cast<double>(v) * v;
  EXPECT_NEAR(one, sequential, 1e-12 * sequential);
  std::vector<uint16_t> half(x.size());
  ConvertHost(x.data(), DType::kF32, half.data(), DType::kBF16, x.size());
  EXPECT_NEAR(SumSquaresHost(half.data(), DType::kBF16, x.size(), 3), one, 1e-2 * one);
  EXPECT_EQ(SumSquaresHost(x.data(), DType::kF32, 0, 4), 0.0);
}

TEST(CpuDeviceTest, SumSquaresTakesOnlyDeviceMemory) {
  auto device = MakeCpuDevice();
  ASSERT_OK_AND_ASSIGN(auto s, device->CreateStream("s"));
  std::vector<float> host(16, 1.0f);
  ASSERT_OK_AND_ASSIGN(void* buf, device->Alloc(256));
  double* sum = static_cast<double*>(buf);
  Status st = device->SumSquares(host.data(), DType::kF32, host.size(), sum, *s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  double host_sum = 0;
  st = device->SumSquares(buf, DType::kF32, 8, &host_sum, *s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  ASSERT_TRUE(device->Synchronize(*s).ok());
  device->Free(buf);
}

}  // namespace
}  // namespace strata::device::testing

namespace strata::device::testing {
namespace {

TEST(CpuDeviceTest, CountsCopiesFromAndToUnregisteredHostMemory) {
  auto device = MakeCpuDevice();
  ASSERT_OK_AND_ASSIGN(auto s, device->CreateStream("s"));
  ASSERT_OK_AND_ASSIGN(void* d, device->Alloc(8192));
  std::vector<char> pageable(8192, 1);
  void* pinned = ::operator new(8192, std::align_val_t{4096});
  ASSERT_TRUE(device->RegisterHost(pinned, 8192).ok());
  ASSERT_TRUE(device->CopyAsync(d, pinned, 8192, CopyKind::kHostToDevice, *s).ok());
  ASSERT_TRUE(device->CopyAsync(pinned, d, 4096, CopyKind::kDeviceToHost, *s).ok());
  EXPECT_EQ(device->memory_stats().pageable_copies, 0u);
  ASSERT_TRUE(device->CopyAsync(d, pageable.data(), 8192, CopyKind::kHostToDevice, *s).ok());
  ASSERT_TRUE(device->CopyAsync(pageable.data(), d, 100, CopyKind::kDeviceToHost, *s).ok());
  // A piece inside a registered range is registered.
  ASSERT_TRUE(device->CopyAsync(d, static_cast<char*>(pinned) + 4096, 4096,
                                CopyKind::kHostToDevice, *s)
                  .ok());
  ASSERT_TRUE(device->Synchronize(*s).ok());
  EXPECT_EQ(device->memory_stats().pageable_copies, 2u);
  EXPECT_EQ(device->memory_stats().pageable_copy_bytes, 8292u);
  ASSERT_TRUE(device->UnregisterHost(pinned).ok());
  ::operator delete(pinned, std::align_val_t{4096});
  device->Free(d);
}

}  // namespace
}  // namespace strata::device::testing

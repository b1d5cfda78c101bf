// The single-rank backend: every operation is a copy (or nothing), arguments are checked like the
// other backends check them, and operations keep stream order.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "comm/comm_test_util.h"
#include "strata/collective.h"
#include "strata/device.h"
#include "strata/trace.h"

namespace strata::comm {
namespace {

using device::DType;
using device::testing::Gate;
using testing::InputValue;
using testing::LoadBits;
using testing::StoreValue;

class SingleCollectiveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    env_.ClearLauncher();
    device::DeviceOptions options;
    options.memory_budget = uint64_t{64} << 20;
    ASSERT_OK_AND_ASSIGN(device_, device::CreateDevice(options));
    ASSERT_OK_AND_ASSIGN(stream_, device_->CreateStream("comm"));
    CollectiveOptions collective_options;
    collective_options.backend = Backend::kSingle;
    collective_options.trace = &trace_;
    ASSERT_OK_AND_ASSIGN(collective_, CreateCollective(*device_, collective_options));
  }
  void TearDown() override {
    if (stream_ != nullptr) EXPECT_OK(device_->Synchronize(*stream_));
    collective_.reset();
    stream_.reset();
    for (void* p : allocations_)
      device_->Free(p);
  }

  // Device memory holding InputValue(0, i) as `dtype` (or zeros), freed at TearDown.
  void* Buffer(size_t n, DType dtype, bool zero = false) {
    auto ptr = device_->Alloc(n * device::DTypeSize(dtype));
    EXPECT_TRUE(ptr.ok()) << ptr.status().ToString();
    if (!ptr.ok()) return nullptr;
    allocations_.push_back(*ptr);
    for (size_t i = 0; i < n; ++i)
      StoreValue(*ptr, dtype, i, zero ? 0.0f : InputValue(0, i));
    return *ptr;
  }

  testing::EnvGuard env_;
  TraceRecorder trace_;
  std::unique_ptr<device::Device> device_;
  std::unique_ptr<device::Stream> stream_;
  std::unique_ptr<Collective> collective_;
  std::vector<void*> allocations_;
};

TEST_F(SingleCollectiveTest, IsAWorldOfOne) {
  EXPECT_EQ(collective_->backend(), Backend::kSingle);
  EXPECT_EQ(collective_->rank(), 0);
  EXPECT_EQ(collective_->world_size(), 1);
}

TEST_F(SingleCollectiveTest, EveryOperationCopiesItsInput) {
  constexpr size_t kCount = 1001;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      SCOPED_TRACE(fmt::format("{} {}", device::DTypeName(dtype), ReduceOpName(op)));
      void* send = Buffer(kCount, dtype);
      void* all_reduced = Buffer(kCount, dtype, /*zero=*/true);
      void* scattered = Buffer(kCount, dtype, /*zero=*/true);
      void* gathered = Buffer(kCount, dtype, /*zero=*/true);
      ASSERT_OK(collective_->AllReduce(send, all_reduced, kCount, dtype, op, *stream_));
      ASSERT_OK(collective_->ReduceScatter(send, scattered, kCount, dtype, op, *stream_));
      ASSERT_OK(collective_->AllGather(send, gathered, kCount, dtype, *stream_));
      ASSERT_OK(device_->Synchronize(*stream_));
      for (size_t i = 0; i < kCount; ++i) {
        const uint32_t expected = LoadBits(send, dtype, i);
        ASSERT_EQ(LoadBits(all_reduced, dtype, i), expected) << i;
        ASSERT_EQ(LoadBits(scattered, dtype, i), expected) << i;
        ASSERT_EQ(LoadBits(gathered, dtype, i), expected) << i;
      }
    }
  }
}

TEST_F(SingleCollectiveTest, InPlaceLeavesTheBufferAsItWas) {
  constexpr size_t kCount = 257;
  void* buffer = Buffer(kCount, DType::kBF16);
  std::vector<uint16_t> before(kCount);
  std::memcpy(before.data(), buffer, kCount * 2);
  ASSERT_OK(collective_->AllReduce(buffer, buffer, kCount, DType::kBF16, ReduceOp::kAvg, *stream_));
  ASSERT_OK(
      collective_->ReduceScatter(buffer, buffer, kCount, DType::kBF16, ReduceOp::kSum, *stream_));
  ASSERT_OK(collective_->AllGather(buffer, buffer, kCount, DType::kBF16, *stream_));
  ASSERT_OK(collective_->Broadcast(buffer, kCount * 2, /*root=*/0, *stream_));
  ASSERT_OK(collective_->Barrier(*stream_));
  ASSERT_OK(device_->Synchronize(*stream_));
  EXPECT_EQ(std::memcmp(before.data(), buffer, kCount * 2), 0);
}

TEST_F(SingleCollectiveTest, EmptyOperationsAreValid) {
  EXPECT_OK(collective_->AllReduce(nullptr, nullptr, 0, DType::kF32, ReduceOp::kSum, *stream_));
  EXPECT_OK(collective_->AllGather(nullptr, nullptr, 0, DType::kF16, *stream_));
  EXPECT_OK(
      collective_->ReduceScatter(nullptr, nullptr, 0, DType::kBF16, ReduceOp::kAvg, *stream_));
  EXPECT_OK(collective_->Broadcast(nullptr, 0, 0, *stream_));
}

void ExpectInvalid(const Status& status, std::string_view expected) {
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  EXPECT_NE(status.message().find(expected), std::string_view::npos) << status.ToString();
}

TEST_F(SingleCollectiveTest, ArgumentErrorsAreReportedAtEnqueue) {
  constexpr size_t kCount = 64;
  auto* a = static_cast<std::byte*>(Buffer(kCount + 1, DType::kF32));
  auto* b = static_cast<std::byte*>(Buffer(kCount + 1, DType::kF32));
  ExpectInvalid(collective_->AllReduce(nullptr, b, kCount, DType::kF32, ReduceOp::kSum, *stream_),
                "send buffer is null");
  ExpectInvalid(collective_->AllGather(a, nullptr, kCount, DType::kF32, *stream_),
                "recv buffer is null");
  ExpectInvalid(collective_->AllReduce(a + 2, b, kCount, DType::kF32, ReduceOp::kSum, *stream_),
                "is not aligned to fp32");
  ExpectInvalid(collective_->AllReduce(a, a + 4, kCount, DType::kF32, ReduceOp::kSum, *stream_),
                "overlap");
  ExpectInvalid(collective_->AllGather(a + 4, a, kCount, DType::kF32, *stream_), "overlap");
  ExpectInvalid(collective_->ReduceScatter(a, a + 4, kCount, DType::kF32, ReduceOp::kAvg, *stream_),
                "overlap");
  ExpectInvalid(
      collective_->AllReduce(a, b, kCount, static_cast<DType>(9), ReduceOp::kSum, *stream_),
      "unknown dtype");
  ExpectInvalid(
      collective_->AllReduce(a, b, kCount, DType::kF32, static_cast<ReduceOp>(7), *stream_),
      "unknown reduce op");
  ExpectInvalid(collective_->Broadcast(a, 16, /*root=*/1, *stream_), "root 1");
  ExpectInvalid(collective_->Broadcast(a, 16, /*root=*/-1, *stream_), "root -1");
  ExpectInvalid(collective_->Broadcast(nullptr, 16, /*root=*/0, *stream_), "buffer is null");
  ExpectInvalid(collective_->AllReduce(a, b, ~size_t{0} / 2, DType::kF32, ReduceOp::kSum, *stream_),
                "overflows");
  // Nothing was enqueued, nothing failed.
  EXPECT_OK(device_->Synchronize(*stream_));
}

TEST_F(SingleCollectiveTest, KeepsStreamOrder) {
  // The operation must see the Fill enqueued before it, and the Scale after it must see its
  // result; a gate holds the stream so that the host can check that nothing ran early.
  constexpr size_t kCount = 4096;
  auto* send = static_cast<float*>(Buffer(kCount, DType::kF32, /*zero=*/true));
  auto* recv = static_cast<float*>(Buffer(kCount, DType::kF32, /*zero=*/true));
  Gate gate;
  ASSERT_OK(device_->HostTask(
      *stream_, [&] { return gate.Wait() ? Status::Ok() : InternalError("gate timed out"); },
      "gate"));
  ASSERT_OK(device_->Fill(send, DType::kF32, 3.0f, kCount, *stream_));
  ASSERT_OK(collective_->AllReduce(send, recv, kCount, DType::kF32, ReduceOp::kAvg, *stream_));
  ASSERT_OK(device_->Scale(recv, DType::kF32, 2.0f, kCount, *stream_));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(recv[0], 0.0f);
  gate.Open();
  ASSERT_OK(device_->Synchronize(*stream_));
  EXPECT_EQ(recv[0], 6.0f);
  EXPECT_EQ(recv[kCount - 1], 6.0f);
}

TEST_F(SingleCollectiveTest, RecordsEachOperationOnTheCommTrack) {
  void* send = Buffer(100, DType::kBF16);
  void* recv = Buffer(100, DType::kBF16, /*zero=*/true);
  ASSERT_OK(collective_->AllReduce(send, recv, 100, DType::kBF16, ReduceOp::kSum, *stream_));
  ASSERT_OK(collective_->Barrier(*stream_));
  ASSERT_OK(device_->Synchronize(*stream_));
  const auto names = trace_.TrackNames();
  std::vector<TraceEvent> comm;
  for (const TraceEvent& event : trace_.Events()) {
    if (names.at(event.track) == "comm") comm.push_back(event);
  }
  ASSERT_EQ(comm.size(), 2u);
  EXPECT_EQ(comm[0].name, "all-reduce bf16");
  EXPECT_EQ(comm[0].category, "comm");
  ASSERT_FALSE(comm[0].args.empty());
  EXPECT_EQ(comm[0].args[0].first, "bytes");
  EXPECT_EQ(comm[0].args[0].second, 200.0);
  EXPECT_LE(comm[0].start_ns, comm[0].end_ns);
  EXPECT_EQ(comm[1].name, "barrier");
}

TEST_F(SingleCollectiveTest, AStreamOfAnotherDeviceIsRejected) {
  device::DeviceOptions options;
  options.memory_budget = uint64_t{1} << 20;
  ASSERT_OK_AND_ASSIGN(auto other, device::CreateDevice(options));
  ASSERT_OK_AND_ASSIGN(auto other_stream, other->CreateStream("other"));
  void* send = Buffer(16, DType::kF32);
  void* recv = Buffer(16, DType::kF32, /*zero=*/true);
  EXPECT_EQ(
      collective_->AllReduce(send, recv, 16, DType::kF32, ReduceOp::kSum, *other_stream).code(),
      StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::comm

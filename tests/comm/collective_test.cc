// CreateCollective's choices and errors, and the MPI backend as a world of one process (an MPI
// singleton: the test runs without mpirun), which exercises the MPI thread, its stream
// handshake and its chunked paths in a unit test.
#include "strata/collective.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "comm/comm_test_util.h"
#include "strata/device.h"
#include "strata/trace.h"

#if defined(STRATA_COMM_WITH_MPI)
#include "comm/mpi_collective.h"
#endif

namespace strata::comm {
namespace {

using device::DType;
using device::testing::Gate;
using testing::EnvGuard;
using testing::InputValue;
using testing::LoadBits;
using testing::StoreValue;

// A CPU device that says it is a CUDA device: for the checks that a backend fits its device.
class CudaLookalike final : public device::Device {
 public:
  explicit CudaLookalike(device::Device& inner) : inner_(inner) {}
  device::DeviceType type() const override { return device::DeviceType::kCuda; }
  std::string_view name() const override { return "cuda-lookalike"; }
  Result<void*> Alloc(size_t bytes) override { return inner_.Alloc(bytes); }
  void Free(void* ptr) override { inner_.Free(ptr); }
  device::DeviceMemoryStats memory_stats() const override { return inner_.memory_stats(); }
  void ResetPeak() override { inner_.ResetPeak(); }
  Status RegisterHost(void* ptr, size_t bytes) override { return inner_.RegisterHost(ptr, bytes); }
  Status UnregisterHost(void* ptr) override { return inner_.UnregisterHost(ptr); }
  Result<std::unique_ptr<device::Stream>> CreateStream(std::string_view name) override {
    return inner_.CreateStream(name);
  }
  Result<std::unique_ptr<device::Event>> CreateEvent() override { return inner_.CreateEvent(); }
  Status Record(device::Event& event, device::Stream& stream) override {
    return inner_.Record(event, stream);
  }
  Status Wait(device::Stream& stream, const device::Event& event) override {
    return inner_.Wait(stream, event);
  }
  Result<bool> Query(const device::Event& event) override { return inner_.Query(event); }
  Status Synchronize(const device::Event& event) override { return inner_.Synchronize(event); }
  Status Synchronize(device::Stream& stream) override { return inner_.Synchronize(stream); }
  Status CopyAsync(void* dst, const void* src, size_t bytes, device::CopyKind kind,
                   device::Stream& stream) override {
    return inner_.CopyAsync(dst, src, bytes, kind, stream);
  }
  Status HostTask(device::Stream& stream, std::function<Status()> fn,
                  std::string_view label) override {
    return inner_.HostTask(stream, std::move(fn), label);
  }
  Status Notify(device::Stream& stream, std::function<void(const Status&)> fn) override {
    return inner_.Notify(stream, std::move(fn));
  }
  Status Cast(const void* x, DType from, void* y, DType to, size_t n,
              device::Stream& stream) override {
    return inner_.Cast(x, from, y, to, n, stream);
  }
  Status Scale(void* x, DType dtype, float alpha, size_t n, device::Stream& stream) override {
    return inner_.Scale(x, dtype, alpha, n, stream);
  }
  Status Axpy(float alpha, const void* x, void* y, DType dtype, size_t n,
              device::Stream& stream) override {
    return inner_.Axpy(alpha, x, y, dtype, n, stream);
  }
  Status Fill(void* x, DType dtype, float value, size_t n, device::Stream& stream) override {
    return inner_.Fill(x, dtype, value, n, stream);
  }

 private:
  device::Device& inner_;
};

std::unique_ptr<device::Device> CpuDevice(TraceRecorder* trace = nullptr) {
  device::DeviceOptions options;
  options.memory_budget = uint64_t{256} << 20;
  options.trace = trace;
  auto device = device::CreateDevice(options);
  EXPECT_TRUE(device.ok()) << device.status().ToString();
  return device.ok() ? std::move(device).value() : nullptr;
}

TEST(CollectiveNamesTest, Names) {
  EXPECT_EQ(ReduceOpName(ReduceOp::kSum), "sum");
  EXPECT_EQ(ReduceOpName(ReduceOp::kAvg), "avg");
  EXPECT_EQ(BackendName(Backend::kAuto), "auto");
  EXPECT_EQ(BackendName(Backend::kSingle), "single");
  EXPECT_EQ(BackendName(Backend::kMpi), "mpi");
  EXPECT_EQ(BackendName(Backend::kNccl), "nccl");
}

TEST(CreateCollectiveTest, AutoWithoutALauncherIsSingle) {
  EnvGuard env;
  env.ClearLauncher();
  auto device = CpuDevice();
  ASSERT_NE(device, nullptr);
  ASSERT_OK_AND_ASSIGN(auto collective, CreateCollective(*device, {}));
  EXPECT_EQ(collective->backend(), Backend::kSingle);
  EXPECT_EQ(collective->world_size(), 1);
}

TEST(CreateCollectiveTest, SingleRefusesAWorldOfMany) {
  EnvGuard env;
  env.ClearLauncher();
  env.Set("OMPI_COMM_WORLD_RANK", "0");
  env.Set("OMPI_COMM_WORLD_SIZE", "4");
  auto device = CpuDevice();
  ASSERT_NE(device, nullptr);
  CollectiveOptions options;
  options.backend = Backend::kSingle;
  Result<std::unique_ptr<Collective>> collective = CreateCollective(*device, options);
  ASSERT_FALSE(collective.ok());
  EXPECT_EQ(collective.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(collective.status().message().find("started 4 ranks"), std::string_view::npos)
      << collective.status().ToString();
}

TEST(CreateCollectiveTest, MalformedLauncherEnvironmentIsAnError) {
  EnvGuard env;
  env.ClearLauncher();
  env.Set("SLURM_PROCID", "x");
  env.Set("SLURM_NTASKS", "2");
  auto device = CpuDevice();
  ASSERT_NE(device, nullptr);
  Result<std::unique_ptr<Collective>> collective = CreateCollective(*device, {});
  ASSERT_FALSE(collective.ok());
  EXPECT_EQ(collective.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(collective.status().message().find("SLURM_PROCID='x'"), std::string_view::npos);
}

TEST(CreateCollectiveTest, TimeoutMustBePositive) {
  EnvGuard env;
  env.ClearLauncher();
  auto device = CpuDevice();
  ASSERT_NE(device, nullptr);
  CollectiveOptions options;
  options.timeout = std::chrono::milliseconds(0);
  EXPECT_EQ(CreateCollective(*device, options).status().code(), StatusCode::kInvalidArgument);
}

TEST(CreateCollectiveTest, BackendMustFitTheDevice) {
  EnvGuard env;
  env.ClearLauncher();
  auto cpu = CpuDevice();
  ASSERT_NE(cpu, nullptr);
  CudaLookalike cuda(*cpu);

  CollectiveOptions mpi;
  mpi.backend = Backend::kMpi;
  Status status = CreateCollective(cuda, mpi).status();
#if defined(STRATA_COMM_WITH_MPI)
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  EXPECT_NE(status.message().find("use nccl"), std::string_view::npos) << status.ToString();
#else
  EXPECT_EQ(status.code(), StatusCode::kUnimplemented) << status.ToString();
#endif

  CollectiveOptions nccl;
  nccl.backend = Backend::kNccl;
  status = CreateCollective(*cpu, nccl).status();
#if defined(STRATA_COMM_WITH_NCCL)
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  EXPECT_NE(status.message().find("use mpi"), std::string_view::npos) << status.ToString();
#else
  EXPECT_EQ(status.code(), StatusCode::kUnimplemented) << status.ToString();
#endif
}

#if defined(STRATA_COMM_WITH_MPI)

TEST(CreateCollectiveTest, LauncherAndMpiMustAgree) {
  // The launcher's variables say two ranks, but this process is an MPI singleton (world 1):
  // what happens when a binary is started by another MPI's launcher.
  EnvGuard env;
  env.ClearLauncher();
  env.Set("PMI_RANK", "1");
  env.Set("PMI_SIZE", "2");
  auto device = CpuDevice();
  ASSERT_NE(device, nullptr);
  Status status = CreateCollective(*device, {}).status();  // auto: mpi for the CPU device
  EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.ToString();
  EXPECT_NE(status.message().find("MPI reports rank 0 of 1"), std::string_view::npos)
      << status.ToString();
}

// The MPI backend in a world of one: real MPI calls on the MPI thread, no peers.
class MpiSingletonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    env_.ClearLauncher();
    device_ = CpuDevice(&trace_);
    ASSERT_NE(device_, nullptr);
    ASSERT_OK_AND_ASSIGN(a_, device_->CreateStream("comm-a"));
    ASSERT_OK_AND_ASSIGN(b_, device_->CreateStream("comm-b"));
    CollectiveOptions options;
    options.backend = Backend::kMpi;
    options.timeout = std::chrono::seconds(30);
    options.trace = &trace_;
    ASSERT_OK_AND_ASSIGN(collective_, CreateCollective(*device_, options));
  }
  void TearDown() override {
    if (a_ != nullptr) EXPECT_OK(device_->Synchronize(*a_));
    if (b_ != nullptr) EXPECT_OK(device_->Synchronize(*b_));
    collective_.reset();
    a_.reset();
    b_.reset();
    for (void* p : allocations_)
      device_->Free(p);
  }
  void* Buffer(size_t n, DType dtype, bool zero = false) {
    auto ptr = device_->Alloc(n * device::DTypeSize(dtype));
    EXPECT_TRUE(ptr.ok()) << ptr.status().ToString();
    if (!ptr.ok()) return nullptr;
    allocations_.push_back(*ptr);
    for (size_t i = 0; i < n; ++i)
      StoreValue(*ptr, dtype, i, zero ? 0.0f : InputValue(0, i));
    return *ptr;
  }
  // Every operation of `collective` on every dtype, out of place and in place: with one rank
  // each result is its input.
  void CheckIdentity(Collective& collective, size_t count) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        SCOPED_TRACE(
            fmt::format("{} {} count {}", device::DTypeName(dtype), ReduceOpName(op), count));
        void* send = Buffer(count, dtype);
        void* reduced = Buffer(count, dtype, /*zero=*/true);
        void* scattered = Buffer(count, dtype, /*zero=*/true);
        void* gathered = Buffer(count, dtype, /*zero=*/true);
        void* in_place = Buffer(count, dtype);
        void* broadcast = Buffer(count, dtype);
        void* exchanged = Buffer(count, dtype, /*zero=*/true);
        ASSERT_OK(collective.AllReduce(send, reduced, count, dtype, op, *a_));
        ASSERT_OK(collective.AllToAll(send, exchanged, count, dtype, *a_));
        ASSERT_OK(collective.ReduceScatter(send, scattered, count, dtype, op, *a_));
        ASSERT_OK(collective.AllGather(send, gathered, count, dtype, *a_));
        ASSERT_OK(collective.AllReduce(in_place, in_place, count, dtype, op, *a_));
        ASSERT_OK(collective.ReduceScatter(in_place, in_place, count, dtype, op, *a_));
        ASSERT_OK(collective.AllGather(in_place, in_place, count, dtype, *a_));
        ASSERT_OK(collective.Broadcast(broadcast, count * device::DTypeSize(dtype), 0, *a_));
        ASSERT_OK(collective.Barrier(*a_));
        ASSERT_OK(device_->Synchronize(*a_));
        for (size_t i = 0; i < count; ++i) {
          const uint32_t expected = LoadBits(send, dtype, i);
          ASSERT_EQ(LoadBits(reduced, dtype, i), expected) << i;
          ASSERT_EQ(LoadBits(scattered, dtype, i), expected) << i;
          ASSERT_EQ(LoadBits(gathered, dtype, i), expected) << i;
          ASSERT_EQ(LoadBits(exchanged, dtype, i), expected) << i;
          ASSERT_EQ(LoadBits(in_place, dtype, i), expected) << i;
          ASSERT_EQ(LoadBits(broadcast, dtype, i), expected) << i;
        }
      }
    }
  }

  EnvGuard env_;
  TraceRecorder trace_;
  std::unique_ptr<device::Device> device_;
  std::unique_ptr<device::Stream> a_, b_;
  std::unique_ptr<Collective> collective_;
  std::vector<void*> allocations_;
};

TEST_F(MpiSingletonTest, IsAWorldOfOne) {
  EXPECT_EQ(collective_->backend(), Backend::kMpi);
  EXPECT_EQ(collective_->rank(), 0);
  EXPECT_EQ(collective_->world_size(), 1);
}

TEST_F(MpiSingletonTest, EveryOperationIsTheIdentity) {
  CheckIdentity(*collective_, 1);
  CheckIdentity(*collective_, 100003);
}

TEST_F(MpiSingletonTest, ChunkedPathsAreTheIdentity) {
  internal::MpiTuning tiny;
  tiny.stage_elements = 1000;
  tiny.max_call_elements = 777;
  CollectiveOptions options;
  options.timeout = std::chrono::seconds(30);
  ASSERT_OK_AND_ASSIGN(auto chunked,
                       internal::CreateMpiCollective(*device_, options, DetectLaunch(), tiny));
  CheckIdentity(*chunked, 10007);
}

TEST_F(MpiSingletonTest, OperationsOnTwoStreamsRunInEnqueueOrder) {
  // op1 is enqueued on stream a behind a closed gate, op2 after it on stream b. op2 may not run
  // before op1 (every rank runs them in enqueue order), so b's work after op2 must wait for the
  // gate too.
  constexpr size_t kCount = 1024;
  auto* x = static_cast<float*>(Buffer(kCount, DType::kF32));
  auto* y = static_cast<float*>(Buffer(kCount, DType::kF32));
  Gate gate;
  std::atomic<bool> b_done{false};
  ASSERT_OK(device_->HostTask(
      *a_, [&] { return gate.Wait() ? Status::Ok() : InternalError("gate timed out"); }, "gate"));
  ASSERT_OK(device_->Fill(x, DType::kF32, 1.5f, kCount, *a_));
  ASSERT_OK(collective_->AllReduce(x, x, kCount, DType::kF32, ReduceOp::kSum, *a_));
  ASSERT_OK(device_->Fill(y, DType::kF32, 2.5f, kCount, *b_));
  ASSERT_OK(collective_->AllReduce(y, y, kCount, DType::kF32, ReduceOp::kAvg, *b_));
  ASSERT_OK(device_->HostTask(
      *b_,
      [&] {
        b_done = true;
        return Status::Ok();
      },
      "after op2"));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(b_done.load());
  EXPECT_EQ(x[0], InputValue(0, 0));  // the Fill behind the gate has not run
  gate.Open();
  ASSERT_OK(device_->Synchronize(*b_));
  EXPECT_TRUE(b_done.load());
  ASSERT_OK(device_->Synchronize(*a_));
  EXPECT_EQ(x[0], 1.5f);
  EXPECT_EQ(y[kCount - 1], 2.5f);
}

TEST_F(MpiSingletonTest, RecordsEachOperationOnTheCommTrack) {
  void* buffer = Buffer(1000, DType::kF16);
  ASSERT_OK(collective_->AllReduce(buffer, buffer, 1000, DType::kF16, ReduceOp::kSum, *a_));
  ASSERT_OK(collective_->Broadcast(buffer, 64, 0, *a_));
  ASSERT_OK(device_->Synchronize(*a_));
  const auto names = trace_.TrackNames();
  std::vector<TraceEvent> comm;
  for (const TraceEvent& event : trace_.Events()) {
    if (names.at(event.track) == "comm") comm.push_back(event);
  }
  ASSERT_EQ(comm.size(), 2u);
  EXPECT_EQ(comm[0].name, "all-reduce fp16");
  EXPECT_EQ(comm[1].name, "broadcast");
  ASSERT_EQ(comm[1].args.size(), 2u);
  EXPECT_EQ(comm[1].args[0].first, "bytes");
  EXPECT_EQ(comm[1].args[0].second, 64.0);
  EXPECT_EQ(comm[1].args[1].first, "seq");
  EXPECT_EQ(comm[1].args[1].second, comm[0].args[1].second + 1);
  // The stream shows the host task that waited for each operation, named after it.
  bool found = false;
  for (const TraceEvent& event : trace_.Events()) {
    if (names.at(event.track) == "comm-a" && event.name.starts_with("mpi all-reduce #")) {
      found = true;
    }
  }
  EXPECT_TRUE(found);
}

TEST_F(MpiSingletonTest, ArgumentErrorsAreReportedAtEnqueue) {
  void* buffer = Buffer(16, DType::kF32);
  Status status = collective_->Broadcast(buffer, 16, /*root=*/1, *a_);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  EXPECT_NE(status.message().find("mpi broadcast"), std::string_view::npos);
}

// A stream that fails before reaching an operation: its host task is skipped, the operation is
// cancelled instead of run (its buffers may be gone), and the runtime fails, so that later
// operations fail at once instead of hanging. This poisons the process's MPI runtime, so it runs
// in a child process (a death test that re-executes the binary).
void StreamFailsBeforeTheOperation() {
  EnvGuard env;
  env.ClearLauncher();
  auto check = [](bool ok, std::string_view what) {
    if (!ok) {
      std::fprintf(stderr, "check failed: %.*s\n", static_cast<int>(what.size()), what.data());
      std::exit(1);
    }
  };
  auto device = CpuDevice();
  check(device != nullptr, "device");
  auto stream = device->CreateStream("comm");
  check(stream.ok(), "stream");
  CollectiveOptions options;
  options.backend = Backend::kMpi;
  options.timeout = std::chrono::seconds(30);
  auto collective = CreateCollective(*device, options);
  check(collective.ok(), collective.status().ToString());
  auto buffer = device->Alloc(64);
  check(buffer.ok(), "alloc");

  Gate gate;
  check(
      device
          ->HostTask(
              **stream, [&] { return gate.Wait() ? Status::Ok() : InternalError("gate"); }, "gate")
          .ok(),
      "gate task");
  check(device
            ->HostTask(
                **stream, [] { return DataLossError("injected failure"); }, "fail")
            .ok(),
        "failing task");
  check((*collective)->AllReduce(*buffer, *buffer, 16, DType::kF32, ReduceOp::kSum, **stream).ok(),
        "enqueue");
  gate.Open();
  Status synced = device->Synchronize(**stream);
  check(synced.code() == StatusCode::kDataLoss, synced.ToString());

  // The MPI thread fails the runtime once it sees the cancelled operation.
  Status later;
  for (int i = 0; i < 500; ++i) {
    later = (*collective)->Barrier(**stream);
    if (later.code() == StatusCode::kAborted) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  check(later.code() == StatusCode::kAborted, later.ToString());
  check(later.message().find("mpi all-reduce #") != std::string_view::npos, later.ToString());
  check(later.message().find("not run") != std::string_view::npos, later.ToString());
  check(later.message().find("injected failure") != std::string_view::npos, later.ToString());
  device->Free(*buffer);
  stream->reset();
  collective->reset();
  device.reset();
  std::fprintf(stderr, "all checks passed\n");
  std::exit(0);  // the exit handler skips MPI_Finalize after the failure
}

TEST(MpiSingletonDeathTest, StreamFailureBeforeAnOperationFailsTheRuntime) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(StreamFailsBeforeTheOperation(), ::testing::ExitedWithCode(0), "all checks passed");
}

#endif  // STRATA_COMM_WITH_MPI

}  // namespace
}  // namespace strata::comm

// The NCCL backend as a world of one, on a real GPU: every operation with real NCCL calls on the
// CUDA device's streams, checked bit for bit against the values computed on the host. This is the
// GPU check's NCCL smoke test (deploy/gpu-check.sh); the several-rank runs need several GPUs.
// Every test skips without a GPU, or in a build without NCCL, saying which.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/comm_test_util.h"
#include "strata/collective.h"
#include "strata/device.h"
#include "test_support.h"

namespace strata::comm::testing {
namespace {

using device::CopyKind;
using device::Device;
using device::DeviceOptions;
using device::DeviceType;
using device::DTypeSize;
using device::Stream;

class NcclGpuTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
#if !defined(STRATA_COMM_WITH_NCCL)
    GTEST_SKIP() << "this build has no NCCL backend (CUDA toolkit or NCCL not found at build time)";
#endif
    env_.ClearLauncher();
    DeviceOptions options;
    options.type = DeviceType::kCuda;
    Result<std::unique_ptr<Device>> created = device::CreateDevice(options);
    if (!created.ok()) GTEST_SKIP() << "no CUDA device: " << created.status().ToString();
    device_ = std::move(created).value();
    ASSERT_OK_AND_ASSIGN(stream_, device_->CreateStream("nccl-test"));
    CollectiveOptions copt;
    copt.backend = Backend::kNccl;
    copt.timeout = std::chrono::seconds(20);  // a hang must not eat the GPU check's budget
    ASSERT_OK_AND_ASSIGN(collective_, CreateCollective(*device_, copt));
    ASSERT_EQ(collective_->backend(), Backend::kNccl);
    ASSERT_EQ(collective_->world_size(), 1);
    ASSERT_EQ(collective_->rank(), 0);
  }
  void TearDown() override {
    if (stream_ != nullptr) EXPECT_OK(device_->Synchronize(*stream_));
    collective_.reset();
    for (void* p : buffers_)
      device_->Free(p);
    stream_.reset();
    device_.reset();
  }

  // A device buffer of n elements holding rank 0's inputs (or `fill` everywhere).
  void* Upload(size_t n, DType dtype, std::optional<float> fill = std::nullopt) {
    std::vector<uint8_t> host(n * DTypeSize(dtype));
    for (size_t i = 0; i < n; ++i)
      StoreValue(host.data(), dtype, i, fill ? *fill : InputValue(0, i));
    Result<void*> p = device_->Alloc(host.size());
    EXPECT_OK(p.status());
    if (!p.ok()) return nullptr;
    buffers_.push_back(*p);
    EXPECT_OK(device_->CopyAsync(*p, host.data(), host.size(), CopyKind::kHostToDevice, *stream_));
    EXPECT_OK(device_->Synchronize(*stream_));  // `host` goes out of scope
    return *p;
  }
  std::vector<uint8_t> Download(const void* p, size_t n, DType dtype) {
    std::vector<uint8_t> host(n * DTypeSize(dtype));
    EXPECT_OK(device_->CopyAsync(host.data(), p, host.size(), CopyKind::kDeviceToHost, *stream_));
    EXPECT_OK(device_->Synchronize(*stream_));
    return host;
  }
  // Every element of `got` has the bits of rank 0's input put through `op` over a world of one.
  void ExpectInputs(const std::vector<uint8_t>& got, size_t n, DType dtype, ReduceOp op,
                    const std::string& what) {
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
      const uint32_t want = ExpectedBits(dtype, ExactSum(i, 1), op, 1);
      const uint32_t have = LoadBits(got.data(), dtype, i);
      if (have != want && ++bad <= 3) {
        ADD_FAILURE() << what << " " << device::DTypeName(dtype) << " element " << i << ": bits "
                      << have << ", expected " << want;
      }
    }
    EXPECT_EQ(bad, 0u) << what;
  }

  EnvGuard env_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Collective> collective_;
  std::vector<void*> buffers_;
};

// Odd sizes too: NCCL splits large buffers into chunks and channels.
constexpr size_t kCounts[] = {1, 1000, (size_t{1} << 20) + 3};

TEST_P(NcclGpuTest, AllGatherCopiesTheOneRanksPart) {
  const DType dtype = GetParam();
  for (size_t n : kCounts) {
    void* send = Upload(n, dtype);
    void* recv = Upload(n, dtype, -7.0f);
    ASSERT_OK(collective_->AllGather(send, recv, n, dtype, *stream_));
    ExpectInputs(Download(recv, n, dtype), n, dtype, ReduceOp::kSum, "all-gather");
    // In place: send is recv + rank * count.
    ASSERT_OK(collective_->AllGather(send, send, n, dtype, *stream_));
    ExpectInputs(Download(send, n, dtype), n, dtype, ReduceOp::kSum, "in-place all-gather");
  }
}

TEST_P(NcclGpuTest, AllToAllOfOneRankIsACopyThroughSendAndReceive) {
  const DType dtype = GetParam();
  for (size_t n : kCounts) {
    void* send = Upload(n, dtype);
    void* recv = Upload(n, dtype, -7.0f);
    ASSERT_OK(collective_->AllToAll(send, recv, n, dtype, *stream_));
    ExpectInputs(Download(recv, n, dtype), n, dtype, ReduceOp::kSum, "all-to-all");
  }
}

TEST_P(NcclGpuTest, SplitMakesAWorkingSubCommunicator) {
  // One GPU: the split of a world of one is a world of one, through ncclCommSplit.
  const DType dtype = GetParam();
  ASSERT_OK_AND_ASSIGN(auto sub, collective_->Split(0, 0));
  EXPECT_EQ(sub->backend(), Backend::kNccl);
  EXPECT_EQ(sub->world_size(), 1);
  EXPECT_EQ(sub->rank(), 0);
  const size_t n = 4099;
  void* send = Upload(n, dtype);
  void* recv = Upload(n, dtype, -7.0f);
  ASSERT_OK(sub->AllReduce(send, recv, n, dtype, ReduceOp::kSum, *stream_));
  ExpectInputs(Download(recv, n, dtype), n, dtype, ReduceOp::kSum, "split all-reduce");
  ASSERT_OK(device_->Synchronize(*stream_));
  EXPECT_EQ(collective_->Split(-1, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST_P(NcclGpuTest, ReduceScatterAndAllReduceSumAverageAndMax) {
  const DType dtype = GetParam();
  for (size_t n : kCounts) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      const std::string name(ReduceOpName(op));
      void* send = Upload(n, dtype);
      void* recv = Upload(n, dtype, 9.0f);
      ASSERT_OK(collective_->ReduceScatter(send, recv, n, dtype, op, *stream_));
      ExpectInputs(Download(recv, n, dtype), n, dtype, op, "reduce-scatter " + name);
      ASSERT_OK(collective_->AllReduce(send, recv, n, dtype, op, *stream_));
      ExpectInputs(Download(recv, n, dtype), n, dtype, op, "all-reduce " + name);
      ASSERT_OK(collective_->AllReduce(send, send, n, dtype, op, *stream_));
      ExpectInputs(Download(send, n, dtype), n, dtype, op, "in-place all-reduce " + name);
    }
  }
}

TEST_P(NcclGpuTest, BroadcastBarrierAndStreamOrder) {
  const DType dtype = GetParam();
  const size_t n = 4099;
  void* buf = Upload(n, dtype, 0.0f);
  void* src = Upload(n, dtype);
  // The copy enqueued before the broadcast must be what the broadcast sends, and the barrier
  // must not reorder anything.
  ASSERT_OK(
      device_->CopyAsync(buf, src, n * DTypeSize(dtype), CopyKind::kDeviceToDevice, *stream_));
  ASSERT_OK(collective_->Broadcast(buf, n * DTypeSize(dtype), 0, *stream_));
  ASSERT_OK(collective_->Barrier(*stream_));
  ExpectInputs(Download(buf, n, dtype), n, dtype, ReduceOp::kSum, "broadcast");
  // A root outside the world is refused at enqueue.
  Status bad = collective_->Broadcast(buf, 16, 1, *stream_);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad.ToString();
}

std::string DtypeTestName(const ::testing::TestParamInfo<DType>& param_info) {
  return std::string(device::DTypeName(param_info.param));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, NcclGpuTest,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16), DtypeTestName);

}  // namespace
}  // namespace strata::comm::testing

// The MPI backend with several ranks. Every rank runs this whole binary under mpirun (ctest:
// comm_mpi_np2, comm_mpi_np4), so every test enqueues the same collectives in the same order on
// every rank. Inputs are functions of (rank, index), so each rank computes the expected result
// locally; fp32 sums of the inputs are exact, so the expectation does not depend on the order of
// the additions (ReductionsAddInRankOrder checks that order with inputs whose sums round).
//
//   mpirun -n 4 --oversubscribe build/<dir>/tests/comm/strata_comm_mpi_tests
#include "comm/mpi_collective.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "comm/comm_test_util.h"
#include "comm/in_process_collective.h"
#include "comm/op.h"
#include "strata/collective.h"
#include "strata/device.h"
#include "strata/trace.h"

namespace strata::comm {
namespace {

using device::DType;
using testing::ExactSum;
using testing::ExpectedBits;
using testing::InputValue;
using testing::LoadBits;
using testing::StoreValue;

// Generous: a failure on one rank should fail the others instead of hanging the test, but a
// slow, oversubscribed machine must not trip it.
constexpr auto kTimeout = std::chrono::seconds(60);

class MpiFixture {
 protected:
  void Open(const internal::MpiTuning& tuning = {}) {
    device::DeviceOptions options;
    options.memory_budget = uint64_t{1} << 30;
    ASSERT_OK_AND_ASSIGN(device_, device::CreateDevice(options));
    ASSERT_OK_AND_ASSIGN(a_, device_->CreateStream("comm-a"));
    ASSERT_OK_AND_ASSIGN(b_, device_->CreateStream("comm-b"));
    CollectiveOptions collective_options;
    collective_options.timeout = kTimeout;
    collective_options.trace = &trace_;
    ASSERT_OK_AND_ASSIGN(collective_, internal::CreateMpiCollective(*device_, collective_options,
                                                                    DetectLaunch(), tuning));
    rank_ = collective_->rank();
    world_ = collective_->world_size();
  }
  void Close() {
    if (a_ != nullptr) EXPECT_OK(device_->Synchronize(*a_));
    if (b_ != nullptr) EXPECT_OK(device_->Synchronize(*b_));
    collective_.reset();
    a_.reset();
    b_.reset();
    for (void* p : allocations_)
      device_->Free(p);
    allocations_.clear();
  }

  // Device memory of n elements, zeroed.
  void* Buffer(size_t n, DType dtype) {
    auto ptr = device_->Alloc(std::max<size_t>(1, n * device::DTypeSize(dtype)));
    EXPECT_TRUE(ptr.ok()) << ptr.status().ToString();
    if (!ptr.ok()) return nullptr;
    allocations_.push_back(*ptr);
    std::memset(*ptr, 0, n * device::DTypeSize(dtype));
    return *ptr;
  }
  // Element j of `buffer` = InputValue(rank, index_base + j) for j < n.
  static void FillInput(void* buffer, DType dtype, size_t n, int rank, size_t index_base = 0) {
    for (size_t j = 0; j < n; ++j)
      StoreValue(buffer, dtype, j, InputValue(rank, index_base + j));
  }

  TraceRecorder trace_;
  std::unique_ptr<device::Device> device_;
  std::unique_ptr<device::Stream> a_, b_;
  std::unique_ptr<Collective> collective_;
  std::vector<void*> allocations_;
  int rank_ = 0;
  int world_ = 1;
};

// ---- each operation, each dtype and op, in place or not, small to large, chunked or not ---------

struct Size {
  size_t count;
  bool chunked;  // a tiny MpiTuning, so that the op is cut into many MPI calls and staged rounds
};
void PrintTo(const Size& size, std::ostream* os) {
  *os << size.count << (size.chunked ? " chunked" : "");
}

internal::MpiTuning TuningFor(const Size& size) {
  internal::MpiTuning tuning;
  if (size.chunked) {
    tuning.stage_elements = 1000;
    tuning.max_call_elements = 777;
  }
  return tuning;
}

using OpParam = std::tuple<DType, ReduceOp, bool /*in_place*/, Size>;

std::string OpParamName(const ::testing::TestParamInfo<OpParam>& info) {
  const auto& [dtype, op, in_place, size] = info.param;
  return fmt::format("{}_{}_{}_{}{}", device::DTypeName(dtype), ReduceOpName(op),
                     in_place ? "inplace" : "outofplace", size.count,
                     size.chunked ? "_chunked" : "");
}

class MpiOpTest : public MpiFixture, public ::testing::TestWithParam<OpParam> {
 protected:
  void SetUp() override { Open(TuningFor(std::get<3>(GetParam()))); }
  void TearDown() override { Close(); }
};

TEST_P(MpiOpTest, AllReduce) {
  const auto& [dtype, op, in_place, size] = GetParam();
  const size_t n = size.count;
  void* send = Buffer(n, dtype);
  void* recv = in_place ? send : Buffer(n, dtype);
  FillInput(send, dtype, n, rank_);
  ASSERT_OK(collective_->AllReduce(send, recv, n, dtype, op, *a_));
  ASSERT_OK(device_->Synchronize(*a_));
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(LoadBits(recv, dtype, i), ExpectedBits(dtype, ExactSum(i, world_), op, world_))
        << "element " << i << " on rank " << rank_;
  }
  if (!in_place) {  // send is untouched
    for (size_t i = 0; i < n; i += 997) {
      ASSERT_EQ(LoadBits(send, dtype, i),
                ExpectedBits(dtype, InputValue(rank_, i), ReduceOp::kSum, 1));
    }
  }
}

TEST_P(MpiOpTest, ReduceScatter) {
  const auto& [dtype, op, in_place, size] = GetParam();
  const size_t n = size.count;  // per rank
  const size_t whole = n * static_cast<size_t>(world_);
  const size_t elem = device::DTypeSize(dtype);
  void* send = Buffer(whole, dtype);
  FillInput(send, dtype, whole, rank_);
  void* recv = in_place ? static_cast<std::byte*>(send) + static_cast<size_t>(rank_) * n * elem
                        : Buffer(n, dtype);
  ASSERT_OK(collective_->ReduceScatter(send, recv, n, dtype, op, *a_));
  ASSERT_OK(device_->Synchronize(*a_));
  const size_t base = static_cast<size_t>(rank_) * n;
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(LoadBits(recv, dtype, i), ExpectedBits(dtype, ExactSum(base + i, world_), op, world_))
        << "element " << i << " on rank " << rank_;
  }
  if (in_place) {  // the other ranks' parts of send are untouched
    for (size_t i = 0; i < whole; i += 991) {
      if (i / n == static_cast<size_t>(rank_)) continue;
      ASSERT_EQ(LoadBits(send, dtype, i),
                ExpectedBits(dtype, InputValue(rank_, i), ReduceOp::kSum, 1));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Ops, MpiOpTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values(ReduceOp::kSum, ReduceOp::kAvg), ::testing::Bool(),
                       ::testing::Values(Size{1, false}, Size{1000003, false}, Size{10007, true})),
    OpParamName);

using GatherParam = std::tuple<DType, bool /*in_place*/, Size>;

std::string GatherParamName(const ::testing::TestParamInfo<GatherParam>& info) {
  const auto& [dtype, in_place, size] = info.param;
  return fmt::format("{}_{}_{}{}", device::DTypeName(dtype), in_place ? "inplace" : "outofplace",
                     size.count, size.chunked ? "_chunked" : "");
}

class MpiAllGatherTest : public MpiFixture, public ::testing::TestWithParam<GatherParam> {
 protected:
  void SetUp() override { Open(TuningFor(std::get<2>(GetParam()))); }
  void TearDown() override { Close(); }
};

TEST_P(MpiAllGatherTest, AllGather) {
  const auto& [dtype, in_place, size] = GetParam();
  const size_t n = size.count;
  const size_t elem = device::DTypeSize(dtype);
  void* recv = Buffer(n * static_cast<size_t>(world_), dtype);
  void* send = in_place ? static_cast<std::byte*>(recv) + static_cast<size_t>(rank_) * n * elem
                        : Buffer(n, dtype);
  // Rank r contributes InputValue(r, r * n + j), so the gathered whole is InputValue(q, i) at i.
  FillInput(send, dtype, n, rank_, static_cast<size_t>(rank_) * n);
  ASSERT_OK(collective_->AllGather(send, recv, n, dtype, *a_));
  ASSERT_OK(device_->Synchronize(*a_));
  for (size_t i = 0; i < n * static_cast<size_t>(world_); ++i) {
    const int q = static_cast<int>(i / n);
    ASSERT_EQ(LoadBits(recv, dtype, i), ExpectedBits(dtype, InputValue(q, i), ReduceOp::kSum, 1))
        << "element " << i << " on rank " << rank_;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Ops, MpiAllGatherTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16), ::testing::Bool(),
                       ::testing::Values(Size{1, false}, Size{1000003, false}, Size{10007, true})),
    GatherParamName);

using AllToAllParam = std::tuple<DType, Size>;

std::string AllToAllParamName(const ::testing::TestParamInfo<AllToAllParam>& info) {
  const auto& [dtype, size] = info.param;
  return fmt::format("{}_{}{}", device::DTypeName(dtype), size.count,
                     size.chunked ? "_chunked" : "");
}

class MpiAllToAllTest : public MpiFixture, public ::testing::TestWithParam<AllToAllParam> {
 protected:
  void SetUp() override { Open(TuningFor(std::get<1>(GetParam()))); }
  void TearDown() override { Close(); }
};

TEST_P(MpiAllToAllTest, AllToAll) {
  const auto& [dtype, size] = GetParam();
  const size_t n = size.count;
  const size_t whole = n * static_cast<size_t>(world_);
  void* send = Buffer(whole, dtype);
  void* recv = Buffer(whole, dtype);
  // Rank q sends InputValue(q, k) at k; this rank receives q's elements [rank * n, (rank + 1) * n).
  FillInput(send, dtype, whole, rank_);
  ASSERT_OK(collective_->AllToAll(send, recv, n, dtype, *a_));
  ASSERT_OK(device_->Synchronize(*a_));
  for (size_t i = 0; i < whole; ++i) {
    const int q = static_cast<int>(i / n);
    const size_t k = static_cast<size_t>(rank_) * n + i % n;
    ASSERT_EQ(LoadBits(recv, dtype, i), ExpectedBits(dtype, InputValue(q, k), ReduceOp::kSum, 1))
        << "element " << i << " on rank " << rank_;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Ops, MpiAllToAllTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values(Size{1, false}, Size{100003, false}, Size{10007, true})),
    AllToAllParamName);

// ---- the rest ----------------------------------------------------------------------------------

class MpiCollectiveTest : public MpiFixture, public ::testing::Test {
 protected:
  void SetUp() override { Open(); }
  void TearDown() override { Close(); }
};

TEST_F(MpiCollectiveTest, MaxTakesTheLargestValue) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(device::DTypeName(dtype));
    const size_t n = 10007;
    const size_t whole = n * static_cast<size_t>(world_);
    void* send = Buffer(whole, dtype);
    void* reduced = Buffer(whole, dtype);
    void* scattered = Buffer(n, dtype);
    FillInput(send, dtype, whole, rank_);
    ASSERT_OK(collective_->AllReduce(send, reduced, whole, dtype, ReduceOp::kMax, *a_));
    ASSERT_OK(collective_->ReduceScatter(send, scattered, n, dtype, ReduceOp::kMax, *a_));
    ASSERT_OK(device_->Synchronize(*a_));
    for (size_t i = 0; i < whole; ++i) {
      ASSERT_EQ(LoadBits(reduced, dtype, i),
                ExpectedBits(dtype, testing::MaxInput(i, world_), ReduceOp::kMax, world_))
          << "all-reduce element " << i << " on rank " << rank_;
    }
    for (size_t i = 0; i < n; ++i) {
      const size_t at = static_cast<size_t>(rank_) * n + i;
      ASSERT_EQ(LoadBits(scattered, dtype, i),
                ExpectedBits(dtype, testing::MaxInput(at, world_), ReduceOp::kMax, world_))
          << "reduce-scatter element " << i << " on rank " << rank_;
    }
  }
}

TEST_F(MpiCollectiveTest, RankAndWorldComeFromTheLauncher) {
  const LaunchInfo launch = DetectLaunch();
  EXPECT_EQ(collective_->backend(), Backend::kMpi);
  EXPECT_EQ(rank_, launch.rank);
  EXPECT_EQ(world_, launch.world_size);
  EXPECT_GE(world_, 2) << "run this binary under mpirun with at least 2 ranks";
}

TEST_F(MpiCollectiveTest, AllReduceGivesEveryRankTheSameBits) {
  // Random inputs whose sums round (unlike the exact inputs above): the result depends on the
  // order of the additions, and every rank must still get the very same bits.
  constexpr size_t kCount = 300007;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(device::DTypeName(dtype));
    void* data = Buffer(kCount, dtype);
    std::mt19937 random(1234 + static_cast<unsigned>(rank_));
    std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
    std::uniform_int_distribution<int> exponent(-20, 20);
    for (size_t i = 0; i < kCount; ++i)
      StoreValue(data, dtype, i, std::ldexp(mantissa(random), exponent(random)));
    ASSERT_OK(collective_->AllReduce(data, data, kCount, dtype, ReduceOp::kSum, *a_));
    // Gather every rank's result and compare them bit for bit.
    const size_t elem = device::DTypeSize(dtype);
    void* all = Buffer(kCount * static_cast<size_t>(world_), dtype);
    ASSERT_OK(collective_->AllGather(data, all, kCount, dtype, *a_));
    ASSERT_OK(device_->Synchronize(*a_));
    for (int q = 0; q < world_; ++q) {
      ASSERT_EQ(std::memcmp(static_cast<std::byte*>(all) + static_cast<size_t>(q) * kCount * elem,
                            data, kCount * elem),
                0)
          << "rank " << q << "'s result differs from rank " << rank_ << "'s";
    }
  }
}

TEST_F(MpiCollectiveTest, ReductionsAddInRankOrder) {
  // Inputs whose sums round, and in which the order of the additions shows: rank q's value at i
  // is a random number times a random power of two in [2^-12, 2^12] (so the partial sums lose
  // different low bits depending on which ranks are added first). Every rank regenerates every
  // rank's inputs and computes the sum in rank order (fp32, one rounding, then the avg scale), and
  // both reductions must give exactly those bits (each dtype, in place or not, whole and chunked).
  // With 2 ranks any order gives the same bits; comm_mpi_np4 is the run that can tell.
  constexpr size_t kPerRank = 20011;
  const auto world = static_cast<size_t>(world_);
  const size_t whole = kPerRank * world;
  std::vector<std::vector<float>> values(world, std::vector<float>(whole));
  for (size_t q = 0; q < world; ++q) {
    std::mt19937 random(977 + static_cast<unsigned>(q));
    std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
    std::uniform_int_distribution<int> exponent(-12, 12);
    for (float& v : values[q]) {
      const float m = mantissa(random);
      v = std::ldexp(m, exponent(random));
    }
  }
  auto value = [&](size_t q, size_t i) { return values[q][i]; };
  for (bool chunked : {false, true}) {
    Close();
    Open(TuningFor(Size{whole, chunked}));
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (auto [op, in_place] : {std::pair{ReduceOp::kSum, false}, std::pair{ReduceOp::kAvg, true},
                                  std::pair{ReduceOp::kSum, true}}) {
        SCOPED_TRACE(fmt::format("{} {}{}{}", device::DTypeName(dtype), ReduceOpName(op),
                                 in_place ? " in place" : "", chunked ? " chunked" : ""));
        const size_t elem = device::DTypeSize(dtype);
        void* expected = Buffer(whole, dtype);
        void* probe = Buffer(1, dtype);
        for (size_t i = 0; i < whole; ++i) {
          float acc = 0.0f;
          for (size_t q = 0; q < world; ++q) {  // each input as stored in `dtype`, widened
            StoreValue(probe, dtype, 0, value(q, i));
            float widened = 0.0f;
            internal::WidenToF32(probe, dtype, &widened, 1);
            acc = q == 0 ? widened : acc + widened;
          }
          internal::NarrowFromF32(&acc, op == ReduceOp::kAvg ? internal::AvgScale(world_) : 1.0f,
                                  static_cast<std::byte*>(expected) + i * elem, dtype, 1);
        }
        void* input = Buffer(whole, dtype);
        void* input_too = Buffer(whole, dtype);  // the all-reduce's (in place, it is its result)
        for (size_t i = 0; i < whole; ++i) {
          StoreValue(input, dtype, i, value(static_cast<size_t>(rank_), i));
          StoreValue(input_too, dtype, i, value(static_cast<size_t>(rank_), i));
        }
        void* scattered =
            in_place ? static_cast<std::byte*>(input) + static_cast<size_t>(rank_) * kPerRank * elem
                     : Buffer(kPerRank, dtype);
        void* reduced = in_place ? input_too : Buffer(whole, dtype);
        ASSERT_OK(collective_->ReduceScatter(input, scattered, kPerRank, dtype, op, *a_));
        ASSERT_OK(collective_->AllReduce(input_too, reduced, whole, dtype, op, *a_));
        ASSERT_OK(device_->Synchronize(*a_));
        const size_t base = static_cast<size_t>(rank_) * kPerRank;
        for (size_t i = 0; i < kPerRank; ++i) {
          ASSERT_EQ(LoadBits(scattered, dtype, i), LoadBits(expected, dtype, base + i))
              << "reduce-scatter, element " << i << " on rank " << rank_;
        }
        for (size_t i = 0; i < whole; ++i) {
          ASSERT_EQ(LoadBits(reduced, dtype, i), LoadBits(expected, dtype, i))
              << "all-reduce, element " << i << " on rank " << rank_;
        }
      }
    }
  }
}

TEST_F(MpiCollectiveTest, TheInProcessBackendGivesTheSameBits) {
  // Inputs whose sums round (as above). This rank reduces its own with MPI; it also runs an
  // in-process world of as many threads, each reducing that rank's inputs on a device of its
  // own, and this rank's thread must get the bits MPI gave this rank.
  constexpr size_t kPerRank = 5003;
  const auto world = static_cast<size_t>(world_);
  const size_t whole = kPerRank * world;
  auto inputs = [&](size_t q) {
    std::vector<float> v(whole);
    std::mt19937 random(4711 + static_cast<unsigned>(q));
    std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
    std::uniform_int_distribution<int> exponent(-12, 12);
    for (float& x : v)
      x = std::ldexp(mantissa(random), exponent(random));
    return v;
  };
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      SCOPED_TRACE(fmt::format("{} {}", device::DTypeName(dtype), ReduceOpName(op)));
      const size_t elem = device::DTypeSize(dtype);
      const std::vector<float> mine = inputs(static_cast<size_t>(rank_));
      void* input = Buffer(whole, dtype);
      for (size_t i = 0; i < whole; ++i)
        StoreValue(input, dtype, i, mine[i]);
      void* scattered = Buffer(kPerRank, dtype);
      void* reduced = Buffer(whole, dtype);
      ASSERT_OK(collective_->ReduceScatter(input, scattered, kPerRank, dtype, op, *a_));
      ASSERT_OK(collective_->AllReduce(input, reduced, whole, dtype, op, *a_));
      ASSERT_OK(device_->Synchronize(*a_));

      ASSERT_OK_AND_ASSIGN(auto in_process, InProcessWorld::Create({.world_size = world_}));
      std::vector<std::byte> threads_scattered(kPerRank * elem), threads_reduced(whole * elem);
      std::vector<std::thread> threads;
      for (int q = 0; q < world_; ++q) {
        threads.emplace_back([&, q] {
          ASSERT_OK_AND_ASSIGN(auto dev, device::CreateDevice({}));
          ASSERT_OK_AND_ASSIGN(auto stream, dev->CreateStream("in-process"));
          ASSERT_OK_AND_ASSIGN(auto comm, in_process->Join(q, *dev));
          const std::vector<float> theirs = inputs(static_cast<size_t>(q));
          ASSERT_OK_AND_ASSIGN(void* in, dev->Alloc(whole * elem));
          ASSERT_OK_AND_ASSIGN(void* out_scattered, dev->Alloc(kPerRank * elem));
          ASSERT_OK_AND_ASSIGN(void* out_reduced, dev->Alloc(whole * elem));
          for (size_t i = 0; i < whole; ++i)
            StoreValue(in, dtype, i, theirs[i]);
          ASSERT_OK(comm->ReduceScatter(in, out_scattered, kPerRank, dtype, op, *stream));
          ASSERT_OK(comm->AllReduce(in, out_reduced, whole, dtype, op, *stream));
          ASSERT_OK(dev->Synchronize(*stream));
          if (q == rank_) {
            std::memcpy(threads_scattered.data(), out_scattered, kPerRank * elem);
            std::memcpy(threads_reduced.data(), out_reduced, whole * elem);
          }
          comm.reset();
          stream.reset();
          for (void* p : {in, out_scattered, out_reduced})
            dev->Free(p);
        });
      }
      for (auto& t : threads)
        t.join();
      EXPECT_EQ(std::memcmp(threads_scattered.data(), scattered, kPerRank * elem), 0)
          << "reduce-scatter on rank " << rank_;
      EXPECT_EQ(std::memcmp(threads_reduced.data(), reduced, whole * elem), 0)
          << "all-reduce on rank " << rank_;
    }
  }
}

TEST_F(MpiCollectiveTest, BroadcastFromEveryRoot) {
  for (size_t bytes : {size_t{1}, size_t{4099}, (size_t{1} << 20) + 3}) {
    auto* buffer = static_cast<uint8_t*>(Buffer(bytes, DType::kBF16));  // 2x the bytes: plenty
    for (int root = 0; root < world_; ++root) {
      SCOPED_TRACE(fmt::format("{} bytes from rank {}", bytes, root));
      for (size_t i = 0; i < bytes; ++i)
        buffer[i] = static_cast<uint8_t>(rank_ == root ? (i * 7 + root * 13) : 0xee);
      ASSERT_OK(collective_->Broadcast(buffer, bytes, root, *a_));
      ASSERT_OK(device_->Synchronize(*a_));
      for (size_t i = 0; i < bytes; ++i) {
        ASSERT_EQ(buffer[i], static_cast<uint8_t>(i * 7 + root * 13)) << i;
      }
      EXPECT_EQ(buffer[bytes], 0) << "a byte past the broadcast changed";
    }
  }
}

TEST_F(MpiCollectiveTest, BarrierWaitsForEveryRank) {
  // Rank r reaches the barrier (world - 1 - r) * 100 ms late; nobody may leave it before the
  // last one arrived. Times are steady_clock nanoseconds, comparable across processes of one
  // machine, exchanged as raw bytes with an all-gather.
  auto* times = static_cast<int64_t*>(Buffer(2 * static_cast<size_t>(world_), DType::kF32));
  auto* mine = static_cast<int64_t*>(Buffer(2, DType::kF32));  // fp32 x 2 = one int64
  auto now_ns = [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  };
  int64_t arrived = 0;
  int64_t left = 0;
  ASSERT_OK(device_->HostTask(
      *a_,
      [&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100 * (world_ - 1 - rank_)));
        arrived = now_ns();
        *mine = arrived;
        return Status::Ok();
      },
      "arrive"));
  ASSERT_OK(collective_->Barrier(*a_));
  ASSERT_OK(device_->HostTask(
      *a_,
      [&] {
        left = now_ns();
        return Status::Ok();
      },
      "leave"));
  ASSERT_OK(collective_->AllGather(mine, times, 2, DType::kF32, *a_));
  ASSERT_OK(device_->Synchronize(*a_));
  for (int q = 0; q < world_; ++q) {
    EXPECT_LE(times[q], left) << "rank " << q << " arrived after rank " << rank_ << " left";
  }
  EXPECT_EQ(times[rank_], arrived);
}

TEST_F(MpiCollectiveTest, ManyOperationsOnTwoStreamsFollowEnqueueOrder) {
  // 200 all-reduces alternating between two streams, each on its own buffer. Rank-dependent
  // delays on one stream make the streams reach their operations in a different order on each
  // rank; the backend must still run them in enqueue order everywhere (or it deadlocks or mixes
  // buffers up).
  constexpr int kOps = 200;
  constexpr size_t kCount = 257;
  std::vector<float*> buffers;
  for (int k = 0; k < kOps; ++k) {
    buffers.push_back(static_cast<float*>(Buffer(kCount, DType::kF32)));
  }
  for (int k = 0; k < kOps; ++k) {
    device::Stream& stream = k % 2 == 0 ? *a_ : *b_;
    if (k % 40 == (rank_ % 2 == 0 ? 0 : 1)) {
      ASSERT_OK(device_->HostTask(
          stream,
          [] {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
            return Status::Ok();
          },
          "delay"));
    }
    ASSERT_OK(device_->Fill(buffers[k], DType::kF32, testing::OrderingInput(k, rank_), kCount,
                            stream));
    ASSERT_OK(collective_->AllReduce(buffers[k], buffers[k], kCount, DType::kF32,
                                     testing::OrderingOp(k), stream));
  }
  ASSERT_OK(device_->Synchronize(*a_));
  ASSERT_OK(device_->Synchronize(*b_));
  for (int k = 0; k < kOps; ++k) {
    const float expected = testing::OrderingResult(k, world_);
    ASSERT_EQ(buffers[k][0], expected) << "operation " << k;
    ASSERT_EQ(buffers[k][kCount - 1], expected) << "operation " << k;
  }
}

TEST_F(MpiCollectiveTest, AnOperationSeesEarlierStreamWorkAndLaterWorkSeesItsResult) {
  constexpr size_t kCount = 100000;
  auto* x = static_cast<float*>(Buffer(kCount, DType::kF32));
  auto* y = static_cast<float*>(Buffer(kCount, DType::kF32));
  // Stream b produces x; stream a waits for it (an event), reduces it, and scales the result.
  ASSERT_OK_AND_ASSIGN(auto produced, device_->CreateEvent());
  ASSERT_OK(device_->HostTask(
      *b_,
      [] {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        return Status::Ok();
      },
      "slow producer"));
  ASSERT_OK(device_->Fill(x, DType::kF32, static_cast<float>(rank_ + 1), kCount, *b_));
  ASSERT_OK(device_->Record(*produced, *b_));
  ASSERT_OK(device_->Wait(*a_, *produced));
  ASSERT_OK(collective_->AllReduce(x, y, kCount, DType::kF32, ReduceOp::kSum, *a_));
  ASSERT_OK(device_->Scale(y, DType::kF32, 2.0f, kCount, *a_));
  ASSERT_OK(device_->Synchronize(*a_));
  const float expected = static_cast<float>(world_ * (world_ + 1));  // 2 * sum of 1..world
  EXPECT_EQ(y[0], expected);
  EXPECT_EQ(y[kCount - 1], expected);
}

TEST_F(MpiCollectiveTest, TwoCollectivesShareOneOrder) {
  CollectiveOptions options;
  options.timeout = kTimeout;
  ASSERT_OK_AND_ASSIGN(auto second, CreateCollective(*device_, options));
  EXPECT_EQ(second->backend(), Backend::kMpi);
  auto* x = static_cast<float*>(Buffer(64, DType::kF32));
  auto* y = static_cast<float*>(Buffer(64, DType::kF32));
  for (int k = 0; k < 10; ++k) {
    ASSERT_OK(device_->Fill(x, DType::kF32, 1.0f, 64, *a_));
    ASSERT_OK(device_->Fill(y, DType::kF32, 2.0f, 64, *b_));
    ASSERT_OK(collective_->AllReduce(x, x, 64, DType::kF32, ReduceOp::kSum, *a_));
    ASSERT_OK(second->AllReduce(y, y, 64, DType::kF32, ReduceOp::kSum, *b_));
  }
  ASSERT_OK(device_->Synchronize(*a_));
  ASSERT_OK(device_->Synchronize(*b_));
  EXPECT_EQ(x[63], static_cast<float>(world_));
  EXPECT_EQ(y[63], 2.0f * static_cast<float>(world_));
}

TEST_F(MpiCollectiveTest, SplitGroupsRunTheirOwnOperationsInterleavedWithTheWorlds) {
  // Pairs of ranks as "nodes" ({0,1}, {2,3}) when the world is even; odd worlds split in halves
  // by parity instead. Sums of 2^rank say exactly which ranks took part.
  const int color = world_ % 2 == 0 ? rank_ / 2 : rank_ % 2;
  ASSERT_OK_AND_ASSIGN(auto group, collective_->Split(color, rank_));
  ASSERT_OK_AND_ASSIGN(auto reversed, collective_->Split(0, -rank_));
  EXPECT_EQ(group->backend(), Backend::kMpi);
  EXPECT_EQ(reversed->rank(), world_ - 1 - rank_);
  EXPECT_EQ(reversed->world_size(), world_);
  float expected_group = 0;
  int group_rank = 0;
  int group_size = 0;
  for (int q = 0; q < world_; ++q) {
    const int qc = world_ % 2 == 0 ? q / 2 : q % 2;
    if (qc != color) continue;
    expected_group += static_cast<float>(1 << q);
    if (q < rank_) ++group_rank;
    ++group_size;
  }
  EXPECT_EQ(group->rank(), group_rank);
  EXPECT_EQ(group->world_size(), group_size);
  auto* x = static_cast<float*>(Buffer(1, DType::kF32));
  auto* y = static_cast<float*>(Buffer(1, DType::kF32));
  auto* z = static_cast<float*>(Buffer(world_, DType::kF32));
  for (int k = 0; k < 5; ++k) {
    *x = static_cast<float>(1 << rank_);
    *y = static_cast<float>(1 << rank_);
    ASSERT_OK(group->AllReduce(x, x, 1, DType::kF32, ReduceOp::kSum, *a_));
    ASSERT_OK(collective_->AllReduce(y, y, 1, DType::kF32, ReduceOp::kSum, *b_));
    z[reversed->rank()] = static_cast<float>(rank_);
    ASSERT_OK(reversed->AllGather(z + reversed->rank(), z, 1, DType::kF32, *a_));
    ASSERT_OK(device_->Synchronize(*a_));
    ASSERT_OK(device_->Synchronize(*b_));
    EXPECT_EQ(*x, expected_group);
    EXPECT_EQ(*y, static_cast<float>((1 << world_) - 1));
    for (int q = 0; q < world_; ++q)
      EXPECT_EQ(z[q], static_cast<float>(world_ - 1 - q));
  }
  EXPECT_EQ(collective_->Split(-2, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(MpiCollectiveTest, RecordsOperationsOnTheCommTrack) {
  auto* x = static_cast<float*>(Buffer(1024, DType::kF32));
  ASSERT_OK(collective_->AllReduce(x, x, 1024, DType::kF32, ReduceOp::kSum, *a_));
  ASSERT_OK(collective_->Barrier(*a_));
  ASSERT_OK(device_->Synchronize(*a_));
  const auto names = trace_.TrackNames();
  std::vector<std::string> comm;
  for (const TraceEvent& event : trace_.Events()) {
    if (names.at(event.track) == "comm") comm.push_back(event.name);
  }
  EXPECT_EQ(comm, (std::vector<std::string>{"all-reduce fp32", "barrier"}));
}

TEST_F(MpiCollectiveTest, RootOutsideTheWorldIsInvalid) {
  auto* x = Buffer(16, DType::kF32);
  EXPECT_EQ(collective_->Broadcast(x, 16, world_, *a_).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::comm

// The in-process backend (comm/in_process_collective.h): N ranks as threads of this process, each
// with its own CPU device. The same checks as the MPI backend's tests under mpirun (each
// operation against exact sums, reductions in rank order, enqueue order across streams), plus
// what only a world in one process can show without waiting: a missing rank named at the
// timeout (on a manual clock), a failed or departed rank aborting the others at once, ranks that
// disagree on an operation.
#include "comm/in_process_collective.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <latch>
#include <memory>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "comm/collective_wrapper.h"
#include "comm/comm_test_util.h"
#include "comm/op.h"
#include "comm/topology.h"
#include "common/clock.h"
#include "strata/collective.h"
#include "strata/device.h"

namespace strata::comm {
namespace {

using device::DType;
using testing::ExactSum;
using testing::ExpectedBits;
using testing::InputValue;
using testing::LoadBits;
using testing::MaxInput;
using testing::StoreValue;

// One rank: its device, two streams, its collective and its buffers.
struct Rank {
  int rank = 0;
  std::unique_ptr<device::Device> device;
  std::unique_ptr<device::Stream> a, b;
  std::unique_ptr<Collective> comm;
  std::vector<void*> buffers;

  // Device memory of n elements, zeroed.
  void* Buffer(size_t n, DType dtype) {
    auto ptr = device->Alloc(std::max<size_t>(1, n * device::DTypeSize(dtype)));
    EXPECT_TRUE(ptr.ok()) << ptr.status().ToString();
    if (!ptr.ok()) return nullptr;
    buffers.push_back(*ptr);
    std::memset(*ptr, 0, n * device::DTypeSize(dtype));
    return *ptr;
  }
  ~Rank() {
    if (a != nullptr) (void)device->Synchronize(*a);
    if (b != nullptr) (void)device->Synchronize(*b);
    comm.reset();
    a.reset();
    b.reset();
    for (void* p : buffers)
      device->Free(p);
  }
};

// Makes a world of `world` ranks and runs `body` for each on its own thread (rank r's device,
// streams and collective are made on that thread), then joins them.
void RunRanks(int world, const std::function<void(Rank&)>& body, InProcessOptions options = {}) {
  options.world_size = world;
  auto made = InProcessWorld::Create(options);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  std::shared_ptr<InProcessWorld> w = *made;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      Rank rank;
      rank.rank = r;
      device::DeviceOptions o;
      o.memory_budget = uint64_t{1} << 28;
      o.name = fmt::format("cpu:rank{}", r);
      ASSERT_OK_AND_ASSIGN(rank.device, device::CreateDevice(o));
      ASSERT_OK_AND_ASSIGN(rank.a, rank.device->CreateStream("comm-a"));
      ASSERT_OK_AND_ASSIGN(rank.b, rank.device->CreateStream("comm-b"));
      ASSERT_OK_AND_ASSIGN(rank.comm, w->Join(r, *rank.device));
      body(rank);
    });
  }
  for (auto& t : threads)
    t.join();
}

// Element j of `buffer` = InputValue(rank, index_base + j) for j < n.
void FillInput(void* buffer, DType dtype, size_t n, int rank, size_t index_base = 0) {
  for (size_t j = 0; j < n; ++j)
    StoreValue(buffer, dtype, j, InputValue(rank, index_base + j));
}

// ---- each operation, each dtype and op, in place or not ---------------------------------------

using OpParam = std::tuple<int /*world*/, DType, ReduceOp, bool /*in_place*/>;

std::string OpParamName(const ::testing::TestParamInfo<OpParam>& info) {
  const auto& [world, dtype, op, in_place] = info.param;
  return fmt::format("world{}_{}_{}_{}", world, device::DTypeName(dtype), ReduceOpName(op),
                     in_place ? "inplace" : "outofplace");
}

class InProcessOpTest : public ::testing::TestWithParam<OpParam> {};

constexpr size_t kCount = 10007;  // not a multiple of anything the backend blocks by

TEST_P(InProcessOpTest, AllReduceGivesTheExactSums) {
  const auto& [world, dtype, op, in_place] = GetParam();
  RunRanks(world, [&](Rank& r) {
    void* send = r.Buffer(kCount, dtype);
    void* recv = in_place ? send : r.Buffer(kCount, dtype);
    FillInput(send, dtype, kCount, r.rank);
    ASSERT_OK(r.comm->AllReduce(send, recv, kCount, dtype, op, *r.a));
    ASSERT_OK(r.device->Synchronize(*r.a));
    for (size_t i = 0; i < kCount; ++i) {
      ASSERT_EQ(LoadBits(recv, dtype, i), ExpectedBits(dtype, ExactSum(i, world), op, world))
          << "element " << i << " on rank " << r.rank;
    }
    if (!in_place) {
      for (size_t i = 0; i < kCount; i += 97) {
        ASSERT_EQ(LoadBits(send, dtype, i),
                  ExpectedBits(dtype, InputValue(r.rank, i), ReduceOp::kSum, 1));
      }
    }
  });
}

TEST_P(InProcessOpTest, ReduceScatterGivesEachRankItsPartOfTheExactSums) {
  const auto& [world, dtype, op, in_place] = GetParam();
  RunRanks(world, [&](Rank& r) {
    const size_t whole = kCount * static_cast<size_t>(world);
    const size_t elem = device::DTypeSize(dtype);
    void* send = r.Buffer(whole, dtype);
    FillInput(send, dtype, whole, r.rank);
    void* recv = in_place
                     ? static_cast<std::byte*>(send) + static_cast<size_t>(r.rank) * kCount * elem
                     : r.Buffer(kCount, dtype);
    ASSERT_OK(r.comm->ReduceScatter(send, recv, kCount, dtype, op, *r.a));
    ASSERT_OK(r.device->Synchronize(*r.a));
    const size_t base = static_cast<size_t>(r.rank) * kCount;
    for (size_t i = 0; i < kCount; ++i) {
      ASSERT_EQ(LoadBits(recv, dtype, i), ExpectedBits(dtype, ExactSum(base + i, world), op, world))
          << "element " << i << " on rank " << r.rank;
    }
    if (in_place) {  // the other ranks' parts of send are untouched
      for (size_t i = 0; i < whole; i += 91) {
        if (i / kCount == static_cast<size_t>(r.rank)) continue;
        ASSERT_EQ(LoadBits(send, dtype, i),
                  ExpectedBits(dtype, InputValue(r.rank, i), ReduceOp::kSum, 1));
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Ops, InProcessOpTest,
    ::testing::Combine(::testing::Values(1, 3, 4),
                       ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values(ReduceOp::kSum, ReduceOp::kAvg), ::testing::Bool()),
    OpParamName);

using GatherParam = std::tuple<int /*world*/, DType, bool /*in_place*/>;

std::string GatherParamName(const ::testing::TestParamInfo<GatherParam>& info) {
  const auto& [world, dtype, in_place] = info.param;
  return fmt::format("world{}_{}_{}", world, device::DTypeName(dtype),
                     in_place ? "inplace" : "outofplace");
}

class InProcessAllGatherTest : public ::testing::TestWithParam<GatherParam> {};

TEST_P(InProcessAllGatherTest, AllGatherPutsEachRanksPartAtItsOffset) {
  const auto& [world, dtype, in_place] = GetParam();
  RunRanks(world, [&](Rank& r) {
    const size_t elem = device::DTypeSize(dtype);
    void* recv = r.Buffer(kCount * static_cast<size_t>(world), dtype);
    void* send = in_place
                     ? static_cast<std::byte*>(recv) + static_cast<size_t>(r.rank) * kCount * elem
                     : r.Buffer(kCount, dtype);
    FillInput(send, dtype, kCount, r.rank, static_cast<size_t>(r.rank) * kCount);
    ASSERT_OK(r.comm->AllGather(send, recv, kCount, dtype, *r.a));
    ASSERT_OK(r.device->Synchronize(*r.a));
    for (size_t i = 0; i < kCount * static_cast<size_t>(world); ++i) {
      const int q = static_cast<int>(i / kCount);
      ASSERT_EQ(LoadBits(recv, dtype, i), ExpectedBits(dtype, InputValue(q, i), ReduceOp::kSum, 1))
          << "element " << i << " on rank " << r.rank;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ops, InProcessAllGatherTest,
                         ::testing::Combine(::testing::Values(1, 3, 4),
                                            ::testing::Values(DType::kF32, DType::kBF16,
                                                              DType::kF16),
                                            ::testing::Bool()),
                         GatherParamName);

using AllToAllParam = std::tuple<int /*world*/, DType>;

std::string AllToAllParamName(const ::testing::TestParamInfo<AllToAllParam>& info) {
  return fmt::format("world{}_{}", std::get<0>(info.param),
                     device::DTypeName(std::get<1>(info.param)));
}

class InProcessAllToAllTest : public ::testing::TestWithParam<AllToAllParam> {};

TEST_P(InProcessAllToAllTest, AllToAllSendsEachRankItsPart) {
  const auto& [world, dtype] = GetParam();
  RunRanks(world, [&](Rank& r) {
    const size_t whole = kCount * static_cast<size_t>(world);
    void* send = r.Buffer(whole, dtype);
    void* recv = r.Buffer(whole, dtype);
    // Rank q sends InputValue(q, k) at k; rank r receives q's elements [r * n, (r + 1) * n).
    FillInput(send, dtype, whole, r.rank);
    ASSERT_OK(r.comm->AllToAll(send, recv, kCount, dtype, *r.a));
    ASSERT_OK(r.device->Synchronize(*r.a));
    for (size_t i = 0; i < whole; ++i) {
      const int q = static_cast<int>(i / kCount);
      const size_t k = static_cast<size_t>(r.rank) * kCount + i % kCount;
      ASSERT_EQ(LoadBits(recv, dtype, i), ExpectedBits(dtype, InputValue(q, k), ReduceOp::kSum, 1))
          << "element " << i << " on rank " << r.rank;
    }
    // The buffers must not overlap: an all-to-all has no in-place form.
    const Status st = r.comm->AllToAll(send, send, kCount, dtype, *r.a);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find("must be disjoint"), std::string_view::npos) << st.ToString();
  });
}

INSTANTIATE_TEST_SUITE_P(Ops, InProcessAllToAllTest,
                         ::testing::Combine(::testing::Values(1, 3, 4),
                                            ::testing::Values(DType::kF32, DType::kBF16,
                                                              DType::kF16)),
                         AllToAllParamName);

// ---- the rest ----------------------------------------------------------------------------------

TEST(InProcessCollectiveTest, MaxTakesTheLargestValueAndANanWins) {
  for (int world : {1, 3, 4}) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(fmt::format("world {}, {}", world, device::DTypeName(dtype)));
      RunRanks(world, [&](Rank& r) {
        const size_t whole = kCount * static_cast<size_t>(world);
        void* send = r.Buffer(whole, dtype);
        void* reduced = r.Buffer(whole, dtype);
        void* scattered = r.Buffer(kCount, dtype);
        FillInput(send, dtype, whole, r.rank);
        // The last rank's element 1 is NaN: the result there is NaN on every rank.
        if (r.rank == world - 1) StoreValue(send, dtype, 1, std::nanf(""));
        ASSERT_OK(r.comm->AllReduce(send, reduced, whole, dtype, ReduceOp::kMax, *r.a));
        ASSERT_OK(r.comm->ReduceScatter(send, scattered, kCount, dtype, ReduceOp::kMax, *r.a));
        ASSERT_OK(r.device->Synchronize(*r.a));
        for (size_t i = 0; i < whole; ++i) {
          if (i == 1) {
            float back = 0.0f;
            device::ConvertHost(static_cast<const char*>(reduced) + device::DTypeSize(dtype),
                                dtype, &back, DType::kF32, 1);
            EXPECT_TRUE(std::isnan(back));
            continue;
          }
          ASSERT_EQ(LoadBits(reduced, dtype, i),
                    ExpectedBits(dtype, MaxInput(i, world), ReduceOp::kMax, world))
              << "all-reduce element " << i << " on rank " << r.rank;
        }
        for (size_t i = 0; i < kCount; ++i) {
          const size_t at = static_cast<size_t>(r.rank) * kCount + i;
          if (at == 1) continue;
          ASSERT_EQ(LoadBits(scattered, dtype, i),
                    ExpectedBits(dtype, MaxInput(at, world), ReduceOp::kMax, world))
              << "reduce-scatter element " << i << " on rank " << r.rank;
        }
      });
    }
  }
}

TEST(InProcessCollectiveTest, ReductionsAddInRankOrderAsTheMpiBackendDoes) {
  // The check of mpi_collective_test.cc's ReductionsAddInRankOrder: inputs whose sums round and
  // in which the order of the additions shows; every rank regenerates every rank's inputs and
  // adds them in rank order in fp32 (one rounding, then the avg scale); both reductions must give
  // exactly those bits — the bits the MPI backend is checked against.
  constexpr int kWorld = 4;
  constexpr size_t kPerRank = 2003;
  const size_t whole = kPerRank * kWorld;
  std::vector<std::vector<float>> values(kWorld, std::vector<float>(whole));
  for (size_t q = 0; q < kWorld; ++q) {
    std::mt19937 random(977 + static_cast<unsigned>(q));
    std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
    std::uniform_int_distribution<int> exponent(-12, 12);
    for (float& v : values[q])
      v = std::ldexp(mantissa(random), exponent(random));
  }
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      SCOPED_TRACE(fmt::format("{} {}", device::DTypeName(dtype), ReduceOpName(op)));
      const size_t elem = device::DTypeSize(dtype);
      std::vector<std::byte> expected(whole * elem);
      for (size_t i = 0; i < whole; ++i) {
        float acc = 0.0f;
        for (size_t q = 0; q < kWorld; ++q) {
          uint32_t stored = 0;  // the input as stored in `dtype`, widened
          StoreValue(&stored, dtype, 0, values[q][i]);
          float widened = 0.0f;
          internal::WidenToF32(&stored, dtype, &widened, 1);
          acc = q == 0 ? widened : acc + widened;
        }
        internal::NarrowFromF32(&acc, op == ReduceOp::kAvg ? internal::AvgScale(kWorld) : 1.0f,
                                expected.data() + i * elem, dtype, 1);
      }
      RunRanks(kWorld, [&](Rank& r) {
        void* input = r.Buffer(whole, dtype);
        void* reduced = r.Buffer(whole, dtype);
        void* scattered = r.Buffer(kPerRank, dtype);
        for (size_t i = 0; i < whole; ++i) {
          StoreValue(input, dtype, i, values[static_cast<size_t>(r.rank)][i]);
        }
        ASSERT_OK(r.comm->ReduceScatter(input, scattered, kPerRank, dtype, op, *r.a));
        ASSERT_OK(r.comm->AllReduce(input, reduced, whole, dtype, op, *r.a));
        ASSERT_OK(r.device->Synchronize(*r.a));
        const size_t base = static_cast<size_t>(r.rank) * kPerRank;
        ASSERT_EQ(std::memcmp(scattered, expected.data() + base * elem, kPerRank * elem), 0)
            << "reduce-scatter on rank " << r.rank;
        ASSERT_EQ(std::memcmp(reduced, expected.data(), whole * elem), 0)
            << "all-reduce on rank " << r.rank;
      });
    }
  }
}

TEST(InProcessCollectiveTest, BroadcastFromEveryRoot) {
  constexpr int kWorld = 3;
  RunRanks(kWorld, [&](Rank& r) {
    for (size_t bytes : {size_t{1}, size_t{4099}}) {
      auto* buffer = static_cast<uint8_t*>(r.Buffer(bytes, DType::kBF16));  // 2x: a guard byte
      for (int root = 0; root < kWorld; ++root) {
        SCOPED_TRACE(fmt::format("{} bytes from rank {}", bytes, root));
        for (size_t i = 0; i < bytes; ++i) {
          buffer[i] = static_cast<uint8_t>(r.rank == root ? (i * 7 + root * 13) : 0xee);
        }
        ASSERT_OK(r.comm->Broadcast(buffer, bytes, root, *r.a));
        ASSERT_OK(r.device->Synchronize(*r.a));
        for (size_t i = 0; i < bytes; ++i)
          ASSERT_EQ(buffer[i], static_cast<uint8_t>(i * 7 + root * 13));
        EXPECT_EQ(buffer[bytes], 0) << "a byte past the broadcast changed";
      }
    }
  });
}

TEST(InProcessCollectiveTest, NoRankLeavesABarrierBeforeEveryRankReachedIt) {
  constexpr int kWorld = 4;
  std::atomic<int> arrived{0};
  RunRanks(kWorld, [&](Rank& r) {
    int seen_after = -1;
    ASSERT_OK(r.device->HostTask(
        *r.a,
        [&] {
          arrived.fetch_add(1);
          return Status::Ok();
        },
        "arrive"));
    ASSERT_OK(r.comm->Barrier(*r.a));
    ASSERT_OK(r.device->HostTask(
        *r.a,
        [&] {
          seen_after = arrived.load();
          return Status::Ok();
        },
        "leave"));
    ASSERT_OK(r.device->Synchronize(*r.a));
    EXPECT_EQ(seen_after, kWorld) << "rank " << r.rank << " left the barrier early";
  });
}

TEST(InProcessCollectiveTest, OperationsOnTwoStreamsRunInEnqueueOrder) {
  // 100 all-reduces alternating between two streams. Every rank's stream a is held at its start
  // until all ranks enqueued everything, so stream b reaches its operations first (#2, #4, ...)
  // while #1 waits on stream a; the backend must still run them in enqueue order on every rank.
  constexpr int kWorld = 3;
  constexpr int kOps = 100;
  constexpr size_t kElems = 33;
  std::latch enqueued(kWorld);
  RunRanks(kWorld, [&](Rank& r) {
    std::vector<float*> buffers;
    for (int k = 0; k < kOps; ++k)
      buffers.push_back(static_cast<float*>(r.Buffer(kElems, DType::kF32)));
    ASSERT_OK(r.device->HostTask(
        *r.a,
        [&] {
          enqueued.wait();
          return Status::Ok();
        },
        "hold stream a"));
    for (int k = 0; k < kOps; ++k) {
      device::Stream& stream = k % 2 == 0 ? *r.a : *r.b;
      ASSERT_OK(r.device->Fill(buffers[k], DType::kF32, testing::OrderingInput(k, r.rank), kElems,
                               stream));
      ASSERT_OK(r.comm->AllReduce(buffers[k], buffers[k], kElems, DType::kF32,
                                  testing::OrderingOp(k), stream));
    }
    enqueued.count_down();
    ASSERT_OK(r.device->Synchronize(*r.a));
    ASSERT_OK(r.device->Synchronize(*r.b));
    for (int k = 0; k < kOps; ++k) {
      const float expected = testing::OrderingResult(k, kWorld);
      ASSERT_EQ(buffers[k][0], expected) << "operation " << k;
      ASSERT_EQ(buffers[k][kElems - 1], expected) << "operation " << k;
    }
  });
}

TEST(InProcessCollectiveTest, AMissingRankIsNamedWhenTheTimeoutPassesOnTheClock) {
  // Rank 1 never enqueues the all-reduce. On a manual clock nothing times out until the test
  // moves the clock past the timeout; then rank 0's operation fails naming rank 1, and the
  // world's failure is every later operation's.
  ManualClock clock;
  InProcessOptions options;
  options.timeout = std::chrono::seconds(30);
  options.clock = &clock;
  std::latch rank0_done(1);
  std::latch joined(2);
  RunRanks(
      2,
      [&](Rank& r) {
        joined.arrive_and_wait();
        if (r.rank == 1) {
          rank0_done.wait();  // stays in the world (its collective alive) but never enqueues
          return;
        }
        auto* x = static_cast<float*>(r.Buffer(16, DType::kF32));
        const uint64_t waits = clock.timed_waits();
        ASSERT_OK(r.comm->AllReduce(x, x, 16, DType::kF32, ReduceOp::kSum, *r.a));
        ASSERT_TRUE(clock.AwaitTimedWaits(waits));  // rank 0 waits, its deadline set
        clock.Advance(std::chrono::seconds(29));
        ASSERT_OK_AND_ASSIGN(auto done, r.device->CreateEvent());
        ASSERT_OK(r.device->Record(*done, *r.a));
        ASSERT_OK_AND_ASSIGN(const bool finished, r.device->Query(*done));
        EXPECT_FALSE(finished) << "the operation ended before its timeout";
        clock.Advance(std::chrono::seconds(1));
        const Status st = r.device->Synchronize(*r.a);
        EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st.ToString();
        EXPECT_NE(st.message().find("all-reduce #1"), std::string_view::npos) << st.ToString();
        EXPECT_NE(st.message().find("rank 1 (has not reached this operation: it completed #0)"),
                  std::string_view::npos)
            << st.ToString();
        const Status later = r.comm->Barrier(*r.b);
        EXPECT_EQ(later.code(), StatusCode::kDeadlineExceeded) << later.ToString();
        rank0_done.count_down();
      },
      options);
}

// An all-reduce of 16 floats on stream a, then a wait for it. A failure may come from the enqueue
// itself: once the device has a sticky error, every enqueue returns it (strata/device.h), and the
// operation's own failure can make it sticky before the enqueue returned.
Status AllReduceAndWait(Rank& r) {
  auto* x = static_cast<float*>(r.Buffer(16, DType::kF32));
  Status st = r.comm->AllReduce(x, x, 16, DType::kF32, ReduceOp::kSum, *r.a);
  return st.ok() ? r.device->Synchronize(*r.a) : st;
}

TEST(InProcessCollectiveTest, ARankWhoseStreamFailedAbortsTheOthersAtOnce) {
  // Rank 1's stream fails before it reaches the all-reduce (a host task returns an error, once
  // the all-reduce is enqueued behind it; the device skips what follows). Rank 0 must not wait
  // for it: on a clock that never moves, only the abort can end its operation.
  ManualClock clock;
  InProcessOptions options;
  options.clock = &clock;
  RunRanks(
      2,
      [&](Rank& r) {
        if (r.rank == 0) {
          const Status st = AllReduceAndWait(r);
          EXPECT_EQ(st.code(), StatusCode::kAborted) << st.ToString();
          EXPECT_NE(st.message().find("rank 1 failed"), std::string_view::npos) << st.ToString();
          EXPECT_NE(st.message().find("its stream failed first"), std::string_view::npos)
              << st.ToString();
          return;
        }
        std::latch enqueued(1);
        ASSERT_OK(r.device->HostTask(
            *r.a,
            [&] {
              enqueued.wait();
              return InternalError("the kernel before it failed");
            },
            "kernel"));
        auto* x = static_cast<float*>(r.Buffer(16, DType::kF32));
        ASSERT_OK(r.comm->AllReduce(x, x, 16, DType::kF32, ReduceOp::kSum, *r.a));
        enqueued.count_down();
        const Status st = r.device->Synchronize(*r.a);
        EXPECT_EQ(st.code(), StatusCode::kInternal) << st.ToString();
      },
      options);
}

TEST(InProcessCollectiveTest, ARankThatLeftTheWorldAbortsTheOthersAtOnce) {
  ManualClock clock;  // never moves: only the abort ends rank 0's wait
  InProcessOptions options;
  options.clock = &clock;
  RunRanks(
      2,
      [&](Rank& r) {
        if (r.rank == 1) {
          r.comm.reset();  // leaves without enqueueing anything
          return;
        }
        const Status st = AllReduceAndWait(r);
        EXPECT_EQ(st.code(), StatusCode::kAborted) << st.ToString();
        EXPECT_NE(st.message().find("rank 1 (left the world after completing #0)"),
                  std::string_view::npos)
            << st.ToString();
      },
      options);
}

TEST(InProcessCollectiveTest, RanksThatDisagreeOnAnOperationFailWithInvalidArgument) {
  RunRanks(2, [&](Rank& r) {
    auto* x = static_cast<float*>(r.Buffer(32, DType::kF32));
    // (Enqueueing fails at once when the other rank already found the disagreement.)
    Status st = r.comm->AllReduce(x, x, r.rank == 0 ? 16 : 32, DType::kF32, ReduceOp::kSum, *r.a);
    if (st.ok()) st = r.device->Synchronize(*r.a);
    EXPECT_TRUE(st.code() == StatusCode::kInvalidArgument || st.code() == StatusCode::kAborted)
        << st.ToString();
    EXPECT_NE(st.message().find("the ranks disagree on the operation"), std::string_view::npos)
        << st.ToString();
  });
}

// A wrapper that counts all-reduces and makes rank 1's barrier fail at enqueue.
class CountingCollective final : public CollectiveWrapper {
 public:
  using CollectiveWrapper::CollectiveWrapper;
  Status AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                   device::Stream& stream) override {
    ++all_reduces;
    return CollectiveWrapper::AllReduce(send, recv, count, dtype, op, stream);
  }
  Status Barrier(device::Stream& stream) override {
    if (rank() == 1) return UnavailableError("rank 1's barrier is refused by the test");
    return CollectiveWrapper::Barrier(stream);
  }
  int all_reduces = 0;
};

TEST(CollectiveWrapperTest, ForwardsEveryCallAndATestOverridesOne) {
  ManualClock clock;  // never moves: only rank 1's departure ends rank 0's barrier
  InProcessOptions options;
  options.clock = &clock;
  RunRanks(
      2,
      [&](Rank& r) {
        auto counting = std::make_unique<CountingCollective>(std::move(r.comm));
        CountingCollective& c = *counting;
        r.comm = std::move(counting);
        EXPECT_EQ(c.backend(), Backend::kInProcess);
        EXPECT_EQ(c.rank(), r.rank);
        EXPECT_EQ(c.world_size(), 2);
        auto* x = static_cast<float*>(r.Buffer(8, DType::kF32));
        auto* all = static_cast<float*>(r.Buffer(16, DType::kF32));
        ASSERT_OK(r.device->Fill(x, DType::kF32, static_cast<float>(r.rank + 1), 8, *r.a));
        ASSERT_OK(c.AllReduce(x, x, 8, DType::kF32, ReduceOp::kSum, *r.a));
        ASSERT_OK(c.AllGather(x, all, 8, DType::kF32, *r.a));
        ASSERT_OK(r.device->Synchronize(*r.a));
        EXPECT_EQ(c.all_reduces, 1);
        EXPECT_EQ(x[7], 3.0f);
        EXPECT_EQ(all[15], 3.0f);
        if (r.rank == 1) {
          EXPECT_EQ(c.Barrier(*r.a).code(), StatusCode::kUnavailable);
          r.comm.reset();  // leaves: rank 0's barrier must not wait for it
          return;
        }
        Status st = c.Barrier(*r.a);
        if (st.ok()) st = r.device->Synchronize(*r.a);
        EXPECT_EQ(st.code(), StatusCode::kAborted) << st.ToString();
      },
      options);
}

TEST(InProcessCollectiveTest, JoinChecksTheRankAndTheDevice) {
  EXPECT_EQ(InProcessWorld::Create({.world_size = 0}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(InProcessWorld::Create({.world_size = 2, .timeout = std::chrono::milliseconds(0)})
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(auto world, InProcessWorld::Create({.world_size = 2}));
  ASSERT_OK_AND_ASSIGN(auto device, device::CreateDevice({}));
  EXPECT_EQ(world->Join(2, *device).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(world->Join(-1, *device).status().code(), StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(auto rank0, world->Join(0, *device));
  EXPECT_EQ(rank0->backend(), Backend::kInProcess);
  EXPECT_EQ(rank0->rank(), 0);
  EXPECT_EQ(rank0->world_size(), 2);
  const auto again = world->Join(0, *device);
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("joined already"), std::string_view::npos);
  EXPECT_EQ(BackendName(Backend::kInProcess), "in-process");
  CollectiveOptions options;
  options.backend = Backend::kInProcess;
  EXPECT_EQ(CreateCollective(*device, options).status().code(), StatusCode::kInvalidArgument);
}


// ---- Split, topology and traffic ----------------------------------------------------------------

// Sums `value` over the ranks of `comm` with an fp32 all-reduce and waits.
float SumOver(Rank& r, Collective& comm, float value) {
  auto* x = static_cast<float*>(r.Buffer(1, DType::kF32));
  *x = value;
  EXPECT_OK(comm.AllReduce(x, x, 1, DType::kF32, ReduceOp::kSum, *r.a));
  EXPECT_OK(r.device->Synchronize(*r.a));
  return *x;
}

TEST(InProcessSplitTest, NodeGroupsHoldTheRightRanksInTheRightOrder) {
  // 6 ranks as 3 nodes x 2: intra = {0,1}, {2,3}, {4,5}; inter = {0,2,4}, {1,3,5}. Sums of 2^rank
  // say exactly which ranks took part; an all-gather says in which order.
  RunRanks(6, [](Rank& r) {
    ASSERT_OK_AND_ASSIGN(const Topology t, Topology::Uniform(r.rank, 6, 2));
    ASSERT_OK_AND_ASSIGN(NodeGroups g, SplitNodeGroups(*r.comm, t));
    EXPECT_EQ(g.intra->world_size(), 2);
    EXPECT_EQ(g.intra->rank(), r.rank % 2);
    EXPECT_EQ(g.inter->world_size(), 3);
    EXPECT_EQ(g.inter->rank(), r.rank / 2);
    const float bit = static_cast<float>(1 << r.rank);
    const int node = r.rank / 2;
    EXPECT_EQ(SumOver(r, *g.intra, bit), static_cast<float>(3 << (2 * node)));
    EXPECT_EQ(SumOver(r, *g.inter, bit), static_cast<float>(r.rank % 2 == 0 ? 21 : 42));
    // The world still works after (and between) the groups' operations.
    EXPECT_EQ(SumOver(r, *r.comm, bit), 63.0f);
    auto* gathered = static_cast<float*>(r.Buffer(3, DType::kF32));
    gathered[g.inter->rank()] = static_cast<float>(r.rank);
    ASSERT_OK(g.inter->AllGather(gathered + g.inter->rank(), gathered, 1, DType::kF32, *r.a));
    ASSERT_OK(r.device->Synchronize(*r.a));
    for (int n = 0; n < 3; ++n)
      EXPECT_EQ(gathered[n], static_cast<float>(2 * n + r.rank % 2));
    // A split of a split, keyed in reverse: ranks {1,0} of each node's group.
    ASSERT_OK_AND_ASSIGN(auto reversed, g.intra->Split(0, -g.intra->rank()));
    EXPECT_EQ(reversed->rank(), 1 - r.rank % 2);
    EXPECT_EQ(SumOver(r, *reversed, bit), static_cast<float>(3 << (2 * node)));
    reversed.reset();
    g.intra.reset();
    g.inter.reset();
  });
}

TEST(InProcessSplitTest, ARankThatDoesNotSplitIsNamedAtTheTimeout) {
  ManualClock clock;
  InProcessOptions options;
  options.timeout = std::chrono::seconds(30);
  options.clock = &clock;
  std::latch rank0_done(1);
  RunRanks(
      2,
      [&](Rank& r) {
        if (r.rank == 1) {
          rank0_done.wait();
          return;
        }
        std::thread mover([&] {
          ASSERT_TRUE(clock.AwaitTimedWaits(0));
          clock.Advance(std::chrono::seconds(31));
        });
        const auto split = r.comm->Split(0, 0);
        mover.join();
        ASSERT_FALSE(split.ok());
        EXPECT_EQ(split.status().code(), StatusCode::kDeadlineExceeded);
        EXPECT_NE(split.status().message().find("rank(s) 1 did not split"), std::string_view::npos)
            << split.status().ToString();
        rank0_done.count_down();
      },
      options);
}

TEST(InProcessSplitTest, ANegativeColorIsRefusedOnEveryBackend) {
  ASSERT_OK_AND_ASSIGN(auto device, device::CreateDevice({}));
  ASSERT_OK_AND_ASSIGN(auto single, CreateCollective(*device, {.backend = Backend::kSingle}));
  const auto bad = single->Split(-1, 0);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("color must be >= 0"), std::string_view::npos);
  ASSERT_OK_AND_ASSIGN(auto one, single->Split(3, 0));
  EXPECT_EQ(one->world_size(), 1);
  EXPECT_EQ(one->backend(), Backend::kSingle);
}

TEST(TopologyTest, DiscoveryFormsContiguousEqualNodesAndRefusesOthers) {
  // The host names each rank reports; the launcher's local rank is not what forms the nodes.
  const std::vector<std::vector<std::string>> layouts = {
      {"a", "a", "b", "b"}, {"a", "b", "a", "b"}, {"a", "a", "a", "b"}, {"x", "y", "z", "w"}};
  for (const auto& hosts : layouts) {
    SCOPED_TRACE(fmt::format("{}", fmt::join(hosts, ",")));
    RunRanks(4, [&](Rank& r) {
      const auto t = DiscoverTopology(*r.comm, *r.device, hosts[static_cast<size_t>(r.rank)], 0);
      if (hosts[1] == "b") {  // not contiguous
        ASSERT_FALSE(t.ok());
        EXPECT_NE(t.status().message().find("must be contiguous"), std::string_view::npos)
            << t.status().ToString();
      } else if (hosts[2] == "a") {  // 3 + 1
        ASSERT_FALSE(t.ok());
        EXPECT_NE(t.status().message().find("node 1 (ranks 3-3) holds 1 rank(s) where node 0 "
                                            "holds 3"),
                  std::string_view::npos)
            << t.status().ToString();
      } else {
        ASSERT_TRUE(t.ok()) << t.status().ToString();
        const int per_node = hosts[0] == "x" ? 1 : 2;
        EXPECT_EQ(t->ranks_per_node, per_node);
        EXPECT_EQ(t->node(), r.rank / per_node);
        EXPECT_EQ(t->local_rank(), r.rank % per_node);
      }
    });
  }
  EXPECT_EQ(Topology::Uniform(0, 6, 4).status().code(), StatusCode::kInvalidArgument);
}

TEST(TrafficTest, CountsWhatEachOperationSendsWithinAndAcrossNodes) {
  // 4 ranks as 2 nodes x 2. Each rank has 1 peer on its node and 2 on the other.
  std::vector<TrafficCounters> counters(4);
  RunRanks(4, [&](Rank& r) {
    ASSERT_OK_AND_ASSIGN(const Topology t, Topology::Uniform(r.rank, 4, 2));
    TrafficCounters& c = counters[static_cast<size_t>(r.rank)];
    auto world = CountTraffic(std::move(r.comm), t, &c, *r.device);
    const size_t n = 1000;
    void* buf = r.Buffer(4 * n, DType::kBF16);
    c.SetPhase(TrafficPhase::kForwardGather);
    char* own = static_cast<char*>(buf) + static_cast<size_t>(r.rank) * n * 2;
    ASSERT_OK(world->AllGather(own, buf, n, DType::kBF16, *r.a));  // 2000 B to each peer
    c.SetPhase(TrafficPhase::kReduce);
    ASSERT_OK(world->ReduceScatter(buf, own, n, DType::kBF16, ReduceOp::kSum, *r.a));
    // 2 x 8000 B / 4 ranks = 4000 B to each peer.
    ASSERT_OK(world->AllReduce(buf, buf, 4 * n, DType::kBF16, ReduceOp::kSum, *r.a));
    // 300 B to each peer.
    void* exchanged = r.Buffer(4 * 150, DType::kBF16);
    ASSERT_OK(world->AllToAll(buf, exchanged, 150, DType::kBF16, *r.a));
    c.SetPhase(TrafficPhase::kOther);
    ASSERT_OK(world->Broadcast(buf, 100, /*root=*/1, *r.a));
    // The intra-node group's traffic never leaves the node; the inter-node group's always does.
    ASSERT_OK_AND_ASSIGN(NodeGroups g, SplitNodeGroups(*world, t));
    c.SetPhase(TrafficPhase::kBackwardGather);
    ASSERT_OK(g.intra->AllGather(own, buf, n, DType::kBF16, *r.a));
    ASSERT_OK(r.device->Synchronize(*r.a));
    EXPECT_EQ(c.of(TrafficPhase::kForwardGather).intra_bytes, 2000u);
    EXPECT_EQ(c.of(TrafficPhase::kForwardGather).inter_bytes, 4000u);
    EXPECT_EQ(c.of(TrafficPhase::kReduce).intra_bytes, 6300u);
    EXPECT_EQ(c.of(TrafficPhase::kReduce).inter_bytes, 12600u);
    const bool root = r.rank == 1;
    EXPECT_EQ(c.of(TrafficPhase::kOther).intra_bytes, root ? 100u : 0u);
    EXPECT_EQ(c.of(TrafficPhase::kOther).inter_bytes, root ? 200u : 0u);
    EXPECT_EQ(c.of(TrafficPhase::kBackwardGather).intra_bytes, 2000u);
    EXPECT_EQ(c.of(TrafficPhase::kBackwardGather).inter_bytes, 0u);
    ASSERT_OK_AND_ASSIGN(auto inter_only, world->Split(t.local_rank(), t.node()));
    const Traffic before = c.total();
    char* own_inter = static_cast<char*>(buf) + static_cast<size_t>(inter_only->rank()) * n * 2;
    ASSERT_OK(inter_only->AllGather(own_inter, buf, n, DType::kBF16, *r.a));
    ASSERT_OK(r.device->Synchronize(*r.a));
    EXPECT_EQ(c.total().intra_bytes, before.intra_bytes);
    EXPECT_EQ(c.total().inter_bytes, before.inter_bytes + 2000u);
    inter_only.reset();
    g = {};
    r.comm = std::move(world);
  });
}

}  // namespace
}  // namespace strata::comm

// The paced store: a disk of fixed bandwidth. The tests of its timing run on a ManualClock
// (common/clock.h): a request completes when the test moves the clock past the end of its
// service, never before, so the service times are checked exactly and nothing sleeps. The
// concurrency and lifetime tests run on the real clock.
#include "io/paced_store.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "io/fault_injection.h"
#include "io/memory_store.h"

namespace strata::io {
namespace {

using RealSteadyClock = std::chrono::steady_clock;  // the concurrency test's wall time
using std::chrono::milliseconds;

constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kRate = 64 * kMiB;  // 1 MiB is served in 15.6 ms
constexpr uint64_t kChunk = 1 << 20;
const auto kChunkTime = std::chrono::nanoseconds(static_cast<int64_t>(1e9 * kChunk / kRate));

// A paced store over `inner` (the memory store when null) at `rate` on `clock` (the real one when
// null), with `path` opened (buffered, so that any length is allowed) into *file.
std::unique_ptr<BlockStore> MakePaced(double rate, const std::string& path, FileId* file,
                                      std::unique_ptr<BlockStore> inner = nullptr,
                                      Clock* clock = nullptr) {
  if (inner == nullptr) {
    auto memory = CreateMemoryStore(StoreOptions{});
    EXPECT_TRUE(memory.ok());
    if (!memory.ok()) return nullptr;
    inner = std::move(memory).value();
  }
  auto paced = CreatePacedStore(std::move(inner), rate, clock);
  EXPECT_TRUE(paced.ok()) << paced.status().ToString();
  if (!paced.ok()) return nullptr;
  FileSpec spec;
  spec.paths = {path};
  spec.direct = DirectMode::kOff;
  auto id = (*paced)->Open(spec);
  EXPECT_TRUE(id.ok()) << id.status().ToString();
  if (!id.ok()) return nullptr;
  *file = *id;
  return std::move(paced).value();
}

// A paced store on a manual clock.
class PacedStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = MakePaced(kRate, "/mem/paced", &file_, nullptr, &clock_);
    ASSERT_NE(store_, nullptr);
  }
  // Submits one request, moves the clock by `service`, and waits (in real time) for the result.
  Status Serve(IoOp op, uint64_t offset, uint64_t length, void* buf, Clock::Duration service) {
    std::future<Status> pending = store_->SubmitAsync(op, file_, offset, length, buf);
    clock_.Advance(service);
    return pending.get();
  }
  ManualClock clock_;
  std::unique_ptr<BlockStore> store_;
  FileId file_ = 0;
};

TEST_F(PacedStoreTest, ServesOneRequestAtATimeAtItsBandwidth) {
  constexpr int kRequests = 6;
  std::vector<std::vector<char>> out(kRequests, std::vector<char>(kChunk));
  for (int i = 0; i < kRequests; ++i)
    std::memset(out[i].data(), 'a' + i, kChunk);
  std::mutex mu;
  std::vector<std::pair<int, Clock::TimePoint>> completed;
  std::vector<std::promise<Status>> results(kRequests);
  std::vector<IoRequest> batch;
  for (int i = 0; i < kRequests; ++i) {
    batch.push_back({IoOp::kWrite, file_, i * kChunk, kChunk, out[i].data(), [&, i](const Status& s) {
                       {
                         std::lock_guard lock(mu);
                         completed.emplace_back(i, clock_.Now());
                       }
                       results[i].set_value(s);
                     }});
  }
  const auto t0 = clock_.Now();
  ASSERT_TRUE(store_->Submit(batch).ok());
  // One service time at a time: request k completes once the clock has moved k + 1 of them, and
  // not one request more.
  for (int k = 0; k < kRequests; ++k) {
    clock_.Advance(kChunkTime);
    ASSERT_TRUE(results[k].get_future().get().ok());
    std::lock_guard lock(mu);
    EXPECT_EQ(completed.size(), static_cast<size_t>(k + 1));
  }
  // In submission order, the k-th no earlier than k service times after the submission.
  ASSERT_EQ(completed.size(), static_cast<size_t>(kRequests));
  for (int k = 0; k < kRequests; ++k) {
    EXPECT_EQ(completed[k].first, k);
    EXPECT_GE(completed[k].second - t0, (k + 1) * kChunkTime) << "request " << k;
  }
  // What went through is what comes back, byte for byte, and reads are paced too.
  std::vector<char> back(kRequests * kChunk);
  const auto t1 = clock_.Now();
  ASSERT_TRUE(Serve(IoOp::kRead, 0, back.size(), back.data(), kRequests * kChunkTime).ok());
  EXPECT_GE(clock_.Now() - t1, kRequests * kChunkTime);
  for (int i = 0; i < kRequests; ++i)
    EXPECT_EQ(std::memcmp(back.data() + i * kChunk, out[i].data(), kChunk), 0) << "chunk " << i;
  // The paced disk was busy for at least the service time, and not longer than the wall time.
  const StoreStats stats = store_->stats();
  EXPECT_GE(stats.busy_ns, static_cast<uint64_t>(2 * kRequests * kChunkTime.count()));
  EXPECT_LE(stats.busy_ns,
            static_cast<uint64_t>(std::chrono::nanoseconds(clock_.Now() - t0).count()));
  EXPECT_EQ(stats.writes, static_cast<uint64_t>(kRequests));
  EXPECT_EQ(stats.reads, 1u);
}

TEST_F(PacedStoreTest, AnIdleDiskDoesNotBankTime) {
  std::vector<char> buf(kChunk, 'x');
  ASSERT_TRUE(Serve(IoOp::kWrite, 0, kChunk, buf.data(), kChunkTime).ok());
  clock_.Advance(milliseconds(200));  // idle: worth 12 requests of service
  const auto tb = clock_.Now();
  const uint64_t busy_before = store_->stats().busy_ns;
  const auto t0 = clock_.Now();
  // The read is served in one service time from now: the idle time banked nothing.
  ASSERT_TRUE(Serve(IoOp::kRead, 0, kChunk, buf.data(), kChunkTime).ok());
  EXPECT_GE(clock_.Now() - t0, kChunkTime);
  // The idle time added nothing to the busy time: only this read's, which lies inside [tb, now].
  const uint64_t busy = store_->stats().busy_ns - busy_before;
  EXPECT_GE(busy, static_cast<uint64_t>(kChunkTime.count()));
  EXPECT_LE(busy, static_cast<uint64_t>(std::chrono::nanoseconds(clock_.Now() - tb).count()));
  EXPECT_LT(busy, 150'000'000u);  // had the 200 ms idle been banked as busy
}

TEST_F(PacedStoreTest, RefusedRequestsCostNoServiceTime) {
  // A request the inner store refuses up front is not paced: had its 64 MiB (1 s of service)
  // been charged, the next request would wait for it.
  std::vector<char> big(64 << 20);
  IoRequest bad{IoOp::kRead, file_ + 100, 0, big.size(), big.data(),
                [](const Status&) { FAIL() << "a refused request's callback ran"; }};
  EXPECT_EQ(store_->Submit(bad).code(), StatusCode::kNotFound);
  IoRequest empty{IoOp::kRead, file_, 0, 0, big.data(), [](const Status&) { FAIL(); }};
  EXPECT_EQ(store_->Submit(empty).code(), StatusCode::kInvalidArgument);
  // The next write is served in its own service time (61 us), not after 1 s.
  const auto t0 = clock_.Now();
  std::vector<char> buf(4096, 'y');
  const auto service =
      std::chrono::nanoseconds(std::llround(1e9 * static_cast<double>(buf.size()) / kRate));
  ASSERT_TRUE(Serve(IoOp::kWrite, 0, buf.size(), buf.data(), service).ok());
  EXPECT_LT(clock_.Now() - t0, milliseconds(700));
}

TEST_F(PacedStoreTest, InnerErrorsReachTheCallerAfterTheirServiceTime) {
  std::vector<char> buf(kChunk);
  const auto t0 = clock_.Now();
  Status st = Serve(IoOp::kRead, 0, kChunk, buf.data(), kChunkTime);  // the file is empty
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange) << st.ToString();
  EXPECT_GE(clock_.Now() - t0, kChunkTime);
  EXPECT_EQ(store_->stats().errors, 1u);
}

TEST_F(PacedStoreTest, CloseWaitsForPacedRequests) {
  std::vector<char> buf(32 * kChunk, 'z');  // 0.5 s of service: the clock stands before its end
  std::future<Status> pending =
      store_->SubmitAsync(IoOp::kWrite, file_, 0, buf.size(), buf.data());
  Status closing = store_->Close(file_);
  EXPECT_EQ(closing.code(), StatusCode::kFailedPrecondition) << closing.ToString();
  EXPECT_NE(closing.message().find("have not completed"), std::string::npos);
  clock_.Advance(32 * kChunkTime);
  EXPECT_TRUE(pending.get().ok());
  EXPECT_TRUE(store_->Close(file_).ok());
}

TEST(PacedStoreLaggingInnerTest, AnInnerStoreBehindThePaceSetsTheTime) {
  // The inner store (delayed 120 ms by a fault rule) finishes after the 16 ms paced deadline: the
  // callback then runs from the inner store's completion, once, and not before it. Both delays
  // are on one manual clock.
  ManualClock clock;
  auto faults = std::make_shared<FaultInjector>(1, &clock);
  FaultRule slow;
  slow.kind = FaultKind::kLatency;
  slow.latency = milliseconds(120);
  faults->AddRule(slow);
  auto memory = CreateMemoryStore(StoreOptions{});
  ASSERT_TRUE(memory.ok());
  FileId f = 0;
  std::unique_ptr<BlockStore> store =
      MakePaced(kRate, "/mem/lagging", &f,
                CreateFaultInjectingStore(std::move(memory).value(), faults), &clock);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->name(), "paced(faulty(memory), 64.00 MiB/s)");
  std::vector<char> buf(kChunk, 's');
  std::atomic<int> calls{0};
  std::promise<Status> done;
  std::future<Status> called = done.get_future();
  const auto t0 = clock.Now();
  IoRequest r{IoOp::kWrite, f, 0, kChunk, buf.data(), [&](const Status& s) {
                if (++calls == 1) done.set_value(s);
              }};
  ASSERT_TRUE(store->Submit(r).ok());
  clock.Advance(kChunkTime);  // the paced deadline passes; the inner store is still delayed
  EXPECT_EQ(called.wait_for(milliseconds(5)), std::future_status::timeout);
  EXPECT_EQ(calls.load(), 0);
  clock.Advance(milliseconds(120) - kChunkTime);
  EXPECT_TRUE(called.get().ok());
  EXPECT_GE(clock.Now() - t0, milliseconds(115));
  store.reset();  // waits for everything; a second callback would have run by now
  EXPECT_EQ(calls.load(), 1);
}

TEST(PacedStoreConcurrencyTest, ConcurrentSubmittersWithRefusalsGetEachCallbackOnce) {
  // Four threads submit batches of small writes, every third batch refused (unknown file). Every
  // accepted request calls back exactly once, no refused one ever does, and the accepted bytes
  // take at least their service time at the paced rate.
  constexpr double kFast = 256 * kMiB;
  FileId f = 0;
  std::unique_ptr<BlockStore> store = MakePaced(kFast, "/mem/many", &f);
  ASSERT_NE(store, nullptr);
  constexpr int kThreads = 4, kBatches = 30, kPerBatch = 3;
  constexpr uint64_t kBytes = 64 << 10;
  std::vector<char> buf(kBytes, 'c');
  std::atomic<int> accepted_calls{0}, refused_calls{0};
  std::atomic<uint64_t> accepted_bytes{0};
  const auto t0 = RealSteadyClock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int b = 0; b < kBatches; ++b) {
        const bool refuse = (b + t) % 3 == 0;
        std::vector<IoRequest> batch;
        for (int i = 0; i < kPerBatch; ++i) {
          batch.push_back({IoOp::kWrite, refuse ? f + 1000 : f, 0, kBytes, buf.data(),
                           [&, refuse](const Status& s) {
                             EXPECT_TRUE(s.ok()) << s.ToString();
                             ++(refuse ? refused_calls : accepted_calls);
                           }});
        }
        const Status st = store->Submit(batch);
        EXPECT_EQ(st.ok(), !refuse) << st.ToString();
        if (st.ok()) accepted_bytes += kPerBatch * kBytes;
      }
    });
  }
  for (std::thread& t : threads)
    t.join();
  store.reset();  // waits for every callback
  const double elapsed = std::chrono::duration<double>(RealSteadyClock::now() - t0).count();
  EXPECT_EQ(refused_calls.load(), 0);
  EXPECT_EQ(accepted_calls.load() * kBytes, accepted_bytes.load());
  EXPECT_GE(elapsed, static_cast<double>(accepted_bytes.load()) / kFast * 0.999);
}

TEST(PacedStoreLifetimeTest, DestroyedWhileCallbacksKeepSubmitting) {
  FileId f = 0;
  std::unique_ptr<BlockStore> store = MakePaced(16 * kMiB, "/mem/chain", &f);
  ASSERT_NE(store, nullptr);
  std::vector<char> buf(16 << 10, 1);  // 1 ms of service each
  std::atomic<int> completed{0};
  BlockStore* raw = store.get();
  std::function<void(int)> link = [&](int remaining) {
    IoRequest r{IoOp::kWrite, f, 0, buf.size(), buf.data(), [&, remaining](const Status& s) {
                  ++completed;
                  if (s.ok() && remaining > 0) link(remaining - 1);
                }};
    (void)raw->Submit(r);
  };
  for (int chain = 0; chain < 4; ++chain)
    link(20);
  store.reset();  // waits for every chain to finish
  EXPECT_EQ(completed.load(), 4 * 21);
}

TEST(PacedStoreCreateTest, RejectsRatesThatAreNotRates) {
  for (double rate : {0.0, -1.0, 1000.0, std::numeric_limits<double>::quiet_NaN(),
                      std::numeric_limits<double>::infinity()}) {
    auto inner = CreateMemoryStore(StoreOptions{});
    ASSERT_TRUE(inner.ok());
    auto paced = CreatePacedStore(std::move(inner).value(), rate);
    ASSERT_FALSE(paced.ok()) << rate;
    EXPECT_EQ(paced.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(paced.status().message().find("at least 1 MiB/s"), std::string::npos);
  }
  EXPECT_FALSE(CreatePacedStore(nullptr, kRate).ok());
}

}  // namespace
}  // namespace strata::io

#include "io/fault_injection.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "io/memory_store.h"

namespace strata::io {
namespace {

TEST(FaultInjectorTest, OrdinalsPickExactTransfers) {
  FaultInjector f;
  FaultRule r;
  r.kind = FaultKind::kError;
  r.error = EIO;
  r.ordinals = {1, 3};
  size_t idx = f.AddRule(r);
  std::vector<int> errors;
  for (int i = 0; i < 5; ++i)
    errors.push_back(f.Decide(IoOp::kRead, "/x", 0, 4096, 4096).error);
  EXPECT_EQ(errors, (std::vector<int>{0, EIO, 0, EIO, 0}));
  EXPECT_EQ(f.hits(idx), 2u);
}

TEST(FaultInjectorTest, FiltersByOpPathAndRange) {
  FaultInjector f;
  FaultRule r;
  r.error = ENOSPC;
  r.op = IoOp::kWrite;
  r.path_contains = "nvme1";
  r.offset_begin = 8192;
  r.offset_end = 12288;
  f.AddRule(r);
  EXPECT_EQ(f.Decide(IoOp::kRead, "/mnt/nvme1/f", 8192, 4096, 1).error, 0);
  EXPECT_EQ(f.Decide(IoOp::kWrite, "/mnt/nvme0/f", 8192, 4096, 1).error, 0);
  EXPECT_EQ(f.Decide(IoOp::kWrite, "/mnt/nvme1/f", 0, 4096, 1).error, 0);
  EXPECT_EQ(f.Decide(IoOp::kWrite, "/mnt/nvme1/f", 12288, 4096, 1).error, 0);
  EXPECT_EQ(f.Decide(IoOp::kWrite, "/mnt/nvme1/f", 4096, 8192, 1).error, ENOSPC);  // overlaps
}

TEST(FaultInjectorTest, MaxHitsStopsInjection) {
  FaultInjector f;
  FaultRule r;
  r.error = EAGAIN;
  r.max_hits = 2;
  f.AddRule(r);
  EXPECT_EQ(f.Decide(IoOp::kRead, "/x", 0, 1, 1).error, EAGAIN);
  EXPECT_EQ(f.Decide(IoOp::kRead, "/x", 0, 1, 1).error, EAGAIN);
  EXPECT_EQ(f.Decide(IoOp::kRead, "/x", 0, 1, 1).error, 0);
  EXPECT_EQ(f.total_hits(), 2u);
}

TEST(FaultInjectorTest, ShortTransferKeepsAlignment) {
  FaultInjector f;
  FaultRule r;
  r.kind = FaultKind::kShortTransfer;
  r.short_bytes = 5000;
  f.AddRule(r);
  EXPECT_EQ(f.Decide(IoOp::kRead, "/x", 0, 16384, 4096).length, 4096u);
  // Too small to shorten while staying aligned: left alone.
  EXPECT_EQ(f.Decide(IoOp::kRead, "/x", 0, 4096, 4096).length, 4096u);
  // Half by default.
  FaultInjector half;
  FaultRule h;
  h.kind = FaultKind::kShortTransfer;
  half.AddRule(h);
  EXPECT_EQ(half.Decide(IoOp::kWrite, "/x", 0, 1000, 1).length, 500u);
}

TEST(FaultInjectorTest, ProbabilityIsRoughlyHonoured) {
  FaultInjector f(42);
  FaultRule r;
  r.probability = 0.25;
  f.AddRule(r);
  int hits = 0;
  for (int i = 0; i < 4000; ++i)
    hits += f.Decide(IoOp::kRead, "/x", 0, 1, 1).error != 0;
  EXPECT_GT(hits, 800);
  EXPECT_LT(hits, 1200);
}

class FaultInjectingStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    faults_ = std::make_shared<FaultInjector>(1, &clock_);  // latency on a manual clock
    StoreOptions options;
    auto inner = CreateMemoryStore(options);
    ASSERT_TRUE(inner.ok());
    store_ = CreateFaultInjectingStore(std::move(inner).value(), faults_);
    FileSpec spec;
    spec.paths = {"/mem/faulty"};
    spec.direct = DirectMode::kOff;
    auto id = store_->Open(spec);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    file_ = *id;
  }
  ManualClock clock_;  // outlives the store that waits on it
  std::shared_ptr<FaultInjector> faults_;
  std::unique_ptr<BlockStore> store_;
  FileId file_ = 0;
};

TEST_F(FaultInjectingStoreTest, InjectedErrorNamesTheRequest) {
  FaultRule r;
  r.error = EIO;
  r.op = IoOp::kWrite;
  faults_->AddRule(r);
  char buf[100] = {};
  Status st = store_->Write(file_, 200, sizeof(buf), buf);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("write of 100 bytes at offset 200 in /mem/faulty"), std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("Input/output error (EIO)"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("injected"), std::string::npos) << st.message();
  // Reads are unaffected and the store stays usable.
  EXPECT_EQ(store_->Read(file_, 0, 1, buf).code(), StatusCode::kOutOfRange);
}

TEST_F(FaultInjectingStoreTest, LatencyDelaysAndCloseWaits) {
  FaultRule r;
  r.kind = FaultKind::kLatency;
  r.latency = std::chrono::milliseconds(150);
  faults_->AddRule(r);
  char buf[10] = {1, 2, 3};
  const auto t0 = clock_.Now();
  std::future<Status> pending = store_->SubmitAsync(IoOp::kWrite, file_, 0, sizeof(buf), buf);
  // The request is held by the wrapper, so the file cannot be closed yet, and it stays held
  // until the clock passes its latency.
  Status closing = store_->Close(file_);
  EXPECT_EQ(closing.code(), StatusCode::kFailedPrecondition) << closing.ToString();
  clock_.Advance(std::chrono::milliseconds(149));
  EXPECT_EQ(pending.wait_for(std::chrono::milliseconds(5)), std::future_status::timeout);
  clock_.Advance(std::chrono::milliseconds(1));
  EXPECT_TRUE(pending.get().ok());
  EXPECT_GE(clock_.Now() - t0, std::chrono::milliseconds(140));
  char back[10] = {};
  faults_->Clear();
  ASSERT_TRUE(store_->Read(file_, 0, sizeof(back), back).ok());
  EXPECT_EQ(std::memcmp(buf, back, sizeof(buf)), 0);
  EXPECT_TRUE(store_->Close(file_).ok());
}

TEST(FaultInjectingStoreLifetimeTest, DestroyedWhileCallbacksKeepSubmitting) {
  // Chains of requests, each submitted from the previous one's callback, some delayed by the
  // wrapper, are still running when the store is destroyed: the destructor waits for all of them.
  auto faults = std::make_shared<FaultInjector>(3);
  FaultRule slow;
  slow.kind = FaultKind::kLatency;
  slow.latency = std::chrono::milliseconds(2);
  slow.probability = 0.3;
  faults->AddRule(slow);
  StoreOptions options;
  options.threads = 2;
  auto inner = CreateMemoryStore(options);
  ASSERT_TRUE(inner.ok());
  auto store = CreateFaultInjectingStore(std::move(inner).value(), faults);
  FileSpec spec;
  spec.paths = {"/mem/chain"};
  spec.direct = DirectMode::kOff;
  FileId f = *store->Open(spec);
  std::vector<char> buf(64, 1);
  std::atomic<int> completed{0};
  BlockStore* raw = store.get();  // unique_ptr::reset clears the pointer before destroying
  std::function<void(int)> link = [&](int remaining) {
    IoRequest r{IoOp::kWrite, f, 0, buf.size(), buf.data(), [&, remaining](const Status& s) {
                  ++completed;
                  if (s.ok() && remaining > 0) link(remaining - 1);
                }};
    (void)raw->Submit(r);
  };
  for (int chain = 0; chain < 8; ++chain)
    link(50);
  store.reset();  // must wait for every chain to finish, and not crash
  EXPECT_EQ(completed.load(), 8 * 51);
}

TEST_F(FaultInjectingStoreTest, InvalidRequestsAreRejectedUpFront) {
  char buf[4];
  IoRequest r{IoOp::kRead, file_ + 100, 0, 4, buf, [](const Status&) { FAIL(); }};
  EXPECT_EQ(store_->Submit(r).code(), StatusCode::kNotFound);
  IoRequest empty{IoOp::kRead, file_, 0, 0, buf, [](const Status&) { FAIL(); }};
  EXPECT_EQ(store_->Submit(empty).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::io

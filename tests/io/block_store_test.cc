// Behaviour every BlockStore backend must share, run against each backend with direct I/O on and
// off: data round-trips byte for byte, bad requests are rejected with clear errors, faults injected
// below the backend (EIO, ENOSPC, EAGAIN, short transfers) are handled or surfaced with context,
// and a concurrent stress of random reads and writes stays consistent.
#include "strata/block_store.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "common/host_memory.h"
#include "io/fault_injection.h"
#include "io/memory_store.h"
#include "io/posix_store.h"
#include "io/uring_probe.h"
#include "io/uring_store.h"
#include "test_support.h"

namespace strata::io {
namespace {

using strata::testing::FillPattern;
using strata::testing::PatternBytes;
using strata::testing::ReadWholeFile;
using strata::testing::TempDir;

// A 4 KiB-aligned heap buffer.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t size)
      : size_(size), data_(static_cast<char*>(std::aligned_alloc(4096, RoundUp(size)))) {
    std::memset(data_, 0, RoundUp(size));
  }
  ~AlignedBuffer() { std::free(data_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  static size_t RoundUp(size_t n) { return (n + 4095) / 4096 * 4096 + 4096; }
  size_t size_;
  char* data_;
};

struct Param {
  Backend backend;
  DirectMode direct;
};

void PrintTo(const Param& p, std::ostream* os) {
  *os << BackendName(p.backend) << "/direct=" << DirectModeName(p.direct);
}

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  return std::string(BackendName(info.param.backend)) + "_direct_" +
         std::string(DirectModeName(info.param.direct));
}

Result<std::unique_ptr<BlockStore>> MakeStore(Backend backend,
                                              std::shared_ptr<FaultInjector> faults,
                                              int threads = 2, int depth = 16) {
  StoreOptions options;
  options.backend = backend;
  options.threads = threads;
  options.queue_depth = depth;
  switch (backend) {
    case Backend::kUring:
      return CreateUringStore(options, std::move(faults));
    case Backend::kPosix:
      return CreatePosixStore(options, std::move(faults));
    case Backend::kMemory:
      return CreateMemoryStore(options, std::move(faults));
    case Backend::kAuto:
      break;
  }
  return CreateBlockStore(options);
}

class BlockStoreTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    if (GetParam().backend == Backend::kUring) {
      UringSupport support = ProbeUring();
      if (!support.available) GTEST_SKIP() << "io_uring is not available here: " << support.error;
    }
    faults_ = std::make_shared<FaultInjector>(7);
    auto store = MakeStore(GetParam().backend, faults_);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    store_ = std::move(store).value();
  }

  FileSpec Spec(const std::string& name, uint64_t preallocate = 0) {
    FileSpec spec;
    spec.paths = {dir_.file(name)};
    spec.direct = GetParam().direct;
    spec.preallocate = preallocate;
    return spec;
  }

  FileId OpenOrDie(const FileSpec& spec) {
    Result<FileId> id = store_->Open(spec);
    EXPECT_TRUE(id.ok()) << id.status().ToString();
    return id.ok() ? *id : 0;
  }

  bool direct() const { return GetParam().direct != DirectMode::kOff; }
  bool on_disk() const { return GetParam().backend != Backend::kMemory; }

  TempDir dir_;
  std::shared_ptr<FaultInjector> faults_;
  std::unique_ptr<BlockStore> store_;
};

TEST_P(BlockStoreTest, WriteThenReadBackIsByteIdentical) {
  FileId f = OpenOrDie(Spec("data", 8 << 20));
  Result<FileInfo> info = store_->Info(f);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->direct, direct());
  EXPECT_EQ(info->alignment, direct() ? kDirectIoAlignment : 1u);
  // Sizes: one block, odd multiples, 1 MiB and a bit, one request larger than a device command.
  const std::vector<size_t> sizes = {4096, 3 * 4096, (1 << 20) + 4096, 5 << 20};
  uint64_t offset = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    AlignedBuffer out(sizes[i]);
    FillPattern(out.data(), sizes[i], i + 1);
    ASSERT_TRUE(store_->Write(f, offset, sizes[i], out.data()).ok());
    AlignedBuffer in(sizes[i]);
    Status st = store_->Read(f, offset, sizes[i], in.data());
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(std::memcmp(out.data(), in.data(), sizes[i]), 0) << "size " << sizes[i];
    offset += sizes[i];
  }
  EXPECT_TRUE(store_->Sync(f).ok());
  StoreStats stats = store_->stats();
  EXPECT_EQ(stats.writes, sizes.size());
  EXPECT_EQ(stats.reads, sizes.size());
  EXPECT_EQ(stats.errors, 0u);
  ASSERT_TRUE(store_->Close(f).ok());
  if (on_disk()) {
    // What reached the file is exactly what was written, every byte of it.
    std::vector<char> file = ReadWholeFile(dir_.file("data"));
    ASSERT_GE(file.size(), offset);
    uint64_t at = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      EXPECT_EQ(std::memcmp(file.data() + at, PatternBytes(sizes[i], i + 1).data(), sizes[i]), 0)
          << "range " << i;
      at += sizes[i];
    }
  }
}

// busy_ns counts the time during which a request is outstanding (its callback included), once
// however many overlap, and not the time the store sits idle.
TEST_P(BlockStoreTest, BusyTimeCountsOutstandingRequestsOnce) {
  using Clock = std::chrono::steady_clock;
  auto ns_since = [](Clock::time_point t) {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t).count());
  };
  constexpr auto kCallback = std::chrono::milliseconds(20);
  constexpr int kRequests = 4;
  EXPECT_EQ(store_->stats().busy_ns, 0u) << "no request was submitted yet";
  FileId f = OpenOrDie(Spec("busy"));
  AlignedBuffer buf(kRequests * 4096);
  FillPattern(buf.data(), buf.size(), 5);

  // Four writes whose callbacks each take 20 ms; with two I/O threads some run side by side.
  const Clock::time_point t0 = Clock::now();
  std::atomic<int> left{kRequests};
  std::promise<void> all_done;
  std::vector<IoRequest> batch;
  for (int i = 0; i < kRequests; ++i) {
    batch.push_back({IoOp::kWrite, f, static_cast<uint64_t>(i) * 4096, 4096,
                     buf.data() + i * 4096, [&](const Status& st) {
                       EXPECT_TRUE(st.ok()) << st.ToString();
                       std::this_thread::sleep_for(kCallback);
                       if (left.fetch_sub(1) == 1) all_done.set_value();
                     }});
  }
  ASSERT_TRUE(store_->Submit(batch).ok());
  all_done.get_future().wait();
  const uint64_t busy = store_->stats().busy_ns;
  const uint64_t wall = ns_since(t0);
  // At least the longest callback, at most the wall time (so overlaps were not added up).
  EXPECT_GE(busy, static_cast<uint64_t>(std::chrono::nanoseconds(kCallback).count()));
  EXPECT_LE(busy, wall);

  // Idle time is not busy time. The last callback may still be returning when `busy` was read.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const uint64_t after_idle = store_->stats().busy_ns;
  EXPECT_GE(after_idle, busy);
  EXPECT_LT(after_idle - busy, 50'000'000u) << "100 ms without a request outstanding";
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(store_->stats().busy_ns, after_idle) << "nothing outstanding, nothing added";
  ASSERT_TRUE(store_->Close(f).ok());
}

TEST_P(BlockStoreTest, UnalignedBytesWorkOnlyWithoutDirectIo) {
  FileId f = OpenOrDie(Spec("odd"));
  std::vector<char> out = PatternBytes(1000, 3);
  Status st = store_->Write(f, 123, out.size(), out.data() + 0);
  if (direct()) {
    ASSERT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("offset 0x7b (123) is not a multiple of 4096"), std::string::npos)
        << st.message();
    EXPECT_NE(st.message().find(dir_.file("odd")), std::string::npos) << st.message();
  } else {
    ASSERT_TRUE(st.ok()) << st.ToString();
    std::vector<char> in(out.size());
    ASSERT_TRUE(store_->Read(f, 123, in.size(), in.data()).ok());
    EXPECT_EQ(in, out);
  }
}

// Tests that only make sense with direct I/O on.
using DirectStoreTest = BlockStoreTest;
// Tests of file-backed stores only (the memory store has no filesystem or physical paths).
using DiskStoreTest = BlockStoreTest;

TEST_P(DirectStoreTest, AlignmentErrorsNameWhatIsWrong) {
  FileId f = OpenOrDie(Spec("align"));
  AlignedBuffer buf(3 * 4096);
  auto never = [](const Status&) { ADD_FAILURE() << "a rejected request must not complete"; };
  IoRequest bad_length{IoOp::kWrite, f, 0, 4000, buf.data(), never};
  Status st = store_->Submit(bad_length);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("length 0xfa0 (4000) is not a multiple of 4096"), std::string::npos)
      << st.message();
  IoRequest bad_buffer{IoOp::kRead, f, 0, 4096, buf.data() + 512, never};
  st = store_->Submit(bad_buffer);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("buffer address"), std::string::npos) << st.message();
  // A batch with one bad request is rejected whole.
  std::vector<IoRequest> batch = {{IoOp::kWrite, f, 0, 4096, buf.data(), never},
                                  {IoOp::kWrite, f, 4096, 4096, buf.data() + 1, never}};
  EXPECT_EQ(store_->Submit(batch).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->stats().writes, 0u);
}

TEST_P(BlockStoreTest, RejectsBadRequests) {
  FileId f = OpenOrDie(Spec("bad"));
  AlignedBuffer buf(4096);
  auto never = [](const Status&) { ADD_FAILURE() << "a rejected request must not complete"; };
  EXPECT_EQ(store_->Submit(IoRequest{IoOp::kRead, f + 99, 0, 4096, buf.data(), never}).code(),
            StatusCode::kNotFound);
  EXPECT_EQ(store_->Submit(IoRequest{IoOp::kRead, f, 0, 0, buf.data(), never}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->Submit(IoRequest{IoOp::kRead, f, 0, 4096, nullptr, never}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->Submit(IoRequest{IoOp::kRead, f, 0, 4096, buf.data(), nullptr}).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(store_->Write(f, 0, 4096, buf.data()).ok());
  ASSERT_TRUE(store_->Close(f).ok());
  FileSpec ro = Spec("bad");
  ro.read_only = true;
  FileId r = OpenOrDie(ro);
  Status st = store_->Write(r, 0, 4096, buf.data());
  EXPECT_EQ(st.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(st.message().find("read-only"), std::string::npos) << st.message();
  EXPECT_TRUE(store_->Read(r, 0, 4096, buf.data()).ok());
}

TEST_P(BlockStoreTest, ReadPastEndOfFileIsOutOfRange) {
  FileId f = OpenOrDie(Spec("short"));
  AlignedBuffer buf(8192);
  ASSERT_TRUE(store_->Write(f, 0, 4096, buf.data()).ok());
  Status st = store_->Read(f, 0, 8192, buf.data());
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange) << st.ToString();
  EXPECT_NE(st.message().find("end of file"), std::string::npos) << st.message();
}

TEST_P(BlockStoreTest, ShortTransfersAreResubmitted) {
  FileId f = OpenOrDie(Spec("shortx", 1 << 20));
  FaultRule rule;
  rule.kind = FaultKind::kShortTransfer;
  rule.short_bytes = 4096;  // every transfer moves one block at a time
  size_t idx = faults_->AddRule(rule);
  AlignedBuffer out(64 << 10), in(64 << 10);
  FillPattern(out.data(), out.size(), 11);
  ASSERT_TRUE(store_->Write(f, 8192, out.size(), out.data()).ok());
  ASSERT_TRUE(store_->Read(f, 8192, in.size(), in.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), in.data(), out.size()), 0);
  // 16 blocks each way: 15 short completions per direction.
  EXPECT_GE(faults_->hits(idx), 30u);
  EXPECT_GE(store_->stats().short_transfers, 30u);
}

TEST_P(BlockStoreTest, EioIsReportedWithPathOffsetAndLength) {
  FileId f = OpenOrDie(Spec("eio", 1 << 20));
  FaultRule rule;
  rule.error = EIO;
  rule.op = IoOp::kRead;
  rule.ordinals = {0};
  faults_->AddRule(rule);
  AlignedBuffer buf(8192);
  ASSERT_TRUE(store_->Write(f, 4096, 8192, buf.data()).ok());
  Status st = store_->Read(f, 4096, 8192, buf.data());
  ASSERT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
  EXPECT_NE(st.message().find("read of 8192 bytes at offset 4096 in " + dir_.file("eio")),
            std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("Input/output error (EIO)"), std::string::npos) << st.message();
  // The store stays usable after the error.
  EXPECT_TRUE(store_->Read(f, 4096, 8192, buf.data()).ok());
  EXPECT_EQ(store_->stats().errors, 1u);
}

TEST_P(BlockStoreTest, EnospcIsResourceExhausted) {
  FileId f = OpenOrDie(Spec("enospc"));
  FaultRule rule;
  rule.error = ENOSPC;
  rule.op = IoOp::kWrite;
  rule.offset_begin = 1 << 20;
  faults_->AddRule(rule);
  AlignedBuffer buf(4096);
  EXPECT_TRUE(store_->Write(f, 0, 4096, buf.data()).ok());
  Status st = store_->Write(f, 1 << 20, 4096, buf.data());
  ASSERT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
  EXPECT_NE(st.message().find("write of 4096 bytes at offset 1048576"), std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("No space left on device (ENOSPC)"), std::string::npos)
      << st.message();
}

TEST_P(BlockStoreTest, EagainAndEintrAreRetried) {
  FileId f = OpenOrDie(Spec("again"));
  FaultRule again;
  again.error = EAGAIN;
  again.max_hits = 3;
  faults_->AddRule(again);
  FaultRule intr;
  intr.error = EINTR;
  intr.max_hits = 2;
  faults_->AddRule(intr);
  AlignedBuffer out(16384), in(16384);
  FillPattern(out.data(), out.size(), 5);
  ASSERT_TRUE(store_->Write(f, 0, out.size(), out.data()).ok());
  ASSERT_TRUE(store_->Read(f, 0, in.size(), in.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), in.data(), out.size()), 0);
  EXPECT_GE(store_->stats().retries, 4u);
}

TEST_P(BlockStoreTest, CallbacksMaySubmitMoreWork) {
  // A chain of writes, each submitted from the previous one's completion callback.
  FileId f = OpenOrDie(Spec("chain", 1 << 20));
  constexpr int kLinks = 64;
  AlignedBuffer buf(kLinks * 4096);
  FillPattern(buf.data(), buf.size(), 9);
  std::promise<Status> finished;
  std::function<void(int)> link = [&](int i) {
    IoRequest r{IoOp::kWrite,
                f,
                static_cast<uint64_t>(i) * 4096,
                4096,
                buf.data() + i * 4096,
                [&, i](const Status& s) {
                  if (!s.ok() || i + 1 == kLinks) {
                    finished.set_value(s);
                  } else {
                    link(i + 1);
                  }
                }};
    Status st = store_->Submit(r);
    if (!st.ok()) finished.set_value(st);
  };
  link(0);
  ASSERT_TRUE(finished.get_future().get().ok());
  AlignedBuffer in(kLinks * 4096);
  ASSERT_TRUE(store_->Read(f, 0, in.size(), in.data()).ok());
  EXPECT_EQ(std::memcmp(buf.data(), in.data(), in.size()), 0);
}

TEST_P(BlockStoreTest, RegisteredHugePageBuffersRoundTrip) {
  Result<HostRegion> region = HostRegion::Allocate(8 << 20, HugePages::kAuto);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  BufferRange range{region->data(), region->size(), region->fully_huge()};
  ASSERT_TRUE(store_->RegisterBuffers({&range, 1}).ok());
  FileId f = OpenOrDie(Spec("fixed", 4 << 20));
  FillPattern(region->data(), 4 << 20, 21);
  ASSERT_TRUE(store_->Write(f, 0, 4 << 20, region->data()).ok());
  ASSERT_TRUE(store_->Read(f, 0, 4 << 20, region->data() + (4 << 20)).ok());
  EXPECT_EQ(std::memcmp(region->data(), region->data() + (4 << 20), 4 << 20), 0);
  // The region is freed before the store: it must be unregistered first.
  EXPECT_TRUE(store_->UnregisterBuffers(region->data()).ok());
}

TEST_P(BlockStoreTest, StripesOverThreeDirectories) {
  TempDir a, b, c;
  FileSpec spec;
  spec.paths = {a.file("s"), b.file("s"), c.file("s")};
  spec.stripe_unit = 64 << 10;
  spec.direct = GetParam().direct;
  spec.preallocate = 1 << 20;
  FileId f = OpenOrDie(spec);
  Result<FileInfo> info = store_->Info(f);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->paths.size(), 3u);
  EXPECT_EQ(info->stripe_unit, 64u << 10);
  // 10 stripes, starting in the middle of stripe 0: crosses every path several times.
  const size_t len = 10 * (64 << 10);
  AlignedBuffer out(len), in(len);
  FillPattern(out.data(), len, 77);
  ASSERT_TRUE(store_->Write(f, 32 << 10, len, out.data()).ok());
  ASSERT_TRUE(store_->Read(f, 32 << 10, len, in.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), in.data(), len), 0);
  ASSERT_TRUE(store_->Close(f).ok());
  if (on_disk()) {
    // Logical byte x lives in path (x / unit) % 3 at ((x / unit) / 3) * unit + x % unit.
    std::vector<std::vector<char>> files = {ReadWholeFile(a.file("s")), ReadWholeFile(b.file("s")),
                                            ReadWholeFile(c.file("s"))};
    const uint64_t unit = 64 << 10;
    for (uint64_t x = 32 << 10; x < (32 << 10) + len; x += 4093) {
      const uint64_t stripe = x / unit;
      const auto& file = files[stripe % 3];
      const uint64_t off = (stripe / 3) * unit + x % unit;
      ASSERT_LT(off, file.size());
      ASSERT_EQ(file[off], out.data()[x - (32 << 10)]) << "logical byte " << x;
    }
    // Preallocation split the logical megabyte over the three paths.
    EXPECT_GE(std::filesystem::file_size(a.file("s")) + std::filesystem::file_size(b.file("s")) +
                  std::filesystem::file_size(c.file("s")),
              1u << 20);
  }
}

// Thousands of random reads and writes from several threads, each verified against a shadow copy.
// Requests never overlap in flight (a block is locked while a request on it is outstanding).
void RunStress(BlockStore* store, FileId f, int ops_per_thread, int threads, uint64_t seed) {
  constexpr size_t kBlocks = 512;
  constexpr size_t kBlock = 4096;
  std::vector<char> shadow(kBlocks * kBlock, 0);
  std::vector<std::atomic<bool>> busy(kBlocks);
  AlignedBuffer init(kBlocks * kBlock);
  ASSERT_TRUE(store->Write(f, 0, init.size(), init.data()).ok());
  std::mutex shadow_mu;
  std::atomic<int> failures{0};
  auto worker = [&](int tid) {
    std::mt19937_64 rng(seed + tid);
    AlignedBuffer buf(8 * kBlock);
    for (int i = 0; i < ops_per_thread; ++i) {
      const size_t nblocks = 1 + rng() % 8;
      const size_t first = rng() % (kBlocks - nblocks + 1);
      // Lock the blocks (in order, so threads cannot deadlock).
      size_t locked = 0;
      for (; locked < nblocks; ++locked) {
        bool expected = false;
        if (!busy[first + locked].compare_exchange_strong(expected, true)) break;
      }
      if (locked < nblocks) {
        for (size_t k = 0; k < locked; ++k)
          busy[first + k] = false;
        continue;
      }
      const size_t len = nblocks * kBlock;
      const uint64_t off = first * kBlock;
      if (rng() % 2 == 0) {
        FillPattern(buf.data(), len, rng());
        Status st = store->Write(f, off, len, buf.data());
        if (!st.ok()) {
          ++failures;
          ADD_FAILURE() << st.ToString();
        }
        std::lock_guard lock(shadow_mu);
        std::memcpy(shadow.data() + off, buf.data(), len);
      } else {
        Status st = store->Read(f, off, len, buf.data());
        if (!st.ok()) {
          ++failures;
          ADD_FAILURE() << st.ToString();
        }
        std::lock_guard lock(shadow_mu);
        if (std::memcmp(shadow.data() + off, buf.data(), len) != 0) {
          ++failures;
          ADD_FAILURE() << "read of blocks " << first << ".." << first + nblocks
                        << " differs from what was written";
        }
      }
      for (size_t k = 0; k < nblocks; ++k)
        busy[first + k] = false;
      if (failures > 10) return;
    }
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back(worker, t);
  for (auto& t : pool)
    t.join();
  // Finally the whole file equals the shadow.
  AlignedBuffer all(kBlocks * kBlock);
  ASSERT_TRUE(store->Read(f, 0, all.size(), all.data()).ok());
  EXPECT_EQ(std::memcmp(all.data(), shadow.data(), shadow.size()), 0);
}

TEST_P(BlockStoreTest, ConcurrentRandomReadsAndWritesStayConsistent) {
  FileId f = OpenOrDie(Spec("stress", 2 << 20));
  RunStress(store_.get(), f, 1000, 4, 1234);  // 4000 requests
}

TEST_P(BlockStoreTest, SlowConcurrentStressWithFaults) {
  // Longer, with short transfers and retried EAGAINs sprinkled in at random.
  FaultRule shorts;
  shorts.kind = FaultKind::kShortTransfer;
  shorts.probability = 0.2;
  faults_->AddRule(shorts);
  FaultRule again;
  again.error = EAGAIN;
  again.probability = 0.05;
  faults_->AddRule(again);
  FileId f = OpenOrDie(Spec("stress-slow", 2 << 20));
  RunStress(store_.get(), f, 10000, 4, 99);  // 40000 requests
  EXPECT_GT(store_->stats().short_transfers, 0u);
}

TEST_P(DiskStoreTest, PreallocationShortageNamesPathAndBytes) {
  FileSpec spec = Spec("huge", uint64_t{1} << 60);  // an exbibyte
  Result<FileId> id = store_->Open(spec);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(id.status().message().find(dir_.file("huge")), std::string::npos)
      << id.status().message();
  EXPECT_NE(id.status().message().find("bytes are free"), std::string::npos)
      << id.status().message();
  EXPECT_NE(id.status().message().find("1152921504606846976"), std::string::npos)
      << id.status().message();
  // The file this failed Open created is gone again.
  EXPECT_FALSE(std::filesystem::exists(dir_.file("huge")));
}

TEST_P(DiskStoreTest, FailedOpenKeepsExistingData) {
  // An existing file, then a striped Open with truncate whose second path cannot be opened:
  // the Open fails and the existing file still holds every byte.
  const std::string existing = dir_.file("existing");
  {
    FileId f = OpenOrDie(Spec("existing"));
    AlignedBuffer buf(8192);
    FillPattern(buf.data(), buf.size(), 3);
    ASSERT_TRUE(store_->Write(f, 0, buf.size(), buf.data()).ok());
    ASSERT_TRUE(store_->Close(f).ok());
  }
  const std::vector<char> before = ReadWholeFile(existing);
  FileSpec spec = Spec("existing");
  spec.paths.push_back(dir_.file("missing-dir/x"));
  spec.truncate = true;
  Result<FileId> id = store_->Open(spec);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(ReadWholeFile(existing), before);
  // Same with a preallocation that cannot fit.
  spec = Spec("existing", uint64_t{1} << 60);
  spec.truncate = true;
  EXPECT_EQ(store_->Open(spec).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(ReadWholeFile(existing), before);
}

TEST_P(DiskStoreTest, SameFileTwiceInOneStripeIsRejected) {
  FileSpec spec = Spec("twice");
  spec.paths.push_back(dir_.path().string() + "/./twice");
  spec.stripe_unit = 4096;
  Result<FileId> id = store_->Open(spec);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(id.status().message().find("same file"), std::string::npos) << id.status().message();
}

TEST_P(DiskStoreTest, CloseWithRequestsOutstandingIsRefused) {
  // One I/O thread of depth 1: the second request cannot complete while the first one's
  // callback is held, so it is outstanding when Close is called.
  StoreOptions options;
  options.backend = GetParam().backend;
  options.threads = 1;
  options.queue_depth = 1;
  auto store =
      GetParam().backend == Backend::kUring ? CreateUringStore(options) : CreatePosixStore(options);
  ASSERT_TRUE(store.ok());
  Result<FileId> f = (*store)->Open(Spec("busy"));
  ASSERT_TRUE(f.ok());
  AlignedBuffer buf(8192);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::promise<void> first_running;
  std::promise<Status> second_done;
  std::vector<IoRequest> batch = {{IoOp::kWrite, *f, 0, 4096, buf.data(),
                                   [&](const Status&) {
                                     first_running.set_value();
                                     released.wait();
                                   }},
                                  {IoOp::kWrite, *f, 4096, 4096, buf.data() + 4096,
                                   [&](const Status& s) { second_done.set_value(s); }}};
  ASSERT_TRUE((*store)->Submit(batch).ok());
  first_running.get_future().wait();
  Status closing = (*store)->Close(*f);
  EXPECT_EQ(closing.code(), StatusCode::kFailedPrecondition) << closing.ToString();
  EXPECT_NE(closing.message().find("have not completed"), std::string::npos);
  release.set_value();
  EXPECT_TRUE(second_done.get_future().get().ok());
  EXPECT_TRUE((*store)->Close(*f).ok());
}

TEST_P(DiskStoreTest, PreallocationSizesTheFile) {
  FileId f = OpenOrDie(Spec("pre", 3 << 20));
  EXPECT_EQ(std::filesystem::file_size(dir_.file("pre")), 3u << 20);
  ASSERT_TRUE(store_->Close(f).ok());
}

TEST_P(DiskStoreTest, MissingDirectoryIsNotFound) {
  FileSpec spec = Spec("x");
  spec.paths = {dir_.file("no/such/dir/x")};
  Result<FileId> id = store_->Open(spec);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), StatusCode::kNotFound);
  EXPECT_NE(id.status().message().find(dir_.file("no/such/dir/x")), std::string::npos);
  EXPECT_NE(id.status().message().find("ENOENT"), std::string::npos) << id.status().message();
}

TEST_P(BlockStoreTest, DurableWritesAndSync) {
  FileSpec spec = Spec("durable");
  spec.durable_writes = true;
  FileId f = OpenOrDie(spec);
  AlignedBuffer out(8192), in(8192);
  FillPattern(out.data(), out.size(), 4);
  ASSERT_TRUE(store_->Write(f, 0, out.size(), out.data()).ok());
  ASSERT_TRUE(store_->Sync(f).ok());
  ASSERT_TRUE(store_->Read(f, 0, in.size(), in.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), in.data(), in.size()), 0);
}

TEST_P(BlockStoreTest, CloseReopenKeepsData) {
  FileId f = OpenOrDie(Spec("reopen"));
  AlignedBuffer out(4096), in(4096);
  FillPattern(out.data(), 4096, 8);
  ASSERT_TRUE(store_->Write(f, 0, 4096, out.data()).ok());
  ASSERT_TRUE(store_->Close(f).ok());
  EXPECT_EQ(store_->Close(f).code(), StatusCode::kNotFound);
  FileId g = OpenOrDie(Spec("reopen"));
  ASSERT_TRUE(store_->Read(g, 0, 4096, in.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), in.data(), 4096), 0);
}

TEST_P(BlockStoreTest, OneBatchFarDeeperThanTheQueue) {
  // 1000 requests in one Submit on a store of depth 16: most wait in the store's queue.
  FileId f = OpenOrDie(Spec("deep", 4 << 20));
  constexpr int kRequests = 1000;
  AlignedBuffer out(kRequests * 4096);
  FillPattern(out.data(), out.size(), 31);
  std::atomic<int> done{0}, failed{0};
  std::promise<void> all;
  std::vector<IoRequest> batch;
  for (int i = 0; i < kRequests; ++i) {
    batch.push_back({IoOp::kWrite, f, static_cast<uint64_t>(i) * 4096, 4096,
                     out.data() + static_cast<size_t>(i) * 4096, [&](const Status& s) {
                       if (!s.ok()) ++failed;
                       if (++done == kRequests) all.set_value();
                     }});
  }
  ASSERT_TRUE(store_->Submit(batch).ok());
  all.get_future().wait();
  EXPECT_EQ(failed.load(), 0);
  AlignedBuffer in(kRequests * 4096);
  ASSERT_TRUE(store_->Read(f, 0, in.size(), in.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), in.data(), in.size()), 0);
}

TEST_P(DiskStoreTest, ErrorInAStripeNamesTheRequestAndThePath) {
  TempDir a, b;
  FileSpec spec;
  spec.paths = {a.file("s"), b.file("s")};
  spec.stripe_unit = 64 << 10;
  spec.direct = GetParam().direct;
  FileId f = OpenOrDie(spec);
  AlignedBuffer buf(256 << 10);
  ASSERT_TRUE(store_->Write(f, 0, buf.size(), buf.data()).ok());
  FaultRule rule;
  rule.error = EIO;
  rule.op = IoOp::kRead;
  rule.path_contains = b.path().string();
  faults_->AddRule(rule);
  Status st = store_->Read(f, 0, buf.size(), buf.data());
  ASSERT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
  // The caller's request (the whole logical range) and the piece that failed (on path b).
  EXPECT_NE(st.message().find("read of 262144 bytes at offset 0 in " + a.file("s") +
                              " (striped with " + b.file("s") + ")"),
            std::string::npos)
      << st.message();
  // Either of path b's two pieces may be the one reported (they fail concurrently).
  EXPECT_NE(st.message().find("): read of 65536 bytes at offset "), std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find(" in " + b.file("s") + ": Input/output error (EIO)"),
            std::string::npos)
      << st.message();
}

TEST_P(BlockStoreTest, OpenAndCloseWhileCallbacksTakeTheCallersLock) {
  // The caller holds a mutex that completion callbacks also take, and opens and closes files
  // meanwhile: nothing in Open or Close may wait for the I/O threads.
  FileId f = OpenOrDie(Spec("locked", 1 << 20));
  std::mutex m;
  AlignedBuffer buf(64 * 4096);
  std::atomic<int> done{0};
  std::vector<IoRequest> batch;
  for (int i = 0; i < 64; ++i) {
    batch.push_back({IoOp::kWrite, f, static_cast<uint64_t>(i) * 4096, 4096,
                     buf.data() + static_cast<size_t>(i) * 4096, [&](const Status&) {
                       std::lock_guard lock(m);
                       ++done;
                     }});
  }
  std::atomic<bool> finished{false};
  std::thread watchdog([&] {
    for (int i = 0; i < 300 && !finished; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!finished) {
      std::fprintf(stderr, "deadlock: Open/Close waited for the I/O threads\n");
      std::abort();
    }
  });
  {
    std::lock_guard lock(m);
    ASSERT_TRUE(store_->Submit(batch).ok());
    for (int i = 0; i < 20; ++i) {
      FileId g = OpenOrDie(Spec("other" + std::to_string(i)));
      ASSERT_TRUE(store_->Close(g).ok());
    }
  }
  while (done < 64)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  finished = true;
  watchdog.join();
}

TEST_P(BlockStoreTest, UnregisteredAddressCanBeRegisteredAgainWithNewMemory) {
  // Register a region, unregister and free it, then register new memory (often at the same
  // address): I/O must use the new memory, never the old pages.
  FileId f = OpenOrDie(Spec("rereg", 1 << 20));
  for (int round = 0; round < 3; ++round) {
    Result<HostRegion> region = HostRegion::Allocate(4 << 20, HugePages::kAuto);
    ASSERT_TRUE(region.ok());
    std::memset(region->data(), 'A' + round, region->size());
    BufferRange range{region->data(), region->size(), region->fully_huge()};
    ASSERT_TRUE(store_->RegisterBuffers({&range, 1}).ok());
    ASSERT_TRUE(store_->Write(f, 0, 4096, region->data()).ok());
    AlignedBuffer back(4096);
    ASSERT_TRUE(store_->Read(f, 0, 4096, back.data()).ok());
    EXPECT_EQ(back.data()[0], 'A' + round);
    EXPECT_EQ(back.data()[4095], 'A' + round);
    ASSERT_TRUE(store_->UnregisterBuffers(region->data()).ok());
  }
  char dummy;
  EXPECT_EQ(store_->UnregisterBuffers(&dummy).code(), StatusCode::kNotFound);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BlockStoreTest,
                         ::testing::Values(Param{Backend::kUring, DirectMode::kOn},
                                           Param{Backend::kUring, DirectMode::kOff},
                                           Param{Backend::kPosix, DirectMode::kOn},
                                           Param{Backend::kPosix, DirectMode::kOff},
                                           Param{Backend::kMemory, DirectMode::kOn},
                                           Param{Backend::kMemory, DirectMode::kOff}),
                         ParamName);
INSTANTIATE_TEST_SUITE_P(DirectBackends, DirectStoreTest,
                         ::testing::Values(Param{Backend::kUring, DirectMode::kOn},
                                           Param{Backend::kPosix, DirectMode::kOn},
                                           Param{Backend::kMemory, DirectMode::kOn}),
                         ParamName);
INSTANTIATE_TEST_SUITE_P(FileBackends, DiskStoreTest,
                         ::testing::Values(Param{Backend::kUring, DirectMode::kOn},
                                           Param{Backend::kUring, DirectMode::kOff},
                                           Param{Backend::kPosix, DirectMode::kOn},
                                           Param{Backend::kPosix, DirectMode::kOff}),
                         ParamName);

// --- Backend selection and filesystems without O_DIRECT ---------------------------------------

TEST(BlockStoreFactoryTest, AutoPicksUringWhereAvailable) {
  StoreOptions options;
  auto store = CreateBlockStore(options);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  if (ProbeUring().available) {
    EXPECT_EQ((*store)->name(), "uring");
  } else {
    EXPECT_EQ((*store)->name(), "posix");
  }
  options.threads = 0;
  EXPECT_EQ(CreateBlockStore(options).status().code(), StatusCode::kInvalidArgument);
}

// A ramfs mount refuses O_DIRECT at open (EINVAL), like tmpfs on older kernels.
class NoDirectIoFilesystem : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::mount("strata-test", dir_.path().c_str(), "ramfs", 0, nullptr) != 0) {
      GTEST_SKIP() << "cannot mount a ramfs here (" << std::strerror(errno)
                   << "); needs root or CAP_SYS_ADMIN";
    }
    mounted_ = true;
  }
  void TearDown() override {
    if (mounted_) ::umount2(dir_.path().c_str(), MNT_DETACH);
  }
  TempDir dir_;
  bool mounted_ = false;
};

TEST_F(NoDirectIoFilesystem, AutoFallsBackToBufferedIo) {
  for (Backend backend : {Backend::kUring, Backend::kPosix}) {
    if (backend == Backend::kUring && !ProbeUring().available) continue;
    auto store = MakeStore(backend, nullptr);
    ASSERT_TRUE(store.ok());
    FileSpec spec;
    spec.paths = {dir_.file(std::string(BackendName(backend)))};
    spec.direct = DirectMode::kAuto;
    Result<FileId> f = (*store)->Open(spec);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    EXPECT_FALSE((*store)->Info(*f)->direct);
    EXPECT_EQ((*store)->Info(*f)->alignment, 1u);
    std::vector<char> out = PatternBytes(1000, 1), in(1000);
    ASSERT_TRUE((*store)->Write(*f, 7, out.size(), out.data()).ok());
    ASSERT_TRUE((*store)->Read(*f, 7, in.size(), in.data()).ok());
    EXPECT_EQ(in, out);
  }
}

TEST_F(NoDirectIoFilesystem, DirectOnIsAClearError) {
  auto store = MakeStore(Backend::kPosix, nullptr);
  ASSERT_TRUE(store.ok());
  FileSpec spec;
  spec.paths = {dir_.file("demand")};
  spec.direct = DirectMode::kOn;
  Result<FileId> f = (*store)->Open(spec);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("O_DIRECT"), std::string::npos) << f.status().message();
  EXPECT_NE(f.status().message().find("ramfs"), std::string::npos) << f.status().message();
  EXPECT_NE(f.status().message().find(dir_.file("demand")), std::string::npos);
  // The failed Open removed the file it created.
  EXPECT_FALSE(std::filesystem::exists(dir_.file("demand")));
}

TEST_F(NoDirectIoFilesystem, PreallocationWorksWithoutBlockAccounting) {
  // ramfs reports no blocks and no free space; preallocation must not be refused for that.
  auto store = MakeStore(Backend::kPosix, nullptr);
  ASSERT_TRUE(store.ok());
  FileSpec spec;
  spec.paths = {dir_.file("pre")};
  spec.preallocate = 1 << 20;
  Result<FileId> f = (*store)->Open(spec);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(std::filesystem::file_size(dir_.file("pre")), 1u << 20);
}

// --- io_uring registration -----------------------------------------------------------------

class UringRegistrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    UringSupport support = ProbeUring();
    if (!support.available) GTEST_SKIP() << "io_uring is not available here: " << support.error;
    if (!support.register_buffers) GTEST_SKIP() << "buffer registration is not permitted here";
  }
  TempDir dir_;
};

TEST_F(UringRegistrationTest, RegisteredBuffersAreReallyUsed) {
  StoreOptions options;
  options.threads = 2;
  auto store = CreateUringStore(options);
  ASSERT_TRUE(store.ok());
  Result<HostRegion> region = HostRegion::Allocate(4 << 20, HugePages::kAuto);
  ASSERT_TRUE(region.ok());
  BufferRange range{region->data(), region->size(), region->fully_huge()};
  ASSERT_TRUE((*store)->RegisterBuffers({&range, 1}).ok());
  FileSpec spec;
  spec.paths = {dir_.file("fixed")};
  Result<FileId> f = (*store)->Open(spec);
  ASSERT_TRUE(f.ok());
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE((*store)->Write(*f, static_cast<uint64_t>(i) << 20, 1 << 20, region->data()).ok());
  }
  StoreStats stats = (*store)->stats();
  EXPECT_EQ(stats.registered_buffer_bytes, region->size());
  EXPECT_EQ(stats.fixed_buffer_transfers, stats.device_requests);
  EXPECT_GT(stats.fixed_file_transfers, 0u);
  // Heap memory outside the registered range goes as a plain buffer.
  AlignedBuffer heap(4096);
  ASSERT_TRUE((*store)->Write(*f, 0, 4096, heap.data()).ok());
  EXPECT_EQ((*store)->stats().fixed_buffer_transfers, stats.fixed_buffer_transfers);
  EXPECT_TRUE((*store)->UnregisterBuffers(region->data()).ok());
}

TEST_F(UringRegistrationTest, RequestsOnEitherSideOfAGibibyteChunkBoundary) {
  // Registered memory is split into 1 GiB chunks, one buffer index each. A request inside the
  // second chunk uses that chunk's index; one that straddles the boundary goes unregistered.
  StoreOptions options;
  auto store = CreateUringStore(options);
  ASSERT_TRUE(store.ok());
  const size_t kGiB = size_t{1} << 30;
  Result<HostRegion> region = HostRegion::Allocate(kGiB + (8 << 20), HugePages::kAuto);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  BufferRange range{region->data(), region->size(), region->fully_huge()};
  ASSERT_TRUE((*store)->RegisterBuffers({&range, 1}).ok());
  FileSpec spec;
  spec.paths = {dir_.file("chunks")};
  Result<FileId> f = (*store)->Open(spec);
  ASSERT_TRUE(f.ok());
  char* first = region->data() + (1 << 20);           // chunk 0
  char* second = region->data() + kGiB + (1 << 20);   // chunk 1
  char* across = region->data() + kGiB - (64 << 10);  // both
  FillPattern(first, 64 << 10, 1);
  FillPattern(second, 64 << 10, 2);
  FillPattern(across, 128 << 10, 3);
  const std::vector<char> want_first(first, first + (64 << 10));
  const std::vector<char> want_second(second, second + (64 << 10));
  const std::vector<char> want_across(across, across + (128 << 10));
  ASSERT_TRUE((*store)->Write(*f, 0, 64 << 10, first).ok());
  ASSERT_TRUE((*store)->Write(*f, 64 << 10, 64 << 10, second).ok());
  ASSERT_TRUE((*store)->Write(*f, 128 << 10, 128 << 10, across).ok());
  EXPECT_EQ((*store)->stats().fixed_buffer_transfers, 2u);  // the straddling one is not fixed
  std::memset(first, 0, 64 << 10);
  std::memset(second, 0, 64 << 10);
  std::memset(across, 0, 128 << 10);
  ASSERT_TRUE((*store)->Read(*f, 0, 64 << 10, second).ok());
  ASSERT_TRUE((*store)->Read(*f, 64 << 10, 64 << 10, first).ok());
  ASSERT_TRUE((*store)->Read(*f, 128 << 10, 128 << 10, across).ok());
  EXPECT_TRUE(std::equal(want_first.begin(), want_first.end(), second));
  EXPECT_TRUE(std::equal(want_second.begin(), want_second.end(), first));
  EXPECT_TRUE(std::equal(want_across.begin(), want_across.end(), across));
  EXPECT_TRUE((*store)->UnregisterBuffers(region->data()).ok());
}

}  // namespace
}  // namespace strata::io

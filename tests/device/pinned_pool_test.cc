#include "device/pinned_pool.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/units.h"
#include "io/memory_store.h"
#include "strata/block_store.h"
#include "strata/device.h"
#include "test_support.h"

namespace strata::device {
namespace {

using ::testing::HasSubstr;

constexpr size_t KiB = size_t{1} << 10;
constexpr size_t MiB = size_t{1} << 20;
constexpr size_t GiB = size_t{1} << 30;

// A pool of exactly `bytes` (small pages: no rounding to 2 MiB), or a test failure.
std::unique_ptr<PinnedPool> MakePool(size_t bytes, Device* device = nullptr,
                                     io::BlockStore* store = nullptr) {
  PinnedPoolOptions options;
  options.bytes = bytes;
  options.huge_pages = HugePages::kOff;
  options.device = device;
  options.store = store;
  Result<std::unique_ptr<PinnedPool>> pool = PinnedPool::Create(options);
  EXPECT_TRUE(pool.ok()) << pool.status().ToString();
  return pool.ok() ? std::move(pool).value() : nullptr;
}

PinnedBlock MustAllocate(PinnedPool& pool, size_t bytes) {
  Result<PinnedBlock> block = pool.Allocate(bytes);
  EXPECT_TRUE(block.ok()) << bytes << ": " << block.status().ToString();
  return block.ok() ? *block : PinnedBlock{};
}

uint64_t OffsetOf(const PinnedPool& pool, const PinnedBlock& block) {
  return static_cast<uint64_t>(static_cast<char*>(block.data) - pool.base());
}

// A Device that only records host registration; everything else is unimplemented.
class FakeDevice : public Device {
 public:
  struct Registration {
    void* ptr;
    size_t bytes;
  };

  DeviceType type() const override { return DeviceType::kCpu; }
  std::string_view name() const override { return "fake:0"; }
  Result<void*> Alloc(size_t) override { return UnimplementedError("fake"); }
  void Free(void*) override {}
  DeviceMemoryStats memory_stats() const override { return {}; }
  void ResetPeak() override {}

  Status RegisterHost(void* ptr, size_t bytes) override {
    std::lock_guard lock(mu_);
    if (fail_register_) return UnavailableError("injected registration failure");
    registered_.push_back({ptr, bytes});
    return Status::Ok();
  }
  Status UnregisterHost(void* ptr) override {
    std::lock_guard lock(mu_);
    unregistered_.push_back(ptr);
    return Status::Ok();
  }

  Result<std::unique_ptr<Stream>> CreateStream(std::string_view) override {
    return UnimplementedError("fake");
  }
  Result<std::unique_ptr<Event>> CreateEvent() override { return UnimplementedError("fake"); }
  Status Record(Event&, Stream&) override { return UnimplementedError("fake"); }
  Status Wait(Stream&, const Event&) override { return UnimplementedError("fake"); }
  Result<bool> Query(const Event&) override { return UnimplementedError("fake"); }
  Status Synchronize(const Event&) override { return UnimplementedError("fake"); }
  Status Synchronize(Stream&) override { return UnimplementedError("fake"); }
  Status CopyAsync(void*, const void*, size_t, CopyKind, Stream&) override {
    return UnimplementedError("fake");
  }
  Status HostTask(Stream&, std::function<Status()>, std::string_view) override {
    return UnimplementedError("fake");
  }
  Status Notify(Stream&, std::function<void(const Status&)>) override {
    return UnimplementedError("fake");
  }
  Status Cast(const void*, DType, void*, DType, size_t, Stream&) override {
    return UnimplementedError("fake");
  }
  Status Scale(void*, DType, float, size_t, Stream&) override { return UnimplementedError("fake"); }
  Status Axpy(float, const void*, void*, DType, size_t, Stream&) override {
    return UnimplementedError("fake");
  }
  Status Fill(void*, DType, float, size_t, Stream&) override { return UnimplementedError("fake"); }

  void set_fail_register(bool fail) {
    std::lock_guard lock(mu_);
    fail_register_ = fail;
  }
  std::vector<Registration> registered() const {
    std::lock_guard lock(mu_);
    return registered_;
  }
  std::vector<void*> unregistered() const {
    std::lock_guard lock(mu_);
    return unregistered_;
  }

 private:
  mutable std::mutex mu_;
  bool fail_register_ = false;
  std::vector<Registration> registered_;
  std::vector<void*> unregistered_;
};

// Forwards to a real store and records buffer registration (LevelDB's EnvWrapper pattern); can
// refuse a registration.
class RecordingStore : public io::BlockStore {
 public:
  explicit RecordingStore(std::unique_ptr<io::BlockStore> inner) : inner_(std::move(inner)) {}

  std::string_view name() const override { return inner_->name(); }
  Result<io::FileId> Open(const io::FileSpec& spec) override { return inner_->Open(spec); }
  Status Close(io::FileId file) override { return inner_->Close(file); }
  Result<io::FileInfo> Info(io::FileId file) const override { return inner_->Info(file); }
  Status Submit(std::span<io::IoRequest> requests) override { return inner_->Submit(requests); }
  Status Sync(io::FileId file) override { return inner_->Sync(file); }
  io::StoreStats stats() const override { return inner_->stats(); }

  Status RegisterBuffers(std::span<const io::BufferRange> ranges) override {
    {
      std::lock_guard lock(mu_);
      register_calls_.emplace_back(ranges.begin(), ranges.end());
      if (fail_register_) return ResourceExhaustedError("injected: no registration slots");
    }
    return inner_->RegisterBuffers(ranges);
  }
  Status UnregisterBuffers(const void* base) override {
    {
      std::lock_guard lock(mu_);
      unregistered_.push_back(base);
    }
    return inner_->UnregisterBuffers(base);
  }

  void set_fail_register(bool fail) {
    std::lock_guard lock(mu_);
    fail_register_ = fail;
  }
  std::vector<std::vector<io::BufferRange>> register_calls() const {
    std::lock_guard lock(mu_);
    return register_calls_;
  }
  std::vector<const void*> unregistered() const {
    std::lock_guard lock(mu_);
    return unregistered_;
  }

 private:
  std::unique_ptr<io::BlockStore> inner_;
  mutable std::mutex mu_;
  bool fail_register_ = false;
  std::vector<std::vector<io::BufferRange>> register_calls_;
  std::vector<const void*> unregistered_;
};

std::unique_ptr<io::BlockStore> MemoryStore() {
  io::StoreOptions options;
  options.backend = io::Backend::kMemory;
  Result<std::unique_ptr<io::BlockStore>> store = io::CreateMemoryStore(options);
  EXPECT_TRUE(store.ok()) << store.status().ToString();
  return store.ok() ? std::move(store).value() : nullptr;
}

// ---- size classes
// --------------------------------------------------------------------------------

TEST(PinnedPoolSizeClassTest, SmallClassesArePowersOfTwo) {
  EXPECT_EQ(PinnedPool::SizeClass(1), 4 * KiB);
  EXPECT_EQ(PinnedPool::SizeClass(4 * KiB), 4 * KiB);
  EXPECT_EQ(PinnedPool::SizeClass(4 * KiB + 1), 8 * KiB);
  EXPECT_EQ(PinnedPool::SizeClass(9 * KiB), 16 * KiB);
  EXPECT_EQ(PinnedPool::SizeClass(33 * KiB), 64 * KiB);
  EXPECT_EQ(PinnedPool::SizeClass(64 * KiB), 64 * KiB);
  // Above 64 KiB: 8 classes per power of two.
  EXPECT_EQ(PinnedPool::SizeClass(64 * KiB + 1), 72 * KiB);
  EXPECT_EQ(PinnedPool::SizeClass(127 * KiB), 128 * KiB);
  EXPECT_EQ(PinnedPool::SizeClass(128 * KiB + 1), 144 * KiB);
  EXPECT_EQ(PinnedPool::SizeClass(MiB + 1), MiB + 128 * KiB);
  EXPECT_EQ(PinnedPool::SizeClass(100 * MiB), 104 * MiB);
  EXPECT_EQ(PinnedPool::SizeClass(GiB), GiB);
}

TEST(PinnedPoolSizeClassTest, MonotoneAlignedAndWasteBounded) {
  auto check = [](size_t bytes, size_t* previous_class) {
    const size_t c = PinnedPool::SizeClass(bytes);
    ASSERT_GE(c, bytes);
    ASSERT_EQ(c % (4 * KiB), 0u) << bytes;
    ASSERT_GE(c, *previous_class) << bytes;
    ASSERT_EQ(PinnedPool::SizeClass(c), c) << bytes;  // a class is its own class
    if (bytes > 64 * KiB) {
      ASSERT_LE(c - bytes, bytes / 8) << bytes;
    }
    *previous_class = c;
  };
  size_t previous = 0;
  for (size_t bytes = 1; bytes <= 4 * MiB; ++bytes)
    check(bytes, &previous);
  // Larger sizes, sparsely: every class boundary +- 1, up to 1 TiB.
  previous = 0;
  for (size_t c = 4 * KiB; c <= (size_t{1} << 40); c = PinnedPool::SizeClass(c + 1)) {
    check(c - 1, &previous);
    check(c, &previous);
    check(c + 1, &previous);
  }
  // 8 classes in every power of two above 64 KiB.
  for (size_t p = 64 * KiB; p < (size_t{1} << 40); p *= 2) {
    int classes = 0;
    for (size_t c = PinnedPool::SizeClass(p + 1); c <= 2 * p; c = PinnedPool::SizeClass(c + 1))
      ++classes;
    EXPECT_EQ(classes, 8) << p;
  }
}

// ---- allocation
// ----------------------------------------------------------------------------------

TEST(PinnedPoolTest, CreateRejectsZeroBytes) {
  PinnedPoolOptions options;
  Result<std::unique_ptr<PinnedPool>> pool = PinnedPool::Create(options);
  EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument);
}

TEST(PinnedPoolTest, SizeIsRoundedToThePage) {
  auto pool = MakePool(MiB + 1);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->size(), MiB + 4 * KiB);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pool->base()) % (4 * KiB), 0u);
  const PinnedPoolStats stats = pool->stats();
  EXPECT_EQ(stats.size, MiB + 4 * KiB);
  EXPECT_EQ(stats.in_use, 0u);
  EXPECT_EQ(stats.largest_free, stats.size);
  EXPECT_FALSE(stats.device_registered);
  EXPECT_FALSE(stats.store_registered);
}

TEST(PinnedPoolTest, BlocksAreAlignedReservedByClassAndContained) {
  auto pool = MakePool(4 * MiB);
  ASSERT_NE(pool, nullptr);
  PinnedBlock a = MustAllocate(*pool, 1);
  PinnedBlock b = MustAllocate(*pool, 100 * KiB);
  EXPECT_EQ(a.bytes, 1u);
  EXPECT_EQ(a.capacity, 4 * KiB);
  EXPECT_EQ(b.bytes, 100 * KiB);
  EXPECT_EQ(b.capacity, 104 * KiB);
  for (const PinnedBlock& x : {a, b}) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(x.data) % (4 * KiB), 0u);
    EXPECT_TRUE(pool->Contains(x.data));
    EXPECT_TRUE(pool->Contains(static_cast<char*>(x.data) + x.capacity - 1));
  }
  EXPECT_FALSE(pool->Contains(pool->base() + pool->size()));
  EXPECT_FALSE(pool->Contains(&a));
  std::memset(b.data, 0xAB, b.capacity);  // the whole capacity is usable
  EXPECT_EQ(pool->stats().in_use, 108 * KiB);
  pool->Free(a);
  pool->Free(b);
  EXPECT_EQ(pool->stats().in_use, 0u);
  EXPECT_EQ(pool->stats().largest_free, 4 * MiB);
}

TEST(PinnedPoolTest, ExactFitThenExhaustion) {
  auto pool = MakePool(MiB);
  ASSERT_NE(pool, nullptr);
  std::set<void*> seen;
  std::vector<PinnedBlock> blocks;
  for (int i = 0; i < 256; ++i) {
    PinnedBlock b = MustAllocate(*pool, 4 * KiB);
    ASSERT_TRUE(b);
    EXPECT_TRUE(seen.insert(b.data).second);
    blocks.push_back(b);
  }
  PinnedPoolStats stats = pool->stats();
  EXPECT_EQ(stats.in_use, MiB);
  EXPECT_EQ(stats.largest_free, 0u);
  Result<PinnedBlock> more = pool->Allocate(1);
  EXPECT_EQ(more.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(pool->stats().failed_allocs, 1u);
  EXPECT_EQ(pool->stats().allocs, 256u);

  // One block back: exactly one 4 KiB request fits again, in that very place.
  pool->Free(blocks[17]);
  PinnedBlock again = MustAllocate(*pool, 4 * KiB);
  EXPECT_EQ(again.data, blocks[17].data);
  EXPECT_FALSE(pool->Allocate(4 * KiB).ok());
  blocks[17] = again;
  for (const PinnedBlock& b : blocks)
    pool->Free(b);
  // The whole pool as one block.
  PinnedBlock all = MustAllocate(*pool, MiB);
  EXPECT_EQ(all.data, pool->base());
  EXPECT_EQ(all.capacity, MiB);
  pool->Free(all);
}

TEST(PinnedPoolTest, ExhaustionMessageNamesPoolInUseLargestFreeAndRequest) {
  auto pool = MakePool(MiB);
  ASSERT_NE(pool, nullptr);
  PinnedBlock a = MustAllocate(*pool, 256 * KiB);
  PinnedBlock b = MustAllocate(*pool, 256 * KiB);
  PinnedBlock c = MustAllocate(*pool, 256 * KiB);
  pool->Free(b);  // free: [256K, 512K) and [768K, 1M), 256 KiB each
  Result<PinnedBlock> big = pool->Allocate(384 * KiB);
  ASSERT_EQ(big.status().code(), StatusCode::kResourceExhausted);
  const std::string message(big.status().message());
  EXPECT_THAT(message, HasSubstr("pool " + FormatBytes(MiB)));
  EXPECT_THAT(message, HasSubstr("in use " + FormatBytes(512 * KiB)));
  EXPECT_THAT(message, HasSubstr("largest free extent " + FormatBytes(256 * KiB)));
  EXPECT_THAT(message, HasSubstr(FormatBytes(384 * KiB)));
  EXPECT_THAT(message, HasSubstr("393216 bytes"));
  // Larger than the whole pool.
  Result<PinnedBlock> huge = pool->Allocate(2 * MiB);
  ASSERT_EQ(huge.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(huge.status().message(), HasSubstr(FormatBytes(2 * MiB)));
  EXPECT_EQ(pool->Allocate(0).status().code(), StatusCode::kInvalidArgument);
  pool->Free(a);
  pool->Free(c);
}

TEST(PinnedPoolTest, FreedBlocksCoalesceIntoTheWholePool) {
  auto pool = MakePool(8 * MiB);
  ASSERT_NE(pool, nullptr);
  std::mt19937_64 rng(7);
  std::vector<PinnedBlock> blocks;
  // Fill the pool with blocks of mixed sizes until nothing more fits.
  std::uniform_int_distribution<size_t> size(1, 300 * KiB);
  for (int misses = 0; misses < 50;) {
    Result<PinnedBlock> b = pool->Allocate(size(rng));
    if (b.ok()) {
      blocks.push_back(*b);
    } else {
      ++misses;
    }
  }
  ASSERT_GT(blocks.size(), 20u);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  for (size_t i = 0; i < blocks.size(); ++i) {
    pool->Free(blocks[i]);
    // Partially freed, the pool still serves the largest extent it reports.
    if (i == blocks.size() / 2) {
      const uint64_t largest = pool->stats().largest_free;
      PinnedBlock probe = MustAllocate(*pool, largest);
      pool->Free(probe);
    }
  }
  EXPECT_EQ(pool->stats().in_use, 0u);
  EXPECT_EQ(pool->stats().largest_free, 8 * MiB);
  PinnedBlock all = MustAllocate(*pool, 8 * MiB);
  EXPECT_EQ(all.data, pool->base());
  pool->Free(all);
}

TEST(PinnedPoolTest, RequestLargerThanAnyBlockSoFarIsServed) {
  auto pool = MakePool(4 * MiB);
  ASSERT_NE(pool, nullptr);
  // Cycle through small blocks (their class lists fill up), then ask for more than any of them.
  for (int round = 0; round < 3; ++round) {
    std::vector<PinnedBlock> blocks;
    for (int i = 0; i < 64; ++i)
      blocks.push_back(MustAllocate(*pool, 64 * KiB));
    EXPECT_FALSE(pool->Allocate(4 * KiB).ok());
    for (const PinnedBlock& b : blocks)
      pool->Free(b);
  }
  PinnedBlock one = MustAllocate(*pool, MiB);
  PinnedBlock three = MustAllocate(*pool, 3 * MiB);
  EXPECT_EQ(one.capacity + three.capacity, 4 * MiB);
  pool->Free(one);
  pool->Free(three);
}

TEST(PinnedPoolTest, RequestWhoseClassDoesNotFitGetsItsExactSize) {
  // 3 MiB + 8 KiB: the class of the whole pool (3.5 MiB) is larger than the pool.
  auto pool = MakePool(3 * MiB + 8 * KiB);
  ASSERT_NE(pool, nullptr);
  ASSERT_GT(PinnedPool::SizeClass(pool->size()), pool->size());
  PinnedBlock all = MustAllocate(*pool, pool->size());
  EXPECT_EQ(all.capacity, pool->size());
  EXPECT_EQ(pool->stats().in_use, pool->size());
  pool->Free(all);
  // The odd-sized block went straight back to the free extents.
  EXPECT_EQ(pool->stats().largest_free, pool->size());
  PinnedBlock again = MustAllocate(*pool, 3 * MiB + 1);
  EXPECT_EQ(again.capacity, 3 * MiB + 4 * KiB);
  pool->Free(again);
}

TEST(PinnedPoolTest, ReuseOfAFreedClassBlock) {
  auto pool = MakePool(4 * MiB);
  ASSERT_NE(pool, nullptr);
  PinnedBlock a = MustAllocate(*pool, 200 * KiB);
  PinnedBlock b = MustAllocate(*pool, 16 * KiB);
  pool->Free(a);
  PinnedBlock c = MustAllocate(*pool, 199 * KiB);  // same class: the same place
  EXPECT_EQ(c.data, a.data);
  EXPECT_EQ(c.capacity, a.capacity);
  pool->Free(b);
  pool->Free(c);
}

// ---- randomized stress against a reference model ------------------------------------------------

// What the pool should look like: live blocks by offset.
struct Model {
  std::map<uint64_t, PinnedBlock> live;
  uint64_t in_use = 0;
  uint64_t peak = 0;

  // The largest gap between live blocks in a pool of `size` bytes.
  uint64_t LargestGap(uint64_t size) const {
    uint64_t largest = 0, cursor = 0;
    for (const auto& [offset, block] : live) {
      largest = std::max(largest, offset - cursor);
      cursor = offset + block.capacity;
    }
    return std::max(largest, size - cursor);
  }
};

void FillBlock(const PinnedBlock& b, uint8_t tag) {
  auto* p = static_cast<uint8_t*>(b.data);
  p[0] = tag;
  p[b.capacity / 2] = tag;
  p[b.capacity - 1] = tag;
}
bool CheckBlock(const PinnedBlock& b, uint8_t tag) {
  const auto* p = static_cast<const uint8_t*>(b.data);
  return p[0] == tag && p[b.capacity / 2] == tag && p[b.capacity - 1] == tag;
}

TEST(PinnedPoolTest, RandomizedAgainstAReferenceModel) {
  constexpr size_t kPool = 16 * MiB;
  auto pool = MakePool(kPool);
  ASSERT_NE(pool, nullptr);
  Model model;
  std::mt19937_64 rng(12345);
  // Sizes log-uniform from 1 byte to 2 MiB, so that small and large classes mix.
  std::uniform_real_distribution<double> log_size(0.0, 21.0);
  std::map<uint64_t, uint8_t> tags;
  int failures = 0;
  for (int op = 0; op < 20000; ++op) {
    const bool allocate = model.live.empty() || (rng() % 100) < 55;
    if (allocate) {
      const auto bytes = std::max<size_t>(1, static_cast<size_t>(std::exp2(log_size(rng))));
      Result<PinnedBlock> r = pool->Allocate(bytes);
      if (!r.ok()) {
        ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
        // Fails only when no gap could hold even the request rounded to 4 KiB.
        ASSERT_LT(model.LargestGap(kPool), RoundUp(bytes, 4 * KiB)) << "op " << op;
        ++failures;
        continue;
      }
      const PinnedBlock b = *r;
      ASSERT_EQ(b.bytes, bytes);
      ASSERT_TRUE(b.capacity == PinnedPool::SizeClass(bytes) ||
                  b.capacity == RoundUp(bytes, 4 * KiB))
          << bytes << " -> " << b.capacity;
      ASSERT_EQ(reinterpret_cast<uintptr_t>(b.data) % (4 * KiB), 0u);
      const uint64_t offset = OffsetOf(*pool, b);
      ASSERT_LE(offset + b.capacity, kPool);
      // No overlap with the neighbours on either side.
      auto next = model.live.lower_bound(offset);
      if (next != model.live.end()) {
        ASSERT_LE(offset + b.capacity, next->first) << "op " << op;
      }
      if (next != model.live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second.capacity, offset) << "op " << op;
      }
      model.live.emplace(offset, b);
      model.in_use += b.capacity;
      model.peak = std::max(model.peak, model.in_use);
      const auto tag = static_cast<uint8_t>(rng());
      tags[offset] = tag;
      FillBlock(b, tag);
    } else {
      auto it = model.live.begin();
      std::advance(it, static_cast<long>(rng() % model.live.size()));
      ASSERT_TRUE(CheckBlock(it->second, tags[it->first])) << "block overwritten, op " << op;
      pool->Free(it->second);
      model.in_use -= it->second.capacity;
      model.live.erase(it);
    }
    if (op % 97 == 0) {
      const PinnedPoolStats stats = pool->stats();
      ASSERT_EQ(stats.in_use, model.in_use);
      ASSERT_EQ(stats.peak, model.peak);
      ASSERT_EQ(stats.largest_free, model.LargestGap(kPool)) << "op " << op;
    }
  }
  EXPECT_GT(failures, 0) << "the stress never reached exhaustion";
  for (const auto& [offset, block] : model.live) {
    EXPECT_TRUE(CheckBlock(block, tags[offset]));
    pool->Free(block);
  }
  const PinnedPoolStats stats = pool->stats();
  EXPECT_EQ(stats.in_use, 0u);
  EXPECT_EQ(stats.peak, model.peak);
  EXPECT_EQ(stats.largest_free, kPool);
  EXPECT_EQ(stats.failed_allocs, static_cast<uint64_t>(failures));
}

TEST(PinnedPoolTest, ConcurrentAllocateAndFree) {
  constexpr size_t kPool = 32 * MiB;
  constexpr int kThreads = 4;
  constexpr int kOps = 4000;
  auto pool = MakePool(kPool);
  ASSERT_NE(pool, nullptr);
  std::atomic<int> corrupted{0};
  std::atomic<int> unexpected_errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<uint64_t>(t) + 1);
      std::vector<PinnedBlock> mine;
      const auto tag = static_cast<uint8_t>(t + 1);
      for (int op = 0; op < kOps; ++op) {
        if (mine.empty() || rng() % 2 == 0) {
          const size_t bytes = 1 + rng() % (512 * KiB);
          Result<PinnedBlock> b = pool->Allocate(bytes);
          if (!b.ok()) {
            if (b.status().code() != StatusCode::kResourceExhausted) ++unexpected_errors;
            continue;
          }
          std::memset(b->data, tag, b->capacity);
          mine.push_back(*b);
        } else {
          const size_t i = rng() % mine.size();
          const auto* p = static_cast<const uint8_t*>(mine[i].data);
          if (p[0] != tag || p[mine[i].capacity - 1] != tag) ++corrupted;
          pool->Free(mine[i]);
          mine[i] = mine.back();
          mine.pop_back();
        }
        if (op % 500 == 0) (void)pool->stats();
      }
      for (const PinnedBlock& b : mine)
        pool->Free(b);
    });
  }
  for (auto& th : threads)
    th.join();
  EXPECT_EQ(corrupted.load(), 0);
  EXPECT_EQ(unexpected_errors.load(), 0);
  const PinnedPoolStats stats = pool->stats();
  EXPECT_EQ(stats.in_use, 0u);
  EXPECT_EQ(stats.largest_free, kPool);
  EXPECT_GT(stats.peak, 0u);
  EXPECT_LE(stats.peak, kPool);
}

// ---- misuse
// --------------------------------------------------------------------------------------

TEST(PinnedPoolTest, FreeOfAForeignOrFreedBlockIsRefused) {
  auto pool = MakePool(MiB);
  ASSERT_NE(pool, nullptr);
  PinnedBlock a = MustAllocate(*pool, 64 * KiB);
  pool->Free(PinnedBlock{});  // empty: ignored
  alignas(4096) static char outside[4096];
  PinnedBlock foreign{outside, 4096, 4096};
  PinnedBlock inner{static_cast<char*>(a.data) + 4096, 4096, 4096};  // inside a live block
#ifdef NDEBUG
  pool->Free(foreign);
  pool->Free(inner);
  EXPECT_EQ(pool->stats().in_use, 64 * KiB);
  pool->Free(a);
  pool->Free(a);  // twice
  EXPECT_EQ(pool->stats().in_use, 0u);
  // The double free did not put the block on a free list twice: two allocations of its class
  // get different memory.
  PinnedBlock x = MustAllocate(*pool, 64 * KiB);
  PinnedBlock y = MustAllocate(*pool, 64 * KiB);
  EXPECT_NE(x.data, y.data);
  pool->Free(x);
  pool->Free(y);
#else
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(pool->Free(foreign), "not a live block");
  EXPECT_DEATH(pool->Free(inner), "not a live block");
  pool->Free(a);
  EXPECT_DEATH(pool->Free(a), "not a live block");
#endif
  EXPECT_EQ(pool->stats().largest_free, MiB);
}

// ---- registration
// --------------------------------------------------------------------------------

TEST(PinnedPoolTest, RegistersWithTheDeviceAndUnregistersOnDestruction) {
  FakeDevice device;
  char* base = nullptr;
  {
    auto pool = MakePool(2 * MiB, &device);
    ASSERT_NE(pool, nullptr);
    base = pool->base();
    ASSERT_EQ(device.registered().size(), 1u);
    EXPECT_EQ(device.registered()[0].ptr, pool->base());
    EXPECT_EQ(device.registered()[0].bytes, pool->size());
    EXPECT_TRUE(pool->stats().device_registered);
    EXPECT_TRUE(device.unregistered().empty());
  }
  ASSERT_EQ(device.unregistered().size(), 1u);
  EXPECT_EQ(device.unregistered()[0], base);
}

TEST(PinnedPoolTest, RegistersWithTheCpuDeviceAndCopiesFromBlocks) {
  DeviceOptions device_options;
  device_options.type = DeviceType::kCpu;
  device_options.memory_budget = 16 * MiB;
  Result<std::unique_ptr<Device>> device_or = CreateDevice(device_options);
  ASSERT_TRUE(device_or.ok()) << device_or.status().ToString();
  Device& device = **device_or;
  char* base = nullptr;
  {
    auto pool = MakePool(4 * MiB, &device);
    ASSERT_NE(pool, nullptr);
    base = pool->base();
    EXPECT_TRUE(pool->stats().device_registered);
    // The device holds the range: registering part of it again overlaps.
    EXPECT_EQ(device.RegisterHost(base, 4096).code(), StatusCode::kInvalidArgument);

    // A round trip host -> device -> host through pool blocks.
    PinnedBlock up = MustAllocate(*pool, 64 * KiB);
    PinnedBlock down = MustAllocate(*pool, 64 * KiB);
    testing::FillPattern(up.data, up.bytes, 5);
    Result<void*> dev = device.Alloc(up.bytes);
    ASSERT_TRUE(dev.ok()) << dev.status().ToString();
    Result<std::unique_ptr<Stream>> stream = device.CreateStream("copy");
    ASSERT_TRUE(stream.ok()) << stream.status().ToString();
    ASSERT_TRUE(device.CopyAsync(*dev, up.data, up.bytes, CopyKind::kHostToDevice, **stream).ok());
    ASSERT_TRUE(
        device.CopyAsync(down.data, *dev, up.bytes, CopyKind::kDeviceToHost, **stream).ok());
    ASSERT_TRUE(device.Synchronize(**stream).ok());
    EXPECT_EQ(std::memcmp(up.data, down.data, up.bytes), 0);
    device.Free(*dev);
    pool->Free(up);
    pool->Free(down);
  }
  // Unregistered by the pool's destructor: nothing starts at `base` any more.
  EXPECT_EQ(device.UnregisterHost(base).code(), StatusCode::kNotFound);
}

TEST(PinnedPoolTest, DeviceRegistrationFailureIsAnError) {
  FakeDevice device;
  device.set_fail_register(true);
  PinnedPoolOptions options;
  options.bytes = MiB;
  options.device = &device;
  Result<std::unique_ptr<PinnedPool>> pool = PinnedPool::Create(options);
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(pool.status().message(), HasSubstr("pinned pool"));
  EXPECT_THAT(pool.status().message(), HasSubstr("fake:0"));
  EXPECT_THAT(pool.status().message(), HasSubstr("injected registration failure"));
  EXPECT_TRUE(device.unregistered().empty());
}

TEST(PinnedPoolTest, RegistersWithAMemoryStoreAndDoesIoFromBlocks) {
  RecordingStore store(MemoryStore());
  FakeDevice device;
  {
    auto pool = MakePool(4 * MiB, &device, &store);
    ASSERT_NE(pool, nullptr);
    const PinnedPoolStats stats = pool->stats();
    EXPECT_TRUE(stats.store_registered);
    EXPECT_TRUE(stats.device_registered);
    ASSERT_EQ(store.register_calls().size(), 1u);
    const std::vector<io::BufferRange> ranges = store.register_calls()[0];
    ASSERT_EQ(ranges.size(), 1u);
    EXPECT_EQ(ranges[0].base, pool->base());
    EXPECT_EQ(ranges[0].length, pool->size());
    EXPECT_FALSE(ranges[0].huge_pages);  // HugePages::kOff
    // The store really holds the range: registering it again overlaps.
    io::BufferRange again{pool->base(), 4096, false};
    EXPECT_EQ(store.RegisterBuffers({&again, 1}).code(), StatusCode::kInvalidArgument);

    // Direct-I/O-style transfers from pool blocks.
    io::FileSpec spec;
    spec.paths = {"/pool-test/file"};
    Result<io::FileId> file = store.Open(spec);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    PinnedBlock out = MustAllocate(*pool, 256 * KiB);
    PinnedBlock in = MustAllocate(*pool, 256 * KiB);
    testing::FillPattern(out.data, out.bytes, 3);
    ASSERT_TRUE(store.Write(*file, 0, out.bytes, out.data).ok());
    ASSERT_TRUE(store.Read(*file, 0, in.bytes, in.data).ok());
    EXPECT_EQ(std::memcmp(out.data, in.data, out.bytes), 0);
    ASSERT_TRUE(store.Close(*file).ok());
    pool->Free(out);
    pool->Free(in);
  }
  ASSERT_EQ(store.unregistered().size(), 1u);
  EXPECT_EQ(store.unregistered()[0], store.register_calls()[0][0].base);
  EXPECT_EQ(device.unregistered().size(), 1u);
}

TEST(PinnedPoolTest, StoreRegistrationFailureUndoesTheDeviceRegistration) {
  RecordingStore store(MemoryStore());
  store.set_fail_register(true);
  FakeDevice device;
  PinnedPoolOptions options;
  options.bytes = MiB;
  options.device = &device;
  options.store = &store;
  Result<std::unique_ptr<PinnedPool>> pool = PinnedPool::Create(options);
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(pool.status().message(), HasSubstr("injected: no registration slots"));
  EXPECT_THAT(pool.status().message(), HasSubstr("memory store"));
  ASSERT_EQ(device.registered().size(), 1u);
  ASSERT_EQ(device.unregistered().size(), 1u);
  EXPECT_EQ(device.unregistered()[0], device.registered()[0].ptr);
}

TEST(PinnedPoolTest, RegistersWithARealStoreAndUsesFixedBuffers) {
  io::StoreOptions options;  // io_uring where it can be set up, else pread/pwrite
  Result<std::unique_ptr<io::BlockStore>> store_or = io::CreateBlockStore(options);
  ASSERT_TRUE(store_or.ok()) << store_or.status().ToString();
  std::unique_ptr<io::BlockStore> store = std::move(store_or).value();
  testing::TempDir dir;
  {
    PinnedPoolOptions pool_options;
    pool_options.bytes = 8 * MiB;
    pool_options.store = store.get();
    Result<std::unique_ptr<PinnedPool>> pool_or = PinnedPool::Create(pool_options);
    ASSERT_TRUE(pool_or.ok()) << pool_or.status().ToString();
    PinnedPool& pool = **pool_or;
    EXPECT_TRUE(pool.stats().store_registered);

    io::FileSpec spec;
    spec.paths = {dir.file("pool.dat")};
    Result<io::FileId> file = store->Open(spec);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    PinnedBlock out = MustAllocate(pool, MiB);
    PinnedBlock in = MustAllocate(pool, MiB);
    testing::FillPattern(out.data, out.bytes, 11);
    ASSERT_TRUE(store->Write(*file, 0, out.bytes, out.data).ok());
    ASSERT_TRUE(store->Read(*file, 0, in.bytes, in.data).ok());
    EXPECT_EQ(std::memcmp(out.data, in.data, out.bytes), 0);
    ASSERT_TRUE(store->Close(*file).ok());
    const io::StoreStats stats = store->stats();
    if (store->name() == "uring" && stats.registered_buffer_bytes > 0) {
      EXPECT_GE(stats.registered_buffer_bytes, pool.size());
      EXPECT_GT(stats.fixed_buffer_transfers, 0u);
    }
    pool.Free(out);
    pool.Free(in);
  }
  // The pool unregistered its range: it can be registered again (bookkeeping only; the memory
  // is gone, so it is unregistered right away).
  static char scratch[4096];
  io::BufferRange range{scratch, sizeof(scratch), false};
  ASSERT_TRUE(store->RegisterBuffers({&range, 1}).ok());
  EXPECT_TRUE(store->UnregisterBuffers(scratch).ok());
}

TEST(PinnedPoolTest, LargePoolRegistersGibChunksAndBlocksStayInsideOne) {
  // 1 GiB + 16 MiB: two registered ranges. Small pages, so the flag is false.
  constexpr size_t kPool = GiB + 16 * MiB;
  RecordingStore store(MemoryStore());
  auto pool = MakePool(kPool, nullptr, &store);
  ASSERT_NE(pool, nullptr);
  ASSERT_EQ(store.register_calls().size(), 1u);
  const std::vector<io::BufferRange> ranges = store.register_calls()[0];
  ASSERT_EQ(ranges.size(), 2u);
  EXPECT_EQ(ranges[0].base, pool->base());
  EXPECT_EQ(ranges[0].length, GiB);
  EXPECT_EQ(ranges[1].base, pool->base() + GiB);
  EXPECT_EQ(ranges[1].length, 16 * MiB);
  for (const io::BufferRange& r : ranges)
    EXPECT_EQ(r.huge_pages, false);

  // Fill the first chunk but its last 4 KiB, from classes: 960 MiB, then 32 MiB, 16 MiB, ...,
  // 4 KiB. An 8 KiB block then does not straddle the boundary but starts at it, and the 4 KiB
  // gap left before it is still served to a 4 KiB request.
  std::vector<PinnedBlock> filler = {MustAllocate(*pool, 960 * MiB)};
  for (size_t b = 32 * MiB; b >= 4 * KiB; b /= 2)
    filler.push_back(MustAllocate(*pool, b));
  EXPECT_EQ(pool->stats().in_use, GiB - 4 * KiB);
  PinnedBlock eight = MustAllocate(*pool, 8 * KiB);
  EXPECT_EQ(OffsetOf(*pool, eight), GiB);
  PinnedBlock four = MustAllocate(*pool, 4 * KiB);
  EXPECT_EQ(OffsetOf(*pool, four), GiB - 4 * KiB);
  for (const PinnedBlock& b : filler)
    pool->Free(b);
  pool->Free(eight);
  pool->Free(four);

  // A block larger than a chunk spans both ranges.
  PinnedBlock all = MustAllocate(*pool, kPool);
  EXPECT_EQ(all.data, pool->base());
  pool->Free(all);
  pool.reset();
  ASSERT_EQ(store.unregistered().size(), 2u);
  EXPECT_EQ(store.unregistered()[0], ranges[0].base);
  EXPECT_EQ(store.unregistered()[1], ranges[1].base);
}

TEST(PinnedPoolTest, HugePageFlagFollowsTheRegion) {
  RecordingStore store(MemoryStore());
  PinnedPoolOptions options;
  options.bytes = 4 * MiB;
  options.huge_pages = HugePages::kAuto;
  options.store = &store;
  Result<std::unique_ptr<PinnedPool>> pool = PinnedPool::Create(options);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  const PinnedPoolStats stats = (*pool)->stats();
  ASSERT_EQ(store.register_calls().size(), 1u);
  EXPECT_EQ(store.register_calls()[0][0].huge_pages, stats.huge_page_bytes >= stats.size);
  EXPECT_EQ(stats.size % (4 * KiB), 0u);
}

}  // namespace
}  // namespace strata::device

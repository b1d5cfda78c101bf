// TierManager: residency, budgets, eviction, write-back and failure handling, on the CPU device
// with in-memory, real-file and fault-injecting stores.
#include "offload/tier_manager.h"

#include <gtest/gtest.h>

#include <atomic>
#include <barrier>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <thread>

#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>

#include "offload_test_util.h"

namespace strata::offload {
namespace {

using testing::Content;
using testing::ExpectShard;
using testing::Fnv;
using testing::GatedFill;
using testing::Rig;
using testing::Spec;
using testing::WriteShard;

TEST(TierManagerTest, RoundTripThroughEveryTier) {
  Rig r = Rig::Make({});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, 100'000, Tier::kNvme, "a")).ok());
  ASSERT_TRUE(m.Register(Spec(2, 5'000, Tier::kHost, "b")).ok());
  ASSERT_TRUE(m.Register(Spec(3, 12'288, Tier::kDevice, "c")).ok());
  ASSERT_TRUE(m.Start().ok());

  WriteShard(m, 1, 100'000, 11, Tier::kHost);
  WriteShard(m, 2, 5'000, 22, Tier::kDevice);
  WriteShard(m, 3, 12'288, 33, Tier::kHost);
  Status flushed = m.FlushAll();
  ASSERT_TRUE(flushed.ok()) << flushed.ToString();
  for (ShardId id : {1, 2, 3}) {
    EXPECT_TRUE(m.IsCurrent(id, id == 1 ? Tier::kNvme : id == 2 ? Tier::kHost : Tier::kDevice));
  }
  // Drop every non-home copy, then read everything back through every tier.
  for (ShardId id : {1, 2, 3}) {
    ASSERT_TRUE(m.Evict(id, Tier::kDevice).ok());
    ASSERT_TRUE(m.Evict(id, Tier::kHost).ok());
  }
  EXPECT_FALSE(m.IsCurrent(1, Tier::kHost));
  ExpectShard(m, 1, 100'000, 11, Tier::kDevice);
  ExpectShard(m, 2, 5'000, 22, Tier::kDevice);
  ExpectShard(m, 3, 12'288, 33, Tier::kHost);
  ExpectShard(m, 1, 100'000, 11, Tier::kHost);
  EXPECT_GT(m.stats(Tier::kHost).fill_bytes, 0u);
  EXPECT_GT(m.stats(Tier::kNvme).writeback_bytes, 0u);
}

TEST(TierManagerTest, RegistrationErrors) {
  Rig r = Rig::Make({});
  TierManager& m = *r.manager;
  EXPECT_EQ(m.Register(Spec(1, 0, Tier::kNvme)).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(m.Register(Spec(1, 10, Tier::kNvme)).ok());
  EXPECT_EQ(m.Register(Spec(1, 10, Tier::kNvme)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m.Acquire(1, Tier::kHost).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(m.Start().ok());
  EXPECT_EQ(m.Register(Spec(2, 10, Tier::kNvme)).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(m.Acquire(9, Tier::kHost).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(m.Acquire(1, Tier::kNvme).status().code(), StatusCode::kInvalidArgument);
}

// Registers five 16 KiB NVMe shards 'block.0'..'block.4', starts the manager and acquires the
// first four on the device for "forward".
void HoldFourOfFive(TierManager& m, std::vector<Lease>& held) {
  for (ShardId id = 0; id < 5; ++id) {
    ASSERT_TRUE(m.Register(Spec(id, 16 << 10, Tier::kNvme, "block." + std::to_string(id))).ok());
  }
  ASSERT_TRUE(m.Start().ok());
  for (ShardId id = 0; id < 4; ++id) {
    Result<Lease> l = m.Acquire(id, Tier::kDevice, Access::kRead, "forward");
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    held.push_back(std::move(*l));
  }
}

TEST(TierManagerTest, BudgetErrorNamesTierBudgetRequestAndHolders) {
  Rig r = Rig::Make({.device_budget = 64 << 10});
  TierManager& m = *r.manager;
  std::vector<Lease> held;
  HoldFourOfFive(m, held);
  ASSERT_EQ(held.size(), 4u);
  Result<Lease> l = m.Acquire(4, Tier::kDevice, Access::kRead, "backward");
  ASSERT_FALSE(l.ok());
  const std::string msg = l.status().ToString();
  EXPECT_EQ(l.status().code(), StatusCode::kResourceExhausted) << msg;
  EXPECT_NE(msg.find("device tier budget 64.00 KiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'block.4' (16.00 KiB)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'block.0' 16.00 KiB by forward"), std::string::npos) << msg;
  EXPECT_NE(msg.find("for backward"), std::string::npos) << msg;
  // The manager stays usable: release one and the request succeeds.
  held[1].Release();
  EXPECT_TRUE(m.Acquire(4, Tier::kDevice).ok());
  EXPECT_LE(m.stats(Tier::kDevice).peak, 64u << 10);
}

// With shared host memory a device lease holds the host copy under it; a host-tier budget error
// must name that lease's owner, not count the bytes as "in flight".
TEST(TierManagerTest, SharedHostBudgetErrorNamesTheDeviceLeaseHolders) {
  Rig r = Rig::Make({.device_budget = 1 << 20, .host_budget = 64 << 10, .share_host_memory = true});
  TierManager& m = *r.manager;
  std::vector<Lease> held;
  HoldFourOfFive(m, held);
  ASSERT_EQ(held.size(), 4u);
  ASSERT_EQ(m.stats(Tier::kHost).in_use, 64u << 10);
  Result<Lease> l = m.Acquire(4, Tier::kHost, Access::kRead, "optimizer");
  ASSERT_FALSE(l.ok());
  const std::string msg = l.status().ToString();
  EXPECT_EQ(l.status().code(), StatusCode::kResourceExhausted) << msg;
  EXPECT_NE(msg.find("host tier budget 64.00 KiB is exhausted"), std::string::npos) << msg;
  EXPECT_NE(msg.find("acquired 64.00 KiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'block.2' 16.00 KiB by forward (device lease sharing it)"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("in flight 0 B"), std::string::npos) << msg;
  EXPECT_NE(msg.find("for optimizer"), std::string::npos) << msg;
  held[0].Release();
  EXPECT_TRUE(m.Acquire(4, Tier::kHost).ok());
  EXPECT_LE(m.stats(Tier::kHost).peak, 64u << 10);
}

// The budget has room but the pool (shared with other users) does not: the error is the pool's,
// and says that the tier is within its budget and what it holds.
TEST(TierManagerTest, PoolRefusalWithinTheBudgetSaysSo) {
  Rig r = Rig::Make({.pool_bytes = 2 << 20});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(0, 256 << 10, Tier::kNvme, "small")).ok());
  ASSERT_TRUE(m.Register(Spec(1, 1 << 20, Tier::kNvme, "large")).ok());
  ASSERT_TRUE(m.Start().ok());
  WriteShard(m, 1, 1 << 20, 5, Tier::kHost);
  ASSERT_TRUE(m.FlushAll().ok());
  ASSERT_TRUE(m.Evict(1, Tier::kHost).ok());
  Result<Lease> small = m.Acquire(0, Tier::kHost, Access::kRead, "forward");
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  // Another user of the pool takes most of what is left (1.25 of 2 MiB in use).
  Result<device::PinnedBlock> other = r.pool->Allocate(1 << 20);
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  Result<Lease> large = m.Acquire(1, Tier::kHost, Access::kRead, "backward");
  ASSERT_FALSE(large.ok());
  const std::string msg = large.status().ToString();
  EXPECT_EQ(large.status().code(), StatusCode::kResourceExhausted) << msg;
  EXPECT_NE(msg.find("pinned pool"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the host tier is within its budget of 2.00 MiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'small' 256.00 KiB by forward"), std::string::npos) << msg;
  // Nothing was lost: once the other user gives its memory back, the request is served.
  r.pool->Free(*other);
  ExpectShard(m, 1, 1 << 20, 5, Tier::kHost);
}

// Two readers wait for room to fill the same shard. The first fills it; the second must find
// that copy and share it, not end its wait in a budget error (the evictor never takes the copy
// it is making room for, so for the second reader the tier looked full of unevictable copies).
TEST(TierManagerTest, ReadersWaitingForRoomForTheSameShardShareItsCopy) {
  constexpr uint64_t kBytes = 16 << 10;
  Rig r = Rig::Make({.host_budget = 2 * kBytes, .faulty = true});
  TierManager& m = *r.manager;
  for (ShardId id = 0; id < 3; ++id) {
    ASSERT_TRUE(m.Register(Spec(id, kBytes, Tier::kNvme, "block." + std::to_string(id))).ok());
  }
  ASSERT_TRUE(m.Start().ok());
  WriteShard(m, 2, kBytes, 9, Tier::kHost);
  ASSERT_TRUE(m.FlushAll().ok());
  ASSERT_TRUE(m.Evict(2, Tier::kHost).ok());
  Result<Lease> held = m.Acquire(0, Tier::kHost, Access::kRead, "holder");
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  // Shard 1's only current copy is in host memory; its write-back (slow) frees the room.
  WriteShard(m, 1, kBytes, 5, Tier::kHost);
  io::FaultRule slow;
  slow.kind = io::FaultKind::kLatency;
  slow.op = io::IoOp::kWrite;
  slow.latency = std::chrono::milliseconds(300);
  r.faults->AddRule(slow);
  ASSERT_TRUE(m.Evict(1, Tier::kHost).ok());
  std::vector<Status> got(2);
  std::vector<std::thread> readers;
  for (int t = 0; t < 2; ++t) {
    readers.emplace_back([&, t] {
      Result<Lease> l = m.Acquire(2, Tier::kHost, Access::kRead, "reader");
      if (!l.ok()) {
        got[t] = l.status();
        return;
      }
      if (Fnv(l->data(), kBytes) != testing::FnvOf(kBytes, 9)) {
        got[t] = Status(StatusCode::kDataLoss, "wrong bytes");
      }
    });
  }
  for (auto& th : readers) th.join();
  for (const Status& st : got) EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_LE(m.stats(Tier::kHost).peak, 2 * kBytes);
  ExpectShard(m, 1, kBytes, 5, Tier::kHost);
}

// A kRead lease must not be released dirty. If one is, the bytes still become the shard's
// current version (nothing written is lost), and the misuse is reported.
TEST(TierManagerTest, ReadLeaseReleasedDirtyIsWarnedAndKept) {
  Rig r = Rig::Make({});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, 4096, Tier::kNvme, "misused")).ok());
  ASSERT_TRUE(m.Start().ok());
  Result<Lease> l = m.Acquire(1, Tier::kHost, Access::kRead, "reader");
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  const std::vector<char> c = Content(4096, 3);
  std::memcpy(l->data(), c.data(), c.size());
  ::testing::internal::CaptureStderr();
  l->Release(/*dirty=*/true);
  const std::string warned = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warned.find("shard 'misused': a lease acquired for reading (Access::kRead) was "
                        "released dirty"),
            std::string::npos)
      << warned;
  ASSERT_TRUE(m.FlushAll().ok());
  ASSERT_TRUE(m.Evict(1, Tier::kHost).ok());
  ExpectShard(m, 1, 4096, 3, Tier::kDevice);
}

TEST(TierManagerTest, EvictionWithoutOracleIsLru) {
  Rig r = Rig::Make({.device_budget = 48 << 10});
  TierManager& m = *r.manager;
  for (ShardId id = 0; id < 4; ++id) ASSERT_TRUE(m.Register(Spec(id, 16 << 10, Tier::kNvme)).ok());
  ASSERT_TRUE(m.Start().ok());
  for (ShardId id : {0, 1, 2}) ASSERT_TRUE(m.Acquire(id, Tier::kDevice).ok());
  ASSERT_TRUE(m.Acquire(0, Tier::kDevice).ok());  // 1 is now least recently used
  ASSERT_TRUE(m.Acquire(3, Tier::kDevice).ok());
  EXPECT_TRUE(m.IsCurrent(0, Tier::kDevice));
  EXPECT_FALSE(m.IsCurrent(1, Tier::kDevice));
  EXPECT_TRUE(m.IsCurrent(2, Tier::kDevice));
}

TEST(TierManagerTest, EvictionWithOracleDropsFarthestNextUse) {
  Rig r = Rig::Make({.device_budget = 48 << 10});
  TierManager& m = *r.manager;
  for (ShardId id = 0; id < 4; ++id) ASSERT_TRUE(m.Register(Spec(id, 16 << 10, Tier::kNvme)).ok());
  ASSERT_TRUE(m.Start().ok());
  for (ShardId id : {0, 1, 2}) ASSERT_TRUE(m.Acquire(id, Tier::kDevice).ok());
  std::map<ShardId, uint64_t> next = {{0, 9}, {1, 2}, {2, 5}, {3, 0}};
  m.SetEvictionOracle([&](ShardId s) { return next.at(s); });
  ASSERT_TRUE(m.Acquire(3, Tier::kDevice).ok());
  EXPECT_FALSE(m.IsCurrent(0, Tier::kDevice)) << "shard 0 is used last and must go first";
  EXPECT_TRUE(m.IsCurrent(1, Tier::kDevice));
  EXPECT_TRUE(m.IsCurrent(2, Tier::kDevice));
}

TEST(TierManagerTest, PrefetchNeverEvictsWhatIsNeededSooner) {
  Rig r = Rig::Make({.device_budget = 32 << 10});
  TierManager& m = *r.manager;
  for (ShardId id = 0; id < 3; ++id) ASSERT_TRUE(m.Register(Spec(id, 16 << 10, Tier::kNvme)).ok());
  ASSERT_TRUE(m.Start().ok());
  for (ShardId id : {0, 1}) ASSERT_TRUE(m.Acquire(id, Tier::kDevice).ok());
  std::map<ShardId, uint64_t> next = {{0, 1}, {1, 2}, {2, 3}};
  m.SetEvictionOracle([&](ShardId s) { return next.at(s); });
  Result<PrefetchOutcome> p = m.Prefetch(2, Tier::kDevice);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(*p, PrefetchOutcome::kNoRoom);
  EXPECT_TRUE(m.IsCurrent(0, Tier::kDevice));
  EXPECT_TRUE(m.IsCurrent(1, Tier::kDevice));
  next[2] = 0;  // now 2 is needed first: shard 1 (farthest) makes room
  p = m.Prefetch(2, Tier::kDevice);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(*p, PrefetchOutcome::kIssued);
  EXPECT_FALSE(m.IsCurrent(1, Tier::kDevice));
  m.WaitIdle();
  EXPECT_TRUE(m.IsCurrent(2, Tier::kDevice));
  EXPECT_EQ(*m.Prefetch(2, Tier::kDevice), PrefetchOutcome::kResident);
}

TEST(TierManagerTest, DirtyDeviceCopyIsWrittenBackBeforeItIsDropped) {
  Rig r = Rig::Make({.device_budget = 32 << 10, .pool_bytes = 64 << 10});
  TierManager& m = *r.manager;
  for (ShardId id = 0; id < 6; ++id) ASSERT_TRUE(m.Register(Spec(id, 16 << 10, Tier::kNvme)).ok());
  ASSERT_TRUE(m.Start().ok());
  // Write every shard on the device: the budget holds two, so the rest are written back through
  // host to NVMe as they are pushed out.
  for (ShardId id = 0; id < 6; ++id) {
    WriteShard(m, id, 16 << 10, 100 + id, Tier::kDevice);
  }
  for (ShardId id = 0; id < 6; ++id) ExpectShard(m, id, 16 << 10, 100 + id, Tier::kDevice);
  EXPECT_LE(m.stats(Tier::kDevice).peak, 32u << 10);
  EXPECT_LE(m.stats(Tier::kHost).peak, 64u << 10);
  EXPECT_GT(m.stats(Tier::kHost).writebacks, 0u);
  EXPECT_GT(m.stats(Tier::kNvme).writebacks, 0u);
}

TEST(TierManagerTest, NvmeLayoutIsStripedPreallocatedAndRemoved) {
  Rig r = Rig::Make({.real_files = true, .paths = 2});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, 10'000, Tier::kNvme, "p1", "param")).ok());
  ASSERT_TRUE(m.Register(Spec(2, 20'000, Tier::kNvme, "o1", "optim")).ok());
  ASSERT_TRUE(m.Register(Spec(3, 4096, Tier::kNvme, "p2", "param")).ok());
  ASSERT_TRUE(m.Start().ok());
  const NvmeLayout* layout = m.nvme_layout();
  ASSERT_NE(layout, nullptr);
  ASSERT_EQ(layout->files().size(), 2u);  // one per state class
  for (const auto& f : layout->files()) {
    ASSERT_EQ(f.size(), 2u);  // striped over both paths
    for (const std::string& p : f) EXPECT_TRUE(std::filesystem::exists(p)) << p;
  }
  EXPECT_EQ(layout->Find(1)->offset, 0u);
  EXPECT_EQ(layout->Find(1)->length, 12'288u);
  EXPECT_EQ(layout->Find(3)->offset, 12'288u);
  EXPECT_EQ(layout->Find(2)->offset, 0u);
  EXPECT_EQ(layout->Find(2)->length, 20'480u);
  EXPECT_EQ(layout->total_bytes(), 12'288u + 4096 + 20'480);
  const std::string param0 = layout->files()[1][0];
  EXPECT_NE(param0.find("strata.rank0.param.swap"), std::string::npos);
  // Preallocated: the stripes of each class's file together hold its slots, and (where the
  // filesystem supports fallocate) their blocks are allocated, not a sparse extension.
  const uint64_t class_bytes[2] = {20'480, 12'288 + 4096};  // files in class order: optim, param
  for (size_t f = 0; f < 2; ++f) {
    uint64_t sum = 0;
    for (const std::string& p : layout->files()[f]) {
      struct stat st {};
      ASSERT_EQ(::stat(p.c_str(), &st), 0) << p;
      sum += static_cast<uint64_t>(st.st_size);
      struct statfs fs {};
      ASSERT_EQ(::statfs(p.c_str(), &fs), 0) << p;
      const bool has_fallocate = fs.f_type == EXT4_SUPER_MAGIC || fs.f_type == XFS_SUPER_MAGIC ||
                                 fs.f_type == BTRFS_SUPER_MAGIC || fs.f_type == TMPFS_MAGIC;
      if (has_fallocate) {
        EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, static_cast<uint64_t>(st.st_size))
            << p << " is sparse";
      }
    }
    EXPECT_GE(sum, class_bytes[f]) << layout->files()[f][0];
  }

  WriteShard(m, 1, 10'000, 5, Tier::kHost);
  WriteShard(m, 2, 20'000, 6, Tier::kHost);
  ASSERT_TRUE(m.FlushAll().ok());
  ASSERT_TRUE(m.Evict(1, Tier::kHost).ok());
  ASSERT_TRUE(m.Evict(2, Tier::kHost).ok());
  ExpectShard(m, 1, 10'000, 5, Tier::kHost);
  ExpectShard(m, 2, 20'000, 6, Tier::kDevice);
  std::vector<std::string> paths;
  for (const auto& f : layout->files()) paths.insert(paths.end(), f.begin(), f.end());
  r.manager.reset();
  for (const std::string& p : paths) EXPECT_FALSE(std::filesystem::exists(p)) << p;
}

TEST(TierManagerTest, StallsAndTraceAreRecorded) {
  TraceRecorder trace;
  Rig r = Rig::Make({.trace = &trace});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, 64 << 10, Tier::kNvme, "a")).ok());
  ASSERT_TRUE(m.Start().ok());
  ASSERT_TRUE(m.Acquire(1, Tier::kDevice).ok());
  ASSERT_TRUE(m.Acquire(1, Tier::kDevice).ok());
  TierStats st = m.stats(Tier::kDevice);
  EXPECT_EQ(st.misses, 1u);
  EXPECT_EQ(st.hits, 1u);
  EXPECT_EQ(st.stalls, 1u);
  EXPECT_GT(st.stall_ns, 0u);
  bool read = false, stall = false;
  std::vector<std::string> tracks = trace.TrackNames();
  for (const TraceEvent& e : trace.Events()) {
    read |= tracks[e.track] == "offload nvme read" && e.name == "a";
    stall |= tracks[e.track] == "offload stall";
  }
  EXPECT_TRUE(read);
  EXPECT_TRUE(stall);
}

// The stall time is the manager's clock's: an Acquire that waits for a read held 5 s (on a
// manual clock, which only the test moves) stalls exactly 5 s, and nothing sleeps.
TEST(TierManagerTest, StallTimeIsMeasuredOnTheManagersClock) {
  ManualClock clock;
  Rig r = Rig::Make({.faulty = true, .clock = &clock});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, 64 << 10, Tier::kNvme, "a")).ok());
  ASSERT_TRUE(m.Start().ok());
  io::FaultRule slow;
  slow.kind = io::FaultKind::kLatency;
  slow.op = io::IoOp::kRead;
  slow.latency = std::chrono::seconds(5);
  r.faults->AddRule(slow);
  const uint64_t waits = clock.timed_waits();
  std::thread consumer([&] { ASSERT_TRUE(m.Acquire(1, Tier::kDevice, Access::kRead, "c").ok()); });
  ASSERT_TRUE(clock.AwaitTimedWaits(waits));  // the read is issued and held
  clock.Advance(std::chrono::seconds(5));
  consumer.join();
  const TierStats st = m.stats(Tier::kDevice);
  EXPECT_EQ(st.stalls, 1u);
  EXPECT_EQ(st.stall_ns, 5'000'000'000u);
}

// The main property test: random use of hundreds of shards over all three tiers with tight
// budgets. Every read returns the last version written; no budget is ever exceeded. With
// `faulty`, 15% of I/O requests fail while the threads run: no call hangs, every failure is a
// Status naming the injected error, and once the faults stop every shard reads back its last
// successfully written version.
struct StressParams {
  const char* name;
  bool real_files;
  int threads;
  bool share_host_memory = false;
  bool faulty = false;
};

class TierManagerStressTest : public ::testing::TestWithParam<StressParams> {};

TEST_P(TierManagerStressTest, RandomAccessKeepsEveryByteAndEveryBudget) {
  const StressParams param = GetParam();
  constexpr uint64_t kDeviceBudget = 256 << 10;
  constexpr uint64_t kPool = 512 << 10;  // the host tier's budget
  // The pool holds a third more than the budget for fragmentation, as the engine sizes its pool
  // (Engine::PlanPinnedPoolBytes). With a pool no larger than the budget, three threads' pinned
  // copies scattered among never-evicted home copies can leave no free extent large enough
  // although the budget has room: an allocator limit that no budget can promise to beat.
  Rig r = Rig::Make({.device_budget = kDeviceBudget,
                     .pool_bytes = kPool / 3 * 4,
                     .host_budget = kPool,
                     .real_files = param.real_files,
                     .faulty = param.faulty,
                     .paths = 2,
                     .share_host_memory = param.share_host_memory});
  TierManager& m = *r.manager;
  constexpr int kShards = 300;
  std::mt19937_64 setup(42);
  std::vector<uint64_t> bytes(kShards);
  std::vector<Tier> home(kShards);
  for (int i = 0; i < kShards; ++i) {
    bytes[i] = 1 + setup() % (20 << 10);
    // Home copies are never evicted: keep them to about a third of each budget.
    const int h = setup() % 100;
    home[i] = h < 1 ? Tier::kDevice : h < 6 ? Tier::kHost : Tier::kNvme;
    ASSERT_TRUE(m.Register(Spec(static_cast<ShardId>(i), bytes[i], home[i])).ok());
  }
  Status started = m.Start();
  ASSERT_TRUE(started.ok()) << started.ToString();
  if (param.faulty) {
    io::FaultRule rule;
    rule.probability = 0.15;
    r.faults->AddRule(rule);
  }

  std::atomic<bool> failed{false};
  std::atomic<int> injected{0};
  // An operation's failure: expected (and counted) when it is an injected I/O error.
  auto failure = [&](const Status& st) {
    if (param.faulty && st.message().find("injected") != std::string_view::npos) {
      ++injected;
      return;
    }
    ADD_FAILURE() << st.ToString();
    failed = true;
  };
  // Once every thread has done its operations: the faults stop, and the write-back failures
  // nobody has heard of yet are reported (and dropped).
  auto faults_off = [&]() noexcept {
    if (!param.faulty) return;
    r.faults->Clear();
    m.WaitIdle();
    (void)m.FlushAll();
    (void)m.TakeWritebackError();
  };
  std::barrier done(param.threads, faults_off);
  auto worker = [&](int t) {
    std::mt19937_64 rng(1000 + t);
    std::map<int, uint64_t> version;  // shards owned by this thread -> seed last written
    for (int i = t; i < kShards; i += param.threads) version[i] = 0;  // zeros at start
    auto expected = [&](int i, uint64_t v) {
      return v == 0 ? std::vector<char>(bytes[i], 0) : Content(bytes[i], v);
    };
    const int ops = 1500 / param.threads;
    for (int op = 0; op < ops && !failed; ++op) {
      auto it = version.begin();
      std::advance(it, rng() % version.size());
      const int i = it->first;
      const int kind = rng() % 10;
      const Tier tier = rng() % 2 ? Tier::kDevice : Tier::kHost;
      if (kind < 5) {  // read and check, and sometimes modify in place
        const bool modify = rng() % 3 == 0;
        Result<Lease> l =
            m.Acquire(i, tier, modify ? Access::kReadWrite : Access::kRead, "reader");
        if (!l.ok()) {
          failure(l.status());
          continue;
        }
        std::vector<char> want = expected(i, it->second);
        if (std::memcmp(l->data(), want.data(), bytes[i]) != 0) {
          ADD_FAILURE() << "shard " << i << " in " << TierName(tier) << " lost version "
                        << it->second;
          failed = true;
        }
        if (modify) {
          const uint64_t v = (uint64_t(t) << 32) | (op + 1);
          std::vector<char> c = Content(bytes[i], v);
          std::memcpy(l->data(), c.data(), bytes[i]);
          l->Release(/*dirty=*/true);
          it->second = v;
        }
      } else if (kind < 7) {  // overwrite
        Result<Lease> l = m.Acquire(i, tier, Access::kOverwrite, "writer");
        if (!l.ok()) {
          failure(l.status());
          continue;
        }
        const uint64_t v = (uint64_t(t) << 32) | (op + 1) | (1ull << 31);
        std::vector<char> c = Content(bytes[i], v);
        std::memcpy(l->data(), c.data(), bytes[i]);
        l->Release(true);
        it->second = v;
      } else if (kind < 9) {
        Result<PrefetchOutcome> p = m.Prefetch(i, tier);
        if (!p.ok()) failure(p.status());
      } else {
        Status s = m.Evict(i, tier);
        if (!s.ok()) failure(s);
      }
      EXPECT_LE(m.stats(Tier::kDevice).in_use, kDeviceBudget);
      EXPECT_LE(m.stats(Tier::kHost).in_use, kPool);
    }
    // Every thread is done writing (and the faults are off).
    done.arrive_and_wait();
    // Everything still reads back, through both tiers.
    for (auto& [i, v] : version) {
      for (Tier tier : {Tier::kHost, Tier::kDevice}) {
        Result<Lease> l = m.Acquire(i, tier);
        if (!l.ok() && param.faulty) {
          // A prefetch's failed read is reported once, to the shard's next Acquire.
          EXPECT_NE(l.status().message().find("injected"), std::string_view::npos)
              << l.status().ToString();
          l = m.Acquire(i, tier);
        }
        ASSERT_TRUE(l.ok()) << l.status().ToString();
        std::vector<char> want = expected(i, v);
        EXPECT_EQ(std::memcmp(l->data(), want.data(), bytes[i]), 0)
            << "shard " << i << " in " << TierName(tier);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < param.threads; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  m.WaitIdle();
  EXPECT_LE(m.stats(Tier::kDevice).peak, kDeviceBudget);
  EXPECT_LE(m.stats(Tier::kHost).peak, kPool);
  EXPECT_LE(r.device->memory_stats().peak, kDeviceBudget);
  EXPECT_LE(r.pool->stats().peak, kPool);
  EXPECT_GT(m.stats(Tier::kHost).evictions, 0u) << "the budgets were not tight";
  EXPECT_GT(m.stats(Tier::kNvme).writebacks, 0u);
  if (param.faulty) {
    EXPECT_GT(injected.load(), 0) << "no operation saw a fault";
  }
  if (param.share_host_memory) {
    EXPECT_GT(m.stats(Tier::kDevice).shares, 0u) << "no device copy shared its host copy";
  } else {
    EXPECT_EQ(m.stats(Tier::kDevice).shares, 0u);
  }
  ASSERT_TRUE(m.FlushAll().ok());
}

INSTANTIATE_TEST_SUITE_P(Stores, TierManagerStressTest,
                         ::testing::Values(StressParams{"memory", false, 1},
                                           StressParams{"memory_3threads", false, 3},
                                           StressParams{"files_2threads", true, 2},
                                           StressParams{"shared_memory_3threads", false, 3, true},
                                           StressParams{"shared_files_2threads", true, 2, true},
                                           StressParams{"faulty_3threads", false, 3, false, true},
                                           StressParams{"faulty_shared_3threads", false, 3, true,
                                                        true}),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

// I/O errors at random: a consumer sees either the right bytes or an error, never a hang or
// wrong bytes; once the faults stop, every shard holds its last successfully written version.
TEST(TierManagerTest, FaultsSurfaceAsStatusAndLoseNothing) {
  Rig r = Rig::Make({.device_budget = 64 << 10, .pool_bytes = 96 << 10, .faulty = true});
  TierManager& m = *r.manager;
  constexpr int kShards = 120;
  for (int i = 0; i < kShards; ++i) {
    ASSERT_TRUE(m.Register(Spec(static_cast<ShardId>(i), 8 << 10, Tier::kNvme)).ok());
  }
  ASSERT_TRUE(m.Start().ok());
  io::FaultRule rule;
  rule.probability = 0.2;
  r.faults->AddRule(rule);
  std::vector<uint64_t> version(kShards, 0);
  std::mt19937_64 rng(5);
  int errors = 0;
  for (int op = 0; op < 2000; ++op) {
    const int i = rng() % kShards;
    const Tier tier = rng() % 2 ? Tier::kDevice : Tier::kHost;
    if (rng() % 2) {
      Result<Lease> l = m.Acquire(i, tier, Access::kOverwrite, "writer");
      if (!l.ok()) {
        ++errors;
        EXPECT_NE(l.status().message().find("injected"), std::string::npos)
            << l.status().ToString();
        continue;
      }
      std::vector<char> c = Content(8 << 10, op + 1);
      std::memcpy(l->data(), c.data(), c.size());
      l->Release(true);
      version[i] = op + 1;
    } else {
      Result<Lease> l = m.Acquire(i, tier);
      if (!l.ok()) {
        ++errors;
        EXPECT_NE(l.status().message().find("injected"), std::string::npos)
            << l.status().ToString();
        continue;
      }
      std::vector<char> want =
          version[i] == 0 ? std::vector<char>(8 << 10, 0) : Content(8 << 10, version[i]);
      ASSERT_EQ(std::memcmp(l->data(), want.data(), want.size()), 0) << "shard " << i;
    }
    ASSERT_LE(m.stats(Tier::kDevice).in_use, 64u << 10);
    ASSERT_LE(m.stats(Tier::kHost).in_use, 96u << 10);
  }
  EXPECT_GT(errors, 0);
  EXPECT_GT(r.faults->total_hits(), 0u);
  r.faults->Clear();
  for (int i = 0; i < kShards; ++i) {
    std::vector<char> want =
        version[i] == 0 ? std::vector<char>(8 << 10, 0) : Content(8 << 10, version[i]);
    Result<Lease> l = m.Acquire(i, Tier::kHost);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    ASSERT_EQ(std::memcmp(l->data(), want.data(), want.size()), 0) << "shard " << i;
  }
  ASSERT_TRUE(m.FlushAll().ok());
  EXPECT_LE(m.stats(Tier::kDevice).peak, 64u << 10);
  EXPECT_LE(m.stats(Tier::kHost).peak, 96u << 10);
  EXPECT_LE(r.device->memory_stats().peak, 64u << 10);
  EXPECT_LE(r.pool->stats().peak, 96u << 10);
}

// Release with a stream: the copy is not reused before the consumer's device work finishes.
TEST(TierManagerTest, ReleaseOnStreamWaitsForConsumerWork) {
  Rig r = Rig::Make({.device_budget = 16 << 10});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, 16 << 10, Tier::kNvme)).ok());
  ASSERT_TRUE(m.Register(Spec(2, 16 << 10, Tier::kNvme)).ok());
  ASSERT_TRUE(m.Start().ok());
  std::unique_ptr<device::Stream> compute = std::move(*r.device->CreateStream("compute"));
  Result<Lease> a = m.Acquire(1, Tier::kDevice, Access::kOverwrite);
  ASSERT_TRUE(a.ok());
  // Slow device work that writes the buffer, enqueued before the release.
  GatedFill fill;
  fill.Enqueue(*r.device, *compute, a->data(), 16 << 10);
  a->Release(/*dirty=*/true, compute.get());
  fill.OpenLater();
  // Needs the only device slot: must wait for the fill to finish, then write it back.
  Result<Lease> b = m.Acquire(2, Tier::kDevice);
  fill.Join();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  b->Release();
  Result<Lease> h = m.Acquire(1, Tier::kHost);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(static_cast<unsigned char*>(h->data())[0], 0x5a);
  EXPECT_EQ(static_cast<unsigned char*>(h->data())[(16 << 10) - 1], 0x5a);
}

// Shared host memory, with room for two shards of kBytes in each of the device and host tiers.
constexpr uint64_t kBytes = 16 << 10;
Rig::Options SharedRig() {
  return {.device_budget = 2 * kBytes,
          .pool_bytes = 4 * kBytes,
          .host_budget = 2 * kBytes,
          .share_host_memory = true};
}

// Shared host memory (CPU device): a device copy for reading is the host copy itself, charged to
// the device budget; writers get copies of their own; the evictor and writers drop idle shares.
TEST(TierManagerTest, SharedHostMemoryReadsInPlaceAndWritersGetTheirOwnCopy) {
  Rig r = Rig::Make(SharedRig());
  TierManager& m = *r.manager;
  for (ShardId id : {1, 2, 3}) ASSERT_TRUE(m.Register(Spec(id, kBytes, Tier::kNvme)).ok());
  ASSERT_TRUE(m.Start().ok());
  for (ShardId id : {1, 2, 3}) WriteShard(m, id, kBytes, 10 + id, Tier::kHost);
  ASSERT_TRUE(m.FlushAll().ok());
  for (ShardId id : {1, 2, 3}) ASSERT_TRUE(m.Evict(id, Tier::kHost).ok());
  const uint64_t device_allocated = r.device->memory_stats().in_use;

  // A read on the device: filled from NVMe into host memory, then shared — no device memory.
  {
    Result<Lease> d = m.Acquire(1, Tier::kDevice);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    Result<Lease> h = m.Acquire(1, Tier::kHost);
    ASSERT_TRUE(h.ok());
    EXPECT_EQ(d->data(), h->data());
    EXPECT_EQ(std::memcmp(d->data(), Content(kBytes, 11).data(), kBytes), 0);
    EXPECT_EQ(m.stats(Tier::kDevice).in_use, kBytes);  // the budget is charged all the same
    EXPECT_EQ(r.device->memory_stats().in_use, device_allocated);
    EXPECT_EQ(m.stats(Tier::kDevice).shares, 1u);
    EXPECT_EQ(m.stats(Tier::kDevice).fills, 0u);
  }
  // A prefetch shares too, once its host copy lands.
  ASSERT_TRUE(m.Prefetch(2, Tier::kDevice).ok());
  m.WaitIdle();
  EXPECT_TRUE(m.IsCurrent(2, Tier::kDevice));
  EXPECT_EQ(m.stats(Tier::kDevice).shares, 2u);

  // The host budget holds two shards, both under idle shared device copies: reading shard 3
  // must drop one share and evict the host copy under it (and so on for the device budget).
  ExpectShard(m, 3, kBytes, 13, Tier::kDevice);
  EXPECT_LE(m.stats(Tier::kHost).peak, 2 * kBytes);
  EXPECT_LE(m.stats(Tier::kDevice).peak, 2 * kBytes);
  EXPECT_GT(m.stats(Tier::kDevice).drops, 0u);

  // A writer on the device gets memory of its own; the host copy keeps the old bytes until the
  // new version is written back.
  {
    Result<Lease> w = m.Acquire(3, Tier::kDevice, Access::kReadWrite, "writer");
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    EXPECT_EQ(r.device->memory_stats().in_use, device_allocated + kBytes);
    std::vector<char> c = Content(kBytes, 33);
    std::memcpy(w->data(), c.data(), kBytes);
    w->Release(/*dirty=*/true);
  }
  ExpectShard(m, 3, kBytes, 33, Tier::kHost);
  ExpectShard(m, 3, kBytes, 33, Tier::kDevice);

  // A writer on the host drops the idle share first, and a reader holding the share makes it
  // wait: its bytes are the host copy's.
  ExpectShard(m, 1, kBytes, 11, Tier::kDevice);
  Result<Lease> reader = m.Acquire(1, Tier::kDevice);
  ASSERT_TRUE(reader.ok());
  std::atomic<bool> written{false};
  std::thread writer([&] {
    WriteShard(m, 1, kBytes, 44, Tier::kHost);
    written = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(written.load()) << "a host writer changed bytes a device reader was using";
  EXPECT_EQ(std::memcmp(reader->data(), Content(kBytes, 11).data(), kBytes), 0);
  reader->Release();
  writer.join();
  EXPECT_TRUE(written.load());
  ExpectShard(m, 1, kBytes, 44, Tier::kDevice);
  ASSERT_TRUE(m.FlushAll().ok());
  for (ShardId id : {1, 2, 3}) {
    ASSERT_TRUE(m.Evict(id, Tier::kDevice).ok());
    ASSERT_TRUE(m.Evict(id, Tier::kHost).ok());
  }
  ExpectShard(m, 1, kBytes, 44, Tier::kHost);
  ExpectShard(m, 2, kBytes, 12, Tier::kHost);
  ExpectShard(m, 3, kBytes, 33, Tier::kHost);
}

// A shared device copy's reader waits for device work still writing the host copy (released
// with a stream), as the copy path's host-to-device copy does on its stream.
TEST(TierManagerTest, SharedHostMemoryReaderWaitsForPendingWritesToTheHostCopy) {
  Rig r = Rig::Make(SharedRig());
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, kBytes, Tier::kNvme)).ok());
  ASSERT_TRUE(m.Start().ok());
  std::unique_ptr<device::Stream> producer = std::move(*r.device->CreateStream("producer"));
  Result<Lease> w = m.Acquire(1, Tier::kHost, Access::kOverwrite, "producer");
  ASSERT_TRUE(w.ok());
  GatedFill fill;
  fill.Enqueue(*r.device, *producer, w->data(), kBytes);
  w->Release(/*dirty=*/true, producer.get());
  fill.OpenLater();
  Result<Lease> d = m.Acquire(1, Tier::kDevice);
  // Read before the fill is let go: a reader that did not wait sees the bytes unwritten.
  const bool written = d.ok() && static_cast<unsigned char*>(d->data())[0] == 0x5a &&
                       static_cast<unsigned char*>(d->data())[kBytes - 1] == 0x5a;
  fill.Join();
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_TRUE(written) << "the device reader did not wait for the pending write";
  EXPECT_EQ(m.stats(Tier::kDevice).shares, 1u);
}

// A thread that holds a shared device copy and then asks to write the host copy would wait for
// itself: it gets FailedPrecondition instead of a hang. Another thread's writer waits.
TEST(TierManagerTest, SharedHostMemoryWriterHoldingTheDeviceReadLeaseIsRefused) {
  Rig r = Rig::Make(SharedRig());
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, kBytes, Tier::kNvme, "w")).ok());
  ASSERT_TRUE(m.Start().ok());
  Result<Lease> d = m.Acquire(1, Tier::kDevice);
  ASSERT_TRUE(d.ok());
  for (Access access : {Access::kOverwrite, Access::kReadWrite}) {
    Result<Lease> h = m.Acquire(1, Tier::kHost, access, "writer");
    ASSERT_FALSE(h.ok());
    EXPECT_EQ(h.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(h.status().ToString().find("release the device lease"), std::string::npos)
        << h.status().ToString();
  }
  // A lease moved to another thread still counts as held by the thread that acquired it.
  Lease moved = std::move(*d);
  std::thread other([&] { moved.Release(); });
  other.join();
  WriteShard(m, 1, kBytes, 5, Tier::kHost);
  ExpectShard(m, 1, kBytes, 5, Tier::kDevice);
}

TEST(TierManagerTest, SharedHostMemoryNeedsTheCpuDevice) {
  device::PinnedPoolOptions popt;
  popt.bytes = 1 << 20;
  popt.huge_pages = HugePages::kOff;
  Result<std::unique_ptr<device::PinnedPool>> pool = device::PinnedPool::Create(popt);
  ASSERT_TRUE(pool.ok());
  TierManagerOptions o;
  o.pool = pool->get();
  o.share_host_memory = true;
  Result<std::unique_ptr<TierManager>> m = TierManager::Create(o);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().ToString().find("share_host_memory"), std::string::npos)
      << m.status().ToString();
}

// The CPU device takes the pinned pool as device memory only once a manager shares host memory.
TEST(TierManagerTest, SharingLetsTheCpuDeviceUseThePoolAsDeviceMemory) {
  Result<std::unique_ptr<device::Device>> dev = device::CreateDevice({});
  ASSERT_TRUE(dev.ok());
  device::PinnedPoolOptions popt;
  popt.bytes = 1 << 20;
  popt.huge_pages = HugePages::kOff;
  popt.device = dev->get();
  Result<std::unique_ptr<device::PinnedPool>> pool = device::PinnedPool::Create(popt);
  ASSERT_TRUE(pool.ok());
  Result<std::unique_ptr<device::Stream>> stream = (*dev)->CreateStream("s");
  ASSERT_TRUE(stream.ok());
  auto fill = [&] {
    return (*dev)->Fill((*pool)->base(), device::DType::kF32, 1.0f, 16, **stream);
  };
  TierManagerOptions o;
  o.device = dev->get();
  o.pool = pool->get();
  Result<std::unique_ptr<TierManager>> copies = TierManager::Create(o);
  ASSERT_TRUE(copies.ok()) << copies.status().ToString();
  EXPECT_EQ(fill().code(), StatusCode::kInvalidArgument);
  copies->reset();
  o.share_host_memory = true;
  Result<std::unique_ptr<TierManager>> shared = TierManager::Create(o);
  ASSERT_TRUE(shared.ok()) << shared.status().ToString();
  EXPECT_TRUE(fill().ok());
  EXPECT_TRUE((*dev)->Synchronize(**stream).ok());
}

}  // namespace
}  // namespace strata::offload

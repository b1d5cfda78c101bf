// What the offload tests share: a rig of CPU device + store + pinned pool + tier manager, shard
// specs, and writing / checking a shard's content by version.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "device/pinned_pool.h"
#include "io/fault_injection.h"
#include "io/memory_store.h"
#include "offload/tier_manager.h"
#include "strata/block_store.h"
#include "strata/device.h"
#include "strata/trace.h"
#include "test_support.h"

namespace strata::offload::testing {

inline ShardSpec Spec(ShardId id, uint64_t bytes, Tier home, std::string name = "",
                      std::string state_class = "param") {
  ShardSpec s;
  s.id = id;
  s.bytes = bytes;
  s.home = home;
  s.name = std::move(name);
  s.state_class = std::move(state_class);
  return s;
}

// The bytes a shard holds after the writer stored version `seed` in it.
inline std::vector<char> Content(uint64_t bytes, uint64_t seed) {
  return strata::testing::PatternBytes(bytes, seed);
}

// A checksum, so a failure message stays short.
inline uint64_t Fnv(const void* p, size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

inline uint64_t FnvOf(uint64_t bytes, uint64_t seed) {
  std::vector<char> c = Content(bytes, seed);
  return Fnv(c.data(), c.size());
}

// A CPU device, a store (in memory, or real files through the default backend; optionally
// behind a fault injector), a pinned pool registered with both, and a tier manager over them with
// its NVMe directories in a fresh TempDir.
struct Rig {
  std::unique_ptr<device::Device> device;
  std::unique_ptr<io::BlockStore> store;
  std::unique_ptr<device::PinnedPool> pool;
  std::unique_ptr<TierManager> manager;
  std::shared_ptr<io::FaultInjector> faults;
  std::unique_ptr<strata::testing::TempDir> dir;

  struct Options {
    uint64_t device_budget = 1 << 20;
    uint64_t device_memory = 0;  // the device's own budget (0: = device_budget)
    uint64_t pool_bytes = 2 << 20;
    uint64_t host_budget = 0;
    bool real_files = false;
    bool faulty = false;
    int paths = 1;
    TraceRecorder* trace = nullptr;
    bool share_host_memory = false;
    // The fault injector's latencies and the manager's stall times run on it when set (a
    // ManualClock: a delayed transfer is held until the test advances it). Must outlive the rig.
    Clock* clock = nullptr;
  };

  static Rig Make(const Options& o) {
    Rig r;
    device::DeviceOptions dopt;
    dopt.type = device::DeviceType::kCpu;
    dopt.memory_budget = o.device_memory != 0 ? o.device_memory : o.device_budget;
    r.device = std::move(*device::CreateDevice(dopt));
    io::StoreOptions sopt;
    sopt.threads = 2;
    r.store = o.real_files ? std::move(*io::CreateBlockStore(sopt))
                           : std::move(*io::CreateMemoryStore(sopt));
    if (o.faulty) {
      r.faults = std::make_shared<io::FaultInjector>(7, o.clock);
      r.store = io::CreateFaultInjectingStore(std::move(r.store), r.faults);
    }
    device::PinnedPoolOptions popt;
    popt.bytes = o.pool_bytes;
    popt.huge_pages = HugePages::kOff;
    popt.device = r.device.get();
    popt.store = r.store.get();
    r.pool = std::move(*device::PinnedPool::Create(popt));
    r.dir = std::make_unique<strata::testing::TempDir>();
    TierManagerOptions mopt;
    mopt.device = r.device.get();
    mopt.pool = r.pool.get();
    mopt.store = r.store.get();
    mopt.device_budget = o.device_budget;
    mopt.host_budget = o.host_budget;
    for (int i = 0; i < o.paths; ++i) {
      const std::filesystem::path p = r.dir->path() / ("nvme" + std::to_string(i));
      std::filesystem::create_directories(p);
      mopt.nvme.paths.push_back(p.string());
    }
    mopt.nvme.stripe_unit = 8192;
    mopt.trace = o.trace;
    mopt.share_host_memory = o.share_host_memory;
    mopt.clock = o.clock;
    r.manager = std::move(*TierManager::Create(mopt));
    return r;
  }

  ~Rig() {
    manager.reset();  // before the pool, store and device it uses
    pool.reset();
    store.reset();
  }
  Rig() = default;
  Rig(Rig&&) = default;
};

// Device work that writes 0x5a over [p, p + bytes) on `stream`, held back until Open(): for
// checking that the manager waits for consumer work released with a stream.
struct GatedFill {
  std::atomic<bool> go{false};
  std::thread opener;

  void Enqueue(device::Device& device, device::Stream& stream, void* p, size_t bytes) {
    ASSERT_TRUE(device
                    .HostTask(
                        stream,
                        [this, p, bytes] {
                          while (!go) std::this_thread::yield();
                          std::memset(p, 0x5a, bytes);
                          return Status::Ok();
                        },
                        "gated fill")
                    .ok());
  }
  // Lets the work run 20 ms from now, from another thread.
  void OpenLater() {
    opener = std::thread([this] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      go = true;
    });
  }
  void Join() {
    if (opener.joinable()) opener.join();
  }
  ~GatedFill() { Join(); }
};

// Writes version `seed` of the shard through an overwrite lease (CPU device memory is host
// memory, so both tiers are written with memcpy).
inline void WriteShard(TierManager& m, ShardId id, uint64_t bytes, uint64_t seed, Tier tier) {
  Result<Lease> l = m.Acquire(id, tier, Access::kOverwrite, "writer");
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  std::vector<char> c = Content(bytes, seed);
  std::memcpy(l->data(), c.data(), bytes);
  l->Release(/*dirty=*/true);
}

inline void ExpectShard(TierManager& m, ShardId id, uint64_t bytes, uint64_t seed, Tier tier) {
  Result<Lease> l = m.Acquire(id, tier, Access::kRead, "reader");
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  ASSERT_EQ(Fnv(l->data(), bytes), FnvOf(bytes, seed))
      << "shard " << id << " in " << TierName(tier) << " does not hold version " << seed;
}

}  // namespace strata::offload::testing

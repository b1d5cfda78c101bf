// The tier manager under concurrency (threads racing for one shard, flushes during leases,
// destruction with transfers in flight), stream ordering (a copy is never freed or overwritten
// while work that uses it is queued), failures that must reach the caller, and odd budgets.
// Each test's comment says what it guards against.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <random>
#include <thread>
#include <unistd.h>

#include "offload/prefetch_scheduler.h"
#include "offload/tier_manager.h"
#include "offload_test_util.h"

namespace strata::offload {
namespace {

using namespace std::chrono_literals;

using testing::Content;
using testing::ExpectShard;
using testing::Fnv;
using testing::FnvOf;
using testing::Rig;
using testing::Spec;
using testing::WriteShard;

// A consumer task on `stream` that waits for `go`, then runs `body`.
void Gated(device::Device& dev, device::Stream& stream, std::atomic<bool>& go,
           std::function<void()> body) {
  ASSERT_TRUE(dev.HostTask(
                     stream,
                     [&go, body = std::move(body)] {
                       while (!go) std::this_thread::yield();
                       body();
                       return Status::Ok();
                     },
                     "consumer")
                  .ok());
}

// Runs `body` in a death-test child; passes when it returns within `seconds` (a hang or a
// livelock under the manager's lock cannot be recovered from inside one process).
void ExpectReturnsWithin(const std::function<void()>& body, int seconds) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        std::thread([seconds] {
          std::this_thread::sleep_for(std::chrono::seconds(seconds));
          _exit(3);
        }).detach();
        body();
        _exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

constexpr uint64_t k16K = 16 << 10;

// ---- findings ------------------------------------------------------------------------------------

// Device-homed shard written on the host: Acquire(kDevice) must write the host copy back into the
// home copy. It waits forever instead (the "home is behind a higher tier" branch only looks at
// tier ti-1, which does not exist for the device tier).
TEST(TierManagerConcurrencyTest, DeviceHomedAcquireOnDeviceAfterHostWriteDoesNotHang) {
  Rig r = Rig::Make({});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, k16K, Tier::kDevice, "dev")).ok());
  ASSERT_TRUE(m.Start().ok());
  WriteShard(m, 1, k16K, 5, Tier::kHost);
  auto f = std::async(std::launch::async, [&] {
    Result<Lease> l = m.Acquire(1, Tier::kDevice, Access::kRead, "reader");
    if (!l.ok()) return std::string(l.status().ToString());
    return Fnv(l->data(), k16K) == FnvOf(k16K, 5) ? std::string("ok") : std::string("wrong bytes");
  });
  const bool returned = f.wait_for(2s) == std::future_status::ready;
  EXPECT_TRUE(returned) << "Acquire(kDevice) of a device-homed shard whose current copy is on the "
                           "host never returns";
  if (!returned) {
    ASSERT_TRUE(m.FlushAll().ok());  // writes host -> device and wakes it
  }
  EXPECT_EQ(f.get(), "ok");
}

// Host-homed shard current on the device: a thread that holds a device lease and acquires the
// host copy waits for itself (the write-back into the home copy is only started when the device
// copy is unpinned, although a pinned copy can be a transfer source; an NVMe-homed shard in the
// same situation is served).
TEST(TierManagerConcurrencyTest, HostHomedAcquireOnHostWhileHoldingDeviceLeaseDoesNotHang) {
  Rig r = Rig::Make({});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, k16K, Tier::kHost, "h")).ok());
  ASSERT_TRUE(m.Start().ok());
  WriteShard(m, 1, k16K, 6, Tier::kDevice);
  Result<Lease> dev = m.Acquire(1, Tier::kDevice, Access::kRead, "forward");
  ASSERT_TRUE(dev.ok());
  auto f = std::async(std::launch::async, [&] {
    Result<Lease> l = m.Acquire(1, Tier::kHost, Access::kRead, "optimizer");
    if (!l.ok()) return std::string(l.status().ToString());
    return Fnv(l->data(), k16K) == FnvOf(k16K, 6) ? std::string("ok") : std::string("wrong bytes");
  });
  const bool returned = f.wait_for(2s) == std::future_status::ready;
  EXPECT_TRUE(returned) << "Acquire(kHost) of a host-homed shard blocks while its device copy is "
                           "leased (self-deadlock for a single consumer thread)";
  dev->Release();
  EXPECT_EQ(f.get(), "ok");
}

// FlushAll drops the lock to wait for consumer work on the copy it is about to write back, and
// after re-locking writes that copy back without checking that it is still current. A dirty
// release on another tier in that window gets overwritten by the stale bytes and the newest
// version is lost.
TEST(TierManagerOrderingTest, FlushAllRacingDirtyReleaseKeepsNewestVersion) {
  Rig r = Rig::Make({});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, k16K, Tier::kNvme, "a")).ok());
  ASSERT_TRUE(m.Start().ok());
  std::unique_ptr<device::Stream> compute = std::move(*r.device->CreateStream("compute"));
  std::atomic<bool> go{false};
  {
    Result<Lease> d = m.Acquire(1, Tier::kDevice, Access::kOverwrite, "writer");
    ASSERT_TRUE(d.ok());
    std::vector<char> a = Content(k16K, 1);
    std::memcpy(d->data(), a.data(), k16K);
    Gated(*r.device, *compute, go, [] {});
    d->Release(/*dirty=*/true, compute.get());
  }
  std::promise<Status> flushed;
  std::thread flusher([&] { flushed.set_value(m.FlushAll()); });
  std::this_thread::sleep_for(200ms);  // FlushAll's write-back now waits for the consumer work
  std::thread opener([&] {
    std::this_thread::sleep_for(300ms);
    go = true;
  });
  // The newest version, on the host: written while the flush is in progress (it waits for the
  // write-back into the host copy to land, then overwrites it).
  WriteShard(m, 1, k16K, 2, Tier::kHost);
  opener.join();
  flusher.join();
  Status st = flushed.get_future().get();
  EXPECT_TRUE(st.ok()) << st.ToString();
  ASSERT_TRUE(r.device->Synchronize(*compute).ok());
  ExpectShard(m, 1, k16K, 2, Tier::kHost);
}

// Acquire frees a stale, unpinned copy whose consumer work (Release(..., used_on)) is still
// running, and refills the memory under it. With a one-shard budget a correct Acquire must wait
// for that work; here it returns while the work has not run, and the work reads other bytes.
TEST(TierManagerOrderingTest, AcquireDoesNotFreeStaleCopyStillUsedByConsumerWork) {
  Rig r = Rig::Make({.device_budget = k16K});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, k16K, Tier::kNvme, "a")).ok());
  ASSERT_TRUE(m.Start().ok());
  std::unique_ptr<device::Stream> compute = std::move(*r.device->CreateStream("compute"));
  WriteShard(m, 1, k16K, 1, Tier::kDevice);
  std::atomic<bool> go{false}, consumed{false};
  std::atomic<uint64_t> seen{0};
  {
    Result<Lease> l = m.Acquire(1, Tier::kDevice, Access::kRead, "forward");
    ASSERT_TRUE(l.ok());
    const void* p = l->data();
    Gated(*r.device, *compute, go, [&, p] {
      seen = Fnv(p, k16K);
      consumed = true;
    });
    l->Release(false, compute.get());
  }
  WriteShard(m, 1, k16K, 2, Tier::kHost);  // the device copy is now stale, its work pending
  std::thread opener([&] {
    std::this_thread::sleep_for(300ms);
    go = true;
  });
  Result<Lease> l = m.Acquire(1, Tier::kDevice, Access::kRead, "backward");
  const bool consumer_done_first = consumed.load();
  opener.join();
  ASSERT_TRUE(r.device->Synchronize(*compute).ok());
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_TRUE(consumer_done_first) << "the copy was reused before the consumer's work ran";
  EXPECT_EQ(seen.load(), FnvOf(k16K, 1)) << "the consumer's work read memory that was freed/refilled";
  EXPECT_EQ(Fnv(l->data(), k16K), FnvOf(k16K, 2));
}

// Same through Prefetch: it frees the stale copy without checking its consumer event.
TEST(TierManagerOrderingTest, PrefetchDoesNotFreeStaleCopyStillUsedByConsumerWork) {
  Rig r = Rig::Make({.device_budget = k16K});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, k16K, Tier::kNvme, "a")).ok());
  ASSERT_TRUE(m.Start().ok());
  std::unique_ptr<device::Stream> compute = std::move(*r.device->CreateStream("compute"));
  WriteShard(m, 1, k16K, 1, Tier::kDevice);
  std::atomic<bool> go{false};
  std::atomic<uint64_t> seen{0};
  {
    Result<Lease> l = m.Acquire(1, Tier::kDevice, Access::kRead, "forward");
    ASSERT_TRUE(l.ok());
    const void* p = l->data();
    Gated(*r.device, *compute, go, [&, p] { seen = Fnv(p, k16K); });
    l->Release(false, compute.get());
  }
  WriteShard(m, 1, k16K, 2, Tier::kHost);
  // The budget holds one copy: issuing a fill now means the old copy was freed under the work.
  Result<PrefetchOutcome> p = m.Prefetch(1, Tier::kDevice);
  ASSERT_TRUE(p.ok());
  m.WaitIdle();
  const bool consumer_ran = seen.load() != 0;
  go = true;
  ASSERT_TRUE(r.device->Synchronize(*compute).ok());
  EXPECT_FALSE(*p == PrefetchOutcome::kIssued && !consumer_ran)
      << "Prefetch freed (and refilled) a copy the consumer's work had not yet read";
  EXPECT_EQ(seen.load(), FnvOf(k16K, 1));
}

// A write-back into the home copy (device-homed shard: host -> device) overwrites the home copy
// while consumer work released on a stream is still reading it: the transfer does not wait for
// the destination's consumer event.
TEST(TierManagerOrderingTest, WritebackDoesNotOverwriteCopyStillUsedByConsumerWork) {
  Rig r = Rig::Make({});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, k16K, Tier::kDevice, "dev")).ok());
  ASSERT_TRUE(m.Start().ok());
  std::unique_ptr<device::Stream> compute = std::move(*r.device->CreateStream("compute"));
  WriteShard(m, 1, k16K, 1, Tier::kDevice);
  std::atomic<bool> go{false};
  std::atomic<uint64_t> seen{0};
  {
    Result<Lease> l = m.Acquire(1, Tier::kDevice, Access::kRead, "forward");
    ASSERT_TRUE(l.ok());
    const void* p = l->data();
    Gated(*r.device, *compute, go, [&, p] { seen = Fnv(p, k16K); });
    l->Release(false, compute.get());
  }
  WriteShard(m, 1, k16K, 2, Tier::kHost);   // home (device) copy stale, its work pending
  ASSERT_TRUE(m.Evict(1, Tier::kHost).ok());  // write back host -> device home
  // The write-back waits on the device for the consumer's work, which runs once the gate opens.
  std::thread opener([&] {
    std::this_thread::sleep_for(100ms);
    go = true;
  });
  m.WaitIdle();
  opener.join();
  ASSERT_TRUE(r.device->Synchronize(*compute).ok());
  EXPECT_EQ(seen.load(), FnvOf(k16K, 1))
      << "the write-back overwrote the home copy before the consumer's work read it";
}

// Same for an NVMe-homed shard: device -> host write-back into a stale host copy that consumer
// work still reads.
TEST(TierManagerOrderingTest, DeviceToHostWritebackDoesNotOverwriteHostCopyInUse) {
  Rig r = Rig::Make({});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, k16K, Tier::kNvme, "a")).ok());
  ASSERT_TRUE(m.Start().ok());
  std::unique_ptr<device::Stream> compute = std::move(*r.device->CreateStream("compute"));
  WriteShard(m, 1, k16K, 1, Tier::kHost);
  std::atomic<bool> go{false};
  std::atomic<uint64_t> seen{0};
  {
    Result<Lease> l = m.Acquire(1, Tier::kHost, Access::kRead, "optimizer");
    ASSERT_TRUE(l.ok());
    const void* p = l->data();
    Gated(*r.device, *compute, go, [&, p] { seen = Fnv(p, k16K); });
    l->Release(false, compute.get());
  }
  WriteShard(m, 1, k16K, 2, Tier::kDevice);     // host copy stale, kept (work pending)
  ASSERT_TRUE(m.Evict(1, Tier::kDevice).ok());  // write back device -> host
  // The write-back waits on the device for the consumer's work, which runs once the gate opens.
  std::thread opener([&] {
    std::this_thread::sleep_for(100ms);
    go = true;
  });
  m.WaitIdle();
  opener.join();
  ASSERT_TRUE(r.device->Synchronize(*compute).ok());
  EXPECT_EQ(seen.load(), FnvOf(k16K, 1))
      << "the write-back overwrote the host copy before the consumer's work read it";
}

// A host copy released dirty with used_on (the consumer's writes are still queued on its stream)
// is the source of a host -> device fill that does not wait for those writes: the device copy is
// marked current with the bytes from before the write.
TEST(TierManagerOrderingTest, HostToDeviceFillWaitsForConsumerWritesOnHostCopy) {
  Rig r = Rig::Make({});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, k16K, Tier::kNvme, "a")).ok());
  ASSERT_TRUE(m.Start().ok());
  std::unique_ptr<device::Stream> compute = std::move(*r.device->CreateStream("compute"));
  std::atomic<bool> go{false};
  {
    Result<Lease> l = m.Acquire(1, Tier::kHost, Access::kOverwrite, "optimizer");
    ASSERT_TRUE(l.ok());
    void* p = l->data();
    Gated(*r.device, *compute, go, [p] {
      std::vector<char> c = Content(k16K, 9);
      std::memcpy(p, c.data(), k16K);
    });
    l->Release(/*dirty=*/true, compute.get());
  }
  std::thread opener([&] {
    std::this_thread::sleep_for(300ms);
    go = true;
  });
  Result<Lease> d = m.Acquire(1, Tier::kDevice, Access::kRead, "forward");
  opener.join();
  ASSERT_TRUE(r.device->Synchronize(*compute).ok());
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(Fnv(d->data(), k16K), FnvOf(k16K, 9))
      << "the device copy was filled before the consumer's writes to the host copy landed";
}

// Acquire(kHost) of an NVMe-homed shard current only on the device fills the host copy with a
// device -> host copy. When that fails the error is filed as a write-back error (by direction),
// not as the fill error Acquire looks at, so Acquire reissues it forever (holding the lock when
// the failure is synchronous) instead of returning the error. Here the device has a sticky error.
TEST(TierManagerFailureTest, FailedDeviceToHostFillIsReturnedByAcquire) {
  ExpectReturnsWithin(
      [] {
        Rig r = Rig::Make({});
        TierManager& m = *r.manager;
        if (!m.Register(Spec(1, k16K, Tier::kNvme, "a")).ok() || !m.Start().ok()) _exit(5);
        {
          Result<Lease> l = m.Acquire(1, Tier::kDevice, Access::kOverwrite, "writer");
          if (!l.ok()) _exit(6);
          l->Release(true);
        }
        std::unique_ptr<device::Stream> s = std::move(*r.device->CreateStream("compute"));
        (void)r.device->HostTask(
            *s, [] { return Status(StatusCode::kInternal, "kernel failed"); }, "boom");
        (void)r.device->Synchronize(*s);
        Result<Lease> h = m.Acquire(1, Tier::kHost, Access::kRead, "optimizer");
        if (h.ok()) _exit(7);  // must be the device error
      },
      3);
}

// Eviction that needs a write-back whose transfer fails synchronously: StartWritebackLocked
// reports OK, EvictOneLocked says a write-back started, but the failed write-back cleared
// free_after_writeback, so ReserveLocked never sees its error and evicts the same copy again,
// forever, with the manager's lock held.
TEST(TierManagerFailureTest, FailedWritebackDuringEvictionIsReturnedNotRetriedForever) {
  ExpectReturnsWithin(
      [] {
        Rig r = Rig::Make({.device_budget = k16K});
        TierManager& m = *r.manager;
        if (!m.Register(Spec(1, k16K, Tier::kNvme, "a")).ok()) _exit(5);
        if (!m.Register(Spec(2, k16K, Tier::kNvme, "b")).ok() || !m.Start().ok()) _exit(5);
        {
          Result<Lease> l = m.Acquire(1, Tier::kDevice, Access::kOverwrite, "writer");
          if (!l.ok()) _exit(6);
          l->Release(true);
        }
        std::unique_ptr<device::Stream> s = std::move(*r.device->CreateStream("compute"));
        (void)r.device->HostTask(
            *s, [] { return Status(StatusCode::kInternal, "kernel failed"); }, "boom");
        (void)r.device->Synchronize(*s);
        Result<Lease> b = m.Acquire(2, Tier::kDevice, Access::kRead, "forward");
        if (b.ok()) _exit(7);
      },
      3);
}

// FlushAll gives up on a shard after 1000 loop iterations (every condition-variable wake-up
// counts) and returns OK without having written it home. Another thread's ordinary activity
// produces the wake-ups while FlushAll waits for a reader to let go of the write-back target.
TEST(TierManagerFailureTest, FlushAllNeverReportsSuccessWithoutFlushing) {
  Rig r = Rig::Make({});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, k16K, Tier::kNvme, "a")).ok());
  ASSERT_TRUE(m.Register(Spec(2, 4096, Tier::kNvme, "b")).ok());
  ASSERT_TRUE(m.Start().ok());
  Result<Lease> host = m.Acquire(1, Tier::kHost, Access::kRead, "slow reader");
  ASSERT_TRUE(host.ok());
  {
    Result<Lease> d = m.Acquire(1, Tier::kDevice, Access::kRead, "writer");
    ASSERT_TRUE(d.ok());
    std::vector<char> c = Content(k16K, 3);
    std::memcpy(d->data(), c.data(), k16K);
    d->Release(/*dirty=*/true);  // host copy stale but still leased
  }
  std::atomic<bool> done{false};
  Status flushed;
  std::thread flusher([&] {
    flushed = m.FlushAll();
    done = true;
  });
  // Each release notifies; pause so that the waiting FlushAll sees (nearly) every wake-up.
  const auto deadline = std::chrono::steady_clock::now() + 2s;
  while (!done && std::chrono::steady_clock::now() < deadline) {
    Result<Lease> l = m.Acquire(2, Tier::kHost, Access::kRead, "other");
    ASSERT_TRUE(l.ok());
    l->Release();
    std::this_thread::sleep_for(50us);
  }
  const bool returned_early = done.load();
  host->Release();
  flusher.join();
  EXPECT_FALSE(returned_early) << "FlushAll returned while the shard could not be flushed";
  EXPECT_TRUE(flushed.ok()) << flushed.ToString();
  EXPECT_TRUE(m.IsCurrent(1, Tier::kNvme)) << "FlushAll returned OK but shard 1 is not at home";
}

// When the only copy of a shard is acquired with kOverwrite, FlushAll waits for that lease to
// end and writes the new version (another thread), or refuses at once (the holder's thread)
// instead of reporting data loss or deadlocking.
TEST(TierManagerConcurrencyTest, FlushAllDuringOverwriteLeaseWaitsOrRefuses) {
  Rig r = Rig::Make({});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, k16K, Tier::kNvme, "a")).ok());
  ASSERT_TRUE(m.Start().ok());
  WriteShard(m, 1, k16K, 4, Tier::kDevice);  // only the device copy holds version 4
  Result<Lease> w = m.Acquire(1, Tier::kDevice, Access::kOverwrite, "writer");
  ASSERT_TRUE(w.ok());
  Status mine = m.FlushAll();
  EXPECT_EQ(mine.code(), StatusCode::kFailedPrecondition) << mine.ToString();
  std::promise<Status> flushed;
  std::thread flusher([&] { flushed.set_value(m.FlushAll()); });
  std::this_thread::sleep_for(100ms);
  std::vector<char> c = Content(k16K, 5);
  std::memcpy(w->data(), c.data(), k16K);
  w->Release(true);
  flusher.join();
  Status st = flushed.get_future().get();
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_TRUE(m.IsCurrent(1, Tier::kNvme));
  ASSERT_TRUE(m.Evict(1, Tier::kDevice).ok());
  ExpectShard(m, 1, k16K, 5, Tier::kHost);
}

// PrefetchScheduler::Acquire of a persistent unit (smaller than the persistence threshold) takes
// a second, kRead "persistent" lease on the copy it just leased. With Access::kOverwrite the
// first lease makes the copy non-current and pinned, so the second Acquire waits for the
// caller itself: a self-deadlock on the unit's first use (and every later kOverwrite Acquire of
// a persistent unit waits for the persistent lease's pin).
TEST(TierManagerConcurrencyTest, SchedulerOverwriteOfPersistentUnitDoesNotDeadlock) {
  ExpectReturnsWithin(
      [] {
        Rig r = Rig::Make({});
        TierManager& m = *r.manager;
        if (!m.Register(Spec(1, 4096, Tier::kNvme, "norm")).ok() || !m.Start().ok()) _exit(5);
        PrefetchOptions o;
        o.persistence_threshold_bytes = 1 << 20;
        PrefetchScheduler sched(m, o);
        if (!sched.AddUnit(7, {1}, "norm").ok()) _exit(6);
        sched.BeginStep();
        Result<std::vector<Lease>> l = sched.Acquire(7, Access::kOverwrite, "init");
        if (!l.ok()) _exit(7);
        if (!sched.Release(7, *l, true).ok()) _exit(8);
        Result<std::vector<Lease>> l2 = sched.Acquire(7, Access::kOverwrite, "update");
        if (!l2.ok()) _exit(9);
        if (!sched.Release(7, *l2, true).ok()) _exit(10);
        sched.EndStep();
      },
      3);
}

// ---- probes that found nothing (regression tests) -------------------------------------------

// A fill overtaken in flight by a dirty release on another tier lands stale and is dropped. The
// read's latency is on a manual clock: it lands only when the test moves the clock, so the
// dirty release overtakes it for certain.
TEST(TierManagerOrderingTest, FillOvertakenByDirtyReleaseLandsStale) {
  ManualClock clock;
  Rig r = Rig::Make({.faulty = true, .clock = &clock});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, k16K, Tier::kNvme, "a")).ok());
  ASSERT_TRUE(m.Start().ok());
  io::FaultRule slow;
  slow.kind = io::FaultKind::kLatency;
  slow.op = io::IoOp::kRead;
  slow.latency = 200ms;
  r.faults->AddRule(slow);
  ASSERT_EQ(*m.Prefetch(1, Tier::kHost), PrefetchOutcome::kIssued);
  WriteShard(m, 1, k16K, 8, Tier::kDevice);
  EXPECT_FALSE(m.IsCurrent(1, Tier::kHost));  // the read is still held
  clock.Advance(200ms);
  m.WaitIdle();
  EXPECT_FALSE(m.IsCurrent(1, Tier::kHost));
  ExpectShard(m, 1, k16K, 8, Tier::kHost);
  ExpectShard(m, 1, k16K, 8, Tier::kDevice);
}

// kOverwrite racing with a device prefetch of the same shard (slow NVMe read underneath).
TEST(TierManagerConcurrencyTest, OverwriteRacingPrefetchOfSameShard) {
  Rig r = Rig::Make({.faulty = true});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, k16K, Tier::kNvme, "a")).ok());
  ASSERT_TRUE(m.Start().ok());
  io::FaultRule slow;
  slow.kind = io::FaultKind::kLatency;
  slow.op = io::IoOp::kRead;
  slow.latency = 100ms;
  r.faults->AddRule(slow);
  ASSERT_EQ(*m.Prefetch(1, Tier::kDevice), PrefetchOutcome::kIssued);
  WriteShard(m, 1, k16K, 3, Tier::kHost);
  m.WaitIdle();
  ExpectShard(m, 1, k16K, 3, Tier::kDevice);
  ASSERT_EQ(*m.Prefetch(1, Tier::kDevice), PrefetchOutcome::kResident);
  WriteShard(m, 1, k16K, 4, Tier::kDevice);
  ExpectShard(m, 1, k16K, 4, Tier::kHost);
  ASSERT_TRUE(m.FlushAll().ok());
  EXPECT_TRUE(m.IsCurrent(1, Tier::kNvme));
}

// A failed host fill while a device fill waits on it: the waiting Acquire gets the error, the
// next one succeeds.
TEST(TierManagerFailureTest, HostFillFailureReachesWaitingDeviceAcquireThenRetries) {
  Rig r = Rig::Make({.faulty = true});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, k16K, Tier::kNvme, "a")).ok());
  ASSERT_TRUE(m.Start().ok());
  io::FaultRule fail;
  fail.op = io::IoOp::kRead;
  fail.ordinals = {0};
  r.faults->AddRule(fail);
  Result<Lease> l = m.Acquire(1, Tier::kDevice, Access::kRead, "forward");
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("injected"), std::string::npos) << l.status().ToString();
  Result<Lease> l2 = m.Acquire(1, Tier::kDevice, Access::kRead, "forward");
  ASSERT_TRUE(l2.ok()) << l2.status().ToString();
  EXPECT_EQ(m.stats(Tier::kDevice).in_use, k16K);
}

// Budgets of exactly one shard, shard sizes that are not multiples of 4 KiB, dirty data pushed
// through every tier.
TEST(TierManagerBudgetTest, OneShardBudgetsAndOddSizes) {
  Rig r = Rig::Make({.device_budget = 8192, .pool_bytes = 64 << 10, .host_budget = 8192});
  TierManager& m = *r.manager;
  for (ShardId id = 0; id < 4; ++id) ASSERT_TRUE(m.Register(Spec(id, 5000 + id, Tier::kNvme)).ok());
  ASSERT_TRUE(m.Start().ok());
  for (ShardId id = 0; id < 4; ++id) WriteShard(m, id, 5000 + id, 20 + id, Tier::kDevice);
  for (ShardId id = 0; id < 4; ++id) ExpectShard(m, id, 5000 + id, 20 + id, Tier::kHost);
  for (ShardId id = 0; id < 4; ++id) ExpectShard(m, id, 5000 + id, 20 + id, Tier::kDevice);
  ASSERT_TRUE(m.FlushAll().ok());
  EXPECT_LE(m.stats(Tier::kDevice).peak, 8192u);
  EXPECT_LE(m.stats(Tier::kHost).peak, 8192u);
  EXPECT_LE(r.device->memory_stats().peak, 8192u);
}

// Many threads acquiring (and evicting) the same shard in both tiers.
TEST(TierManagerConcurrencyTest, ManyThreadsAcquireSameShard) {
  Rig r = Rig::Make({});
  TierManager& m = *r.manager;
  ASSERT_TRUE(m.Register(Spec(1, 10'000, Tier::kNvme, "a")).ok());
  ASSERT_TRUE(m.Start().ok());
  WriteShard(m, 1, 10'000, 11, Tier::kHost);
  ASSERT_TRUE(m.FlushAll().ok());
  ASSERT_TRUE(m.Evict(1, Tier::kHost).ok());
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        const Tier tier = (i + t) % 2 ? Tier::kDevice : Tier::kHost;
        Result<Lease> l = m.Acquire(1, tier, Access::kRead, "reader");
        if (!l.ok() || Fnv(l->data(), 10'000) != FnvOf(10'000, 11)) bad++;
        if (l.ok()) l->Release();
        if (i % 7 == 0) (void)m.Evict(1, tier);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
}

// Destroying the manager with slow transfers (and a device fill waiting on its host stage) in
// flight.
TEST(TierManagerConcurrencyTest, DestructionWithTransfersInFlight) {
  Rig r = Rig::Make({.faulty = true});
  TierManager& m = *r.manager;
  for (ShardId id = 0; id < 6; ++id) ASSERT_TRUE(m.Register(Spec(id, 12'000, Tier::kNvme)).ok());
  ASSERT_TRUE(m.Start().ok());
  WriteShard(m, 5, 12'000, 1, Tier::kDevice);
  io::FaultRule slow;
  slow.kind = io::FaultKind::kLatency;
  slow.latency = 150ms;
  r.faults->AddRule(slow);
  for (ShardId id = 0; id < 3; ++id) ASSERT_EQ(*m.Prefetch(id, Tier::kHost), PrefetchOutcome::kIssued);
  ASSERT_EQ(*m.Prefetch(3, Tier::kDevice), PrefetchOutcome::kIssued);
  ASSERT_TRUE(m.Evict(5, Tier::kDevice).ok());  // write-back device -> host -> ...
  r.manager.reset();
  SUCCEED();
}

// FlushAll from one thread while another acquires, writes and releases.
TEST(TierManagerConcurrencyTest, FlushAllConcurrentWithAcquireRelease) {
  Rig r = Rig::Make({.device_budget = 64 << 10, .pool_bytes = 128 << 10});
  TierManager& m = *r.manager;
  constexpr int kShards = 10;
  for (int i = 0; i < kShards; ++i) ASSERT_TRUE(m.Register(Spec(i, 8 << 10, Tier::kNvme)).ok());
  ASSERT_TRUE(m.Start().ok());
  std::atomic<bool> stop{false};
  std::thread flusher([&] {
    while (!stop) {
      Status st = m.FlushAll();
      if (!st.ok()) ADD_FAILURE() << st.ToString();
    }
  });
  std::vector<uint64_t> version(kShards, 0);
  std::mt19937_64 rng(3);
  for (int op = 0; op < 600; ++op) {
    const int i = rng() % kShards;
    const Tier tier = rng() % 2 ? Tier::kDevice : Tier::kHost;
    if (rng() % 2) {
      // Read-modify-write: kReadWrite keeps FlushAll from reading the copy while it changes.
      Result<Lease> l = m.Acquire(i, tier, Access::kReadWrite, "writer");
      ASSERT_TRUE(l.ok()) << l.status().ToString();
      std::vector<char> c = Content(8 << 10, op + 1);
      std::memcpy(l->data(), c.data(), c.size());
      l->Release(/*dirty=*/true);
      version[i] = op + 1;
    } else {
      Result<Lease> l = m.Acquire(i, tier);
      ASSERT_TRUE(l.ok()) << l.status().ToString();
      std::vector<char> want =
          version[i] == 0 ? std::vector<char>(8 << 10, 0) : Content(8 << 10, version[i]);
      ASSERT_EQ(std::memcmp(l->data(), want.data(), want.size()), 0) << "shard " << i;
    }
  }
  stop = true;
  flusher.join();
  ASSERT_TRUE(m.FlushAll().ok());
  for (int i = 0; i < kShards; ++i) EXPECT_TRUE(m.IsCurrent(i, Tier::kNvme)) << i;
}

// The scheduler's oracle (scheduler lock) runs under the manager's lock while the scheduler's
// thread calls the manager, and another thread forces evictions: no lock-order deadlock.
TEST(TierManagerConcurrencyTest, SchedulerOracleUnderManagerLockWhileOtherThreadsEvict) {
  Rig r = Rig::Make({.device_budget = 64 << 10, .pool_bytes = 256 << 10});
  TierManager& m = *r.manager;
  for (ShardId id = 0; id < 12; ++id) ASSERT_TRUE(m.Register(Spec(id, 16 << 10, Tier::kNvme)).ok());
  ASSERT_TRUE(m.Start().ok());
  PrefetchOptions o;
  o.device_lookahead_bytes = 32 << 10;
  o.host_lookahead_bytes = 64 << 10;
  o.persistence_threshold_bytes = 0;
  o.max_reuse_distance_bytes = 0;
  PrefetchScheduler sched(m, o);
  for (UnitId u = 0; u < 6; ++u) ASSERT_TRUE(sched.AddUnit(u, {u}).ok());
  std::atomic<bool> stop{false};
  std::thread other([&] {
    std::mt19937_64 rng(9);
    while (!stop) {
      const ShardId id = 6 + rng() % 6;
      Result<Lease> l = m.Acquire(id, rng() % 2 ? Tier::kDevice : Tier::kHost);
      if (!l.ok() && l.status().code() != StatusCode::kResourceExhausted) {
        ADD_FAILURE() << l.status().ToString();
      }
    }
  });
  for (int step = 0; step < 20; ++step) {
    sched.BeginStep();
    for (UnitId u : {0, 1, 2, 3, 4, 5, 5, 4, 3, 2, 1, 0}) {
      Result<std::vector<Lease>> l = sched.Acquire(u);
      if (!l.ok()) {
        ASSERT_EQ(l.status().code(), StatusCode::kResourceExhausted) << l.status().ToString();
        continue;
      }
      ASSERT_TRUE(sched.Release(u, *l).ok());
    }
    sched.EndStep();
  }
  stop = true;
  other.join();
  EXPECT_LE(m.stats(Tier::kDevice).peak, 64u << 10);
}

}  // namespace
}  // namespace strata::offload

// PrefetchScheduler driven by scripted access sequences on the CPU device and an in-memory store:
// what it issues, in which order, under which budget, and how it handles divergence.
#include "offload/prefetch_scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>

#include "device/pinned_pool.h"
#include "io/fault_injection.h"
#include "io/memory_store.h"
#include "offload_test_util.h"

namespace strata::offload {
namespace {

using testing::Spec;

constexpr uint64_t kUnit = 16 << 10;

class PrefetchSchedulerTest : public ::testing::Test {
 protected:
  void Build(int units, uint64_t device_budget, uint64_t pool_bytes, PrefetchOptions opts,
             uint64_t small_unit_bytes = 0, bool share_host_memory = false) {
    device::DeviceOptions dopt;
    dopt.memory_budget = device_budget;
    device_ = std::move(*device::CreateDevice(dopt));
    store_ = std::move(*io::CreateMemoryStore({}));
    if (read_latency_.count() > 0) {
      auto faults = std::make_shared<io::FaultInjector>();
      io::FaultRule slow;
      slow.kind = io::FaultKind::kLatency;
      slow.op = io::IoOp::kRead;
      slow.latency = read_latency_;
      faults->AddRule(slow);
      store_ = io::CreateFaultInjectingStore(std::move(store_), faults);
    }
    device::PinnedPoolOptions popt;
    popt.bytes = pool_bytes;
    popt.huge_pages = HugePages::kOff;
    pool_ = std::move(*device::PinnedPool::Create(popt));
    TierManagerOptions mopt;
    mopt.device = device_.get();
    mopt.pool = pool_.get();
    mopt.store = store_.get();
    mopt.device_budget = device_budget;
    mopt.share_host_memory = share_host_memory;
    mopt.nvme.paths = {dir_.path().string()};
    manager_ = std::move(*TierManager::Create(mopt));
    for (int u = 0; u < units; ++u) {
      const uint64_t bytes = (small_unit_bytes != 0 && u == 0) ? small_unit_bytes : kUnit;
      ASSERT_TRUE(manager_->Register(Spec(static_cast<ShardId>(100 + u), bytes, Tier::kNvme,
                                      "block." + std::to_string(u)))
                      .ok());
    }
    ASSERT_TRUE(manager_->Start().ok());
    scheduler_ = std::make_unique<PrefetchScheduler>(*manager_, opts);
    for (int u = 0; u < units; ++u) {
      ASSERT_TRUE(scheduler_->AddUnit(u, {static_cast<ShardId>(100 + u)},
                                      "block." + std::to_string(u))
                      .ok());
    }
  }

  void TearDown() override {
    scheduler_.reset();
    manager_.reset();
    pool_.reset();
  }

  // One step over `order`; after each access waits until the manager is idle when `settle`
  // (compute long enough to hide every prefetch), then releases.
  void Step(const std::vector<UnitId>& order, bool settle = true) {
    scheduler_->BeginStep();
    for (UnitId u : order) {
      Result<std::vector<Lease>> l = scheduler_->Acquire(u, Access::kRead, "step");
      ASSERT_TRUE(l.ok()) << l.status().ToString();
      if (settle) manager_->WaitIdle();
      ASSERT_TRUE(scheduler_->Release(u, *l).ok());
      ASSERT_LE(manager_->stats(Tier::kDevice).in_use, manager_->stats(Tier::kDevice).budget);
    }
    scheduler_->EndStep();
    if (settle) manager_->WaitIdle();  // the time between steps (the optimizer, the data loader)
  }

  static std::vector<UnitId> ForwardBackward(int n) {
    std::vector<UnitId> v;
    for (int i = 0; i < n; ++i) v.push_back(i);
    for (int i = n - 1; i >= 0; --i) v.push_back(i);
    return v;
  }

  std::chrono::microseconds read_latency_{0};  // set before Build: every read takes this long
  strata::testing::TempDir dir_;
  std::unique_ptr<device::Device> device_;
  std::unique_ptr<io::BlockStore> store_;
  std::unique_ptr<device::PinnedPool> pool_;
  std::unique_ptr<TierManager> manager_;
  std::unique_ptr<PrefetchScheduler> scheduler_;
};

PrefetchOptions Lookahead(int device_units, int host_units) {
  PrefetchOptions o;
  o.device_lookahead_bytes = device_units * kUnit;
  o.host_lookahead_bytes = host_units * kUnit;
  o.persistence_threshold_bytes = 0;
  o.max_reuse_distance_bytes = 0;  // only immediate reuse keeps a unit
  return o;
}

TEST_F(PrefetchSchedulerTest, FirstStepRecordsAndOnlyItsEndPrefetches) {
  Build(8, 8 * kUnit, 16 * kUnit, Lookahead(2, 4));
  const std::vector<UnitId> order = ForwardBackward(8);
  EXPECT_FALSE(scheduler_->has_trace());
  Step(order);
  // Nothing during the step; at its end, the first units of the next step.
  std::set<UnitId> device;
  for (const PrefetchAction& a : scheduler_->actions()) {
    EXPECT_EQ(a.access, order.size());
    if (a.tier == Tier::kDevice) device.insert(a.unit);
  }
  EXPECT_EQ(device, (std::set<UnitId>{0, 1}));
  EXPECT_EQ(scheduler_->trace(), order);
  // With no trace yet nothing is known about reuse: every unit is let go after use.
  EXPECT_EQ(scheduler_->stats().hits, 0u);
  EXPECT_EQ(scheduler_->stats().let_go, order.size());
}

TEST_F(PrefetchSchedulerTest, WalksAheadInTraceOrderWithinEachStageBudget) {
  Build(8, 8 * kUnit, 16 * kUnit, Lookahead(2, 4));
  const std::vector<UnitId> order = ForwardBackward(8);
  Step(order);
  scheduler_->ClearActions();
  Step(order, /*settle=*/false);
  const std::vector<PrefetchAction> actions = scheduler_->actions();
  ASSERT_FALSE(actions.empty());
  const size_t n = order.size();
  for (const PrefetchAction& a : actions) {
    // Distinct units after the access, wrapping into the next step (from the next step's first
    // access for those EndStep issued).
    const bool at_end = a.access == n;
    std::vector<UnitId> ahead;
    for (size_t k = at_end ? 0 : 1; k < n && ahead.size() < 4; ++k) {
      UnitId u = order[(a.access + k) % n];
      if ((at_end || u != order[a.access]) &&
          std::find(ahead.begin(), ahead.end(), u) == ahead.end()) {
        ahead.push_back(u);
      }
    }
    const size_t window = a.tier == Tier::kDevice ? 2 : 4;
    const auto in = std::find(ahead.begin(), ahead.begin() + std::min(window, ahead.size()),
                              a.unit);
    EXPECT_NE(in, ahead.begin() + std::min(window, ahead.size()))
        << "access " << a.access << " prefetched unit " << a.unit << " into "
        << TierName(a.tier) << ", outside its window";
  }
  // Device prefetches after one access come in trace order.
  for (size_t i = 1; i < actions.size(); ++i) {
    const PrefetchAction& p = actions[i - 1];
    const PrefetchAction& c = actions[i];
    if (p.access != c.access || p.tier != Tier::kDevice || c.tier != Tier::kDevice) continue;
    if (c.access == n) continue;  // EndStep's plan starts at position 0 (checked above)
    auto pos = [&](UnitId u) {
      for (size_t k = 1; k < n; ++k) {
        if (order[(c.access + k) % n] == u) return k;
      }
      return n;
    };
    EXPECT_LT(pos(p.unit), pos(c.unit));
  }
  // The very first access of step 2 already prefetched the next two forward blocks.
  std::set<UnitId> first;
  for (const PrefetchAction& a : actions) {
    if (a.access == 0 && a.tier == Tier::kDevice) first.insert(a.unit);
  }
  EXPECT_EQ(first, (std::set<UnitId>{1, 2}));
}

// The host stage walks as deep as the host budget and charges its lookahead only for what it
// reads: with a host budget of C < L units, a forward/backward step reads each half's first
// missing unit as soon as the half's first access has freed room (not when that unit comes
// within `host_lookahead` units of the cursor), and never more than the 2 (L - C) reads the
// budget makes necessary — with and without shared host memory (a GPU keeps separate copies).
TEST_F(PrefetchSchedulerTest, HostStageReadsAsSoonAsTheBudgetHasRoom) {
  constexpr int kUnits = 12, kHostUnits = 6;
  for (bool share : {false, true}) {
    SCOPED_TRACE(share ? "shared host memory" : "separate device copies");
    Build(kUnits, 4 * kUnit, kHostUnits * kUnit, Lookahead(1, 1), 0, share);
    const std::vector<UnitId> order = ForwardBackward(kUnits);
    Step(order);
    Step(order);
    scheduler_->ClearActions();
    const uint64_t read0 = store_->stats().bytes_read;
    const PrefetchStats before = scheduler_->stats();
    Step(order);
    EXPECT_EQ(store_->stats().bytes_read - read0, 2u * (kUnits - kHostUnits) * kUnit);
    EXPECT_EQ(scheduler_->stats().hits - before.hits, order.size());
    EXPECT_LE(manager_->stats(Tier::kHost).peak, manager_->stats(Tier::kHost).budget);
    // Host reads in issue order: (access, unit).
    std::vector<std::pair<uint64_t, UnitId>> reads;
    for (const PrefetchAction& a : scheduler_->actions()) {
      if (a.tier == Tier::kHost && a.outcome == PrefetchOutcome::kIssued) {
        reads.emplace_back(a.access, a.unit);
      }
    }
    // The forward half reads C..L-1 and the backward half L-C-1..0, each first read right
    // after the half's first access (units 0..C-1, then L-1..L-C, were still in host memory);
    // the reads at the end of the backward half are already for the next step.
    auto first_read_of = [&](UnitId u) -> uint64_t {
      for (const auto& [access, unit] : reads) {
        if (unit == u) return access;
      }
      ADD_FAILURE() << "unit " << u << " was never read";
      return 0;
    };
    EXPECT_EQ(first_read_of(kHostUnits), 1u);
    EXPECT_EQ(first_read_of(kUnits - kHostUnits - 1), static_cast<uint64_t>(kUnits + 1));
    // A host lookahead of one unit: at most one read issued per access.
    std::map<uint64_t, int> per_access;
    for (const auto& [access, unit] : reads) EXPECT_LE(++per_access[access], 1) << access;
    TearDown();
  }
}

// The host lookahead caps the bytes being read, not the units walked: where several units are
// missing at once, no more than `host_lookahead` of them are issued.
TEST_F(PrefetchSchedulerTest, HostLookaheadCapsTheReadsInFlight) {
  constexpr int kUnits = 12;
  // Forward only: at the end of a step the host holds the last units used and misses the
  // next step's first ones. Reads take 5 ms, so those issued after one access are still in
  // flight while the walk goes on.
  read_latency_ = std::chrono::milliseconds(5);
  Build(kUnits, 4 * kUnit, 6 * kUnit, Lookahead(1, 2));
  std::vector<UnitId> order;
  for (int u = 0; u < kUnits; ++u) order.push_back(u);
  Step(order);
  Step(order);
  scheduler_->ClearActions();
  Step(order, /*settle=*/false);
  std::map<uint64_t, int> per_access;
  int most = 0;
  for (const PrefetchAction& a : scheduler_->actions()) {
    // Issued here, or already in flight (a device prefetch reads through host memory).
    if (a.tier == Tier::kHost &&
        (a.outcome == PrefetchOutcome::kIssued || a.outcome == PrefetchOutcome::kInFlight)) {
      most = std::max(most, ++per_access[a.access]);
    }
  }
  EXPECT_EQ(most, 2);
  EXPECT_LE(manager_->stats(Tier::kHost).peak, manager_->stats(Tier::kHost).budget);
}

TEST_F(PrefetchSchedulerTest, SteadyStateHitsEveryAccess) {
  Build(8, 8 * kUnit, 16 * kUnit, Lookahead(2, 4));
  const std::vector<UnitId> order = ForwardBackward(8);
  Step(order);
  Step(order);  // the first access misses: nothing wrapped into it yet
  const PrefetchStats before = scheduler_->stats();
  for (int s = 0; s < 3; ++s) Step(order);
  const PrefetchStats after = scheduler_->stats();
  EXPECT_EQ(after.accesses - before.accesses, 3 * order.size());
  EXPECT_EQ(after.hits - before.hits, 3 * order.size());
  EXPECT_EQ(after.divergences, 0u);
}

TEST_F(PrefetchSchedulerTest, DevicePeakIsBoundedByTheLookaheadNotTheModel) {
  for (int units : {8, 32}) {
    SCOPED_TRACE(units);
    Build(units, 64 * kUnit, 128 * kUnit, Lookahead(2, 4));
    const std::vector<UnitId> order = ForwardBackward(units);
    Step(order);
    Step(order);
    // current unit + 2 ahead + the one kept across the forward/backward turn
    EXPECT_LE(manager_->stats(Tier::kDevice).peak, 4 * kUnit);
    TearDown();
  }
}

// stage3_max_live_parameters: the device stage stops when the compute tier would hold more than
// max_live_bytes, however deep its lookahead and however much room the budget has.
TEST_F(PrefetchSchedulerTest, MaxLiveBytesCapsTheDeviceStage) {
  uint64_t uncapped_peak = 0;
  for (uint64_t max_live_units : {64, 3}) {
    SCOPED_TRACE(max_live_units);
    PrefetchOptions o = Lookahead(6, 8);
    o.max_live_bytes = max_live_units * kUnit;
    Build(16, 64 * kUnit, 128 * kUnit, o);
    const std::vector<UnitId> order = ForwardBackward(16);
    Step(order);
    manager_->WaitIdle();
    const PrefetchStats before = scheduler_->stats();
    const uint64_t peak_before = manager_->stats(Tier::kDevice).peak;
    scheduler_->ClearActions();
    Step(order);
    Step(order);
    const uint64_t peak = std::max(peak_before, manager_->stats(Tier::kDevice).peak);
    const PrefetchStats st = scheduler_->stats();
    // Every access of steps 2 and 3 found its unit prefetched, with or without the cap.
    EXPECT_EQ(st.hits - before.hits, 2 * order.size());
    if (max_live_units == 64) {
      uncapped_peak = peak;
      EXPECT_GE(uncapped_peak, 6 * kUnit) << "the lookahead alone did not reach 6 units";
    } else {
      EXPECT_LE(peak, 3 * kUnit);
      EXPECT_LT(peak, uncapped_peak);
      // At most two units are ever prefetched ahead of the one in use.
      for (const PrefetchAction& a : scheduler_->actions()) {
        if (a.tier != Tier::kDevice || a.outcome != PrefetchOutcome::kIssued) continue;
        // Distinct units after the access (EndStep's: from the next step's first access).
        const size_t n = order.size();
        const bool at_end = a.access == n;
        std::vector<UnitId> ahead;
        for (size_t k = at_end ? 0 : 1; k < n; ++k) {
          const UnitId u = order[(a.access + k) % n];
          if ((at_end || u != order[a.access]) &&
              std::find(ahead.begin(), ahead.end(), u) == ahead.end()) {
            ahead.push_back(u);
          }
          if (u == a.unit) break;
        }
        EXPECT_LE(ahead.size(), at_end ? 3u : 2u)
            << "access " << a.access << " prefetched unit " << a.unit;
      }
    }
    TearDown();
  }
}

TEST_F(PrefetchSchedulerTest, TightBudgetStopsTheWalkInsteadOfStealing) {
  // Room for the current unit and one more: a 3-unit lookahead must stop at kNoRoom.
  Build(8, 2 * kUnit, 16 * kUnit, Lookahead(3, 6));
  const std::vector<UnitId> order = ForwardBackward(8);
  Step(order);
  Step(order, /*settle=*/false);
  Step(order, /*settle=*/true);
  const PrefetchStats st = scheduler_->stats();
  EXPECT_GT(st.no_room, 0u);
  EXPECT_LE(manager_->stats(Tier::kDevice).peak, 2 * kUnit);
  EXPECT_GT(st.hits, order.size());  // still useful
}

TEST_F(PrefetchSchedulerTest, DivergenceIsServedOnDemandAndReRecorded) {
  Build(6, 8 * kUnit, 16 * kUnit, Lookahead(2, 4));
  const std::vector<UnitId> order = ForwardBackward(6);
  Step(order);
  Step(order);
  std::vector<UnitId> changed = order;
  std::swap(changed[2], changed[4]);  // the model's call order changed
  ::testing::internal::CaptureStderr();
  Step(changed);
  const std::string warned = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warned.find("step 3: access 2 is 'block.4' but the recorded trace expected block.2"),
            std::string::npos)
      << warned;
  EXPECT_EQ(scheduler_->stats().divergences, 1u);
  EXPECT_EQ(scheduler_->trace(), changed);
  const PrefetchStats before = scheduler_->stats();
  Step(changed);
  Step(changed);
  EXPECT_EQ(scheduler_->stats().divergences, 1u);
  // The re-recorded trace is followed at once (EndStep prefetched the next step's start).
  EXPECT_EQ(scheduler_->stats().hits - before.hits, 2 * changed.size());
  // A step that ends early (e.g. an exception in the model) is a divergence too.
  std::vector<UnitId> shorter(changed.begin(), changed.begin() + 5);
  ::testing::internal::CaptureStderr();
  Step(shorter);
  const std::string quiet = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(quiet.find("ended after"), std::string::npos) << "warned twice: " << quiet;
  EXPECT_EQ(scheduler_->stats().divergences, 2u);
  EXPECT_EQ(scheduler_->trace(), shorter);
}

// A step that ends early is the first divergence a scheduler sees: it is warned about once.
TEST_F(PrefetchSchedulerTest, StepThatEndsEarlyIsWarnedOnce) {
  Build(6, 8 * kUnit, 16 * kUnit, Lookahead(2, 4));
  const std::vector<UnitId> order = ForwardBackward(6);
  Step(order);
  Step(order);
  const std::vector<UnitId> shorter(order.begin(), order.begin() + 5);
  ::testing::internal::CaptureStderr();
  Step(shorter);
  const std::string warned = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warned.find("step 3 ended after 5 of 12 recorded accesses"), std::string::npos)
      << warned;
  EXPECT_EQ(scheduler_->stats().divergences, 1u);
  EXPECT_EQ(scheduler_->trace(), shorter);
  // The shorter sequence is followed from the next step on.
  const PrefetchStats before = scheduler_->stats();
  Step(shorter);
  EXPECT_EQ(scheduler_->stats().divergences, 1u);
  EXPECT_EQ(scheduler_->stats().hits - before.hits, shorter.size());
}

TEST_F(PrefetchSchedulerTest, ReuseDistanceKeepsUnitsAndPersistentOnesStay) {
  PrefetchOptions o = Lookahead(1, 2);
  o.max_reuse_distance_bytes = kUnit;  // keep a unit if at most one other unit comes between
  o.persistence_threshold_bytes = 8 << 10;
  Build(5, 16 * kUnit, 16 * kUnit, o, /*small_unit_bytes=*/4096);
  // 0 is small (persistent). Pattern: 1 2 1 3 4 ... 1 is reused after one unit: kept.
  const std::vector<UnitId> order = {0, 1, 2, 1, 3, 4, 0};
  Step(order);
  Step(order);
  EXPECT_TRUE(manager_->IsCurrent(100, Tier::kDevice)) << "persistent unit was let go";
  const PrefetchStats st = scheduler_->stats();
  EXPECT_GT(st.kept, 0u);
  EXPECT_GT(st.let_go, 0u);
  // Unit 4 is last used before the final 0 and not again this step: let go.
  EXPECT_FALSE(manager_->IsCurrent(104, Tier::kDevice));
}

TEST_F(PrefetchSchedulerTest, DisabledIssuesNothing) {
  PrefetchOptions o = Lookahead(2, 4);
  o.enabled = false;
  Build(6, 8 * kUnit, 16 * kUnit, o);
  const std::vector<UnitId> order = ForwardBackward(6);
  Step(order);
  Step(order);
  EXPECT_TRUE(scheduler_->actions().empty());
  // Only the immediate reuse at the forward/backward turn of step 2 (no trace in step 1).
  EXPECT_EQ(scheduler_->stats().hits, 1u);
}

TEST_F(PrefetchSchedulerTest, UnitErrors) {
  Build(2, 8 * kUnit, 16 * kUnit, Lookahead(1, 1));
  EXPECT_EQ(scheduler_->AddUnit(0, {100}).code(), StatusCode::kInvalidArgument);  // duplicate
  EXPECT_EQ(scheduler_->AddUnit(7, {}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(scheduler_->AddUnit(7, {999}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(scheduler_->AddUnit(7, {101}).code(), StatusCode::kInvalidArgument);  // in unit 1
  EXPECT_EQ(scheduler_->Acquire(42).status().code(), StatusCode::kNotFound);
}

TEST(PrefetchOptionsTest, FromConfigConvertsElementsToBytes) {
  Result<Config> c = ParseConfig(R"({"zero_optimization": {"stage": 3,
      "stage3_prefetch_bucket_size": 1000, "stage3_max_live_parameters": 5000,
      "stage3_max_reuse_distance": 3000, "stage3_param_persistence_threshold": 10}})",
                                 "test");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  PrefetchOptions o = PrefetchOptions::FromConfig(*c, 2);
  EXPECT_EQ(o.device_lookahead_bytes, 2000u);
  EXPECT_EQ(o.max_live_bytes, 10000u);
  EXPECT_EQ(o.max_reuse_distance_bytes, 6000u);
  EXPECT_EQ(o.persistence_threshold_bytes, 20u);
  EXPECT_EQ(o.host_lookahead_bytes, 8000u);
}

}  // namespace
}  // namespace strata::offload

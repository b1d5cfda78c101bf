// PrefetchScheduler: moves units toward compute ahead of the compute cursor.
//
// A unit is the set of shards used together (a transformer block's parameter shard, the
// embeddings, ...). The consumer brackets every use of a unit with Acquire / Release, and every
// training step with BeginStep / EndStep. The scheduler:
//   - records the sequence of unit accesses during the first step (the trace);
//   - from the next step on, after each access walks the trace ahead of the cursor (wrapping
//     into the next step) and issues, in order, each stage's prefetch under its own budget:
//       device (the compute tier): units whose bytes fit `device_lookahead_bytes`
//         (stage3_prefetch_bucket_size) while the compute tier holds at most `max_live_bytes`
//         (stage3_max_live_parameters);
//       host: deeper, because NVMe is the slowest stage — only for NVMe-homed shards. The host
//         walk covers the units ahead whose bytes fit the host budget (no schedule can hold
//         more at once) and skips those already in host (or compute) memory: what it charges
//         against `host_lookahead_bytes` (strata.prefetch.host_lookahead) are the bytes it is
//         reading from NVMe, so the reads start as soon as the budget has room for them — right
//         after the forward/backward turn too, where the host holds the units needed first;
//     a prefetch that finds no room (TierManager::Prefetch -> kNoRoom: everything there is needed
//     sooner) stops that stage's walk, so earlier units are never starved by later ones;
//   - gives the tier manager an eviction oracle: the distance (in accesses) from the cursor to
//     each shard's next use, so eviction drops the copy needed farthest in the future;
//   - on Release, keeps a unit in the compute tier when it is used again within
//     `max_reuse_distance_bytes` of other units' bytes (stage3_max_reuse_distance), and lets it
//     go (TierManager::Evict) otherwise; units smaller than `persistence_threshold_bytes`
//     (stage3_param_persistence_threshold) stay resident for good once first used.
// Before a trace exists (step 1) every access is served on demand, units are let go after use,
// and eviction falls back to LRU. EndStep already issues the lookahead for the next step's first
// units, so step 2 does not start cold.
//
// Divergence: when an access differs from the trace, the scheduler logs it (once at warning
// level, later ones at debug), serves the rest of the step on demand and makes that step's
// accesses the new trace. It is never an error and never waits for an access that will not come.
//
// Threading: one consumer thread drives Acquire/Release/BeginStep/EndStep; stats() and actions()
// may be called from any thread. The scheduler never holds its own lock while calling the tier
// manager; the oracle it installs takes only its own lock.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/clock.h"
#include "offload/tier_manager.h"
#include "strata/config.h"

namespace strata::offload {

using UnitId = uint64_t;

struct PrefetchOptions {
  bool enabled = true;                       // false: on demand only (for comparison)
  Tier compute_tier = Tier::kDevice;         // where the consumer uses units
  uint64_t device_lookahead_bytes = 100'000'000;
  uint64_t max_live_bytes = 2'000'000'000;
  uint64_t host_lookahead_bytes = 400'000'000;  // NVMe reads in flight ahead of the cursor
  uint64_t max_reuse_distance_bytes = 2'000'000'000;
  uint64_t persistence_threshold_bytes = 200'000;
  TraceRecorder* trace = nullptr;            // prefetch decisions, when set
  // Times the trace's events (the scheduler's decisions depend on the access sequence and the
  // budgets, never on time); RealClock() when null. Must outlive the scheduler.
  Clock* clock = nullptr;

  // From zero_optimization.stage3_* (elements, times `bytes_per_element` of the compute dtype)
  // and strata.prefetch.host_lookahead (bytes; default 4x the device lookahead).
  static PrefetchOptions FromConfig(const Config& config, uint64_t bytes_per_element);
};

// One prefetch the scheduler asked for; kept for tests and diagnostics.
struct PrefetchAction {
  uint64_t step = 0;
  // Index of the access (within the step) after which it was issued; the step's length for
  // prefetches issued by EndStep for the start of the next step.
  uint64_t access = 0;
  UnitId unit = 0;
  ShardId shard = 0;
  Tier tier = Tier::kDevice;
  PrefetchOutcome outcome = PrefetchOutcome::kIssued;
};

struct PrefetchStats {
  uint64_t steps = 0;
  uint64_t accesses = 0;
  uint64_t hits = 0;        // accesses whose shards were all current in the compute tier already
  uint64_t misses = 0;
  uint64_t issued = 0;      // prefetches that started a transfer (all tiers)
  uint64_t no_room = 0;     // prefetch walks stopped by a full budget
  uint64_t divergences = 0;
  uint64_t kept = 0;        // releases that kept the unit resident (reuse distance, persistent)
  uint64_t let_go = 0;      // releases that let the unit go
  double hit_rate() const { return accesses == 0 ? 0.0 : double(hits) / double(accesses); }
};

class PrefetchScheduler {
 public:
  // Installs the eviction oracle on `manager`; the destructor removes it. `manager` must outlive
  // the scheduler.
  PrefetchScheduler(TierManager& manager, PrefetchOptions options);
  ~PrefetchScheduler();
  PrefetchScheduler(const PrefetchScheduler&) = delete;
  PrefetchScheduler& operator=(const PrefetchScheduler&) = delete;

  // Declares a unit. InvalidArgument for a duplicate id, no shards, or an unknown shard.
  Status AddUnit(UnitId unit, std::vector<ShardId> shards, std::string name = "");

  void BeginStep();
  // Ends the step: the first step's accesses (or a diverged step's) become the trace.
  void EndStep();

  // Records the access, issues the lookahead, then acquires every shard of `unit` in the
  // compute tier (blocking until they are there). Errors are the tier manager's.
  Result<std::vector<Lease>> Acquire(UnitId unit, Access access = Access::kRead,
                                     std::string_view owner = "");
  // Releases the leases (see Lease::Release for `dirty` and `used_on`) and decides whether the
  // unit stays in the compute tier.
  Status Release(UnitId unit, std::vector<Lease>& leases, bool dirty = false,
                 device::Stream* used_on = nullptr);

  bool has_trace() const;
  std::vector<UnitId> trace() const;
  std::vector<PrefetchAction> actions() const;
  void ClearActions();
  PrefetchStats stats() const;

 private:
  struct Unit {
    std::vector<ShardId> shards;
    std::string name;
    uint64_t bytes = 0;
    bool persistent = false;
    std::vector<Lease> persistent_leases;  // held for good once first used
  };
  struct Candidate {
    UnitId unit;
    Tier tier;
  };

  uint64_t DistanceLocked(ShardId shard) const;
  // The units to prefetch after position `pos` of the trace (from `pos` itself when
  // `include_pos`, as at the end of a step), in trace order, each with its stage.
  std::vector<Candidate> PlanLocked(size_t pos, bool include_pos) const;
  Status IssuePlan(const std::vector<Candidate>& plan, uint64_t access_index,
                   std::vector<PrefetchAction>* done);
  bool KeepAfterUseLocked(UnitId unit) const;
  // A divergence from the trace: at warning level the first time, at debug level after.
  void LogDivergenceLocked(const std::string& what);
  void SetTraceLocked(std::vector<UnitId> trace);

  TierManager& manager_;
  PrefetchOptions options_;
  uint64_t host_budget_ = 0;  // the manager's host budget: how far the host walk can look
  mutable std::mutex mu_;
  std::unordered_map<UnitId, Unit> units_;
  std::unordered_map<ShardId, UnitId> unit_of_shard_;
  std::vector<UnitId> trace_;                            // the recorded step
  std::unordered_map<UnitId, std::vector<size_t>> positions_;  // unit -> its indices in trace_
  std::vector<UnitId> recording_;                        // this step's accesses
  bool following_ = false;  // this step matches the trace so far
  size_t cursor_ = 0;       // index in trace_ of the current (last) access
  bool warned_divergence_ = false;
  uint64_t step_ = 0;
  std::vector<PrefetchAction> actions_;
  PrefetchStats stats_;
  uint32_t track_ = 0;
};

}  // namespace strata::offload

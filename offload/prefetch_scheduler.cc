#include "offload/prefetch_scheduler.h"

#include <algorithm>
#include <unordered_set>
#include <utility>

#include "common/log.h"

namespace strata::offload {

PrefetchOptions PrefetchOptions::FromConfig(const Config& config, uint64_t bytes_per_element) {
  PrefetchOptions o;
  const auto bytes = [&](int64_t elements) {
    return elements <= 0 ? uint64_t{0} : static_cast<uint64_t>(elements) * bytes_per_element;
  };
  o.device_lookahead_bytes = bytes(config.zero.stage3_prefetch_bucket_size);
  o.max_live_bytes = bytes(config.zero.stage3_max_live_parameters);
  o.max_reuse_distance_bytes = bytes(config.zero.stage3_max_reuse_distance);
  o.persistence_threshold_bytes = bytes(config.zero.stage3_param_persistence_threshold);
  o.host_lookahead_bytes =
      config.strata.prefetch.host_lookahead.value_or(4 * o.device_lookahead_bytes);
  return o;
}

PrefetchScheduler::PrefetchScheduler(TierManager& manager, PrefetchOptions options)
    : manager_(manager),
      options_(std::move(options)),
      host_budget_(manager.stats(Tier::kHost).budget) {
  if (options_.clock == nullptr) options_.clock = &RealClock();
  if (options_.trace != nullptr) track_ = options_.trace->Track("prefetch");
  manager_.SetEvictionOracle([this](ShardId shard) {
    std::lock_guard lock(mu_);
    return DistanceLocked(shard);
  });
}

PrefetchScheduler::~PrefetchScheduler() {
  manager_.SetEvictionOracle(nullptr);
  for (auto& [id, u] : units_) u.persistent_leases.clear();
}

Status PrefetchScheduler::AddUnit(UnitId unit, std::vector<ShardId> shards, std::string name) {
  if (shards.empty()) {
    return Status(StatusCode::kInvalidArgument, "unit " + std::to_string(unit) + " has no shards");
  }
  uint64_t bytes = 0;
  for (ShardId s : shards) {
    const uint64_t b = manager_.shard_bytes(s);
    if (b == 0) {
      return Status(StatusCode::kInvalidArgument, "unit " + std::to_string(unit) +
                                                      ": shard " + std::to_string(s) +
                                                      " is not registered with the tier manager");
    }
    bytes += b;
  }
  std::lock_guard lock(mu_);
  if (units_.count(unit) != 0) {
    return Status(StatusCode::kInvalidArgument,
                  "unit " + std::to_string(unit) + " is declared twice");
  }
  for (ShardId s : shards) {
    if (unit_of_shard_.count(s) != 0) {
      return Status(StatusCode::kInvalidArgument,
                    "shard " + std::to_string(s) + " belongs to two units");
    }
  }
  for (ShardId s : shards) unit_of_shard_[s] = unit;
  Unit u;
  u.shards = std::move(shards);
  u.name = name.empty() ? "unit " + std::to_string(unit) : std::move(name);
  u.bytes = bytes;
  u.persistent = bytes < options_.persistence_threshold_bytes;
  units_.emplace(unit, std::move(u));
  return Status::Ok();
}

void PrefetchScheduler::BeginStep() {
  std::lock_guard lock(mu_);
  recording_.clear();
  following_ = !trace_.empty();
  cursor_ = 0;
  ++step_;
  stats_.steps++;
}

void PrefetchScheduler::EndStep() {
  std::vector<Candidate> plan;
  uint64_t access_index = 0;
  {
    std::lock_guard lock(mu_);
    const bool completed = following_ && recording_.size() == trace_.size();
    if (trace_.empty() || !completed) {
      if (!trace_.empty() && following_) {
        // The step ended early: also a divergence.
        stats_.divergences++;
        LogDivergenceLocked(fmt::format(
            "step {} ended after {} of {} recorded accesses; its sequence is the new trace",
            step_, recording_.size(), trace_.size()));
      }
      SetTraceLocked(std::move(recording_));
    }
    recording_.clear();
    // Until BeginStep, the future is the trace from its start: the eviction oracle answers for
    // the next step, so the prefetches below may evict what that step needs last.
    following_ = !trace_.empty();
    cursor_ = 0;
    // Start the next step's first units now, so that step does not begin cold.
    if (options_.enabled && !trace_.empty()) {
      plan = PlanLocked(0, /*include_pos=*/true);
      access_index = trace_.size();
    }
  }
  if (!plan.empty()) {
    std::vector<PrefetchAction> done;
    Status st = IssuePlan(plan, access_index, &done);
    if (!st.ok()) STRATA_LOG(warn, offload, "prefetch at the end of a step: {}", st.ToString());
    std::lock_guard lock(mu_);
    for (const PrefetchAction& a : done) {
      if (a.outcome == PrefetchOutcome::kIssued) stats_.issued++;
      if (a.outcome == PrefetchOutcome::kNoRoom) stats_.no_room++;
    }
    actions_.insert(actions_.end(), done.begin(), done.end());
  }
}

void PrefetchScheduler::LogDivergenceLocked(const std::string& what) {
  if (!warned_divergence_) {
    warned_divergence_ = true;
    STRATA_LOG(warn, offload, "{} (further divergences are logged at debug level)", what);
  } else {
    STRATA_LOG(debug, offload, "{}", what);
  }
}

void PrefetchScheduler::SetTraceLocked(std::vector<UnitId> trace) {
  trace_ = std::move(trace);
  positions_.clear();
  for (size_t i = 0; i < trace_.size(); ++i) positions_[trace_[i]].push_back(i);
}

uint64_t PrefetchScheduler::DistanceLocked(ShardId shard) const {
  if (!following_ || trace_.empty()) return kNeverUsed;
  auto u = unit_of_shard_.find(shard);
  if (u == unit_of_shard_.end()) return kNeverUsed;
  auto p = positions_.find(u->second);
  if (p == positions_.end()) return kNeverUsed;
  const std::vector<size_t>& pos = p->second;
  // The next index >= cursor (the current access is distance 0), wrapping into the next step.
  auto it = std::lower_bound(pos.begin(), pos.end(), cursor_);
  if (it != pos.end()) return *it - cursor_;
  return pos.front() + trace_.size() - cursor_;
}

std::vector<PrefetchScheduler::Candidate> PrefetchScheduler::PlanLocked(size_t pos,
                                                                        bool include_pos) const {
  std::vector<Candidate> plan;
  const size_t n = trace_.size();
  const UnitId current = trace_[pos];
  // Device (compute tier) window, then the deeper host window; each in access order. The host
  // window is as deep as the host budget: units beyond it cannot be in host memory together with
  // the nearer ones. IssuePlan charges the host lookahead only for what it reads.
  uint64_t device_bytes = 0, host_bytes = 0;
  bool device_open = true;
  bool host_open = options_.compute_tier == Tier::kDevice && options_.host_lookahead_bytes > 0;
  std::unordered_set<UnitId> seen;
  if (!include_pos) seen.insert(current);
  for (size_t k = include_pos ? 0 : 1; k < n; ++k) {
    const UnitId u = trace_[(pos + k) % n];
    if (!seen.insert(u).second) continue;
    const Unit& unit = units_.at(u);
    if (unit.persistent) continue;
    if (device_open && device_bytes + unit.bytes <= options_.device_lookahead_bytes) {
      device_bytes += unit.bytes;
      plan.push_back({u, options_.compute_tier});
    } else {
      device_open = false;
    }
    if (host_open && host_bytes + unit.bytes > host_budget_) host_open = false;
    if (host_open) {
      host_bytes += unit.bytes;
      plan.push_back({u, Tier::kHost});
    } else if (!device_open) {
      break;
    }
  }
  return plan;
}

Status PrefetchScheduler::IssuePlan(const std::vector<Candidate>& plan, uint64_t access_index,
                                    std::vector<PrefetchAction>* done) {
  // In plan order; a stage stops at its first kNoRoom. The scheduler's lock is not held here.
  uint64_t step = 0;
  {
    std::lock_guard lock(mu_);
    step = step_;
  }
  bool stopped[kNumTiers] = {false, false, false};
  uint64_t live = manager_.stats(options_.compute_tier).in_use;
  uint64_t host_reading = 0;  // bytes of the host stage's NVMe reads, issued or in flight
  for (const Candidate& c : plan) {
    const int ti = static_cast<int>(c.tier);
    if (stopped[ti]) continue;
    std::vector<ShardId> unit_shards;
    {
      std::lock_guard lock(mu_);
      unit_shards = units_.at(c.unit).shards;
    }
    for (ShardId s : unit_shards) {
      // The host stage only serves NVMe-homed shards not already in the compute tier.
      if (c.tier == Tier::kHost) {
        Result<Tier> h = manager_.home(s);
        if (!h.ok() || *h != Tier::kNvme || manager_.IsCurrent(s, options_.compute_tier) ||
            manager_.IsCurrent(s, Tier::kHost)) {
          continue;
        }
        if (host_reading + manager_.shard_bytes(s) > options_.host_lookahead_bytes) {
          stopped[ti] = true;
          break;
        }
      }
      if (c.tier == options_.compute_tier) {
        const uint64_t b = manager_.shard_bytes(s);
        if (!manager_.IsCurrent(s, c.tier) && live + b > options_.max_live_bytes) {
          stopped[ti] = true;
          break;
        }
      }
      Result<PrefetchOutcome> r = manager_.Prefetch(s, c.tier);
      if (!r.ok()) return r.status();
      const int64_t now = options_.trace != nullptr ? options_.clock->NowNs() : 0;
      if (options_.trace != nullptr && *r == PrefetchOutcome::kIssued) {
        options_.trace->Complete(track_, "prefetch " + std::string(TierName(c.tier)), "prefetch",
                                 now, now, {{"shard", static_cast<double>(s)}});
      }
      done->push_back({step, access_index, c.unit, s, c.tier, *r});
      if (*r == PrefetchOutcome::kIssued && c.tier == options_.compute_tier) {
        live += manager_.shard_bytes(s);
      }
      if (c.tier == Tier::kHost &&
          (*r == PrefetchOutcome::kIssued || *r == PrefetchOutcome::kInFlight)) {
        host_reading += manager_.shard_bytes(s);
      }
      if (*r == PrefetchOutcome::kNoRoom) {
        stopped[ti] = true;
        break;
      }
    }
  }

  return Status::Ok();
}

Result<std::vector<Lease>> PrefetchScheduler::Acquire(UnitId unit, Access access,
                                                      std::string_view owner) {
  std::vector<Candidate> plan;
  std::vector<ShardId> shards;
  uint64_t access_index = 0;
  bool persistent_first_use = false;
  std::vector<Lease> persistent_to_drop;
  {
    std::lock_guard lock(mu_);
    auto it = units_.find(unit);
    if (it == units_.end()) {
      return Status(StatusCode::kNotFound, "unit " + std::to_string(unit) + " is not declared");
    }
    shards = it->second.shards;
    // The scheduler's own lease on a persistent unit is taken on a read; an overwrite needs the
    // copy to itself, so that lease is handed back first and taken again on the next read.
    if (access != Access::kRead) {
      persistent_to_drop = std::move(it->second.persistent_leases);
      it->second.persistent_leases.clear();
    }
    persistent_first_use = it->second.persistent && it->second.persistent_leases.empty() &&
                           access == Access::kRead;
    access_index = recording_.size();
    recording_.push_back(unit);
    stats_.accesses++;
    if (following_) {
      const size_t expected = recording_.size() - 1;
      if (expected < trace_.size() && trace_[expected] == unit) {
        cursor_ = expected;
        if (options_.enabled) plan = PlanLocked(cursor_, /*include_pos=*/false);
      } else {
        following_ = false;
        stats_.divergences++;
        const std::string want = expected < trace_.size()
                                     ? units_.at(trace_[expected]).name
                                     : std::string("the end of the step");
        LogDivergenceLocked(fmt::format(
            "step {}: access {} is '{}' but the recorded trace expected {}; serving the rest of "
            "the step on demand and re-recording",
            step_, expected, it->second.name, want));
      }
    }
  }

  // Was it already there? (Counted before the lookahead, which cannot make it so.)
  bool hit = true;
  for (ShardId s : shards) hit &= manager_.IsCurrent(s, options_.compute_tier);

  std::vector<PrefetchAction> done;
  STRATA_RETURN_IF_ERROR(IssuePlan(plan, access_index, &done));

  persistent_to_drop.clear();  // released outside the scheduler's lock
  std::vector<Lease> leases;
  leases.reserve(shards.size());
  for (ShardId s : shards) {
    Result<Lease> l = manager_.Acquire(s, options_.compute_tier, access, owner);
    if (!l.ok()) return l.status();
    leases.push_back(std::move(*l));
  }
  std::vector<Lease> persistent;
  if (persistent_first_use) {
    for (ShardId s : shards) {
      Result<Lease> l = manager_.Acquire(s, options_.compute_tier, Access::kRead, "persistent");
      if (l.ok()) persistent.push_back(std::move(*l));
    }
  }

  std::lock_guard lock(mu_);
  for (const PrefetchAction& a : done) {
    if (a.outcome == PrefetchOutcome::kIssued) stats_.issued++;
    if (a.outcome == PrefetchOutcome::kNoRoom) stats_.no_room++;
  }
  actions_.insert(actions_.end(), done.begin(), done.end());
  (hit ? stats_.hits : stats_.misses)++;
  if (!persistent.empty()) {
    Unit& u = units_.at(unit);
    for (Lease& l : persistent) u.persistent_leases.push_back(std::move(l));
  }
  return leases;
}

bool PrefetchScheduler::KeepAfterUseLocked(UnitId unit) const {
  const Unit& u = units_.at(unit);
  if (u.persistent) return true;
  if (!following_ || trace_.empty()) return false;  // no future known: let it go
  auto p = positions_.find(unit);
  if (p == positions_.end()) return false;
  // The next use, wrapping into the next step (a unit used last in one step and first in the
  // next, like the embeddings, is reused at once).
  const size_t n = trace_.size();
  auto next_it = std::upper_bound(p->second.begin(), p->second.end(), cursor_);
  const size_t next = next_it != p->second.end() ? *next_it : p->second.front() + n;
  // Bytes of the other units used in between.
  uint64_t between = 0;
  std::unordered_set<UnitId> seen{unit};
  for (size_t i = cursor_ + 1; i < next; ++i) {
    const UnitId other = trace_[i % n];
    if (seen.insert(other).second) between += units_.at(other).bytes;
    if (between > options_.max_reuse_distance_bytes) return false;
  }
  return true;
}

Status PrefetchScheduler::Release(UnitId unit, std::vector<Lease>& leases, bool dirty,
                                  device::Stream* used_on) {
  for (Lease& l : leases) l.Release(dirty, used_on);
  leases.clear();
  bool keep = false;
  std::vector<ShardId> shards;
  {
    std::lock_guard lock(mu_);
    auto it = units_.find(unit);
    if (it == units_.end()) {
      return Status(StatusCode::kNotFound, "unit " + std::to_string(unit) + " is not declared");
    }
    keep = KeepAfterUseLocked(unit);
    shards = it->second.shards;
    (keep ? stats_.kept : stats_.let_go)++;
  }
  if (keep) return Status::Ok();
  for (ShardId s : shards) STRATA_RETURN_IF_ERROR(manager_.Evict(s, options_.compute_tier));
  return Status::Ok();
}

bool PrefetchScheduler::has_trace() const {
  std::lock_guard lock(mu_);
  return !trace_.empty();
}

std::vector<UnitId> PrefetchScheduler::trace() const {
  std::lock_guard lock(mu_);
  return trace_;
}

std::vector<PrefetchAction> PrefetchScheduler::actions() const {
  std::lock_guard lock(mu_);
  return actions_;
}

void PrefetchScheduler::ClearActions() {
  std::lock_guard lock(mu_);
  actions_.clear();
}

PrefetchStats PrefetchScheduler::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

}  // namespace strata::offload

// OptimizerStates: the CPU optimizer's fp32 states of one rank (master weights, first and second
// moments), in sub-groups, homed in the pinned pool or on NVMe, and the pipeline that streams
// them through host memory once per step.
//
// Each unit's shard of the rank's parameters is cut into sub-groups of at most `sub_group_elems`
// elements; a sub-group's states are one shard of the tier manager (12 bytes per element: master,
// m, v in that order, each `numel` floats). Every step visits all sub-groups in one fixed order:
// units from last to first (the order backward lands their gradients), each unit's sub-groups in
// order. The visit is a pipeline of `pipeline_depth` sub-groups in host memory:
//   - read-ahead: Visit(g) prefetches the next pipeline_depth - 2 sub-groups into host memory
//     (NVMe home only; a prefetch that finds no room stops the read-ahead);
//   - current: the caller acquires g (Acquire) and updates it;
//   - write-behind: releasing it dirty lets the tier manager write it home when it needs room.
// The tier manager's eviction oracle ranks copies by how far ahead of the cursor (the sub-group
// being visited) their next visit is, wrapping into the next step, so read-ahead copies outlive
// the ones already updated this step.
//
// With a host home every state stays in the pool (the host budget is their total); with an NVMe
// home the host budget is pipeline_depth x the largest sub-group.
//
// Threading: the tier manager's. The cursor is one atomic; Visit, Visited and ReadAheadFirst are
// called by one thread at a time (the optimizer's, or the step's before it queues the optimizer).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "offload/tier_manager.h"
#include "strata/status.h"

namespace strata::offload {

struct OptimizerSubGroup {
  ShardId id = 0;
  int unit = 0;
  int64_t offset = 0;  // within the unit's shard of the rank (elements)
  int64_t numel = 0;
};

struct OptimizerStatesOptions {
  // device, pool, store, nvme and trace are used; the budgets are set here.
  TierManagerOptions tiers;
  Tier home = Tier::kHost;  // kHost or kNvme
  int pipeline_depth = 3;   // sub-groups in host memory at once with an NVMe home; >= 3
  int64_t sub_group_elems = 0;  // > 0
  // Per unit: the rank's shard size in elements and a name for logs and errors.
  std::vector<int64_t> unit_elems;
  std::vector<std::string> unit_names;
};

class OptimizerStates {
 public:
  // Registers every sub-group and starts the tier manager. InvalidArgument for a bad option.
  static Result<std::unique_ptr<OptimizerStates>> Create(const OptimizerStatesOptions& options);

  const std::vector<OptimizerSubGroup>& groups(int unit) const { return groups_[unit]; }
  int64_t total_groups() const { return static_cast<int64_t>(sequence_.size()); }

  // Before a step's visit, when the optimizer waits for every gradient (clipping, fp16): the
  // cursor goes back to the first sub-group and the first pipeline_depth - 1 are read ahead
  // (NVMe home), while backward still runs and the disk has little else to do.
  Status ReadAheadFirst();
  // `g` is about to be updated: the cursor moves to it and the read-ahead is issued.
  Status Visit(const OptimizerSubGroup& g);
  // `g` was updated; after the step's last sub-group the cursor moves past the end.
  void Visited(const OptimizerSubGroup& g);

  // The sub-group's states in host memory: master, m, v (numel floats each).
  Result<Lease> Acquire(const OptimizerSubGroup& g, Access access, std::string_view owner) {
    return tiers_->Acquire(g.id, Tier::kHost, access, owner);
  }
  // A write-behind that failed in the background since the last call (once).
  Status TakeWritebackError() { return tiers_->TakeWritebackError(); }
  TierStats stats(Tier tier) const { return tiers_->stats(tier); }

 private:
  OptimizerStates() = default;
  // Prefetches positions [from, from + count) of the visit into host memory (NVMe home only),
  // stopping at the first that finds no room.
  Status ReadAhead(int64_t from, int64_t count);

  Tier home_ = Tier::kHost;
  int pipeline_depth_ = 3;
  std::unique_ptr<TierManager> tiers_;
  std::vector<std::vector<OptimizerSubGroup>> groups_;  // per unit
  std::vector<int64_t> position_;                       // per sub-group id: its place in the visit
  std::vector<const OptimizerSubGroup*> sequence_;      // the visit order
  std::atomic<int64_t> cursor_{0};
};

}  // namespace strata::offload

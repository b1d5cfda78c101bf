#include "offload/optimizer_states.h"

#include <fmt/format.h>

#include <algorithm>

#include "device/pinned_pool.h"

namespace strata::offload {

Result<std::unique_ptr<OptimizerStates>> OptimizerStates::Create(
    const OptimizerStatesOptions& options) {
  if (options.home != Tier::kHost && options.home != Tier::kNvme) {
    return InvalidArgumentError("optimizer states: the home must be the host or NVMe");
  }
  if (options.sub_group_elems <= 0) {
    return InvalidArgumentError(fmt::format("optimizer states: sub-group size {} must be > 0",
                                            options.sub_group_elems));
  }
  if (options.pipeline_depth < 3) {
    return InvalidArgumentError(fmt::format(
        "optimizer states: pipeline depth {} < 3 (read-ahead, current, write-behind)",
        options.pipeline_depth));
  }
  if (options.unit_names.size() != options.unit_elems.size()) {
    return InvalidArgumentError("optimizer states: one name per unit");
  }
  std::unique_ptr<OptimizerStates> s(new OptimizerStates());
  s->home_ = options.home;
  s->pipeline_depth_ = options.pipeline_depth;
  const size_t n_units = options.unit_elems.size();
  s->groups_.resize(n_units);
  uint64_t total = 0, largest = 0;
  ShardId next_id = 0;
  for (size_t u = 0; u < n_units; ++u) {
    const int64_t elems = options.unit_elems[u];
    for (int64_t off = 0; off < elems; off += options.sub_group_elems) {
      OptimizerSubGroup g{next_id++, static_cast<int>(u), off,
                          std::min(options.sub_group_elems, elems - off)};
      const uint64_t held = device::PinnedPool::SizeClass(12 * static_cast<uint64_t>(g.numel));
      total += held;
      largest = std::max<uint64_t>(largest, held);
      s->groups_[u].push_back(g);
    }
  }
  TierManagerOptions to = options.tiers;
  to.host_budget = options.home == Tier::kHost
                       ? total
                       : static_cast<uint64_t>(options.pipeline_depth) * largest;
  STRATA_ASSIGN_OR_RETURN(s->tiers_, TierManager::Create(to));
  for (const auto& unit_groups : s->groups_) {
    for (const OptimizerSubGroup& g : unit_groups) {
      ShardSpec spec;
      spec.id = g.id;
      spec.bytes = 12 * static_cast<uint64_t>(g.numel);
      spec.home = options.home;
      spec.name = fmt::format("{} optimizer states [{}, {})", options.unit_names[g.unit],
                              g.offset, g.offset + g.numel);
      spec.state_class = "optim";
      STRATA_RETURN_IF_ERROR(s->tiers_->Register(spec));
    }
  }
  STRATA_RETURN_IF_ERROR(s->tiers_->Start());
  s->position_.assign(static_cast<size_t>(next_id), 0);
  for (size_t u = n_units; u-- > 0;) {
    for (const OptimizerSubGroup& g : s->groups_[u]) {
      s->position_[g.id] = static_cast<int64_t>(s->sequence_.size());
      s->sequence_.push_back(&g);
    }
  }
  OptimizerStates* self = s.get();
  s->tiers_->SetEvictionOracle([self](ShardId id) -> uint64_t {
    const int64_t n = static_cast<int64_t>(self->sequence_.size());
    const int64_t at = self->position_[id];
    const int64_t cursor = self->cursor_.load(std::memory_order_relaxed);
    return static_cast<uint64_t>(at >= cursor ? at - cursor : at + n - cursor);
  });
  return s;
}

Status OptimizerStates::ReadAhead(int64_t from, int64_t count) {
  if (home_ != Tier::kNvme) return Status::Ok();
  const int64_t total = static_cast<int64_t>(sequence_.size());
  for (int64_t i = from; i < std::min(total, from + std::max<int64_t>(1, count)); ++i) {
    STRATA_ASSIGN_OR_RETURN(PrefetchOutcome o, tiers_->Prefetch(sequence_[i]->id, Tier::kHost));
    if (o == PrefetchOutcome::kNoRoom) break;
  }
  return Status::Ok();
}

Status OptimizerStates::ReadAheadFirst() {
  cursor_.store(0, std::memory_order_relaxed);
  return ReadAhead(0, pipeline_depth_ - 1);
}

Status OptimizerStates::Visit(const OptimizerSubGroup& g) {
  const int64_t at = position_[g.id];
  cursor_.store(at, std::memory_order_relaxed);
  return ReadAhead(at + 1, pipeline_depth_ - 2);
}

void OptimizerStates::Visited(const OptimizerSubGroup& g) {
  const int64_t at = position_[g.id];
  if (at + 1 == static_cast<int64_t>(sequence_.size())) {
    cursor_.store(at + 1, std::memory_order_relaxed);  // the step's last
  }
}

}  // namespace strata::offload

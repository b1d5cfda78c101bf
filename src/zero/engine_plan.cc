// Engine::PlanMemory: the engine's allocations as formulas (docs/planning.md, "the inventory").
// Each term names the code it mirrors; a change to an allocation in engine.cc or engine_step.cc
// must change its term here (EstimateTest compares the two on real runs).
#include <fmt/format.h>

#include <algorithm>

#include "device/pinned_pool.h"
#include "zero/engine.h"
#include "offload/prefetch_scheduler.h"
#include "zero/engine_setup.h"

namespace strata::zero {

using namespace engine_internal;  // NOLINT: the engine's own private header

uint64_t EngineMemoryPlan::device_total() const {
  uint64_t total = 0;
  for (const MemoryPlanItem& i : device) total += i.bytes;
  for (const MemoryPlanItem& i : device_step) total += i.bytes;
  return total;
}

Result<EngineMemoryPlan> Engine::PlanMemory(const std::vector<UnitSpec>& units,
                                            const std::vector<std::vector<int>>& shared,
                                            const Config& config, int world_size,
                                            int optimizer_pipeline_depth,
                                            device::DeviceType device_type,
                                            const std::vector<std::vector<int>>& recompute) {
  STRATA_RETURN_IF_ERROR(CheckResolved(config));
  STRATA_ASSIGN_OR_RETURN(std::vector<UnitLayout> layouts, LayoutModel(units, world_size));
  const auto [stage, csz, param_home, optim_home] = PlacementOf(config);
  // engine_setup.cc ResolveSetup: which units are frozen, and whose states are offloaded
  // (offload_optimizer.ratio).
  STRATA_ASSIGN_OR_RETURN(const std::vector<char> frozen, FrozenUnitsOf(config, units));
  const std::vector<char> cpu_unit = CpuOptimizerUnits(config, layouts, frozen);
  const bool share = SharesHostMemory(config, device_type);
  // Device::Alloc charges each block rounded up to 256 bytes.
  auto charged = [](uint64_t bytes) { return (bytes + 255) / 256 * 256; };
  auto cls = [](uint64_t bytes) {
    return static_cast<uint64_t>(device::PinnedPool::SizeClass(bytes));
  };

  uint64_t shard_sum = 0, full_params = 0, full_grads = 0,
           adam = 0, grad_shards = 0, unit_init = 0, unit_load = 0, unit_load_weights = 0,
           offloaded_shards = 0, trainable = 0;
  uint64_t shard_classes = 0, largest_class = 0;
  for (const UnitLayout& l : layouts) {
    const auto padded = static_cast<uint64_t>(l.padded_numel());
    const auto shard = static_cast<uint64_t>(l.shard_numel);
    shard_sum += shard;
    // engine.cc InitUnitFromModel: the whole unit at stage 0, else the rank's shard.
    unit_init = std::max(unit_init, (stage == 0 ? padded : shard) * (4 + csz));
    // engine_states.cc LoadUnitStates, from a checkpoint with its moments (a model directory
    // holds the master shard and its cast only: load_host_bytes_without_moments).
    unit_load = std::max(unit_load, shard * (frozen[static_cast<size_t>(l.index)] ? csz : 12 + csz));
    unit_load_weights =
        std::max(unit_load_weights, shard * (frozen[static_cast<size_t>(l.index)] ? csz : 4 + csz));
    shard_classes += cls(shard * csz);
    largest_class = std::max(largest_class, cls(shard * csz));
    // engine.cc, "Memory per stage".
    if (stage <= 2) full_params += charged(padded * csz);
    if (frozen[static_cast<size_t>(l.index)]) continue;  // no gradient accumulator, no states
    trainable += shard;
    if (stage <= 1) full_grads += charged(padded * 4);
    const bool cpu = cpu_unit[static_cast<size_t>(l.index)] != 0;
    if (!cpu) adam += 3 * charged((stage == 0 ? padded : shard) * 4);
    if (!cpu && stage >= 2) grad_shards += charged(shard * 4);
    if (cpu) offloaded_shards += shard;
  }

  EngineMemoryPlan plan;
  auto add = [](std::vector<MemoryPlanItem>& to, std::string what, uint64_t bytes) {
    if (bytes > 0) to.push_back({std::move(what), bytes});
  };
  add(plan.device, fmt::format("gathered parameters ({} B per element)", csz), full_params);
  add(plan.device, "fp32 gradient accumulators", full_grads);
  add(plan.device, "AdamW master, exp_avg, exp_avg_sq (fp32)", adam);
  add(plan.device, "fp32 gradient shards", grad_shards);
  if (stage == 3 && param_home == Tier::kDevice) {
    add(plan.device, "stage-3 parameter shards (homed on the device)", shard_sum * csz);
  }
  // The reduction bucket (ReduceBucketCapacity, as the engine sizes it with the overlap option
  // on: strata train's default).
  plan.optimizer_overlapped =
      OverlapsOptimizer(config) &&
      std::any_of(cpu_unit.begin(), cpu_unit.end(), [](char c) { return c != 0; });
  const int64_t bucket_cap =
      ReduceBucketCapacity(config, layouts, frozen, world_size, plan.optimizer_overlapped);
  if (bucket_cap > 0) {
    add(plan.device, "gradient reduction bucket",
        charged(static_cast<uint64_t>(bucket_cap) * static_cast<uint64_t>(world_size) * 4));
    plan.last_bucket_elems = static_cast<uint64_t>(LastBucketElems(layouts, frozen, bucket_cap));
  }
  add(plan.device, "step scalars", charged(16));

  // The step's transients (engine_step.cc AllocLive): gathered units (stage 3) and per-unit fp32
  // gradients, up to the live-buffer limit (engine.cc, "Transient buffers").
  for (size_t u = 0; u < recompute.size() && u < layouts.size(); ++u) {
    for (const int r : recompute[u]) {
      if (r < 0 || static_cast<size_t>(r) >= u) {
        return InvalidArgumentError(fmt::format("unit {} recomputes unit {}, which is not before it", u, r));
      }
    }
  }
  uint64_t shared_live = 0, tied_extra = 0;
  for (size_t u = 0; u < shared.size() && u < layouts.size(); ++u) {
    for (const int s : shared[u]) {
      if (s < 0 || static_cast<size_t>(s) >= layouts.size()) {
        return InvalidArgumentError(fmt::format("unit {} shares unit {}, which does not exist", u, s));
      }
      const auto p = static_cast<uint64_t>(layouts[static_cast<size_t>(s)].padded_numel());
      const uint64_t grad = frozen[static_cast<size_t>(s)] ? 0 : 4;  // frozen: no gradient
      shared_live += p * 12;
      // A unit that reads the unit just before it (a LoRA block its adapters) holds nothing more:
      // that unit's gathered copy is still live from its own turn, and the gradient buffer the
      // block adds into is the one its own backward then uses (counted with it below). A unit
      // further back (a tied embedding) is gathered again and its gradient held until its turn.
      if (static_cast<size_t>(s) + 1 == u) continue;
      tied_extra += p * ((stage == 3 ? csz : 0) + grad);
    }
  }
  // Per element: the gathered unit in forward and in backward (stage 3), and its fp32 gradient
  // (none for a frozen unit). The engine's live limit takes the largest unit's gathered copy and
  // gradient (engine.cc, "Transient buffers").
  uint64_t wanted = tied_extra, largest_live = 0;
  for (const UnitLayout& l : layouts) {
    const uint64_t grad = frozen[static_cast<size_t>(l.index)] ? 0 : 4;
    wanted += static_cast<uint64_t>(l.padded_numel()) * ((stage == 3 ? 2 * csz : 0) + grad);
    largest_live = std::max<uint64_t>(
        largest_live, static_cast<uint64_t>(l.padded_numel()) * ((stage == 3 ? csz : 0) + grad));
  }
  for (size_t u = 0; u < recompute.size() && stage == 3; ++u) {
    for (const int r : recompute[u]) {
      wanted += static_cast<uint64_t>(layouts[static_cast<size_t>(r)].padded_numel()) * csz;
    }
  }
  const uint64_t configured =
      stage == 3 ? static_cast<uint64_t>(config.zero.stage3_max_live_parameters) * csz : 0;
  const uint64_t max_live =
      std::max<uint64_t>(configured, 2 * largest_live) + shared_live;
  // The engine allocates these buffers in the order the step issues them and frees them in about
  // that order as compute finishes them, so what is live at once is a run of consecutive
  // allocations that fits the limit: a model of one large unit (a single 1T-shaped layer) never
  // fills the second half of a limit of two such units. The largest such run, over two
  // micro-batches where a step has several (a run may cross from one's backward into the next's
  // forward; the optimizer step in between drains everything).
  std::vector<uint64_t> order;
  {
    const Result<BatchSizes> batch = ResolveBatchSizes(config.batch, world_size);
    const int micro_batches = batch.ok() && batch->gradient_accumulation_steps > 1 ? 2 : 1;
    auto gathered = [&](size_t u) -> uint64_t {
      if (stage != 3 || layouts[u].numel < config.zero.stage3_param_persistence_threshold) return 0;
      return static_cast<uint64_t>(layouts[u].padded_numel()) * csz;
    };
    const size_t n = layouts.size();
    const std::vector<int> none;
    auto shares = [&](size_t u) -> const std::vector<int>& {
      return u < shared.size() ? shared[u] : none;  // callers may pass no sharing at all
    };
    for (int mb = 0; mb < micro_batches; ++mb) {
      for (size_t u = 0; u < n; ++u) {
        order.push_back(gathered(u));
        for (const int s : shares(u)) order.push_back(gathered(static_cast<size_t>(s)));
      }
      std::vector<char> has_grad(n, 0);
      auto grad = [&](size_t v) -> uint64_t {  // the first use allocates it (engine_step.cc)
        if (frozen[v] || std::exchange(has_grad[v], 1)) return 0;
        return static_cast<uint64_t>(layouts[v].padded_numel()) * 4;
      };
      // Each gathered copy and each gradient is an AllocLive of its own: a copy may be live
      // while the gradient after it still waits.
      for (size_t u = n; u-- > 0;) {
        // Units gathered again to recompute their internals, each let go after its forward.
        if (u < recompute.size()) {
          for (const int r : recompute[u]) order.push_back(gathered(static_cast<size_t>(r)));
        }
        order.push_back(gathered(u));
        order.push_back(grad(u));
        for (const int s : shares(u)) {
          order.push_back(gathered(static_cast<size_t>(s)));
          order.push_back(grad(static_cast<size_t>(s)));
        }
      }
    }
  }
  uint64_t run_max = 0, run = 0;
  for (size_t lo = 0, hi = 0; hi < order.size(); ++hi) {
    run += order[hi];
    while (run > max_live) run -= order[lo++];
    run_max = std::max(run_max, run);
  }
  add(plan.device_step,
      stage == 3 ? "gathered units and fp32 gradients of a micro-batch (live-buffer limit)"
                 : "per-unit fp32 gradients in flight (live-buffer limit)",
      std::min({max_live, wanted, run_max}));
  if (stage == 3) {
    uint64_t persistent = 0;
    for (const UnitLayout& l : layouts) {
      if (l.numel < config.zero.stage3_param_persistence_threshold) {
        persistent += static_cast<uint64_t>(l.padded_numel()) * csz;
      }
    }
    add(plan.device_step, "persistent small units (stage3_param_persistence_threshold)",
        persistent);
    if (param_home != Tier::kDevice && !share) {
      add(plan.device_step, "device copies of offloaded parameter shards (prefetch budget)",
          OffloadedParamDeviceBudget(
              shard_classes, largest_class,
              offload::PrefetchOptions::FromConfig(config, csz).device_lookahead_bytes));
    }
  }

  STRATA_ASSIGN_OR_RETURN(plan.pinned_pool,
                          PlanPinnedPoolBytes(units, config, world_size, optimizer_pipeline_depth,
                                              device_type));
  // NVMe swap files (nvme_layout.cc): every slot is a multiple of 4 KiB already.
  if (stage == 3 && param_home == Tier::kNvme) plan.nvme_param_file = shard_sum * csz;
  if (optim_home == Tier::kNvme) plan.nvme_optim_file = offloaded_shards * 12;
  plan.init_host_bytes = unit_init;
  plan.load_host_bytes = unit_load;
  plan.load_weights_host_bytes = unit_load_weights;
  plan.offloaded_optim_elems = optim_home == Tier::kDevice ? 0 : offloaded_shards;
  plan.shard_elems = shard_sum;
  plan.trainable_elems = trainable;
  return plan;
}

Result<uint64_t> Engine::PlanPinnedPoolBytes(const std::vector<UnitSpec>& units,
                                              const Config& config, int world_size,
                                              int optimizer_pipeline_depth,
                                              device::DeviceType device_type,
                                              bool overlap_optimizer) {
  STRATA_RETURN_IF_ERROR(CheckResolved(config));
  STRATA_ASSIGN_OR_RETURN(std::vector<UnitLayout> layouts, LayoutModel(units, world_size));
  const auto [stage, csz, param_home, optim_home] = PlacementOf(config);
  STRATA_ASSIGN_OR_RETURN(const std::vector<char> frozen, FrozenUnitsOf(config, units));
  const std::vector<char> cpu_unit = CpuOptimizerUnits(config, layouts, frozen);
  const bool cpu_optimizer = std::count(cpu_unit.begin(), cpu_unit.end(), 1) > 0;
  auto cls = [](uint64_t bytes) { return static_cast<uint64_t>(device::PinnedPool::SizeClass(bytes)); };
  uint64_t total = 0, largest_param = 0, largest_group = 0, max_shard = 0, params_all = 0,
           max_offloaded = 0;
  int64_t sg = config.zero.sub_group_size;
  for (const auto& l : layouts) max_shard = std::max<uint64_t>(max_shard, l.shard_numel);
  if (sg <= 0) sg = static_cast<int64_t>(max_shard);
  sg = (sg + kShardAlignElems - 1) / kShardAlignElems * kShardAlignElems;
  uint64_t groups_all = 0, grads_all = 0;
  for (const auto& l : layouts) {
    const uint64_t shard = static_cast<uint64_t>(l.shard_numel);
    largest_param = std::max(largest_param, cls(shard * csz));
    params_all += cls(shard * csz);
    if (cpu_unit[static_cast<size_t>(l.index)]) {
      max_offloaded = std::max(max_offloaded, shard);
      total += cls(shard * 4);                                     // gradient shard
      grads_all += cls(shard * 4);
      if (stage <= 2 || param_home == Tier::kDevice) total += cls(shard * csz);  // staging
      for (int64_t off = 0; off < l.shard_numel; off += sg) {
        const uint64_t g = cls(12 * static_cast<uint64_t>(std::min<int64_t>(sg, l.shard_numel - off)));
        groups_all += g;
        largest_group = std::max(largest_group, g);
      }
    }
  }
  if (cpu_optimizer) {
    // Streamed gradient shards: at most kStreamedGradShards of the largest at once.
    if (StreamsGradShards(config, world_size, overlap_optimizer)) {
      total -= grads_all;
      total += std::min(grads_all, kStreamedGradShards * cls(max_offloaded * 4));
    }
    total += cls(max_offloaded * 4);  // landing buffer
    total += optim_home == Tier::kHost
                 ? groups_all
                 : static_cast<uint64_t>(optimizer_pipeline_depth) * largest_group;
  }
  if (stage == 3) {
    if (param_home == Tier::kHost) total += params_all + 2 * largest_param;
    else if (param_home == Tier::kNvme) {
      const uint64_t device_budget = OffloadedParamDeviceBudget(
          params_all, largest_param,
          offload::PrefetchOptions::FromConfig(config, csz).device_lookahead_bytes);
      // strata.memory.host_budget, where set, is the host tier's budget (Init raises it to two
      // of the largest shard).
      total += config.strata.memory.host_budget
                   ? std::max(*config.strata.memory.host_budget, 2 * largest_param)
                   : NvmeParamHostBudget(params_all, largest_param, device_budget,
                                         SharesHostMemory(config, device_type));
    }
    else total += 2 * largest_param;
  }
  // Fragmentation margin, and never less than 16 MiB.
  return std::max<uint64_t>(total + total / 4 + (4u << 20), 16u << 20);
}

}  // namespace strata::zero

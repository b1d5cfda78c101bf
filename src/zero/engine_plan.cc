// Engine::PlanMemory and PlanPinnedPoolBytes: the engine's allocations as formulas
// (docs/planning.md, "the inventory"). Each term names the code it mirrors; a change to an
// allocation in a component (parameter_store.cc, gradient_reducer.cc, adam_states.cc,
// step_scalars.cc, engine.cc MaxLiveBytes) must change its term here (EstimateTest compares the
// two on real runs).
#include <fmt/format.h>

#include <algorithm>

#include "device/pinned_pool.h"
#include "offload/prefetch_scheduler.h"
#include "zero/engine.h"
#include "zero/engine_setup.h"
#include "zero/quantized_reduce.h"

namespace strata::zero {

using namespace engine_internal;  // NOLINT: the engine's own private header

uint64_t EngineMemoryPlan::device_total() const {
  uint64_t total = 0;
  for (const MemoryPlanItem& i : device) total += i.bytes;
  for (const MemoryPlanItem& i : device_step) total += i.bytes;
  return total;
}

namespace {

// Device::Alloc charges each block rounded up to 256 bytes.
uint64_t Charged(uint64_t bytes) { return (bytes + 255) / 256 * 256; }
// The pinned pool's block for `bytes`.
uint64_t PoolClass(uint64_t bytes) {
  return static_cast<uint64_t>(device::PinnedPool::SizeClass(bytes));
}

// What both plans read: the layouts, the placement, and which units are frozen or offloaded.
struct PlanInputs {
  const Config& config;
  int world_size = 1;
  std::vector<UnitLayout> layouts;
  Placement placement;
  std::vector<char> frozen;
  std::vector<char> cpu_unit;  // CpuOptimizerUnits

  int stage() const { return placement.stage; }
  uint64_t element() const { return placement.compute_bytes; }
  bool is_frozen(const UnitLayout& l) const { return frozen[static_cast<size_t>(l.index)] != 0; }
  bool on_cpu(const UnitLayout& l) const { return cpu_unit[static_cast<size_t>(l.index)] != 0; }
};

Result<PlanInputs> ResolvePlanInputs(const std::vector<UnitSpec>& units, const Config& config,
                                     int world_size) {
  STRATA_RETURN_IF_ERROR(CheckResolved(config));
  PlanInputs in{config, world_size, {}, {}, {}, {}};
  STRATA_ASSIGN_OR_RETURN(in.layouts, LayoutModel(units, world_size));
  in.placement = PlacementOf(config);
  // engine_setup.cc ResolveSetup: which units are frozen, and whose states are offloaded
  // (offload_optimizer.ratio).
  STRATA_ASSIGN_OR_RETURN(in.frozen, FrozenUnitsOf(config, units));
  in.cpu_unit = CpuOptimizerUnits(config, in.layouts, in.frozen);
  return in;
}

// ---- the pinned pool ----------------------------------------------------------------------------

// The CPU optimizer's part of the pool: gradient shards (gradient_reducer.cc AllocateShard, or
// streamed: LandHostShard), staged parameters (adam_states.cc AllocateStaging), the landing
// buffer (AllocateShared) and the optimizer states' sub-groups in host memory.
uint64_t CpuOptimizerPoolBytes(const PlanInputs& in, int optimizer_pipeline_depth,
                               bool overlap_optimizer) {
  uint64_t max_shard = 0;
  for (const auto& l : in.layouts) max_shard = std::max<uint64_t>(max_shard, l.shard_numel);
  int64_t sub_group = in.config.zero.sub_group_size;
  if (sub_group <= 0) sub_group = static_cast<int64_t>(max_shard);
  sub_group = (sub_group + kShardAlignElems - 1) / kShardAlignElems * kShardAlignElems;
  uint64_t total = 0, largest_group = 0, max_offloaded = 0, groups_all = 0, grads_all = 0;
  for (const auto& l : in.layouts) {
    if (!in.on_cpu(l)) continue;
    const auto shard = static_cast<uint64_t>(l.shard_numel);
    max_offloaded = std::max(max_offloaded, shard);
    total += PoolClass(shard * 4);  // gradient shard
    grads_all += PoolClass(shard * 4);
    if (in.stage() <= 2 || in.placement.param_home == Tier::kDevice) {
      total += PoolClass(shard * in.element());  // staging
    }
    for (int64_t off = 0; off < l.shard_numel; off += sub_group) {
      const uint64_t g = PoolClass(
          12 * static_cast<uint64_t>(std::min<int64_t>(sub_group, l.shard_numel - off)));
      groups_all += g;
      largest_group = std::max(largest_group, g);
    }
  }
  if (std::count(in.cpu_unit.begin(), in.cpu_unit.end(), 1) == 0) return 0;
  // Streamed gradient shards: at most kStreamedGradShards of the largest at once.
  if (StreamsGradShards(in.config, in.world_size, overlap_optimizer)) {
    total -= grads_all;
    total += std::min(grads_all, kStreamedGradShards * PoolClass(max_offloaded * 4));
  }
  total += PoolClass(max_offloaded * 4);  // landing buffer
  total += in.placement.optim_home == Tier::kHost
               ? groups_all
               : static_cast<uint64_t>(optimizer_pipeline_depth) * largest_group;
  return total;
}

// Stage 3: the parameter tier manager's host budget (parameter_store.cc TierOptions).
uint64_t ParamPoolBytes(const PlanInputs& in, device::DeviceType device_type) {
  if (in.stage() != 3) return 0;
  uint64_t largest_param = 0, params_all = 0;
  for (const auto& l : in.layouts) {
    const uint64_t bytes = PoolClass(static_cast<uint64_t>(l.shard_numel) * in.element());
    largest_param = std::max(largest_param, bytes);
    params_all += bytes;
  }
  switch (in.placement.param_home) {
    case Tier::kHost:
      return params_all + 2 * largest_param;
    case Tier::kNvme: {
      const uint64_t device_budget = OffloadedParamDeviceBudget(
          params_all, largest_param,
          offload::PrefetchOptions::FromConfig(in.config, in.element()).device_lookahead_bytes);
      // strata.memory.host_budget, where set, is the host tier's budget (Init raises it to two
      // of the largest shard).
      const std::optional<uint64_t>& host_budget = in.config.strata.memory.host_budget;
      return host_budget ? std::max(*host_budget, 2 * largest_param)
                         : NvmeParamHostBudget(params_all, largest_param, device_budget,
                                               SharesHostMemory(in.config, device_type));
    }
    case Tier::kDevice:
      break;
  }
  return 2 * largest_param;
}

}  // namespace

Result<uint64_t> Engine::PlanPinnedPoolBytes(const std::vector<UnitSpec>& units,
                                              const Config& config, int world_size,
                                              int optimizer_pipeline_depth,
                                              device::DeviceType device_type,
                                              bool overlap_optimizer) {
  STRATA_ASSIGN_OR_RETURN(const PlanInputs in, ResolvePlanInputs(units, config, world_size));
  const uint64_t total = CpuOptimizerPoolBytes(in, optimizer_pipeline_depth, overlap_optimizer) +
                         ParamPoolBytes(in, device_type);
  // Fragmentation margin, and never less than 16 MiB.
  return std::max<uint64_t>(total + total / 4 + (4u << 20), 16u << 20);
}

// ---- the memory plan ----------------------------------------------------------------------------

namespace {

void Add(std::vector<MemoryPlanItem>& to, std::string what, uint64_t bytes) {
  if (bytes > 0) to.push_back({std::move(what), bytes});
}

// Sums over the units behind the plan's long-lived device items and its host peaks.
struct UnitSums {
  uint64_t shard_sum = 0;          // the rank's shard elements
  uint64_t trainable = 0;          // of those, in trainable units
  uint64_t offloaded_shards = 0;   // of those, on the CPU optimizer
  uint64_t full_params = 0, full_grads = 0, adam = 0, grad_shards = 0;  // device bytes
  uint64_t unit_init = 0, unit_load = 0, unit_load_weights = 0;         // host peaks
  uint64_t shard_classes = 0, largest_class = 0;  // parameter shards in pool blocks
};

UnitSums SumUnits(const PlanInputs& in) {
  const uint64_t element = in.element();
  UnitSums s;
  for (const UnitLayout& l : in.layouts) {
    const auto padded = static_cast<uint64_t>(l.padded_numel());
    const auto shard = static_cast<uint64_t>(l.shard_numel);
    s.shard_sum += shard;
    // engine.cc InitUnitFromModel: the whole unit at stage 0, else the rank's shard.
    s.unit_init = std::max(s.unit_init, (in.stage() == 0 ? padded : shard) * (4 + element));
    // engine_states.cc LoadUnitStates, from a checkpoint with its moments (a model directory
    // holds the master shard and its cast only: load_weights_host_bytes).
    s.unit_load = std::max(s.unit_load, shard * (in.is_frozen(l) ? element : 12 + element));
    s.unit_load_weights =
        std::max(s.unit_load_weights, shard * (in.is_frozen(l) ? element : 4 + element));
    s.shard_classes += PoolClass(shard * element);
    s.largest_class = std::max(s.largest_class, PoolClass(shard * element));
    // engine.cc AllocateUnit: parameter_store.cc AllocateGathered, gradient_reducer.cc
    // AllocateAccumulator / AllocateShard, adam_states.cc AllocateDevice.
    if (in.stage() <= 2) s.full_params += Charged(padded * element);
    if (in.is_frozen(l)) continue;  // no gradient accumulator, no states
    s.trainable += shard;
    if (in.stage() <= 1) s.full_grads += Charged(padded * 4);
    const bool cpu = in.on_cpu(l);
    if (!cpu) s.adam += 3 * Charged((in.stage() == 0 ? padded : shard) * 4);
    if (!cpu && in.stage() >= 2) s.grad_shards += Charged(shard * 4);
    if (cpu) s.offloaded_shards += shard;
  }
  return s;
}

// Device memory held from Create to the end of the run.
void AddLongLivedDeviceItems(const PlanInputs& in, const UnitSums& sums, EngineMemoryPlan& plan) {
  Add(plan.device, fmt::format("gathered parameters ({} B per element)", in.element()),
      sums.full_params);
  Add(plan.device, "fp32 gradient accumulators", sums.full_grads);
  Add(plan.device, "AdamW master, exp_avg, exp_avg_sq (fp32)", sums.adam);
  Add(plan.device, "fp32 gradient shards", sums.grad_shards);
  if (in.stage() == 3 && in.placement.param_home == Tier::kDevice) {
    Add(plan.device, "stage-3 parameter shards (homed on the device)", sums.shard_sum * in.element());
  }
  // The reduction bucket (ReduceBucketCapacity, as the engine sizes it with the overlap option
  // on: strata train's default).
  plan.optimizer_overlapped =
      OverlapsOptimizer(in.config) &&
      std::any_of(in.cpu_unit.begin(), in.cpu_unit.end(), [](char c) { return c != 0; });
  const int64_t bucket_capacity = ReduceBucketCapacity(in.config, in.layouts, in.frozen,
                                                       in.world_size, plan.optimizer_overlapped);
  if (bucket_capacity > 0) {
    Add(plan.device, "gradient reduction bucket",
        Charged(static_cast<uint64_t>(bucket_capacity) * static_cast<uint64_t>(in.world_size) * 4));
    plan.last_bucket_elems =
        static_cast<uint64_t>(LastBucketElems(in.layouts, in.frozen, bucket_capacity));
  }
  // qgZ (gradient_reducer.cc AllocateShared): the staging of the largest reduction. Its size
  // depends on the ranks per node, which the plan does not know: planned at one rank per node
  // (zero_hpz_partition_size's nodes when set), the largest.
  const bool qgz = in.config.zero.zero_quantized_gradients && in.stage() >= 2 && in.world_size > 1;
  if (qgz) {
    int64_t max_count = bucket_capacity / kQuantBlockElems * kQuantBlockElems;
    for (const UnitLayout& l : in.layouts) {
      if (!in.is_frozen(l)) max_count = std::max(max_count, l.shard_numel);
    }
    const int hpz = in.config.zero.zero_hpz_partition_size;
    const int per_node = hpz > 1 && in.world_size % hpz == 0 ? hpz : 1;
    const comm::Topology nodes{.rank = 0, .world = in.world_size, .ranks_per_node = per_node};
    Add(plan.device, "qgZ staging (zero_quantized_gradients)",
        Charged(QuantizedReduceScatter::StagingBytes(nodes, static_cast<size_t>(max_count))));
  }
  Add(plan.device, "step scalars", Charged(48));  // StepScalars::Allocate
}

// What the caller says about tied and recomputed units must name units that exist, before.
Status CheckSharing(const PlanInputs& in, const std::vector<std::vector<int>>& shared,
                    const std::vector<std::vector<int>>& recompute) {
  for (size_t u = 0; u < recompute.size() && u < in.layouts.size(); ++u) {
    for (const int r : recompute[u]) {
      if (r < 0 || static_cast<size_t>(r) >= u) {
        return InvalidArgumentError(
            fmt::format("unit {} recomputes unit {}, which is not before it", u, r));
      }
    }
  }
  for (size_t u = 0; u < shared.size() && u < in.layouts.size(); ++u) {
    for (const int s : shared[u]) {
      if (s < 0 || static_cast<size_t>(s) >= in.layouts.size()) {
        return InvalidArgumentError(
            fmt::format("unit {} shares unit {}, which does not exist", u, s));
      }
    }
  }
  return Status::Ok();
}

// The step's transients (live_buffers.h): the live-buffer limit (engine.cc MaxLiveBytes) and
// what a micro-batch would hold without one.
struct LiveBytes {
  uint64_t limit = 0;
  uint64_t wanted = 0;
};

LiveBytes PlanLiveBytes(const PlanInputs& in, const std::vector<std::vector<int>>& shared,
                        const std::vector<std::vector<int>>& recompute) {
  const uint64_t gathered = in.stage() == 3 ? in.element() : 0;
  uint64_t shared_live = 0, tied_extra = 0;
  for (size_t u = 0; u < shared.size() && u < in.layouts.size(); ++u) {
    for (const int s : shared[u]) {
      const UnitLayout& ls = in.layouts[static_cast<size_t>(s)];
      const auto p = static_cast<uint64_t>(ls.padded_numel());
      const uint64_t grad = in.is_frozen(ls) ? 0 : 4;  // frozen: no gradient
      shared_live += p * 12;
      // A unit that reads the unit just before it (a LoRA block its adapters) holds nothing more:
      // that unit's gathered copy is still live from its own turn, and the gradient buffer the
      // block adds into is the one its own backward then uses (counted with it below). A unit
      // further back (a tied embedding) is gathered again and its gradient held until its turn.
      if (static_cast<size_t>(s) + 1 == u) continue;
      tied_extra += p * (gathered + grad);
    }
  }
  // Per element: the gathered unit in forward and in backward (stage 3), and its fp32 gradient
  // (none for a frozen unit). The engine's live limit takes the largest unit's gathered copy and
  // gradient.
  LiveBytes live;
  live.wanted = tied_extra;
  uint64_t largest_live = 0;
  // With zero_quantized_weights a gather also holds every rank's quantized shard
  // (ParameterStore::AllGatherShard), freed once dequantized.
  const bool quantized = in.stage() == 3 && in.config.zero.zero_quantized_weights;
  for (const UnitLayout& l : in.layouts) {
    const uint64_t grad = in.is_frozen(l) ? 0 : 4;
    const uint64_t staging =
        quantized ? QuantizedShardBytes(l.shard_numel) * static_cast<uint64_t>(in.world_size) : 0;
    live.wanted += static_cast<uint64_t>(l.padded_numel()) * (2 * gathered + grad) + staging;
    largest_live = std::max<uint64_t>(
        largest_live, static_cast<uint64_t>(l.padded_numel()) * (gathered + grad) + staging);
  }
  for (size_t u = 0; u < recompute.size() && in.stage() == 3; ++u) {
    for (const int r : recompute[u]) {
      live.wanted += static_cast<uint64_t>(in.layouts[static_cast<size_t>(r)].padded_numel()) *
                     in.element();
    }
  }
  const uint64_t configured =
      in.stage() == 3
          ? static_cast<uint64_t>(in.config.zero.stage3_max_live_parameters) * in.element()
          : 0;
  live.limit = std::max<uint64_t>(configured, 2 * largest_live) + shared_live;
  return live;
}

// The live buffers a step allocates, in the order it issues them (engine_step.cc ForwardUnit,
// RecomputeFor, BackwardUnit), over two micro-batches where a step has several (a run may cross
// from one's backward into the next's forward; the optimizer step in between drains everything).
std::vector<uint64_t> LiveAllocationOrder(const PlanInputs& in,
                                          const std::vector<std::vector<int>>& shared,
                                          const std::vector<std::vector<int>>& recompute) {
  const Result<BatchSizes> batch = ResolveBatchSizes(in.config.batch, in.world_size);
  const int micro_batches = batch.ok() && batch->gradient_accumulation_steps > 1 ? 2 : 1;
  auto gathered = [&](size_t u) -> uint64_t {
    const UnitLayout& l = in.layouts[u];
    if (in.stage() != 3 || l.numel < in.config.zero.stage3_param_persistence_threshold) return 0;
    return static_cast<uint64_t>(l.padded_numel()) * in.element();
  };
  const size_t n = in.layouts.size();
  const std::vector<int> none;
  auto shares = [&](size_t u) -> const std::vector<int>& {
    return u < shared.size() ? shared[u] : none;  // callers may pass no sharing at all
  };
  std::vector<uint64_t> order;
  for (int mb = 0; mb < micro_batches; ++mb) {
    for (size_t u = 0; u < n; ++u) {
      order.push_back(gathered(u));
      for (const int s : shares(u)) order.push_back(gathered(static_cast<size_t>(s)));
    }
    std::vector<char> has_grad(n, 0);
    auto grad = [&](size_t v) -> uint64_t {  // the first use allocates it (GradientBuffer)
      if (in.frozen[v] || std::exchange(has_grad[v], 1)) return 0;
      return static_cast<uint64_t>(in.layouts[v].padded_numel()) * 4;
    };
    // Each gathered copy and each gradient is an allocation of its own: a copy may be live
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
  return order;
}

// The engine frees live buffers in about the order it allocates them, as compute finishes them,
// so what is live at once is a run of consecutive allocations that fits the limit: a model of
// one large unit (a single 1T-shaped layer) never fills the second half of a limit of two such
// units. The largest such run.
uint64_t LargestLiveRun(const std::vector<uint64_t>& order, uint64_t limit) {
  uint64_t run_max = 0, run = 0;
  for (size_t lo = 0, hi = 0; hi < order.size(); ++hi) {
    run += order[hi];
    while (run > limit) run -= order[lo++];
    run_max = std::max(run_max, run);
  }
  return run_max;
}

// Device memory a step adds at its peak.
void AddStepDeviceItems(const PlanInputs& in, const UnitSums& sums,
                        const std::vector<std::vector<int>>& shared,
                        const std::vector<std::vector<int>>& recompute,
                        device::DeviceType device_type, EngineMemoryPlan& plan) {
  const LiveBytes live = PlanLiveBytes(in, shared, recompute);
  const uint64_t run = LargestLiveRun(LiveAllocationOrder(in, shared, recompute), live.limit);
  Add(plan.device_step,
      in.stage() == 3 ? "gathered units and fp32 gradients of a micro-batch (live-buffer limit)"
                      : "per-unit fp32 gradients in flight (live-buffer limit)",
      std::min({live.limit, live.wanted, run}));
  if (in.stage() != 3) return;
  uint64_t persistent = 0;
  for (const UnitLayout& l : in.layouts) {
    if (l.numel < in.config.zero.stage3_param_persistence_threshold) {
      persistent += static_cast<uint64_t>(l.padded_numel()) * in.element();
    }
  }
  Add(plan.device_step, "persistent small units (stage3_param_persistence_threshold)", persistent);
  // hpZ (parameter_store.cc KeepSecondary): every other unit's node-local slice, 1/L of it, held
  // from its forward to its backward, so all of them at the end of forward. The engine refuses a
  // partition size other than the ranks per node; one node keeps none.
  const int hpz = in.config.zero.zero_hpz_partition_size;
  if (hpz > 1 && in.world_size > hpz && in.world_size % hpz == 0) {
    uint64_t slices = 0;
    for (const UnitLayout& l : in.layouts) {
      if (l.numel < in.config.zero.stage3_param_persistence_threshold) continue;
      slices += Charged(static_cast<uint64_t>(l.padded_numel()) / static_cast<uint64_t>(hpz) *
                        in.element());
    }
    Add(plan.device_step,
        fmt::format("hpZ node-local parameter copies (zero_hpz_partition_size {})", hpz), slices);
  }
  if (in.placement.param_home != Tier::kDevice && !SharesHostMemory(in.config, device_type)) {
    Add(plan.device_step, "device copies of offloaded parameter shards (prefetch budget)",
        OffloadedParamDeviceBudget(
            sums.shard_classes, sums.largest_class,
            offload::PrefetchOptions::FromConfig(in.config, in.element()).device_lookahead_bytes));
  }
}

}  // namespace

Result<EngineMemoryPlan> Engine::PlanMemory(const std::vector<UnitSpec>& units,
                                            const std::vector<std::vector<int>>& shared,
                                            const Config& config, int world_size,
                                            int optimizer_pipeline_depth,
                                            device::DeviceType device_type,
                                            const std::vector<std::vector<int>>& recompute) {
  STRATA_ASSIGN_OR_RETURN(const PlanInputs in, ResolvePlanInputs(units, config, world_size));
  const UnitSums sums = SumUnits(in);
  EngineMemoryPlan plan;
  AddLongLivedDeviceItems(in, sums, plan);
  STRATA_RETURN_IF_ERROR(CheckSharing(in, shared, recompute));
  AddStepDeviceItems(in, sums, shared, recompute, device_type, plan);
  STRATA_ASSIGN_OR_RETURN(plan.pinned_pool,
                          PlanPinnedPoolBytes(units, config, world_size, optimizer_pipeline_depth,
                                              device_type));
  // NVMe swap files (nvme_layout.cc): every slot is a multiple of 4 KiB already.
  const Placement& placement = in.placement;
  if (placement.stage == 3 && placement.param_home == Tier::kNvme) {
    plan.nvme_param_file = sums.shard_sum * in.element();
  }
  if (placement.optim_home == Tier::kNvme) plan.nvme_optim_file = sums.offloaded_shards * 12;
  plan.init_host_bytes = sums.unit_init;
  plan.load_host_bytes = sums.unit_load;
  plan.load_weights_host_bytes = sums.unit_load_weights;
  plan.offloaded_optim_elems = placement.optim_home == Tier::kDevice ? 0 : sums.offloaded_shards;
  plan.shard_elems = sums.shard_sum;
  plan.trainable_elems = sums.trainable;
  return plan;
}

}  // namespace strata::zero

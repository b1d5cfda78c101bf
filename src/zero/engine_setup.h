// EngineSetup: what the ZeRO engine decides once, at Create, from its options, its config and the
// model — the ranks, the stage, the compute dtype, where each state class lives, the units'
// layouts and which of them are frozen or updated by the CPU optimizer — and the placement rules
// that Engine::PlanMemory and PlanPinnedPoolBytes share with Create. Private to src/zero.
//
// Threading: ResolveSetup fills an EngineSetup on the driving thread before any other engine
// thread exists; afterwards it is read-only, so every thread (the driving thread, the CPU
// optimizer's, stream callbacks) reads it without a lock.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/topology.h"
#include "offload/tier_manager.h"
#include "optim/adam.h"
#include "strata/collective.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/status.h"
#include "zero/engine.h"
#include "zero/partition.h"

namespace strata::zero::engine_internal {

using device::DType;
using offload::Access;
using offload::Lease;
using offload::Tier;

inline double Seconds(int64_t ns) { return static_cast<double>(ns) * 1e-9; }

// Device bytes the parameter tier manager may hold for offloaded shards: the prefetch lookahead
// plus the unit in use and the one being gathered, at least four of the largest shard, and never
// more than every shard plus one in replacement (beyond that a budget cannot bind; a model of a
// few large units, such as two 70B-shaped layers, would otherwise reserve memory it never uses).
inline uint64_t OffloadedParamDeviceBudget(uint64_t shard_bytes_total, uint64_t largest,
                                           uint64_t lookahead_bytes) {
  return std::min(shard_bytes_total + largest,
                  std::max(lookahead_bytes + 2 * largest, 4 * largest));
}

// Pinned-pool bytes the parameter tier manager may hold for NVMe-homed shards: four of the
// largest shard in flight between NVMe and the device (reads ahead, the optimizer's write-back),
// plus, where device copies share host memory, what the device tier caches; never more than
// every shard plus two in flight.
inline uint64_t NvmeParamHostBudget(uint64_t shard_bytes_total, uint64_t largest,
                                    uint64_t device_budget, bool share_host_memory) {
  return std::min(shard_bytes_total + 2 * largest,
                  4 * largest + (share_host_memory ? device_budget : 0));
}

// Where a config puts each state: the compute dtype's size, the parameters' and the optimizer's
// home tiers (stage 0 keeps the optimizer on the device; only stage 3 offloads parameters).
struct Placement {
  int stage = 0;
  uint64_t compute_bytes = 4;  // bytes per element of the compute dtype
  Tier param_home = Tier::kDevice;
  Tier optim_home = Tier::kDevice;  // per unit: CpuOptimizerUnits (offload_optimizer.ratio)
};
Placement PlacementOf(const Config& cfg);

// Per unit: whether it is frozen (strata.freeze / strata.trainable; partition.h FrozenUnits).
inline Result<std::vector<char>> FrozenUnitsOf(const Config& cfg,
                                               const std::vector<UnitSpec>& units) {
  return FrozenUnits(units, cfg.strata.freeze, cfg.strata.trainable);
}

// Per unit: whether its optimizer states are offloaded (the CPU optimizer updates them) or stay
// on the device (offload_optimizer.ratio; partition.h OffloadedUnits). All 0 without offload;
// 0 for a frozen unit, which has none.
inline std::vector<char> CpuOptimizerUnits(const Config& cfg, const std::vector<UnitLayout>& layouts,
                                           const std::vector<char>& frozen) {
  if (PlacementOf(cfg).optim_home == Tier::kDevice) return std::vector<char>(layouts.size(), 0);
  return OffloadedUnits(layouts, cfg.zero.offload_optimizer.ratio, frozen);
}

// The CPU optimizer can update a unit during backward, as soon as its gradient shard lands, when
// no update depends on the global gradient norm: no clipping, no fp16 overflow check, no
// skipping of non-finite steps (EngineOptions::overlap_optimizer may still turn it off).
inline bool OverlapsOptimizer(const Config& cfg) {
  return cfg.gradient_clipping <= 0.0 && !cfg.fp16.enabled &&
         cfg.strata.on_nonfinite != NonFinitePolicy::kSkip;
}

// With the overlapped CPU optimizer and one micro-batch a step, a unit's fp32 gradient shard is
// needed only from its landing on the host until its optimizer job has used it, so the shards
// stream through the pinned pool (kStreamedGradShards of them at most, landing waits for a job
// to free one) instead of one per unit held for the whole step: 4 bytes per parameter of the
// shard less in the pool.
inline constexpr uint64_t kStreamedGradShards = 4;
inline bool StreamsGradShards(const Config& cfg, int world_size, bool overlap_option = true) {
  const Result<BatchSizes> batch = ResolveBatchSizes(cfg.batch, world_size);
  return overlap_option && OverlapsOptimizer(cfg) && batch.ok() &&
         batch->gradient_accumulation_steps == 1;
}

// The reduction bucket's capacity per rank, in elements (0: no bucket): stages 2-3 on several
// ranks, as large as reduce_bucket_size / world_size but no larger than the units that fit in it
// need together. With the overlapped CPU optimizer it is also at most a quarter of the rank's
// trainable shard: a unit's update starts when its bucket is reduced, and a bucket that holds
// the whole shard is reduced only at the end of backward, which would leave every update after it.
inline int64_t ReduceBucketCapacity(const Config& cfg, const std::vector<UnitLayout>& layouts,
                                    const std::vector<char>& frozen, int world_size,
                                    bool overlapped_cpu_optimizer) {
  if (cfg.zero.stage < 2 || world_size <= 1 || layouts.size() <= 1) return 0;
  int64_t per_rank = std::max<int64_t>(cfg.zero.reduce_bucket_size / world_size, 1);
  if (overlapped_cpu_optimizer) {
    int64_t trainable = 0;
    for (const UnitLayout& l : layouts) {
      if (!frozen[static_cast<size_t>(l.index)]) trainable += l.shard_numel;
    }
    per_rank = std::min(per_rank, std::max<int64_t>(trainable / 4, 1));
  }
  int64_t small = 0;
  for (const UnitLayout& l : layouts) {
    if (!frozen[static_cast<size_t>(l.index)] && l.shard_numel <= per_rank) small += l.shard_numel;
  }
  return std::min(per_rank, small);
}

// The shard elements of the last bucket a micro-batch reduces, at the end of its backward, for a
// bucket of `capacity` elements per rank (gradient_reducer.cc Reduce): backward lands units from
// last to first; one that fits goes into the bucket, which is reduced first when it would
// overflow; one too large for it is reduced on its own, after the bucket. What is left when
// unit 0 lands is reduced at the end.
inline int64_t LastBucketElems(const std::vector<UnitLayout>& layouts,
                               const std::vector<char>& frozen, int64_t capacity) {
  int64_t fill = 0;
  for (auto l = layouts.rbegin(); l != layouts.rend(); ++l) {
    if (frozen[static_cast<size_t>(l->index)]) continue;
    if (l->shard_numel > capacity) {
      fill = 0;
      continue;
    }
    if (fill + l->shard_numel > capacity) fill = 0;
    fill += l->shard_numel;
  }
  return fill;
}

// Whether the parameter tier manager shares host memory (strata.memory.share_host_memory; auto:
// on for the CPU device).
inline bool SharesHostMemory(const Config& cfg, device::DeviceType type) {
  return type == device::DeviceType::kCpu && cfg.strata.memory.share_host_memory != Toggle::kOff;
}

// "auto" homes are the planner's to resolve (train/plan.h) before an engine is planned or built.
inline Status CheckResolved(const Config& cfg) {
  if (!HasAutoOffload(cfg)) return Status::Ok();
  return InvalidArgumentError(
      "engine: an offload device is \"auto\"; the placement planner must choose it first "
      "(strata train and strata estimate --plan do)");
}

inline Tier HomeOf(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::kNone:
    case OffloadDevice::kAuto:  // refused by CheckResolved before any use
      return Tier::kDevice;
    case OffloadDevice::kCpu:
      return Tier::kHost;
    case OffloadDevice::kNvme:
      return Tier::kNvme;
  }
  return Tier::kDevice;
}

// The fixed facts of one engine (see the header comment).
struct EngineSetup {
  int rank = 0;
  int file_rank = 0;  // in the swap files' names (EngineOptions::file_rank)
  int world_size = 1;
  int stage = 0;
  DType compute_dtype = DType::kF32;
  size_t compute_bytes = 4;  // bytes per element of compute_dtype
  Tier param_home = Tier::kDevice;
  Tier optim_home = Tier::kDevice;
  std::vector<UnitLayout> layouts;
  // Frozen units (strata.freeze / strata.trainable): backward still runs through them (the
  // earlier units need its input gradient), but their parameter gradient is dropped: no
  // reduction, no optimizer state, no update.
  std::vector<char> frozen;
  // offload_optimizer cpu / nvme: cpu_optimizer_unit[u] says whether unit u's states are
  // offloaded and updated by the CPU optimizer (all trainable units unless
  // offload_optimizer.ratio < 1); cpu_optimizer whether any is.
  std::vector<char> cpu_optimizer_unit;
  bool cpu_optimizer = false;
  bool device_optimizer = true;  // some trainable unit's states are on the device
  // The CPU optimizer steps each unit as soon as its gradients land, overlapped with the rest of
  // backward: only when nothing needs every gradient first (no clipping, no fp16 overflow check).
  bool overlapped_optimizer = false;
  // Gradient shards allocated when they land and freed by their optimizer job (StreamsGradShards).
  bool stream_grad_shards = false;
  // Tied weights: shared[u] = the earlier units unit u also reads (Model::SharedUnits);
  // recompute[u] = the units gathered again before u's backward (Model::RecomputeUnits).
  std::vector<std::vector<int>> shared;
  std::vector<std::vector<int>> recompute;
  // Live-buffer bytes the tied units hold on top of the usual two units (Init's limit).
  uint64_t shared_live_bytes = 0;
  int64_t max_shard = 0;            // the largest unit shard, in elements
  std::vector<std::string> nvme_paths;  // EngineOptions::nvme_paths, else strata.io.nvme_paths
  // The nodes (EngineOptions::topology, or one node of every rank).
  comm::Topology topology;
  // ZeRO++ hpZ (zero_hpz_partition_size): the ranks of a node that shard the secondary copy of
  // each gathered unit when it is on (stage 3, more than one node); 1: off.
  int hpz = 1;
  // ZeRO++ qgZ (zero_quantized_gradients): stages 2-3 reduce gradients by the two-level int8
  // all-to-all (quantized_reduce.h) over the node groups.
  bool quantized_grads = false;
  // Tensor parallelism (EngineOptions::tensor_parallel): the group's size, and per unit the
  // element ranges of its flat buffer that other ranks of the group hold too
  // (Model::TensorParallelCopies > 1, or 0: all of them), which the gradient norm weights by
  // 1 / copies; `weight` indexes tp_copies, the distinct copy counts (at most
  // kMaxTensorParallelCopies of them).
  struct CopiedRange {
    int64_t first = 0, last = 0;
    int weight = 0;
  };
  static constexpr int kMaxTensorParallelCopies = 4;
  int tensor_parallel = 1;
  std::vector<int> tp_copies;
  std::vector<std::vector<CopiedRange>> tp_copied;
  optim::Isa isa = optim::Isa::kScalar;

  int units() const { return static_cast<int>(layouts.size()); }
  bool on_cpu(int u) const { return cpu_optimizer_unit[static_cast<size_t>(u)] != 0; }
  bool is_frozen(int u) const { return frozen[static_cast<size_t>(u)] != 0; }
  uint64_t shard_bytes(int u) const {
    return static_cast<uint64_t>(layouts[static_cast<size_t>(u)].shard_numel) * compute_bytes;
  }
};

// Checks the options against the model and the collective and derives the setup. Errors name
// the option or the unit at fault (InvalidArgument).
Result<EngineSetup> ResolveSetup(const Model& model, const EngineOptions& options,
                                 const comm::Collective& collective);

}  // namespace strata::zero::engine_internal

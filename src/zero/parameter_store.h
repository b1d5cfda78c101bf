// ParameterStore: where each unit's parameters (in the compute dtype) live, and handing them to
// compute. Private to src/zero.
//
//   stages 0-2  every rank keeps every unit gathered on the device (`gathered_`); the rank's
//               shard of it is updated by the optimizer and all-gathered after each step
//   stage 3     each rank keeps only its shard of each unit, homed on the device, the host or
//               NVMe in a tier manager (`tiers_`) and moved ahead of use by the prefetch
//               scheduler (`prefetcher_`); Acquire all-gathers a unit into a live buffer
//               (live_buffers.h) right before its use and Release frees it after. Units smaller
//               than stage3_param_persistence_threshold stay gathered from their first use to
//               the end of the step (`persistent_gathered_`).
//   hpZ         (stage 3, zero_hpz_partition_size = the ranks of a node, several nodes) a unit's
//               forward gather also keeps this rank's slice of it within the node: 1/L of the
//               gathered unit, local rank l holding elements [l, l + 1) * padded / L
//               (`secondary_`). The unit's backward gathers (its own, tying units', recomputes)
//               all-gather it from those slices over the node's ranks only; the last of them
//               frees it. With zero_quantized_weights the slice holds the dequantized values, so
//               backward reads exactly what forward read.
//
// Threading: every method is called by the engine's driving thread, except LeaseShard, which
// the CPU optimizer's thread also calls (the tier manager is thread-safe). Gathers run on the
// comm stream; the compute stream waits for them (StepClock::ComputeWaitsForComm). No lock of
// its own: the tier manager and the scheduler have theirs.
#pragma once

#include <memory>
#include <string_view>
#include <vector>

#include "comm/topology.h"
#include "offload/nvme_layout.h"
#include "offload/prefetch_scheduler.h"
#include "offload/tier_manager.h"
#include "strata/collective.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/status.h"
#include "zero/engine.h"
#include "zero/engine_setup.h"
#include "zero/live_buffers.h"
#include "zero/model.h"
#include "zero/step_clock.h"

namespace strata::zero::engine_internal {

// What a gather is for: the training step's forward or backward (recompute included), or an
// evaluation (outside the prefetch scheduler's trace and hpZ's secondary copies).
enum class GatherUse : uint8_t { kForward, kBackward, kEval };

class ParameterStore {
 public:
  struct Parts {
    const EngineSetup& setup;
    const EngineOptions& options;
    device::Device& device;
    comm::Collective& collective;
    EngineStreams& streams;
    StepClock& clock;
    LiveBuffers& live;
    // The node groups (hpZ's backward gathers use `intra`); filled by Init before the first
    // step when hpZ is on.
    const comm::NodeGroups& groups;
  };
  explicit ParameterStore(const Parts& parts)
      : setup_(parts.setup),
        options_(parts.options),
        config_(parts.options.config),
        device_(parts.device),
        collective_(parts.collective),
        streams_(parts.streams),
        clock_(parts.clock),
        live_(parts.live),
        groups_(parts.groups) {}
  ~ParameterStore();
  ParameterStore(const ParameterStore&) = delete;
  ParameterStore& operator=(const ParameterStore&) = delete;

  // Stage 3: creates the tier manager (budgets from the options, else from the prefetch
  // lookahead), registers every unit's shard and starts the prefetch scheduler.
  Status StartTiers(const offload::NvmeLayoutOptions& nvme);
  // Stages 0-2, per unit in unit order: the gathered copy.
  Status AllocateGathered(int u);
  // Stops the scheduler and the tier manager (the engine's destructor, streams drained).
  void StopTiers();

  // Unit u's parameters for compute, gathered for `use`; the host's wait for its shard is added
  // to *io_wait_ns. kEval: outside the prefetch scheduler's trace, no persistent units.
  Result<UnitView> Acquire(int u, GatherUse use, std::string_view owner, int64_t* io_wait_ns);
  // Lets a view from Acquire go once the compute stream is past its use.
  Status Release(int u, const UnitView& view, bool eval = false);

  // The rank's shard of unit u in the compute dtype: read into host memory, written from it
  // (stage 3 only), or put in place from it (every stage: into the gathered copy, all-gathered,
  // or the shard's home).
  Status ReadShard(int u, void* host_dst);
  Status WriteShard(int u, const void* host_src);
  Status StoreShard(int u, const char* shard);
  // Stage 3: a lease on unit u's shard in `tier` (the optimizers' writes).
  Result<offload::Lease> LeaseShard(int u, offload::Tier tier, offload::Access access,
                                    std::string_view owner);
  // Stages 0-2: unit u's gathered copy on the device.
  void* gathered(int u) const { return gathered_[static_cast<size_t>(u)]; }

  // The prefetch scheduler's step (stage 3).
  void BeginStep();
  // Stage 3, after the update: persistent units are gathered again next step (their shards
  // changed); the scheduler's step ends.
  void EndStep();
  // A write-back that failed in the background since the last call (stage 3), once.
  Status TakeWritebackError();
  // After a failed step: frees the persistent units' copies, forgets write-back errors, and
  // ends the scheduler's step if it began one.
  void ForgetStep(bool in_step);

  // Stage 3: the parameter tiers' traffic, peaks and budgets, and the prefetch hit rate.
  void AddStats(EngineStats& stats) const;

 private:
  offload::TierManagerOptions TierOptions(const offload::NvmeLayoutOptions& nvme) const;
  Result<void*> Gather(int u, GatherUse use, std::string_view owner, int64_t* io_wait_ns);
  Status AllGatherShard(int u, const void* shard, void* full);
  void FreePersistent();
  // hpZ: the elements of unit u's secondary slice; keeps it from a forward gather into `full`;
  // all-gathers `full` from the node's slices; counts a backward use (the last frees it).
  uint64_t SecondaryElems(int u) const;
  Status KeepSecondary(int u, const void* full);
  Status GatherFromSecondary(int u, void* full);
  Status UsedSecondary(int u);
  void FreeSecondaries();

  const EngineSetup& setup_;
  const EngineOptions& options_;
  const Config& config_;
  device::Device& device_;
  comm::Collective& collective_;
  EngineStreams& streams_;
  StepClock& clock_;
  LiveBuffers& live_;

  // Stages 0-2: every unit's parameters, gathered (device).
  std::vector<void*> gathered_;
  // Stage 3: parameter shards (id = unit index), and their prefetcher.
  std::unique_ptr<offload::TierManager> tiers_;
  std::unique_ptr<offload::PrefetchScheduler> prefetcher_;
  std::vector<bool> persistent_;               // per unit
  std::vector<void*> persistent_gathered_;     // per unit: gathered this step, or nullptr
  const comm::NodeGroups& groups_;
  // hpZ, per unit: the secondary slice (device) from its forward gather until its last backward
  // use, or nullptr; the backward gathers a micro-batch makes of it (own, tied, recomputes); those
  // still to come.
  std::vector<void*> secondary_;
  std::vector<int> backward_uses_;
  std::vector<int> uses_left_;
  uint64_t secondary_bytes_ = 0;       // held now (driving thread)
  uint64_t secondary_peak_bytes_ = 0;  // the most held at once
};

}  // namespace strata::zero::engine_internal

// AdamStates: each trainable unit's AdamW states of this rank — fp32 master weights, exp_avg and
// exp_avg_sq — and where the CPU optimizer puts its updated parameters. Private to src/zero.
//
//   units on the device optimizer  master, m, v on the device (the whole unit at stage 0, the
//                                  rank's shard otherwise); the fused device kernel updates them
//   units on the CPU optimizer     offload::OptimizerStates: sub-groups of [master | m | v],
//                                  homed in the pinned pool or on NVMe and streamed through host
//                                  memory; the CPU AdamW updates them, writing the new
//                                  parameters into `staged` (stages 1-2, and stage 3 with
//                                  device-homed parameters), from where the step copies them to
//                                  the device
//   frozen units                   none
//
// Threading: the device states are the driving thread's. OptimizerStates is thread-safe (the CPU
// optimizer's thread and the driving thread both use it; see offload/optimizer_states.h). A
// unit's staged parameters belong to its CPU optimizer job while it runs and to the driving
// thread otherwise (cpu_optimizer_worker.h). No lock of its own.
#pragma once

#include <memory>
#include <vector>

#include "offload/nvme_layout.h"
#include "offload/optimizer_states.h"
#include "strata/device.h"
#include "strata/status.h"
#include "zero/engine.h"
#include "zero/engine_setup.h"
#include "zero/host_buffer.h"
#include "zero/step_clock.h"

namespace strata::zero::engine_internal {

// One sub-group of a unit's optimizer shard: [master | m | v], each `numel` fp32.
using SubGroup = offload::OptimizerSubGroup;

class AdamStates {
 public:
  AdamStates(const EngineSetup& setup, const EngineOptions& options, device::Device& device,
             EngineStreams& streams)
      : setup_(setup), options_(options), device_(device), streams_(streams) {}
  ~AdamStates();
  AdamStates(const AdamStates&) = delete;
  AdamStates& operator=(const AdamStates&) = delete;

  // CPU optimizer: creates the offloaded states (sub_group_size elements a sub-group; 0: one
  // per unit shard).
  Status CreateOffloaded(const offload::NvmeLayoutOptions& nvme);
  // Per unit, in unit order (Engine::Impl::AllocateUnit interleaves these with the other
  // components' allocations): the device states, then the CPU optimizer's staging buffer.
  Status AllocateDevice(int u);
  Status AllocateStaging(int u);
  // Stops the offloaded states' tier manager (the engine's destructor, streams drained).
  void StopOffloaded() { offloaded_.reset(); }

  // Unit u's states from `src`, what the rank keeps of its fp32 weights (the whole unit at stage
  // 0, else its shard): master = src, moments zero.
  Status InitUnit(int u, const float* src);

  // Units on the device optimizer (nullptr for the others).
  void* master(int u) const { return master_[static_cast<size_t>(u)]; }
  void* exp_avg(int u) const { return exp_avg_[static_cast<size_t>(u)]; }
  void* exp_avg_sq(int u) const { return exp_avg_sq_[static_cast<size_t>(u)]; }
  // Units on the CPU optimizer.
  offload::OptimizerStates& offloaded() { return *offloaded_; }
  const std::vector<SubGroup>& groups(int u) const { return offloaded_->groups(u); }
  char* staged(int u) const { return staged_[static_cast<size_t>(u)].data(); }

  // A write-behind that failed in the background since the last call, once (Ok without a CPU
  // optimizer).
  Status TakeWritebackError();
  // The offloaded states' traffic and peak.
  void AddStats(EngineStats& stats) const;

 private:
  const EngineSetup& setup_;
  const EngineOptions& options_;
  device::Device& device_;
  EngineStreams& streams_;
  std::vector<void*> master_, exp_avg_, exp_avg_sq_;     // device; per unit
  std::unique_ptr<offload::OptimizerStates> offloaded_;  // CPU optimizer
  std::vector<HostBuffer> staged_;                       // per unit; empty where unused
};

}  // namespace strata::zero::engine_internal

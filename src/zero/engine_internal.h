// The ZeRO engine's implementation: Engine::Impl composes the components that own the engine's
// state and runs a step as a list of phases over them. Private to src/zero.
//
//   component           header                  its job                                 its lock
//   EngineSetup         engine_setup.h          the fixed facts: ranks, stage, dtype,   none: read-only
//                                               homes, layouts, frozen / CPU units      after Init
//   EngineStreams,      step_clock.h            the compute and comm streams; what ran  none: atomics
//   StepClock                                   when, to tell exposed waits from hidden
//   LiveBuffers         live_buffers.h          the budget of a step's transient device mu_: live_bytes_,
//                                               buffers (gathered units, gradients)     owned_
//   ParameterStore      parameter_store.h       parameters for compute: gathered copies none (the tier
//                                               (stages 0-2), stage-3 shards in tiers   manager's own)
//   GradientReducer     gradient_reducer.h      gradients to where the optimizer reads  none: driving
//                                               them (buckets, shards, landing); norm   thread
//   AdamStates          adam_states.h           master, m, v: on the device or          none (Optimizer-
//                                               offloaded in sub-groups                 States' own)
//   CpuOptimizerWorker  cpu_optimizer_worker.h  the CPU optimizer's thread, queue,      mu_: queue, error,
//                                               error and per-step books                sums, times
//   StepScalars         step_scalars.h          the step's scalars on the device and    none: driving
//                                               one registered host page                thread
//
// Engine::Impl's own fields (the LR schedule, the loss scaler, the step count, the step's
// hyper-parameters) are the driving thread's. The source files:
//   engine.cc            Init (composes the components), the public Engine methods
//   engine_step.cc       the training step and evaluation, phase by phase
//   engine_optimizer.cc  one unit's device optimizer step and CPU optimizer update
//   engine_states.cc     checkpoint states: save, load, gather
//   engine_plan.cc       Engine::PlanMemory and PlanPinnedPoolBytes: the allocations as formulas
//
// Threading: one thread drives the engine (Engine's methods). Besides it run the CPU optimizer's
// thread (CpuOptimizerWorker, which calls back into CpuOptimizerUnit), the device's stream
// threads (stream tasks of StepClock, LiveBuffers and GradientReducer) and the tier managers'
// transfer threads; each component's header says which of its methods each may call.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "optim/adam.h"
#include "optim/loss_scaler.h"
#include "optim/lr_schedule.h"
#include "strata/trace.h"
#include "zero/adam_states.h"
#include "zero/cpu_optimizer_worker.h"
#include "zero/engine.h"
#include "zero/engine_setup.h"
#include "zero/gradient_reducer.h"
#include "zero/live_buffers.h"
#include "zero/parameter_store.h"
#include "zero/partition.h"
#include "zero/step_clock.h"
#include "zero/step_scalars.h"

namespace strata::zero {

using namespace engine_internal;  // NOLINT: the engine's own private header

// What a step measures as it runs, for StepResult's split of its wall time.
struct StepTimes {
  int64_t start_ns = 0;
  int64_t io_wait_ns = 0;         // the host's waits for parameter shards
  double exposed_io_s = 0.0;      // the part of those waits with compute idle
  int64_t exposed_comm_ns = 0;
  int64_t exposed_optimizer_ns = 0;
};

// The global gradient norm and what it decides.
struct GradientNorm {
  double norm = 0.0;       // of the averaged, unscaled gradient
  bool overflow = false;   // the sum of squares is not finite
  double clip_coef = 1.0;  // gradient_clipping's factor (1: no clipping)
};

struct Engine::Impl {
  Impl(Model& m, EngineOptions o);
  ~Impl();

  // ---- set-up (engine.cc)
  Status Init();
  Status InitSchedules();
  offload::NvmeLayoutOptions NvmeLayout() const;
  uint64_t MaxLiveBytes() const;
  Status AllocateUnit(int u);
  Status InitialValues();
  Status InitUnitFromModel(int u);
  void StartCpuOptimizer();

  // ---- the step and evaluation (engine_step.cc)
  Result<StepResult> Step(std::span<const Batch* const> micro_batches);
  Result<StepResult> StepImpl(std::span<const Batch* const> micro_batches);
  Status BeginStep(int micro_batches, StepResult& result);
  Result<double> TrainMicroBatch(const Batch& batch, int mb, bool last, float loss_scale,
                                 StepTimes& times);
  // What the collectives enqueued next are for (the traffic counters' phase, when counted).
  void Phase(comm::TrafficPhase phase) {
    if (options.traffic != nullptr) options.traffic->SetPhase(phase);
  }
  Status ForwardUnit(int u, bool eval, StepTimes& times);
  Status BackwardUnit(int u, int mb, bool last, StepTimes& times);
  Status RecomputeFor(int u, StepTimes& times);
  Status ReleaseViews(int u, const std::vector<UnitView>& views, bool eval);
  Status DrainBackward(StepTimes& times);
  Result<GradientNorm> ComputeGradientNorm(double grad_scale, StepTimes& times);
  Status UpdateUnits(bool skipped, double grad_scale, StepTimes& times);
  Status PublishParameters(bool skipped, StepTimes& times);
  Status FinishResult(double loss_sum, int micro_batches, bool nonfinite, const StepTimes& times,
                      StepResult& result);
  void CleanUpFailedStep();
  Result<double> Eval(std::span<const Batch* const> micro_batches);
  Result<double> EvalImpl(std::span<const Batch* const> micro_batches);

  // ---- the optimizer (engine_optimizer.cc)
  Status DeviceOptimizerStep(int u);
  Status CpuOptimizerUnit(int u, const optim::AdamHyper& hyper);
  Status QueueUpdate(int u, std::shared_ptr<device::Event> ready);

  // ---- checkpoint states (engine_states.cc)
  // Calls fn(slot, offset in the parameter, count, offset in the rank's shard) for every
  // parameter range that falls within elements [begin, end) of the rank's shard of unit u.
  template <typename Fn>
  Status ForEachPiece(int u, int64_t begin, int64_t end, Fn&& fn) const;
  Status EmitPieces(int u, const StateWriter& write, StateKind kind, int64_t begin, int64_t end,
                    const char* base, DType dtype) const;
  Status SaveUnitStates(int u, const StateWriter& write);
  Status SaveOptimizerStates(int u, const StateWriter& write);
  Status LoadUnitStates(int u, const InitialStates& initial);
  Status LoadFrozenUnit(int u, const InitialStates& initial);
  Status PutOptimizerStates(int u, const std::vector<float>& master, const std::vector<float>& m,
                            const std::vector<float>& v, bool moments);
  Result<std::vector<float>> GatherShards(int u, const void* own_shard_host, DType dtype);

  const UnitLayout& layout(int u) const { return setup.layouts[static_cast<size_t>(u)]; }

  Model& model;
  const EngineOptions options;
  const Config& config;
  device::Device& device;
  comm::Collective& collective;

  EngineSetup setup;
  // hpZ and qgZ: this rank's node (intra) and its counterparts on the other nodes (inter), split
  // from `collective` by Init when either is on (comm/topology.h).
  comm::NodeGroups node_groups;
  EngineStreams streams;
  StepClock clock;
  LiveBuffers live;
  CpuOptimizerWorker cpu_worker;
  StepScalars scalars;
  ParameterStore params;
  AdamStates adam;
  GradientReducer reducer;

  std::optional<optim::LrSchedule> lr_schedule;
  std::optional<optim::LossScaler> loss_scaler;
  int64_t steps_taken = 0;
  bool in_step = false;  // between the parameters' BeginStep and EndStep
  // This step's hyper-parameters: the driving thread's; each CPU optimizer job gets a copy.
  optim::AdamHyper step_hyper;
};

}  // namespace strata::zero

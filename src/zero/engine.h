// The ZeRO engine: trains a Model (zero/model.h) data-parallel over the ranks of a Collective,
// with model states partitioned per zero_optimization.stage and homed per offload_param /
// offload_optimizer.
//
//   stage 0  every rank holds all parameters, gradients and optimizer states; gradients are
//            all-reduced and every rank runs the whole optimizer step.
//   stage 1  optimizer states (fp32 master, m, v) are partitioned: rank r updates shard r of each
//            unit; full gradients are accumulated locally and reduce-scattered once per step;
//            the updated shards are all-gathered.
//   stage 2  + gradients: each unit's gradients are reduce-scattered as soon as its backward
//            ends (every micro-batch) and only the rank's shard is kept.
//   stage 3  + parameters: each rank keeps only its parameter shard (homed on device, host or
//            NVMe through the tier manager, moved ahead of use by the prefetch scheduler) and
//            all-gathers a unit right before its forward and backward, letting it go after.
//
// The optimizer runs where its states live: on the device (offload_optimizer none: the fused
// device kernel, optim/device_adam.h), or on the CPU (cpu / nvme: SIMD AdamW, with NVMe-homed
// states streamed in sub-groups of sub_group_size elements: the next sub-group read ahead, the
// previous written behind, host memory bounded by strata's optimizer pipeline depth). With the
// optimizer on the CPU, a unit's optimizer step starts as soon as its gradient shard reached the
// host in the step's last micro-batch, overlapped with the backward of earlier units — except
// when the result needs every gradient first (gradient_clipping > 0, fp16 overflow checks): then
// the global norm / overflow flag is computed after backward and every unit's step follows it.
// docs/zero.md describes the data flow and the cost of that choice.
//
// Threading: one thread drives the engine (Init, TrainStep, Gather*). Internally it uses the
// device's compute and comm streams, the tier managers' transfer threads and one optimizer
// thread.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "comm/topology.h"
#include "strata/collective.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/status.h"
#include "optim/loss_scaler.h"
#include "zero/model.h"
#include "zero/partition.h"

namespace strata {
class TraceRecorder;
namespace io {
class BlockStore;
}
namespace device {
class PinnedPool;
}
}  // namespace strata

namespace strata::zero {

// The dtype of the parameters in compute (strata.bf16 / fp16 / fp32): what the engine gathers
// them in, and what the model's matmuls and attention take.
inline device::DType ComputeDType(const Config& config) {
  switch (config.precision()) {
    case Precision::kFp16:
      return device::DType::kF16;
    case Precision::kBf16:
      return device::DType::kBF16;
    case Precision::kFp32:
      break;
  }
  return device::DType::kF32;
}

// The states a checkpoint holds per parameter: the parameters in the compute dtype, and the
// optimizer's fp32 master weights and Adam moments.
enum class StateKind : uint8_t { kParams, kMaster, kExpAvg, kExpAvgSq };
std::string_view StateKindName(StateKind kind);  // "params", "master", "exp_avg", "exp_avg_sq"

// One piece of a state a rank owns: elements [offset, offset + count) of parameter `slot` of
// unit `unit` (row-major, as in the unpartitioned tensor). What a rank owns is its shard of the
// unit's flat buffer (partition.h), cut at parameter boundaries; the ranks' pieces of a state
// cover every element of every parameter exactly once, whatever the stage.
struct StatePiece {
  int unit = 0;
  int slot = 0;
  StateKind kind = StateKind::kParams;
  int64_t offset = 0;
  int64_t count = 0;
};

// Checkpoint callbacks. A writer receives `count` elements of `dtype` (the compute dtype for
// kParams, fp32 for the rest); a reader fills `out` with `count` elements of `dtype` and must
// honour it: fp32, except a frozen unit's kParams, which are asked for in the compute dtype
// (rounded to nearest even from wider stored values, as ConvertHost does), so that loading a
// frozen unit holds no fp32 copy. Both are called on the engine's driving thread.
using StateWriter =
    std::function<Status(const StatePiece& piece, const void* data, device::DType dtype)>;
using StateReader = std::function<Status(const StatePiece& piece, void* out, device::DType dtype)>;
// Progress of a save or load: units done out of total.
using StateProgress = std::function<void(int done, int total)>;

// What to load instead of Model::InitUnit when the engine is created.
struct InitialStates {
  StateReader read;
  // true: master weights and moments from the reader (a resumed checkpoint; parameters are the
  // master weights in the compute dtype). false: parameters only (kParams, read as fp32: weights
  // of a model to fine-tune); master = those values, moments zero. Either way a frozen unit
  // reads its kParams only, in the compute dtype (StateReader).
  bool with_optimizer = false;
  StateProgress progress;
  // Per unit, 1: not read but initialised by Model::InitUnit (new LoRA adapters on loaded base
  // weights). Shorter than the unit count: the rest are read.
  std::vector<char> init_from_model;
};

// Counters a checkpoint carries besides the tensors.
struct EngineCounters {
  int64_t optimizer_steps = 0;                  // optimizer steps taken (skipped ones excluded)
  std::optional<optim::LossScalerState> loss_scaler;  // fp16 only
};

struct EngineOptions {
  Config config;                         // zero_optimization, optimizer, scheduler, fp16/bf16, ...
  device::Device* device = nullptr;      // required
  comm::Collective* comm = nullptr;      // required
  // Required when a state class is homed on the host or NVMe: host copies of shards live in it.
  device::PinnedPool* pool = nullptr;
  io::BlockStore* store = nullptr;       // required for NVMe offload
  // NVMe directories for swap files (default: offload_param / offload_optimizer nvme_path).
  std::vector<std::string> nvme_paths;
  // The rank in the swap files' names (strata.rank<r>.*.swap); -1: `comm`'s rank. Tensor
  // parallelism sets the world rank: several ranks share a data-parallel rank.
  int file_rank = -1;
  // Device bytes the stage-3 parameter shards may occupy (tier manager budget); 0 = device free.
  uint64_t param_device_budget = 0;
  // Pinned-pool bytes the parameter shards may occupy when homed on NVMe; 0 = 4x the prefetch
  // lookahead, at least 4 units' shards.
  uint64_t param_host_budget = 0;
  // Optimizer sub-groups held in host memory at once with NVMe-homed optimizer states
  // (read-ahead + current + write-behind): the pipeline depth. >= 3.
  int optimizer_pipeline_depth = 4;
  // Run a unit's CPU optimizer step during backward (when exactness allows). false: after
  // backward, one unit after another (for comparison).
  bool overlap_optimizer = true;
  int cpu_adam_threads = 1;
  bool prefetch = true;                  // the stage-3 prefetch scheduler (false: on demand)
  TraceRecorder* trace = nullptr;
  // The bytes `comm` and its groups send within and across nodes (comm/topology.h), when counted:
  // the engine sets their phase (forward gathers, backward gathers, gradient reductions) and
  // stats() reports them. Must outlive the engine.
  comm::TrafficCounters* traffic = nullptr;
  // Which node each rank of `comm` is on (hpZ and qgZ split `comm` into node groups). The default,
  // a world of one, stands for one node holding every rank.
  comm::Topology topology;
  // Where the initial states come from (unset: Model::InitUnit, moments zero).
  std::optional<InitialStates> initial;
  // Tensor parallelism: the model's tensor-parallel group (null or size 1: none); `comm` is then
  // its data-parallel group. The global gradient norm adds the group's ranks' sums, counting the
  // parameters the model holds whole on every rank (Model::SplitOverTensorParallel) once.
  comm::Collective* tensor_parallel = nullptr;
};

struct StepResult {
  int64_t step = 0;            // optimizer steps taken, including this one if not skipped
  double loss = 0.0;           // mean over the global batch
  double grad_norm = 0.0;      // global L2 norm of the averaged, unscaled gradient
  double lr = 0.0;
  double loss_scale = 1.0;
  bool skipped = false;        // fp16 overflow: no update
  // Wall-clock split of the step (seconds). exposed_*: time the step waited for that kind of
  // work with nothing else to do (docs/zero.md); compute: the rest, step_s minus the exposed
  // times.
  double step_s = 0.0;
  double compute_s = 0.0;
  double exposed_comm_s = 0.0;
  double exposed_io_s = 0.0;
  double exposed_optimizer_s = 0.0;
  double optimizer_s = 0.0;    // total optimizer work (overlapped or not)
};

struct EngineStats {
  uint64_t param_nvme_read_bytes = 0, param_nvme_write_bytes = 0;
  uint64_t optim_nvme_read_bytes = 0, optim_nvme_write_bytes = 0;
  uint64_t device_peak_bytes = 0;
  // Stage 3: parameter shards cached in device memory (the tier manager's device tier): its
  // peak and its budget (all shards when parameters are homed on the device, else the prefetch
  // lookahead plus two units).
  uint64_t param_device_peak_bytes = 0;
  uint64_t param_device_budget_bytes = 0;
  uint64_t host_peak_bytes = 0;   // pinned pool bytes held by the engine's tier managers
  double prefetch_hit_rate = 0.0;
  // Units whose optimizer states are offloaded (the CPU optimizer updates them), of all units.
  int offloaded_optimizer_units = 0;
  int frozen_units = 0;  // strata.freeze / strata.trainable
  int units = 0;
  // Bytes this rank sent since the start, per phase (EngineOptions::traffic; zero without).
  std::array<comm::Traffic, comm::kTrafficPhases> traffic{};
  // ZeRO++ device memory: the most hpZ's node-local parameter copies held at once (their
  // allocations, counted when made and when their last use is enqueued), and qgZ's staging.
  uint64_t hpz_copies_peak_bytes = 0;
  uint64_t qgz_staging_bytes = 0;
};

// One line of a memory plan.
struct MemoryPlanItem {
  std::string what;
  uint64_t bytes = 0;
};

// Engine::PlanMemory's answer, per rank.
struct EngineMemoryPlan {
  // Device memory held from Create to the end of the run (parameters, gradients, optimizer
  // states, the reduction bucket), each as the device allocator charges it.
  std::vector<MemoryPlanItem> device;
  // Device memory a step adds at its peak: gathered units and per-unit gradients (bounded by the
  // live-buffer limit), persistent stage-3 units, and cached copies of offloaded parameter shards.
  std::vector<MemoryPlanItem> device_step;
  uint64_t pinned_pool = 0;      // PlanPinnedPoolBytes: the pool strata.memory.pinned_pool "auto" makes
  uint64_t nvme_param_file = 0;  // strata.rank<r>.param.swap, when parameters are on NVMe
  uint64_t nvme_optim_file = 0;  // strata.rank<r>.optim.swap, when the optimizer is on NVMe
  // The rank's shard elements whose optimizer states are offloaded (all, or a share of them with
  // offload_optimizer.ratio < 1; 0 without offload), and all of its shard elements.
  uint64_t offloaded_optim_elems = 0;
  uint64_t shard_elems = 0;
  // Of those, the elements of trainable units (all, unless strata.freeze / trainable freezes
  // some): the ones whose gradients are reduced and that the optimizer updates.
  uint64_t trainable_elems = 0;
  // With a reduction bucket (stages 2-3, several ranks): the shard elements of the last bucket a
  // micro-batch reduces, at the end of its backward (GradientReducer::FlushBucket). Their
  // gradients, and so the overlapped CPU optimizer's work on them, wait for the end of backward.
  // 0 without a bucket.
  uint64_t last_bucket_elems = 0;
  // Whether the CPU optimizer updates units during backward, as each gradient shard lands (the
  // engine's own decision, engine_setup.h OverlapsOptimizer, with EngineOptions'
  // overlap_optimizer on: strata train's default). False without offloaded optimizer states.
  bool optimizer_overlapped = false;
  // Host memory outside every budget while random initialisation builds the largest unit: in
  // fp32 and in the compute dtype, the whole unit at stage 0, else the rank's shard of it.
  uint64_t init_host_bytes = 0;
  // Host memory outside every budget while LoadStates reads the largest unit from a checkpoint:
  // the rank's shard of its master weights and both moments in fp32 and of its parameters in
  // the compute dtype (a frozen unit: its parameters in the compute dtype). From a model
  // directory (no moments to read: they start at zero in place), the master shard and its cast.
  uint64_t load_host_bytes = 0;
  uint64_t load_weights_host_bytes = 0;

  uint64_t device_total() const;  // every item of `device` and `device_step`
};

class Engine {
 public:
  // Validates the options and the model (layouts), creates streams, tier managers, and
  // allocates and initialises every state (parameters from Model::InitUnit, moments zero).
  static Result<std::unique_ptr<Engine>> Create(Model& model, EngineOptions options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Pinned-pool bytes the engine needs for `units` on `world_size` ranks with `config` (host
  // copies of offloaded states, gradient shards, staging), with a margin for the pool's size
  // classes. For sizing strata.memory.pinned_pool when it is "auto". `device_type`: on the CPU
  // device parameter shards share host memory (strata.memory.share_host_memory), and the host
  // copies then also hold what the device caches.
  // `overlap_optimizer`: EngineOptions::overlap_optimizer (whether gradient shards may stream).
  static Result<uint64_t> PlanPinnedPoolBytes(
      const std::vector<UnitSpec>& units, const Config& config, int world_size,
      int optimizer_pipeline_depth = 4, device::DeviceType device_type = device::DeviceType::kCpu,
      bool overlap_optimizer = true);

  // What the engine allocates per rank for `units` on `world_size` ranks with `config`, by tier,
  // with the formulas of Create and the step (docs/planning.md), without allocating anything.
  // `shared[u]`: the earlier units unit u ties to (Model::SharedUnits; empty when none);
  // `recompute[u]`: the units gathered again before u's backward (Model::RecomputeUnits).
  static Result<EngineMemoryPlan> PlanMemory(
      const std::vector<UnitSpec>& units, const std::vector<std::vector<int>>& shared,
      const Config& config, int world_size, int optimizer_pipeline_depth = 4,
      device::DeviceType device_type = device::DeviceType::kCpu,
      const std::vector<std::vector<int>>& recompute = {});

  // One optimizer step over `micro_batches` (gradient_accumulation_steps of them, this rank's).
  Result<StepResult> TrainStep(std::span<const Batch* const> micro_batches);

  // Evaluation: the forward pass alone over `micro_batches` (this rank's), and their mean loss
  // over every rank. Collective. Parameters are gathered (stage 3) as for a step, outside the
  // prefetch scheduler's trace; no gradient, no update, and the step counters do not move.
  Result<double> EvalLoss(std::span<const Batch* const> micro_batches);

  // Collective (every rank must call it): unit `unit`'s parameters, in fp32, unpadded
  // (used_numel elements), as the model sees them.
  Result<std::vector<float>> GatherParams(int unit);
  // Collective: unit `unit`'s fp32 master weights (used_numel elements).
  Result<std::vector<float>> GatherMaster(int unit);

  // Collective (every rank, between steps): hands this rank's pieces of every state to `write`
  // — parameters in the compute dtype, then master, exp_avg, exp_avg_sq in fp32 — unit by unit,
  // reading NVMe-homed states through the tier managers (one sub-group at a time).
  Status SaveStates(const StateWriter& write, const StateProgress& progress = {});
  // Collective: replaces every state with what `initial.read` returns for this rank's pieces
  // (see InitialStates) and re-derives the parameters (gathered again at stages 0-2).
  Status LoadStates(const InitialStates& initial);

  EngineCounters counters() const;
  // InvalidArgument for a negative step count, or a loss-scaler state without fp16 (or the
  // reverse), or one the scaler refuses.
  Status RestoreCounters(const EngineCounters& counters);

  const std::vector<UnitLayout>& layouts() const;
  // Per unit, 1 where it is frozen (strata.freeze / strata.trainable): it has no optimizer
  // state, and SaveStates writes only its parameters.
  const std::vector<char>& frozen_units() const;
  EngineStats stats() const;
  device::DType compute_dtype() const;

 private:
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::zero

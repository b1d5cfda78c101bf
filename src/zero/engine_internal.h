// The ZeRO engine's implementation, shared by its source files (private to src/zero):
//   engine.cc            set-up, the public Engine methods
//   engine_step.cc       the step: compute-stream clock, transient buffers, parameters for compute
//   engine_grads.cc      gradient reduction, bucketing, landing on the host, the global norm
//   engine_optimizer.cc  the device optimizer and the CPU optimizer's thread (its states stream
//                        through offload::OptimizerStates)
//   engine_states.cc     checkpoint states: save, load, gather
#pragma once

#include "zero/engine.h"
#include "zero/partition.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <new>
#include <optional>
#include <thread>
#include <unordered_map>

#include "common/host_memory.h"
#include "common/log.h"
#include "device/pinned_pool.h"
#include "offload/prefetch_scheduler.h"
#include "offload/optimizer_states.h"
#include "offload/tier_manager.h"
#include "optim/adam.h"
#include "optim/device_adam.h"
#include "optim/loss_scaler.h"
#include "optim/lr_schedule.h"
#include "strata/block_store.h"
#include "strata/trace.h"

namespace strata::zero {

namespace engine_internal {

using device::DType;
using offload::Access;
using offload::Lease;
using offload::Tier;

inline double Seconds(int64_t ns) { return static_cast<double>(ns) * 1e-9; }

inline DType ComputeDType(const Config& config) {
  switch (config.precision()) {
    case Precision::kFp16:
      return DType::kF16;
    case Precision::kBf16:
      return DType::kBF16;
    case Precision::kFp32:
      break;
  }
  return DType::kF32;
}

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
  uint64_t csz = 4;
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
// bucket of `capacity` elements per rank (engine_grads.cc ReduceGrads): backward lands units from
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

// A host buffer from the pinned pool when there is one (registered, fast copies), else from the
// heap (the CPU device takes any host memory).
class HostBuffer {
 public:
  HostBuffer() = default;
  ~HostBuffer() { Reset(); }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  HostBuffer(HostBuffer&& o) noexcept { *this = std::move(o); }
  HostBuffer& operator=(HostBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      pool_ = o.pool_;
      block_ = o.block_;
      heap_ = std::move(o.heap_);
      o.pool_ = nullptr;
      o.block_ = {};
    }
    return *this;
  }

  static Result<HostBuffer> Make(device::PinnedPool* pool, size_t bytes, std::string_view what) {
    HostBuffer b;
    if (pool != nullptr) {
      auto block = pool->Allocate(bytes);
      if (!block.ok()) {
        return Status(block.status().code(),
                      fmt::format("{}: {}", what, block.status().message()));
      }
      b.pool_ = pool;
      b.block_ = *block;
    } else {
      b.heap_.reset(new (std::align_val_t{4096}) char[bytes]);
    }
    std::memset(b.data(), 0, bytes);
    return b;
  }

  char* data() const { return pool_ != nullptr ? static_cast<char*>(block_.data) : heap_.get(); }

 private:
  struct AlignedDelete {
    void operator()(char* p) const { ::operator delete[](p, std::align_val_t{4096}); }
  };
  void Reset() {
    if (pool_ != nullptr && block_) pool_->Free(block_);
    pool_ = nullptr;
    block_ = {};
    heap_.reset();
  }
  device::PinnedPool* pool_ = nullptr;
  device::PinnedBlock block_;
  std::unique_ptr<char[], AlignedDelete> heap_;
};

// One sub-group of a unit's optimizer shard: [master | m | v], each `numel` fp32.
using SubGroup = offload::OptimizerSubGroup;

}  // namespace engine_internal

using namespace engine_internal;  // NOLINT: the engine's own private header

struct Engine::Impl {
  Model& model;
  EngineOptions opt;
  const Config& cfg;
  device::Device& dev;
  comm::Collective& comm;
  int rank = 0;
  int world = 1;
  int stage = 0;
  DType cdt = DType::kF32;
  size_t csz = 4;
  // offload_optimizer cpu / nvme: cpu_unit[u] says whether unit u's states are offloaded (all
  // units unless offload_optimizer.ratio < 1); cpu_optimizer whether any is.
  bool cpu_optimizer = false;
  std::vector<char> cpu_unit;
  bool device_optimizer = true;  // some trainable unit's states are on the device
  // Frozen units (strata.freeze / strata.trainable): backward still runs through them (the
  // earlier units need its input gradient), but their parameter gradient is dropped: no
  // reduction, no optimizer state, no update.
  std::vector<char> frozen;
  // The CPU optimizer steps each unit as soon as its gradients land, overlapped with the rest of
  // backward: only when nothing needs every gradient first (no clipping, no fp16 overflow check).
  bool overlapped_optimizer = false;
  // Gradient shards allocated when they land and freed by their optimizer job
  // (StreamsGradShards); grad_freed counts the frees, for a landing that waits for one.
  bool stream_grad_shards = false;
  uint64_t grad_freed = 0;  // guarded by opt_mu
  Tier param_home = Tier::kDevice;
  Tier optim_home = Tier::kDevice;
  std::vector<UnitLayout> layouts;
  // Tied weights: shared[u] = the earlier units unit u also reads (Model::SharedUnits), and the
  // gradient buffer a shared unit's tying unit already added to, waiting for its own backward.
  std::vector<std::vector<int>> shared;
  std::vector<std::vector<int>> recompute;  // Model::RecomputeUnits of each unit
  std::vector<void*> pending_grad;
  int64_t max_shard = 0;

  std::unique_ptr<device::Stream> compute, comm_stream;
  std::unique_ptr<device::Event> ev_compute, ev_comm;

  // Stages 0-2: every unit's parameters, gathered, in the compute dtype (device).
  std::vector<void*> full_params;
  // Stages 0-1: full fp32 gradient accumulators (device).
  std::vector<void*> full_grads;
  // Stages 2-3: the reduction bucket (reduce_bucket_size). Units whose gradient is smaller than
  // the bucket are copied into it (each rank's part at stride bucket_cap) and reduce-scattered
  // together when it is full or backward ends; larger units are reduced on their own.
  void* bucket = nullptr;
  int64_t bucket_cap = 0;   // elements per rank
  int64_t bucket_fill = 0;  // elements per rank in use
  struct Pending {
    int unit;
    int64_t offset;  // in the rank's block
    int mb;
    bool last;
  };
  std::vector<Pending> bucket_units;
  // Stages 2-3, units on the device optimizer: grad shard accumulators (device; stages 0-1 use
  // full_grads). Per unit; nullptr for an offloaded unit.
  std::vector<void*> grad_shard_dev;
  // Offloaded units: grad shard accumulators (host; empty for the others) and the staging buffer
  // they arrive through.
  std::vector<HostBuffer> grad_shard_host;
  HostBuffer grad_landing;
  // Offloaded units at stages 1-2 (and stage 3 with device-homed parameters): the updated shard in
  // the compute dtype, copied to the device after the step (empty for the others).
  std::vector<HostBuffer> param_stage;
  // Units on the device optimizer: master, m, v (shard-sized; full at stage 0; nullptr for an
  // offloaded unit).
  std::vector<void*> master_dev, m_dev, v_dev;
  // The step's scalars: the gradient norm's sum of squares (a double) and the rank sum of it (a
  // float) in device memory, read back through one registered host page; allocated at Init so
  // that the norm costs no allocation and no pageable copy per step.
  void* scalars_dev = nullptr;  // [0, 8): double sum; [8, 12): float for the all-reduce
  HostRegion scalars_host;  // one page, registered with the device
  bool scalars_host_registered = false;

  // Stage 3: parameter shards (id = unit index).
  std::unique_ptr<offload::TierManager> ptm;
  std::unique_ptr<offload::PrefetchScheduler> sched;
  std::vector<void*> persistent_full;  // gathered persistent units, per step
  std::vector<bool> persistent;
  uint64_t max_live_bytes = 0;

  // CPU optimizer: master weights and moments in sub-groups, streamed through host memory
  // (offload/optimizer_states.h).
  std::unique_ptr<offload::OptimizerStates> ostates;

  // Transient device buffers (stage-3 gathered units, per-unit gradients): at most
  // max_live_bytes of them exist at once; each is freed by a Notify once its last stream used it.
  // `owned` holds those not yet handed to a Notify, for clean-up after a failed step.
  std::mutex live_mu;
  std::condition_variable live_cv;
  uint64_t live_bytes = 0;
  std::unordered_map<void*, uint64_t> owned;

  // Compute-stream clock: what ran when, to tell exposed waits from hidden ones.
  std::atomic<uint64_t> compute_done{0};
  uint64_t compute_enqueued = 0;
  std::atomic<int64_t> compute_done_ns{0};
  std::atomic<int64_t> comm_wait_ns{0};

  // The optimizer thread (CPU optimizer).
  struct Job {
    int unit = 0;
    std::shared_ptr<device::Event> grads_ready;  // grad shard final on the host
    optim::AdamHyper hyper;                      // this job's own copy (no sharing with Step)
  };
  std::thread opt_thread;
  std::mutex opt_mu;
  std::condition_variable opt_cv;
  std::deque<Job> opt_queue;
  int opt_pending = 0;
  bool opt_stop = false;
  Status opt_error;
  optim::AdamHyper step_hyper;  // the driving thread's; jobs get copies
  int64_t optimizer_ns = 0;     // total optimizer work this step (guarded by opt_mu)
  // Per unit: the sum of squares of its host gradient shard, taken by the overlapped optimizer's
  // job (guarded by opt_mu; LocalGradSumSquares takes it, or computes it when not ready).
  std::vector<double> host_sumsq;
  std::vector<char> host_sumsq_ready;

  std::optional<optim::LrSchedule> lr;
  std::optional<optim::LossScaler> scaler;
  int64_t steps_taken = 0;
  bool in_step = false;  // between the scheduler's BeginStep and EndStep
  optim::Isa isa = optim::Isa::kScalar;

  Impl(Model& m, EngineOptions o)
      : model(m), opt(std::move(o)), cfg(opt.config), dev(*opt.device), comm(*opt.comm) {}
  ~Impl();

  Status Init();
  Status InitOptimizerStates(int u, const float* src);
  Result<StepResult> Step(std::span<const Batch* const> micro_batches);
  Result<double> Eval(std::span<const Batch* const> micro_batches);
  Result<double> EvalImpl(std::span<const Batch* const> micro_batches);

  // Compute-stream bookkeeping.
  Status StampCompute();
  Status ComputeWaitComm();
  double ExposedSince(int64_t t0_ns) const;

  // Parameters for use by compute. `eval`: for EvalLoss, outside the prefetch scheduler's trace
  // and without keeping persistent units.
  Result<UnitView> AcquireParams(int u, std::string_view owner, int64_t* io_wait_ns,
                                 bool eval = false);
  Status ReleaseParams(int u, const UnitView& view, bool eval = false);
  Result<void*> AllocLive(uint64_t bytes);
  Status FreeLiveAfter(device::Stream& stream, void* ptr);
  void CleanUpFailedStep();
  Result<StepResult> StepImpl(std::span<const Batch* const> micro_batches);
  Status ReduceGrads(int u, void* grads, int mb, bool last);
  Status LandGradShard(int u, const void* dev_shard, int mb);
  Status FinishReducedShard(int u, void* own, int mb, bool last, bool direct_done);
  Status FlushBucket();
  bool Bucketed(int u) const {
    return bucket != nullptr && layouts[u].shard_numel <= bucket_cap;
  }

  // Optimizer.
  Status DeviceOptimizerStep(int u);
  Status CpuOptimizerUnit(int u, const optim::AdamHyper& hyper);
  void OptimizerThread();
  Status QueueOptimizer(int u, std::shared_ptr<device::Event> ready,
                        const optim::AdamHyper& hyper);
  Status WaitOptimizer(int64_t* waited_ns);
  // `optimizer_wait_ns` gains the time spent waiting for overlapped optimizer jobs to take their
  // units' sums (optimizer time, not the norm's: the step reports it as exposed optimizer).
  Result<double> LocalGradSumSquares(int64_t* optimizer_wait_ns);
  double HostGradSumSquares(int u, int64_t* optimizer_wait_ns);
  Result<float> AllReduceHostFloat(float value);
  Status WriteParamShard(int u, const void* host_src);
  Status ReadParamShard(int u, void* host_dst);
  // Calls fn(slot, offset in the parameter, count, offset in the rank's shard) for every
  // parameter range that falls within elements [begin, end) of the rank's shard of unit u.
  template <typename Fn>
  Status ForEachPiece(int u, int64_t begin, int64_t end, Fn&& fn) const;
  Status StoreParamShard(int u, const char* shard_cdt);
  Status LoadUnitStates(int u, const InitialStates& initial);
  Status SaveUnitStates(int u, const StateWriter& write);
  Status InitUnitFromModel(int u);
  Result<std::vector<float>> GatherShards(int u, const void* own_shard_host, DType dtype);
};

}  // namespace strata::zero

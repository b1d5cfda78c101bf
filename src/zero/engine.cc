#include "zero/engine.h"

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

namespace {

using device::DType;
using offload::Access;
using offload::Lease;
using offload::Tier;

double Seconds(int64_t ns) { return static_cast<double>(ns) * 1e-9; }

DType ComputeDType(const Config& config) {
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
// plus the unit in use and the one being gathered, at least four of the largest shard and at most
// all of them.
uint64_t OffloadedParamDeviceBudget(uint64_t shard_bytes_total, uint64_t largest,
                                    uint64_t lookahead_bytes) {
  const uint64_t resident = std::max(shard_bytes_total, 4 * largest);
  return std::min(resident, std::max(lookahead_bytes + 2 * largest, 4 * largest));
}

// Whether the parameter tier manager shares host memory (strata.memory.share_host_memory; auto:
// on for the CPU device).
bool SharesHostMemory(const Config& cfg, device::DeviceType type) {
  return type == device::DeviceType::kCpu && cfg.strata.memory.share_host_memory != Toggle::kOff;
}

Tier HomeOf(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::kNone:
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

}  // namespace

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
  bool cpu_optimizer = false;  // offload_optimizer cpu / nvme
  // The CPU optimizer steps each unit as soon as its gradients land, overlapped with the rest of
  // backward: only when nothing needs every gradient first (no clipping, no fp16 overflow check).
  bool overlapped_optimizer = false;
  Tier param_home = Tier::kDevice;
  Tier optim_home = Tier::kDevice;
  std::vector<UnitLayout> layouts;
  // Tied weights: shared[u] = the earlier units unit u also reads (Model::SharedUnits), and the
  // gradient buffer a shared unit's tying unit already added to, waiting for its own backward.
  std::vector<std::vector<int>> shared;
  std::vector<void*> pending_grad;
  int64_t max_shard = 0;
  int64_t max_padded = 0;

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
  // Stages 1-3, device optimizer: grad shard accumulators (device; stage 1 uses full_grads).
  std::vector<void*> grad_shard_dev;
  // CPU optimizer: grad shard accumulators (host) and the staging buffer they arrive through.
  std::vector<HostBuffer> grad_shard_host;
  HostBuffer grad_landing;
  // CPU optimizer at stages 1-2 (and stage 3 with device-homed parameters): the updated shard in
  // the compute dtype, copied to the device after the step.
  std::vector<HostBuffer> param_stage;
  // Device optimizer: master, m, v (shard-sized; full at stage 0).
  std::vector<void*> master_dev, m_dev, v_dev;
  // The step's scalars: the gradient norm's sum of squares (a double) and the rank sum of it (a
  // float) in device memory, read back through one registered host page; allocated at Init so
  // that the norm costs no allocation and no pageable copy per step.
  void* scalars_dev = nullptr;  // [0, 8): double sum; [8, 12): float for the all-reduce
  void* scalars_host = nullptr;  // 4096 B, registered with the device
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

  std::optional<optim::LrSchedule> lr;
  std::optional<optim::LossScaler> scaler;
  int64_t steps_taken = 0;
  bool in_step = false;  // between the scheduler's BeginStep and EndStep
  optim::Isa isa = optim::Isa::kScalar;

  Impl(Model& m, EngineOptions o)
      : model(m), opt(std::move(o)), cfg(opt.config), dev(*opt.device), comm(*opt.comm) {}
  ~Impl();

  Status Init();
  Status InitOptimizerStates(int u, const std::vector<float>& full);
  Result<StepResult> Step(std::span<const Batch* const> micro_batches);

  // Compute-stream bookkeeping.
  Status StampCompute();
  Status ComputeWaitComm();
  double ExposedSince(int64_t t0_ns) const;

  // Parameters for use by compute.
  Result<UnitView> AcquireParams(int u, std::string_view owner, int64_t* io_wait_ns);
  Status ReleaseParams(int u, const UnitView& view);
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
  Result<double> LocalGradSumSquares();
  Result<float> AllReduceHostFloat(float value);
  Status WriteParamShard(int u, const void* host_src);
  Status ReadParamShard(int u, void* host_dst);
  // Calls fn(slot, offset in the parameter, count, offset in the rank's shard) for every
  // parameter range that falls within elements [begin, end) of the rank's shard of unit u.
  template <typename Fn>
  Status ForEachPiece(int u, int64_t begin, int64_t end, Fn&& fn) const;
  Status LoadUnitStates(int u, const InitialStates& initial);
  Status SaveUnitStates(int u, const StateWriter& write);
  Status InitUnitFromModel(int u);
  Result<std::vector<float>> GatherShards(int u, const void* own_shard_host, DType dtype);
};

Engine::Impl::~Impl() {
  {
    std::lock_guard<std::mutex> lock(opt_mu);
    opt_stop = true;
  }
  opt_cv.notify_all();
  if (opt_thread.joinable()) opt_thread.join();
  if (compute) (void)dev.Synchronize(*compute);
  if (comm_stream) (void)dev.Synchronize(*comm_stream);
  sched.reset();
  ptm.reset();
  ostates.reset();
  for (auto* vec : {&full_params, &full_grads, &grad_shard_dev, &master_dev, &m_dev, &v_dev,
                    &persistent_full}) {
    for (void* p : *vec) dev.Free(p);
  }
  dev.Free(bucket);
  dev.Free(scalars_dev);
  if (scalars_host_registered) (void)dev.UnregisterHost(scalars_host);
  if (scalars_host != nullptr) ::operator delete(scalars_host, std::align_val_t{4096});
}

// ---- compute-stream clock -----------------------------------------------------------------------

Status Engine::Impl::StampCompute() {
  ++compute_enqueued;
  return dev.HostTask(
      *compute,
      [this]() {
        compute_done_ns.store(TraceRecorder::NowNs(), std::memory_order_relaxed);
        compute_done.fetch_add(1, std::memory_order_release);
        return Status::Ok();
      },
      "stamp");
}

// Makes compute wait for everything enqueued on the comm stream so far, measuring on the compute
// stream how long it actually waited (exposed communication).
Status Engine::Impl::ComputeWaitComm() {
  auto t0 = std::make_shared<std::atomic<int64_t>>(0);
  STRATA_RETURN_IF_ERROR(dev.HostTask(
      *compute,
      [t0]() {
        t0->store(TraceRecorder::NowNs());
        return Status::Ok();
      },
      "wait-comm begin"));
  STRATA_RETURN_IF_ERROR(dev.Record(*ev_comm, *comm_stream));
  STRATA_RETURN_IF_ERROR(dev.Wait(*compute, *ev_comm));
  return dev.HostTask(
      *compute,
      [this, t0]() {
        comm_wait_ns.fetch_add(TraceRecorder::NowNs() - t0->load());
        return Status::Ok();
      },
      "wait-comm end");
}

// How much of the host's wait since t0 had the compute stream idle.
double Engine::Impl::ExposedSince(int64_t t0_ns) const {
  const int64_t now = TraceRecorder::NowNs();
  if (compute_done.load(std::memory_order_acquire) < compute_enqueued) return 0.0;  // busy
  const int64_t idle_from = std::max(t0_ns, compute_done_ns.load(std::memory_order_relaxed));
  return now > idle_from ? Seconds(now - idle_from) : 0.0;
}

// Waits until `bytes` more fit under max_live_bytes (or nothing is live: one buffer larger than
// the bound still goes through), then allocates them on the device.
Result<void*> Engine::Impl::AllocLive(uint64_t bytes) {
  {
    std::unique_lock<std::mutex> lock(live_mu);
    live_cv.wait(lock, [&] { return live_bytes == 0 || live_bytes + bytes <= max_live_bytes; });
    live_bytes += bytes;
  }
  Result<void*> p = dev.Alloc(bytes);
  std::lock_guard<std::mutex> lock(live_mu);
  if (!p.ok()) {
    live_bytes -= bytes;
    live_cv.notify_all();
    return p.status();
  }
  owned.emplace(*p, bytes);
  return p;
}

// Frees a buffer from AllocLive once the work enqueued on `stream` so far has run.
Status Engine::Impl::FreeLiveAfter(device::Stream& stream, void* ptr) {
  uint64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(live_mu);
    auto it = owned.find(ptr);
    if (it == owned.end()) return InternalError("FreeLiveAfter: not a live buffer");
    bytes = it->second;
    owned.erase(it);
  }
  Status st = dev.Notify(stream, [this, ptr, bytes](const Status&) {
    dev.Free(ptr);
    {
      std::lock_guard<std::mutex> lock(live_mu);
      live_bytes -= bytes;
    }
    live_cv.notify_all();
  });
  if (!st.ok()) {  // not enqueued: take it back so the clean-up frees it
    std::lock_guard<std::mutex> lock(live_mu);
    owned.emplace(ptr, bytes);
  }
  return st;
}

// After a failed step: no optimizer work may outlive TrainStep, and no transient buffer may leak.
void Engine::Impl::CleanUpFailedStep() {
  {
    std::unique_lock<std::mutex> lock(opt_mu);
    opt_pending -= static_cast<int>(opt_queue.size());
    opt_queue.clear();
    opt_cv.wait(lock, [&] { return opt_pending == 0; });
    opt_error = Status::Ok();
  }
  (void)dev.Synchronize(*compute);
  (void)dev.Synchronize(*comm_stream);
  std::unordered_map<void*, uint64_t> leftovers;
  {
    std::lock_guard<std::mutex> lock(live_mu);
    leftovers.swap(owned);
    for (const auto& [ptr, bytes] : leftovers) live_bytes -= bytes;
  }
  live_cv.notify_all();
  for (const auto& [ptr, bytes] : leftovers) dev.Free(ptr);
  for (void*& p : persistent_full) {
    if (p != nullptr) dev.Free(p);
    p = nullptr;
  }
  bucket_units.clear();
  bucket_fill = 0;
  std::fill(pending_grad.begin(), pending_grad.end(), nullptr);  // freed with `owned` above
  if (ostates) (void)ostates->TakeWritebackError();
  if (ptm) (void)ptm->TakeWritebackError();
  if (sched && in_step) sched->EndStep();
  in_step = false;
}

// ---- set-up -----------------------------------------------------------------------------------

Status Engine::Impl::Init() {
  rank = comm.rank();
  world = comm.world_size();
  stage = cfg.zero.stage;
  cdt = ComputeDType(cfg);
  csz = device::DTypeSize(cdt);
  param_home = stage == 3 ? HomeOf(cfg.zero.offload_param.device) : Tier::kDevice;
  optim_home = HomeOf(cfg.zero.offload_optimizer.device);
  if (stage == 0) optim_home = Tier::kDevice;
  cpu_optimizer = optim_home != Tier::kDevice;
  overlapped_optimizer = cpu_optimizer && opt.overlap_optimizer && cfg.gradient_clipping <= 0.0 &&
                         !cfg.fp16.enabled;
  isa = optim::BestIsa();
  if (opt.cpu_adam_threads < 1) {
    return InvalidArgumentError(
        fmt::format("engine: cpu_adam_threads is {}; expected >= 1", opt.cpu_adam_threads));
  }
  if (opt.optimizer_pipeline_depth < 3) {
    return InvalidArgumentError(fmt::format(
        "engine: optimizer_pipeline_depth is {}; expected >= 3 (read-ahead, current, "
        "write-behind)",
        opt.optimizer_pipeline_depth));
  }
  const bool needs_pool = cpu_optimizer || param_home != Tier::kDevice;
  if (needs_pool && opt.pool == nullptr) {
    return InvalidArgumentError(
        "engine: offload to cpu or nvme needs a pinned pool (EngineOptions::pool)");
  }
  const bool needs_nvme = param_home == Tier::kNvme || optim_home == Tier::kNvme;
  std::vector<std::string> paths = opt.nvme_paths;
  if (paths.empty()) paths = cfg.strata.io.nvme_paths;
  if (needs_nvme && (opt.store == nullptr || paths.empty())) {
    return InvalidArgumentError(
        "engine: NVMe offload needs a block store and at least one NVMe path "
        "(offload_param / offload_optimizer nvme_path, or strata.io.nvme_paths)");
  }

  STRATA_ASSIGN_OR_RETURN(layouts, LayoutModel(model.units(), world));
  for (const auto& l : layouts) {
    max_shard = std::max(max_shard, l.shard_numel);
    max_padded = std::max(max_padded, l.padded_numel());
  }
  const size_t n_units = layouts.size();
  shared.resize(n_units);
  pending_grad.assign(n_units, nullptr);
  uint64_t shared_live_bytes = 0;
  for (size_t u = 0; u < n_units; ++u) {
    shared[u] = model.SharedUnits(static_cast<int>(u));
    for (size_t i = 0; i < shared[u].size(); ++i) {
      const int s = shared[u][i];
      if (s < 0 || s >= static_cast<int>(u) ||
          std::count(shared[u].begin(), shared[u].begin() + static_cast<std::ptrdiff_t>(i), s) > 0) {
        return InvalidArgumentError(fmt::format(
            "model: unit {} ('{}') shares unit {}; a unit may share each earlier unit once", u,
            layouts[u].name, s));
      }
      shared_live_bytes += static_cast<uint64_t>(layouts[s].padded_numel()) * (4 + 8);
    }
  }

  STRATA_ASSIGN_OR_RETURN(compute, dev.CreateStream("compute"));
  STRATA_ASSIGN_OR_RETURN(comm_stream, dev.CreateStream("comm"));
  STRATA_ASSIGN_OR_RETURN(ev_compute, dev.CreateEvent());
  STRATA_ASSIGN_OR_RETURN(ev_comm, dev.CreateEvent());

  // LR schedule and loss scaling.
  STRATA_ASSIGN_OR_RETURN(optim::LrSchedule schedule,
                          optim::LrSchedule::Create(cfg.scheduler, cfg.optimizer));
  lr.emplace(std::move(schedule));
  if (cfg.fp16.enabled) {
    STRATA_ASSIGN_OR_RETURN(optim::LossScaler loss_scaler, optim::LossScaler::Create(cfg.fp16));
    scaler.emplace(std::move(loss_scaler));
  }

  // Tier managers.
  offload::NvmeLayoutOptions nvme;
  nvme.paths = paths;
  nvme.rank = rank;
  nvme.stripe_unit = cfg.strata.io.stripe_unit;
  nvme.durable_writes = cfg.strata.io.durable_writes;
  if (cfg.strata.memory.share_host_memory == Toggle::kOn &&
      dev.type() != device::DeviceType::kCpu) {
    return Status(StatusCode::kInvalidArgument,
                  "strata.memory.share_host_memory is \"on\", but the device is " +
                      std::string(device::DeviceTypeName(dev.type())) +
                      ": only a device whose memory is host memory (cpu) can share it; use "
                      "\"auto\" or \"off\"");
  }
  if (stage == 3) {
    offload::TierManagerOptions to;
    to.device = &dev;
    to.pool = opt.pool;
    to.store = opt.store;
    to.nvme = nvme;
    to.trace = opt.trace;
    // The CPU device's memory is host memory: parameter shards are read in place in their pinned
    // host copies rather than copied into a second buffer (strata.memory.share_host_memory).
    to.share_host_memory = SharesHostMemory(cfg, dev.type());
    uint64_t shard_bytes_total = 0;
    uint64_t largest = 0;
    for (const auto& l : layouts) {
      const uint64_t held = device::PinnedPool::SizeClass(static_cast<uint64_t>(l.shard_numel) * csz);
      shard_bytes_total += held;
      largest = std::max<uint64_t>(largest, held);
    }
    // Device-homed shards all live on the device. Offloaded ones are cached there only as far
    // as the prefetch scheduler looks ahead (stage3_prefetch_bucket_size), plus the unit in use
    // and the one being gathered: device memory for parameters stays within the prefetch budget
    // whatever the model size.
    const offload::PrefetchOptions pf = offload::PrefetchOptions::FromConfig(cfg, csz);
    to.device_budget =
        opt.param_device_budget != 0 ? opt.param_device_budget
        : param_home == Tier::kDevice
            ? std::max(shard_bytes_total, 4 * largest)
            : OffloadedParamDeviceBudget(shard_bytes_total, largest, pf.device_lookahead_bytes);
    if (param_home == Tier::kNvme) {
      // Shared device copies are host copies: the host tier also holds what the device tier
      // caches (PlanPinnedPoolBytes counts the same).
      to.host_budget = opt.param_host_budget != 0 ? opt.param_host_budget
                       : to.share_host_memory  ? 4 * largest + to.device_budget
                                               : 4 * largest;
      // The optimizer holds one unit's host copy while backward stages another through host
      // memory: two of the largest shard is the least that cannot run dry.
      if (to.host_budget < 2 * largest) {
        STRATA_LOG(warn, zero, "parameter host budget {} B raised to {} B (two of the largest shard)",
                   to.host_budget, 2 * largest);
        to.host_budget = 2 * largest;
      }
    } else if (param_home == Tier::kHost) {
      to.host_budget = shard_bytes_total + 2 * largest;
    } else {
      to.host_budget = 2 * largest;  // staging for CPU-optimizer writes of device-homed shards
    }
    STRATA_ASSIGN_OR_RETURN(ptm, offload::TierManager::Create(to));
    for (size_t u = 0; u < n_units; ++u) {
      offload::ShardSpec spec;
      spec.id = u;
      spec.bytes = static_cast<uint64_t>(layouts[u].shard_numel) * csz;
      spec.home = param_home;
      spec.name = fmt::format("{} param shard", layouts[u].name);
      spec.state_class = "param";
      STRATA_RETURN_IF_ERROR(ptm->Register(spec));
    }
    STRATA_RETURN_IF_ERROR(ptm->Start());
    offload::PrefetchOptions po = offload::PrefetchOptions::FromConfig(cfg, csz);
    po.enabled = opt.prefetch;
    po.trace = opt.trace;
    // The engine keeps small units gathered itself (persistent_full); the scheduler must not
    // also hold their shards with leases, which the optimizer's writes would wait on.
    po.persistence_threshold_bytes = 0;
    sched = std::make_unique<offload::PrefetchScheduler>(*ptm, po);
    persistent.assign(n_units, false);
    persistent_full.assign(n_units, nullptr);
    for (size_t u = 0; u < n_units; ++u) {
      STRATA_RETURN_IF_ERROR(sched->AddUnit(u, {u}, layouts[u].name));
      persistent[u] = layouts[u].numel < cfg.zero.stage3_param_persistence_threshold;
    }
  }
  if (cpu_optimizer) {
    // sub_group_size 0 means no tiling: one sub-group per unit shard.
    int64_t sg = cfg.zero.sub_group_size > 0 ? cfg.zero.sub_group_size : max_shard;
    sg = (sg + kShardAlignElems - 1) / kShardAlignElems * kShardAlignElems;
    offload::OptimizerStatesOptions oo;
    oo.tiers.device = &dev;
    oo.tiers.pool = opt.pool;
    oo.tiers.store = opt.store;
    oo.tiers.nvme = nvme;
    oo.tiers.trace = opt.trace;
    oo.home = optim_home;
    oo.pipeline_depth = opt.optimizer_pipeline_depth;
    oo.sub_group_elems = sg;
    for (const auto& l : layouts) {
      oo.unit_elems.push_back(l.shard_numel);
      oo.unit_names.push_back(l.name);
    }
    STRATA_ASSIGN_OR_RETURN(ostates, offload::OptimizerStates::Create(oo));
  }

  // Transient buffers: gathered units (stage 3) and per-unit fp32 gradients. At least two units'
  // worth, so that one unit's gather and another's gradient reduction can be in flight.
  {
    const uint64_t largest = static_cast<uint64_t>(max_padded) * ((stage == 3 ? csz : 0) + 4);
    const uint64_t configured =
        stage == 3 ? static_cast<uint64_t>(cfg.zero.stage3_max_live_parameters) * csz : 0;
    // A tying unit holds its shared units gathered, and their gradients until their own
    // backward, on top of that.
    max_live_bytes = std::max<uint64_t>(configured, 2 * largest) + shared_live_bytes;
  }

  // Memory per stage.
  auto alloc = [&](std::vector<void*>& vec, uint64_t bytes) -> Status {
    STRATA_ASSIGN_OR_RETURN(void* p, dev.Alloc(bytes));
    vec.push_back(p);
    return Status::Ok();
  };
  for (size_t u = 0; u < n_units; ++u) {
    const auto& l = layouts[u];
    const uint64_t padded = static_cast<uint64_t>(l.padded_numel());
    const uint64_t shard = static_cast<uint64_t>(l.shard_numel);
    if (stage <= 2) STRATA_RETURN_IF_ERROR(alloc(full_params, padded * csz));
    if (stage <= 1) STRATA_RETURN_IF_ERROR(alloc(full_grads, padded * 4));
    if (!cpu_optimizer) {
      const uint64_t n = stage == 0 ? padded : shard;
      STRATA_RETURN_IF_ERROR(alloc(master_dev, n * 4));
      STRATA_RETURN_IF_ERROR(alloc(m_dev, n * 4));
      STRATA_RETURN_IF_ERROR(alloc(v_dev, n * 4));
      if (stage >= 2) STRATA_RETURN_IF_ERROR(alloc(grad_shard_dev, shard * 4));
    } else {
      STRATA_ASSIGN_OR_RETURN(HostBuffer g,
                              HostBuffer::Make(opt.pool, shard * 4, "gradient shard (host)"));
      grad_shard_host.push_back(std::move(g));
      if (stage <= 2 || param_home == Tier::kDevice) {
        STRATA_ASSIGN_OR_RETURN(HostBuffer p, HostBuffer::Make(opt.pool, shard * csz,
                                                               "updated parameter shard (host)"));
        param_stage.push_back(std::move(p));
      }
    }
  }
  // The reduction bucket: as large as reduce_bucket_size, but no larger than the units that fit
  // in it need together.
  if (stage >= 2 && world > 1) {
    const int64_t per_rank = std::max<int64_t>(cfg.zero.reduce_bucket_size / world, 1);
    int64_t small = 0;
    for (const auto& l : layouts) {
      if (l.shard_numel <= per_rank) small += l.shard_numel;
    }
    bucket_cap = std::min(per_rank, small);
    if (bucket_cap > 0 && layouts.size() > 1) {
      STRATA_ASSIGN_OR_RETURN(bucket, dev.Alloc(static_cast<uint64_t>(bucket_cap) * world * 4));
    }
  }
  if (cpu_optimizer) {
    STRATA_ASSIGN_OR_RETURN(grad_landing, HostBuffer::Make(opt.pool, max_shard * 4,
                                                           "gradient landing buffer (host)"));
  }
  STRATA_ASSIGN_OR_RETURN(scalars_dev, dev.Alloc(16));
  scalars_host = ::operator new(4096, std::align_val_t{4096});
  std::memset(scalars_host, 0, 4096);
  STRATA_RETURN_IF_ERROR(dev.RegisterHost(scalars_host, 4096));
  scalars_host_registered = true;

  // Initial values: from the caller's reader, or every rank computes each unit in full (fp32)
  // and keeps what it owns.
  for (size_t u = 0; u < n_units; ++u) {
    if (opt.initial.has_value()) {
      STRATA_RETURN_IF_ERROR(LoadUnitStates(static_cast<int>(u), *opt.initial));
      if (opt.initial->progress) opt.initial->progress(static_cast<int>(u) + 1, static_cast<int>(n_units));
    } else {
      STRATA_RETURN_IF_ERROR(InitUnitFromModel(static_cast<int>(u)));
    }
  }
  if (cpu_optimizer) opt_thread = std::thread([this] { OptimizerThread(); });
  return Status::Ok();
}

Status Engine::Impl::InitUnitFromModel(int u) {
  const auto& l = layouts[u];
  std::vector<float> full(static_cast<size_t>(l.padded_numel()), 0.0f);
  STRATA_RETURN_IF_ERROR(model.InitUnit(u, l.slots, std::span<float>(full.data(), l.used_numel)));
  std::vector<char> cast(full.size() * csz);
  device::ConvertHost(full.data(), DType::kF32, cast.data(), cdt, full.size());
  if (stage <= 2) {
    STRATA_RETURN_IF_ERROR(dev.CopyAsync(full_params[u], cast.data(), cast.size(),
                                         device::CopyKind::kHostToDevice, *compute));
    STRATA_RETURN_IF_ERROR(dev.Synchronize(*compute));
  } else {
    STRATA_RETURN_IF_ERROR(WriteParamShard(u, cast.data() + l.shard_offset(rank) * csz));
  }
  return InitOptimizerStates(u, full);
}

Status Engine::Impl::InitOptimizerStates(int u, const std::vector<float>& full) {
  const auto& l = layouts[u];
  if (!cpu_optimizer) {
    const size_t n = stage == 0 ? static_cast<size_t>(l.padded_numel())
                                : static_cast<size_t>(l.shard_numel);
    const float* src = full.data() + (stage == 0 ? 0 : l.shard_offset(rank));
    STRATA_RETURN_IF_ERROR(
        dev.CopyAsync(master_dev[u], src, n * 4, device::CopyKind::kHostToDevice, *compute));
    STRATA_RETURN_IF_ERROR(dev.Fill(m_dev[u], DType::kF32, 0.0f, n, *compute));
    STRATA_RETURN_IF_ERROR(dev.Fill(v_dev[u], DType::kF32, 0.0f, n, *compute));
    return dev.Synchronize(*compute);
  }
  for (const SubGroup& g : ostates->groups(u)) {
    STRATA_ASSIGN_OR_RETURN(Lease lease,
                            ostates->Acquire(g, Access::kOverwrite, "optimizer init"));
    auto* p = static_cast<float*>(lease.data());
    std::memcpy(p, full.data() + l.shard_offset(rank) + g.offset, g.numel * 4);
    std::memset(p + g.numel, 0, 2 * g.numel * 4);
    lease.Release(true);
  }
  return Status::Ok();
}

// Writes unit u's parameter shard (stage 3) from host memory.
Status Engine::Impl::WriteParamShard(int u, const void* host_src) {
  const uint64_t bytes = static_cast<uint64_t>(layouts[u].shard_numel) * csz;
  if (param_home == Tier::kDevice) {
    STRATA_ASSIGN_OR_RETURN(Lease lease,
                            ptm->Acquire(u, Tier::kDevice, Access::kOverwrite, "parameter write"));
    STRATA_RETURN_IF_ERROR(dev.CopyAsync(lease.data(), host_src, bytes,
                                         device::CopyKind::kHostToDevice, *comm_stream));
    STRATA_RETURN_IF_ERROR(dev.Synchronize(*comm_stream));
    lease.Release(true);
    return Status::Ok();
  }
  STRATA_ASSIGN_OR_RETURN(Lease lease,
                          ptm->Acquire(u, Tier::kHost, Access::kOverwrite, "parameter write"));
  std::memcpy(lease.data(), host_src, bytes);
  lease.Release(true);
  return Status::Ok();
}

// ---- parameters for compute -------------------------------------------------------------------

Result<UnitView> Engine::Impl::AcquireParams(int u, std::string_view owner,
                                             int64_t* io_wait_ns) {
  const auto& l = layouts[u];
  UnitView view;
  view.dtype = cdt;
  view.slots = &l.slots;
  if (stage <= 2) {
    view.data = full_params[u];
    return view;
  }
  if (persistent[u] && persistent_full[u] != nullptr) {
    view.data = persistent_full[u];
    return view;
  }
  const uint64_t bytes = static_cast<uint64_t>(l.padded_numel()) * csz;
  // Back-pressure: at most max_live_bytes of gathered units and gradients in flight. A failure
  // below leaves the buffer in `owned`, where the failed step's clean-up frees it.
  STRATA_ASSIGN_OR_RETURN(void* full, AllocLive(bytes));
  const int64_t t0 = TraceRecorder::NowNs();
  auto leases = sched->Acquire(u, Access::kRead, owner);
  *io_wait_ns += TraceRecorder::NowNs() - t0;
  if (!leases.ok()) return leases.status();
  // The shard is ready (Acquire returned); gather it on the comm stream.
  Status st = comm.AllGather((*leases)[0].data(), full, l.shard_numel, cdt, *comm_stream);
  Status rel = sched->Release(u, *leases, false, comm_stream.get());
  STRATA_RETURN_IF_ERROR(st);
  STRATA_RETURN_IF_ERROR(rel);
  STRATA_RETURN_IF_ERROR(ComputeWaitComm());
  if (persistent[u]) {
    // Kept for the rest of the step (freed at its end, or by the clean-up).
    std::lock_guard<std::mutex> lock(live_mu);
    owned.erase(full);
    live_bytes -= bytes;
    persistent_full[u] = full;
  }
  view.data = full;
  return view;
}

Status Engine::Impl::ReleaseParams(int u, const UnitView& view) {
  if (stage <= 2 || persistent[u]) return Status::Ok();
  return FreeLiveAfter(*compute, view.data);
}

// ---- gradients ----------------------------------------------------------------------------------

// `grads`: the unit's full fp32 gradient of this micro-batch (device), written by compute.
Status Engine::Impl::ReduceGrads(int u, void* grads, int mb, bool last) {
  const auto& l = layouts[u];
  const size_t padded = static_cast<size_t>(l.padded_numel());
  const size_t shard = static_cast<size_t>(l.shard_numel);
  if (stage <= 1) {
    STRATA_RETURN_IF_ERROR(dev.Axpy(1.0f, grads, full_grads[u], DType::kF32, padded, *compute));
    return FreeLiveAfter(*compute, grads);
  }
  // Stages 2-3: keep only the shard.
  STRATA_RETURN_IF_ERROR(dev.Record(*ev_compute, *compute));
  STRATA_RETURN_IF_ERROR(dev.Wait(*comm_stream, *ev_compute));
  if (Bucketed(static_cast<int>(u))) {
    // Into the bucket (each rank's part at its stride), then the unit's buffer can go.
    if (bucket_fill + static_cast<int64_t>(shard) > bucket_cap) STRATA_RETURN_IF_ERROR(FlushBucket());
    for (int r = 0; r < world; ++r) {
      STRATA_RETURN_IF_ERROR(dev.CopyAsync(
          static_cast<char*>(bucket) + (static_cast<int64_t>(r) * bucket_cap + bucket_fill) * 4,
          static_cast<const char*>(grads) + l.shard_offset(r) * 4, shard * 4,
          device::CopyKind::kDeviceToDevice, *comm_stream));
    }
    bucket_units.push_back(Pending{u, bucket_fill, mb, last});
    bucket_fill += static_cast<int64_t>(shard);
    STRATA_RETURN_IF_ERROR(FreeLiveAfter(*comm_stream, grads));
    if (u == 0) STRATA_RETURN_IF_ERROR(FlushBucket());  // backward of this micro-batch ends
    return Status::Ok();
  }
  if (bucket_fill > 0) STRATA_RETURN_IF_ERROR(FlushBucket());  // keep the reductions in order
  char* own = static_cast<char*>(grads) + l.shard_offset(rank) * 4;
  bool direct = false;
  if (!cpu_optimizer && mb == 0) {
    STRATA_RETURN_IF_ERROR(comm.ReduceScatter(grads, grad_shard_dev[u], shard, DType::kF32,
                                              comm::ReduceOp::kSum, *comm_stream));
    direct = true;
  } else {
    STRATA_RETURN_IF_ERROR(comm.ReduceScatter(grads, own, shard, DType::kF32,
                                              comm::ReduceOp::kSum, *comm_stream));
  }
  STRATA_RETURN_IF_ERROR(FinishReducedShard(u, own, mb, last, direct));
  STRATA_RETURN_IF_ERROR(FreeLiveAfter(*comm_stream, grads));
  // overlap_comm false: the rest of backward waits for this reduction (DeepSpeed's behaviour).
  if (!cfg.zero.overlap_comm) STRATA_RETURN_IF_ERROR(ComputeWaitComm());
  return Status::Ok();
}

// A unit's reduced gradient shard is at `own` (device, comm-stream order): accumulate it where
// the optimizer reads it, and in the last micro-batch queue the unit's overlapped optimizer step.
Status Engine::Impl::FinishReducedShard(int u, void* own, int mb, bool last, bool direct_done) {
  const size_t shard = static_cast<size_t>(layouts[u].shard_numel);
  if (!direct_done) {
    if (cpu_optimizer) {
      STRATA_RETURN_IF_ERROR(LandGradShard(u, own, mb));
    } else if (mb == 0) {
      STRATA_RETURN_IF_ERROR(dev.CopyAsync(grad_shard_dev[u], own, shard * 4,
                                           device::CopyKind::kDeviceToDevice, *comm_stream));
    } else {
      STRATA_RETURN_IF_ERROR(
          dev.Axpy(1.0f, own, grad_shard_dev[u], DType::kF32, shard, *comm_stream));
    }
  }
  if (last && overlapped_optimizer) {
    std::shared_ptr<device::Event> ready;
    STRATA_ASSIGN_OR_RETURN(auto ev, dev.CreateEvent());
    ready = std::move(ev);
    STRATA_RETURN_IF_ERROR(dev.Record(*ready, *comm_stream));
    STRATA_RETURN_IF_ERROR(QueueOptimizer(u, ready, step_hyper));
  }
  return Status::Ok();
}

// One reduce-scatter for every unit in the bucket (the whole capacity: the parts past the fill
// hold stale values, reduced and never read), then each unit's piece of this rank's block.
Status Engine::Impl::FlushBucket() {
  if (bucket_units.empty()) return Status::Ok();
  char* own = static_cast<char*>(bucket) + static_cast<int64_t>(rank) * bucket_cap * 4;
  STRATA_RETURN_IF_ERROR(comm.ReduceScatter(bucket, own, static_cast<size_t>(bucket_cap),
                                            DType::kF32, comm::ReduceOp::kSum, *comm_stream));
  std::vector<Pending> units = std::move(bucket_units);
  bucket_units.clear();
  bucket_fill = 0;
  for (const Pending& p : units) {
    STRATA_RETURN_IF_ERROR(FinishReducedShard(p.unit, own + p.offset * 4, p.mb, p.last, false));
  }
  if (!cfg.zero.overlap_comm) STRATA_RETURN_IF_ERROR(ComputeWaitComm());
  return Status::Ok();
}

// Copies a reduced gradient shard (device, fp32) to the host and accumulates it, on the comm
// stream.
Status Engine::Impl::LandGradShard(int u, const void* dev_shard, int mb) {
  const size_t shard = static_cast<size_t>(layouts[u].shard_numel);
  float* acc = reinterpret_cast<float*>(grad_shard_host[u].data());
  if (mb == 0) {
    return dev.CopyAsync(acc, dev_shard, shard * 4, device::CopyKind::kDeviceToHost,
                         *comm_stream);
  }
  float* landing = reinterpret_cast<float*>(grad_landing.data());
  STRATA_RETURN_IF_ERROR(dev.CopyAsync(landing, dev_shard, shard * 4,
                                       device::CopyKind::kDeviceToHost, *comm_stream));
  return dev.HostTask(
      *comm_stream,
      [acc, landing, shard]() {
        for (size_t i = 0; i < shard; ++i) acc[i] += landing[i];
        return Status::Ok();
      },
      "accumulate gradient shard");
}

// ---- optimizer ----------------------------------------------------------------------------------

Status Engine::Impl::DeviceOptimizerStep(int u) {
  const auto& l = layouts[u];
  optim::AdamShard s;
  s.n = stage == 0 ? static_cast<size_t>(l.padded_numel()) : static_cast<size_t>(l.shard_numel);
  s.master = static_cast<float*>(master_dev[u]);
  s.m = static_cast<float*>(m_dev[u]);
  s.v = static_cast<float*>(v_dev[u]);
  s.out_dtype = cdt;
  optim::CpuAdamOptions co{isa, opt.cpu_adam_threads};
  if (stage == 0) {
    s.grad = static_cast<const float*>(full_grads[u]);
    s.out16 = full_params[u];
  } else if (stage == 1) {
    s.grad = static_cast<const float*>(full_grads[u]) + l.shard_offset(rank);
    s.out16 = static_cast<char*>(full_params[u]) + l.shard_offset(rank) * csz;
  } else if (stage == 2) {
    s.grad = static_cast<const float*>(grad_shard_dev[u]);
    s.out16 = static_cast<char*>(full_params[u]) + l.shard_offset(rank) * csz;
  } else {
    s.grad = static_cast<const float*>(grad_shard_dev[u]);
    STRATA_ASSIGN_OR_RETURN(Lease lease,
                            ptm->Acquire(u, Tier::kDevice, Access::kOverwrite, "optimizer"));
    s.out16 = lease.data();
    STRATA_RETURN_IF_ERROR(optim::DeviceAdamStep(dev, *compute, step_hyper, s, co));
    lease.Release(true, compute.get());
    return Status::Ok();
  }
  return optim::DeviceAdamStep(dev, *compute, step_hyper, s, co);
}

// One unit's CPU optimizer step: its sub-groups in order, each read ahead (the next one is
// prefetched before the current one is updated) and written behind (released dirty; the tier
// manager writes it to NVMe when it needs the room).
Status Engine::Impl::CpuOptimizerUnit(int u, const optim::AdamHyper& hyper) {
  const float* grad = reinterpret_cast<const float*>(grad_shard_host[u].data());
  Lease param_lease;
  char* out = nullptr;
  if (stage == 3 && param_home != Tier::kDevice) {
    // Read-write, not overwrite: if a sub-group fails, the ones not yet updated keep their
    // current values (consistent with their master weights).
    STRATA_ASSIGN_OR_RETURN(param_lease,
                            ptm->Acquire(u, Tier::kHost, Access::kReadWrite, "optimizer"));
    out = static_cast<char*>(param_lease.data());
  } else {
    out = param_stage[u].data();
  }
  const auto& groups = ostates->groups(u);
  optim::CpuAdamOptions co{isa, opt.cpu_adam_threads};
  // Sub-groups updated so far: their parameters changed in place in the leased copy, and must
  // become the shard's current version even when a later sub-group fails (a clean release would
  // let the tier manager drop them in favour of the old home copy, leaving the parameters behind
  // their master weights).
  size_t updated = 0;
  Status loop = [&]() -> Status {
    for (size_t k = 0; k < groups.size(); ++k) {
      const SubGroup& g = groups[k];
      STRATA_RETURN_IF_ERROR(ostates->Visit(g));
      STRATA_ASSIGN_OR_RETURN(Lease lease, ostates->Acquire(g, Access::kReadWrite, "optimizer"));
      auto* base = static_cast<float*>(lease.data());
      optim::AdamShard s;
      s.master = base;
      s.m = base + g.numel;
      s.v = base + 2 * g.numel;
      s.grad = grad + g.offset;
      s.n = static_cast<size_t>(g.numel);
      s.out16 = out + g.offset * csz;
      s.out_dtype = cdt;
      Status st = optim::CpuAdamStep(hyper, s, co);
      lease.Release(st.ok());
      STRATA_RETURN_IF_ERROR(st);
      ++updated;
      ostates->Visited(g);
    }
    return Status::Ok();
  }();
  if (param_lease) param_lease.Release(/*dirty=*/updated > 0);
  STRATA_RETURN_IF_ERROR(loop);
  // A write-behind of this or an earlier sub-group that failed in the background.
  return ostates->TakeWritebackError();
}

void Engine::Impl::OptimizerThread() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(opt_mu);
      opt_cv.wait(lock, [&] { return opt_stop || !opt_queue.empty(); });
      if (opt_queue.empty()) return;
      job = opt_queue.front();
      opt_queue.pop_front();
    }
    Status st;
    if (job.grads_ready) st = dev.Synchronize(*job.grads_ready);
    const int64_t t0 = TraceRecorder::NowNs();
    bool skip = false;
    {
      std::lock_guard<std::mutex> lock(opt_mu);
      skip = !opt_error.ok();
    }
    if (st.ok() && !skip) st = CpuOptimizerUnit(job.unit, job.hyper);
    const int64_t t1 = TraceRecorder::NowNs();
    {
      std::lock_guard<std::mutex> lock(opt_mu);
      optimizer_ns += t1 - t0;
      if (!st.ok() && opt_error.ok()) opt_error = st;
      --opt_pending;
    }
    opt_cv.notify_all();
  }
}

Status Engine::Impl::QueueOptimizer(int u, std::shared_ptr<device::Event> ready,
                                    const optim::AdamHyper& hyper) {
  {
    std::lock_guard<std::mutex> lock(opt_mu);
    opt_queue.push_back(Job{u, std::move(ready), hyper});
    ++opt_pending;
  }
  opt_cv.notify_all();
  return Status::Ok();
}

Status Engine::Impl::WaitOptimizer(int64_t* waited_ns) {
  const int64_t t0 = TraceRecorder::NowNs();
  std::unique_lock<std::mutex> lock(opt_mu);
  opt_cv.wait(lock, [&] { return opt_pending == 0; });
  *waited_ns += TraceRecorder::NowNs() - t0;
  Status st = opt_error;
  opt_error = Status::Ok();
  return st;
}

// Sum of squares of this rank's part of the (summed, unscaled) gradients, in double.
Result<double> Engine::Impl::LocalGradSumSquares() {
  if (cpu_optimizer) {
    // The gradient shards already sit in host memory, where the optimizer reads them.
    double sum = 0.0;
    for (size_t u = 0; u < layouts.size(); ++u) {
      const float* data = reinterpret_cast<const float*>(grad_shard_host[u].data());
      const size_t n = static_cast<size_t>(layouts[u].shard_numel);
      for (size_t i = 0; i < n; ++i) sum += static_cast<double>(data[i]) * data[i];
    }
    return sum;
  }
  // A device reduction over this rank's gradients; one double comes back.
  auto* host = static_cast<double*>(scalars_host);
  auto* sum = static_cast<double*>(scalars_dev);
  host[0] = 0.0;
  STRATA_RETURN_IF_ERROR(
      dev.CopyAsync(sum, host, sizeof(double), device::CopyKind::kHostToDevice, *comm_stream));
  for (size_t u = 0; u < layouts.size(); ++u) {
    const auto& l = layouts[u];
    const void* src = nullptr;
    size_t n = static_cast<size_t>(l.shard_numel);
    if (stage == 0) {
      src = full_grads[u];
      n = static_cast<size_t>(l.padded_numel());
    } else if (stage == 1) {
      src = static_cast<const float*>(full_grads[u]) + l.shard_offset(rank);
    } else {
      src = grad_shard_dev[u];
    }
    STRATA_RETURN_IF_ERROR(dev.SumSquares(src, DType::kF32, n, sum, *comm_stream));
  }
  STRATA_RETURN_IF_ERROR(
      dev.CopyAsync(host, sum, sizeof(double), device::CopyKind::kDeviceToHost, *comm_stream));
  STRATA_RETURN_IF_ERROR(dev.Synchronize(*comm_stream));
  return host[0];
}

Result<float> Engine::Impl::AllReduceHostFloat(float value) {
  auto* host = reinterpret_cast<float*>(static_cast<char*>(scalars_host) + 8);
  void* buf = static_cast<char*>(scalars_dev) + 8;
  *host = value;
  STRATA_RETURN_IF_ERROR(
      dev.CopyAsync(buf, host, sizeof(float), device::CopyKind::kHostToDevice, *comm_stream));
  STRATA_RETURN_IF_ERROR(
      comm.AllReduce(buf, buf, 1, DType::kF32, comm::ReduceOp::kSum, *comm_stream));
  STRATA_RETURN_IF_ERROR(
      dev.CopyAsync(host, buf, sizeof(float), device::CopyKind::kDeviceToHost, *comm_stream));
  STRATA_RETURN_IF_ERROR(dev.Synchronize(*comm_stream));
  return *host;
}

// ---- the step -----------------------------------------------------------------------------------

Result<StepResult> Engine::Impl::Step(std::span<const Batch* const> micro_batches) {
  if (micro_batches.empty()) return InvalidArgumentError("TrainStep: no micro-batches");
  Result<StepResult> r = StepImpl(micro_batches);
  if (!r.ok()) CleanUpFailedStep();
  return r;
}

Result<StepResult> Engine::Impl::StepImpl(std::span<const Batch* const> micro_batches) {
  const int64_t step_t0 = TraceRecorder::NowNs();
  StepResult result;
  int64_t io_wait_ns = 0;
  double exposed_io = 0.0;
  comm_wait_ns.store(0);
  {
    std::lock_guard<std::mutex> lock(opt_mu);
    optimizer_ns = 0;
  }
  const int n_mb = static_cast<int>(micro_batches.size());
  const int n_units = static_cast<int>(layouts.size());
  const float loss_scale = scaler ? scaler->scale() : 1.0f;
  result.loss_scale = loss_scale;

  // Hyper-parameters of this step (the overlapped optimizer starts during backward).
  result.lr = lr->LrAt(steps_taken);
  step_hyper = optim::AdamHyper{};
  step_hyper.lr = result.lr;
  step_hyper.beta1 = cfg.optimizer.beta1;
  step_hyper.beta2 = cfg.optimizer.beta2;
  step_hyper.eps = cfg.optimizer.eps;
  step_hyper.weight_decay = cfg.optimizer.weight_decay;
  step_hyper.decoupled = cfg.optimizer.decoupled_weight_decay;
  step_hyper.bias_correction = cfg.optimizer.bias_correction;
  step_hyper.step = steps_taken + 1;
  const double inv = 1.0 / (static_cast<double>(world) * n_mb * loss_scale);
  step_hyper.grad_scale = inv;

  if (sched) sched->BeginStep();
  in_step = true;
  for (int u = 0; u < n_units; ++u) {
    const size_t padded = static_cast<size_t>(layouts[u].padded_numel());
    if (stage <= 1) {
      STRATA_RETURN_IF_ERROR(dev.Fill(full_grads[u], DType::kF32, 0.0f, padded, *compute));
    }
  }

  double loss_sum = 0.0;
  for (int mb = 0; mb < n_mb; ++mb) {
    const bool last = mb == n_mb - 1;
    STRATA_RETURN_IF_ERROR(model.BeginMicroBatch(*micro_batches[mb], loss_scale, *compute));
    for (int u = 0; u < n_units; ++u) {
      const int64_t t0 = TraceRecorder::NowNs();
      STRATA_ASSIGN_OR_RETURN(UnitView p, AcquireParams(u, "forward", &io_wait_ns));
      if (shared[u].empty()) {
        exposed_io += ExposedSince(t0);
        STRATA_RETURN_IF_ERROR(model.Forward(u, p, *compute));
        STRATA_RETURN_IF_ERROR(StampCompute());
        STRATA_RETURN_IF_ERROR(ReleaseParams(u, p));
        continue;
      }
      std::vector<UnitView> views{p};
      for (int s : shared[u]) {
        STRATA_ASSIGN_OR_RETURN(UnitView ps, AcquireParams(s, "forward (tied)", &io_wait_ns));
        views.push_back(ps);
      }
      exposed_io += ExposedSince(t0);
      STRATA_RETURN_IF_ERROR(model.ForwardShared(u, views, *compute));
      STRATA_RETURN_IF_ERROR(StampCompute());
      STRATA_RETURN_IF_ERROR(ReleaseParams(u, p));
      for (size_t i = 0; i < shared[u].size(); ++i) {
        STRATA_RETURN_IF_ERROR(ReleaseParams(shared[u][i], views[i + 1]));
      }
    }
    if (last && cpu_optimizer && !overlapped_optimizer) {
      // The step waits for every gradient (clipping, fp16): read its first optimizer states
      // from NVMe during this backward, while the disk has little else to do.
      STRATA_RETURN_IF_ERROR(ostates->ReadAheadFirst());
    }
    for (int u = n_units - 1; u >= 0; --u) {
      const int64_t t0 = TraceRecorder::NowNs();
      STRATA_ASSIGN_OR_RETURN(UnitView p, AcquireParams(u, "backward", &io_wait_ns));
      // The unit's gradient buffer: the one a tying unit already added to, or a zeroed one.
      auto grad_buffer = [&](int v) -> Result<void*> {
        if (void* held = std::exchange(pending_grad[v], nullptr)) return held;
        const size_t padded = static_cast<size_t>(layouts[v].padded_numel());
        STRATA_ASSIGN_OR_RETURN(void* g, AllocLive(padded * 4));
        STRATA_RETURN_IF_ERROR(dev.Fill(g, DType::kF32, 0.0f, padded, *compute));
        return g;
      };
      STRATA_ASSIGN_OR_RETURN(void* g, grad_buffer(u));
      UnitView gv{g, DType::kF32, &layouts[u].slots};
      if (shared[u].empty()) {
        exposed_io += ExposedSince(t0);
        STRATA_RETURN_IF_ERROR(model.Backward(u, p, gv, *compute));
        STRATA_RETURN_IF_ERROR(StampCompute());
        STRATA_RETURN_IF_ERROR(ReleaseParams(u, p));
      } else {
        std::vector<UnitView> views{p}, gviews{gv};
        for (int s : shared[u]) {
          STRATA_ASSIGN_OR_RETURN(UnitView ps, AcquireParams(s, "backward (tied)", &io_wait_ns));
          views.push_back(ps);
          STRATA_ASSIGN_OR_RETURN(void* gs, grad_buffer(s));
          pending_grad[s] = gs;  // reduced after s's own backward
          gviews.push_back(UnitView{gs, DType::kF32, &layouts[s].slots});
        }
        exposed_io += ExposedSince(t0);
        STRATA_RETURN_IF_ERROR(model.BackwardShared(u, views, gviews, *compute));
        STRATA_RETURN_IF_ERROR(StampCompute());
        STRATA_RETURN_IF_ERROR(ReleaseParams(u, p));
        for (size_t i = 0; i < shared[u].size(); ++i) {
          STRATA_RETURN_IF_ERROR(ReleaseParams(shared[u][i], views[i + 1]));
        }
      }
      STRATA_RETURN_IF_ERROR(ReduceGrads(u, g, mb, last));
    }
    STRATA_ASSIGN_OR_RETURN(double loss, model.EndMicroBatch(*compute));
    loss_sum += loss;
  }

  // Stages 0-1: reduce the accumulated full gradients once.
  if (stage <= 1) {
    STRATA_RETURN_IF_ERROR(dev.Record(*ev_compute, *compute));
    STRATA_RETURN_IF_ERROR(dev.Wait(*comm_stream, *ev_compute));
    for (int u = n_units - 1; u >= 0; --u) {
      const auto& l = layouts[u];
      const size_t shard = static_cast<size_t>(l.shard_numel);
      if (stage == 0) {
        STRATA_RETURN_IF_ERROR(comm.AllReduce(full_grads[u], full_grads[u],
                                              static_cast<size_t>(l.padded_numel()), DType::kF32,
                                              comm::ReduceOp::kSum, *comm_stream));
      } else {
        char* own = static_cast<char*>(full_grads[u]) + l.shard_offset(rank) * 4;
        STRATA_RETURN_IF_ERROR(comm.ReduceScatter(full_grads[u], own, shard, DType::kF32,
                                                  comm::ReduceOp::kSum, *comm_stream));
        if (cpu_optimizer) STRATA_RETURN_IF_ERROR(LandGradShard(u, own, 0));
      }
    }
    if (overlapped_optimizer) {
      std::shared_ptr<device::Event> ready;
      STRATA_ASSIGN_OR_RETURN(auto ev, dev.CreateEvent());
      ready = std::move(ev);
      STRATA_RETURN_IF_ERROR(dev.Record(*ready, *comm_stream));
      for (int u = n_units - 1; u >= 0; --u) {
        STRATA_RETURN_IF_ERROR(QueueOptimizer(u, ready, step_hyper));
      }
    }
  }

  // Everything backward enqueued has run; what is left is exposed.
  STRATA_RETURN_IF_ERROR(dev.Synchronize(*compute));
  const int64_t t_comm = TraceRecorder::NowNs();
  STRATA_RETURN_IF_ERROR(dev.Synchronize(*comm_stream));
  int64_t exposed_comm_ns = comm_wait_ns.load() + (TraceRecorder::NowNs() - t_comm);

  const bool overlapped = overlapped_optimizer;
  // Global norm (clipping, overflow check, reporting).
  double clip_coef = 1.0;
  bool overflow = false;
  {
    const int64_t t0 = TraceRecorder::NowNs();
    STRATA_ASSIGN_OR_RETURN(double local, LocalGradSumSquares());
    double total = local;
    if (stage >= 1 && world > 1) {
      const float local_f = static_cast<float>(local);
      STRATA_ASSIGN_OR_RETURN(float all, AllReduceHostFloat(local_f));
      total = all;
    }
    exposed_comm_ns += TraceRecorder::NowNs() - t0;
    overflow = !std::isfinite(total);
    const double norm = std::sqrt(total) * inv;
    result.grad_norm = norm;
    if (cfg.gradient_clipping > 0.0 && std::isfinite(norm)) {
      const double coef = cfg.gradient_clipping / (norm + 1e-6);
      if (coef < 1.0) clip_coef = coef;
    }
  }
  if (scaler) {
    result.skipped = scaler->Update(overflow);
  } else if (overflow) {
    result.skipped = false;  // fp32 / bf16: no skipping; the non-finite values propagate
  }

  int64_t opt_wait_ns = 0;
  if (!result.skipped && !overlapped) {
    step_hyper.grad_scale = inv * clip_coef;  // (overlapped jobs already have theirs: no clipping)
  }
  if (!result.skipped) {
    if (!cpu_optimizer) {
      const int64_t t0 = TraceRecorder::NowNs();
      for (int u = n_units - 1; u >= 0; --u) STRATA_RETURN_IF_ERROR(DeviceOptimizerStep(u));
      STRATA_RETURN_IF_ERROR(dev.Synchronize(*compute));
      opt_wait_ns += TraceRecorder::NowNs() - t0;
      std::lock_guard<std::mutex> lock(opt_mu);
      optimizer_ns += TraceRecorder::NowNs() - t0;
    } else if (!overlapped) {
      for (int u = n_units - 1; u >= 0; --u) {
        STRATA_RETURN_IF_ERROR(QueueOptimizer(u, nullptr, step_hyper));
      }
    }
  }
  if (cpu_optimizer) {
    Status st = WaitOptimizer(&opt_wait_ns);
    STRATA_RETURN_IF_ERROR(st);
    STRATA_RETURN_IF_ERROR(ostates->TakeWritebackError());
  }
  if (ptm) STRATA_RETURN_IF_ERROR(ptm->TakeWritebackError());
  if (!result.skipped) ++steps_taken;

  // Updated shards back into the gathered parameters (stages 1-2) or the device-homed parameter
  // shards (stage 3 with a CPU optimizer).
  {
    const int64_t t0 = TraceRecorder::NowNs();
    for (int u = 0; u < n_units && stage >= 1; ++u) {
      const auto& l = layouts[u];
      const size_t shard = static_cast<size_t>(l.shard_numel);
      if (stage <= 2) {
        char* own = static_cast<char*>(full_params[u]) + l.shard_offset(rank) * csz;
        if (cpu_optimizer && !result.skipped) {
          STRATA_RETURN_IF_ERROR(dev.CopyAsync(own, param_stage[u].data(), shard * csz,
                                               device::CopyKind::kHostToDevice, *comm_stream));
        }
        STRATA_RETURN_IF_ERROR(comm.AllGather(own, full_params[u], shard, cdt, *comm_stream));
      } else if (cpu_optimizer && param_home == Tier::kDevice && !result.skipped) {
        STRATA_RETURN_IF_ERROR(WriteParamShard(u, param_stage[u].data()));
      }
    }
    STRATA_RETURN_IF_ERROR(dev.Synchronize(*comm_stream));
    exposed_comm_ns += TraceRecorder::NowNs() - t0;
  }

  // Stage 3: persistent units are gathered again next step (their shards changed).
  if (stage == 3) {
    for (int u = 0; u < n_units; ++u) {
      if (persistent_full[u] != nullptr) {
        dev.Free(persistent_full[u]);
        persistent_full[u] = nullptr;
      }
    }
    sched->EndStep();
  }
  in_step = false;

  result.step = steps_taken;
  result.loss = loss_sum / n_mb;
  if (world > 1) {
    STRATA_ASSIGN_OR_RETURN(float total, AllReduceHostFloat(static_cast<float>(result.loss)));
    result.loss = static_cast<double>(total) / world;
  }
  result.step_s = Seconds(TraceRecorder::NowNs() - step_t0);
  result.exposed_io_s = exposed_io;
  result.exposed_comm_s = Seconds(exposed_comm_ns);
  result.exposed_optimizer_s = Seconds(opt_wait_ns);
  {
    std::lock_guard<std::mutex> lock(opt_mu);
    result.optimizer_s = Seconds(optimizer_ns);
  }
  result.compute_s = std::max(0.0, result.step_s - result.exposed_io_s - result.exposed_comm_s -
                                       result.exposed_optimizer_s);
  (void)io_wait_ns;
  return result;
}

// ---- checkpoint states ---------------------------------------------------------------------------

// Unit u's parameter shard (stage 3), in the compute dtype, into host memory.
Status Engine::Impl::ReadParamShard(int u, void* host_dst) {
  const uint64_t bytes = static_cast<uint64_t>(layouts[u].shard_numel) * csz;
  if (stage <= 2) {
    const char* own = static_cast<const char*>(full_params[u]) + layouts[u].shard_offset(rank) * csz;
    STRATA_RETURN_IF_ERROR(dev.CopyAsync(host_dst, own, bytes, device::CopyKind::kDeviceToHost,
                                         *comm_stream));
    return dev.Synchronize(*comm_stream);
  }
  if (param_home == Tier::kDevice) {
    STRATA_ASSIGN_OR_RETURN(Lease lease, ptm->Acquire(u, Tier::kDevice, Access::kRead, "checkpoint"));
    STRATA_RETURN_IF_ERROR(dev.CopyAsync(host_dst, lease.data(), bytes,
                                         device::CopyKind::kDeviceToHost, *comm_stream));
    return dev.Synchronize(*comm_stream);
  }
  STRATA_ASSIGN_OR_RETURN(Lease lease, ptm->Acquire(u, Tier::kHost, Access::kRead, "checkpoint"));
  std::memcpy(host_dst, lease.data(), bytes);
  return Status::Ok();
}

template <typename Fn>
Status Engine::Impl::ForEachPiece(int u, int64_t begin, int64_t end, Fn&& fn) const {
  const auto& l = layouts[u];
  const int64_t base = l.shard_offset(rank);
  for (size_t i = 0; i < l.slots.size(); ++i) {
    const ParamSlot& slot = l.slots[i];
    const int64_t lo = std::max(slot.offset, base + begin);
    const int64_t hi = std::min(slot.offset + slot.numel, base + end);
    if (lo >= hi) continue;
    STRATA_RETURN_IF_ERROR(fn(static_cast<int>(i), lo - slot.offset, hi - lo, lo - base));
  }
  return Status::Ok();
}

Status Engine::Impl::SaveUnitStates(int u, const StateWriter& write) {
  const auto& l = layouts[u];
  const int64_t shard = l.shard_numel;
  auto emit = [&](StateKind kind, int64_t begin, int64_t end, const char* base, DType dtype) {
    const size_t es = device::DTypeSize(dtype);
    return ForEachPiece(u, begin, end, [&](int slot, int64_t off, int64_t count, int64_t rel) {
      return write(StatePiece{u, slot, kind, off, count}, base + (rel - begin) * static_cast<int64_t>(es),
                   dtype);
    });
  };
  {
    std::vector<char> params(static_cast<size_t>(shard) * csz);
    STRATA_RETURN_IF_ERROR(ReadParamShard(u, params.data()));
    STRATA_RETURN_IF_ERROR(emit(StateKind::kParams, 0, shard, params.data(), cdt));
  }
  const StateKind kinds[3] = {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq};
  if (!cpu_optimizer) {
    const int64_t first = stage == 0 ? l.shard_offset(rank) : 0;
    void* const bufs[3] = {master_dev[u], m_dev[u], v_dev[u]};
    std::vector<float> host(static_cast<size_t>(shard));
    for (int k = 0; k < 3; ++k) {
      STRATA_RETURN_IF_ERROR(dev.CopyAsync(host.data(), static_cast<const float*>(bufs[k]) + first,
                                           host.size() * 4, device::CopyKind::kDeviceToHost,
                                           *comm_stream));
      STRATA_RETURN_IF_ERROR(dev.Synchronize(*comm_stream));
      STRATA_RETURN_IF_ERROR(emit(kinds[k], 0, shard, reinterpret_cast<const char*>(host.data()),
                                  DType::kF32));
    }
    return Status::Ok();
  }
  // One sub-group at a time: an NVMe-homed shard is never held whole in host memory.
  for (const SubGroup& g : ostates->groups(u)) {
    STRATA_ASSIGN_OR_RETURN(Lease lease, ostates->Acquire(g, Access::kRead, "checkpoint"));
    const char* base = static_cast<const char*>(lease.data());
    for (int k = 0; k < 3; ++k) {
      STRATA_RETURN_IF_ERROR(emit(kinds[k], g.offset, g.offset + g.numel, base + k * g.numel * 4,
                                  DType::kF32));
    }
  }
  return Status::Ok();
}

Status Engine::Impl::LoadUnitStates(int u, const InitialStates& initial) {
  if (!initial.read) return InvalidArgumentError("engine: loading states needs a reader");
  const auto& l = layouts[u];
  const size_t shard = static_cast<size_t>(l.shard_numel);
  // The rank's shard of each state; alignment gaps and padding stay zero.
  std::vector<float> master(shard, 0.0f), m, v;
  auto fill = [&](StateKind kind, std::vector<float>& out) {
    return ForEachPiece(u, 0, l.shard_numel, [&](int slot, int64_t off, int64_t count, int64_t rel) {
      return initial.read(StatePiece{u, slot, kind, off, count}, out.data() + rel, DType::kF32);
    });
  };
  STRATA_RETURN_IF_ERROR(fill(initial.with_optimizer ? StateKind::kMaster : StateKind::kParams, master));
  m.assign(shard, 0.0f);
  v.assign(shard, 0.0f);
  if (initial.with_optimizer) {
    STRATA_RETURN_IF_ERROR(fill(StateKind::kExpAvg, m));
    STRATA_RETURN_IF_ERROR(fill(StateKind::kExpAvgSq, v));
  }
  // Parameters: the master weights in the compute dtype (what the optimizer's fused copy writes).
  std::vector<char> cast(shard * csz);
  device::ConvertHost(master.data(), DType::kF32, cast.data(), cdt, shard);
  if (stage <= 2) {
    char* own = static_cast<char*>(full_params[u]) + l.shard_offset(rank) * csz;
    STRATA_RETURN_IF_ERROR(dev.CopyAsync(own, cast.data(), cast.size(),
                                         device::CopyKind::kHostToDevice, *comm_stream));
    STRATA_RETURN_IF_ERROR(comm.AllGather(own, full_params[u], l.shard_numel, cdt, *comm_stream));
    STRATA_RETURN_IF_ERROR(dev.Synchronize(*comm_stream));
  } else {
    STRATA_RETURN_IF_ERROR(WriteParamShard(u, cast.data()));
  }
  const std::vector<float>* const states[3] = {&master, &m, &v};
  if (!cpu_optimizer) {
    void* const bufs[3] = {master_dev[u], m_dev[u], v_dev[u]};
    for (int k = 0; k < 3; ++k) {
      float* own = static_cast<float*>(bufs[k]) + (stage == 0 ? l.shard_offset(rank) : 0);
      STRATA_RETURN_IF_ERROR(dev.CopyAsync(own, states[k]->data(), shard * 4,
                                           device::CopyKind::kHostToDevice, *comm_stream));
      if (stage == 0) {  // every rank keeps every state
        STRATA_RETURN_IF_ERROR(comm.AllGather(own, bufs[k], l.shard_numel, DType::kF32, *comm_stream));
      }
      STRATA_RETURN_IF_ERROR(dev.Synchronize(*comm_stream));
    }
    return Status::Ok();
  }
  for (const SubGroup& g : ostates->groups(u)) {
    STRATA_ASSIGN_OR_RETURN(Lease lease,
                            ostates->Acquire(g, Access::kOverwrite, "checkpoint load"));
    auto* p = static_cast<float*>(lease.data());
    for (int k = 0; k < 3; ++k) {
      std::memcpy(p + k * g.numel, states[k]->data() + g.offset, static_cast<size_t>(g.numel) * 4);
    }
    lease.Release(true);
  }
  return ostates->TakeWritebackError();
}

// ---- gathering for tests and checkpoints --------------------------------------------------------

// All-gathers each rank's shard (host memory, `dtype`) of unit u and returns the unit in fp32.
Result<std::vector<float>> Engine::Impl::GatherShards(int u, const void* own_shard_host,
                                                      DType dtype) {
  const auto& l = layouts[u];
  const size_t es = device::DTypeSize(dtype);
  const size_t shard = static_cast<size_t>(l.shard_numel);
  const size_t padded = static_cast<size_t>(l.padded_numel());
  STRATA_ASSIGN_OR_RETURN(void* buf, dev.Alloc(padded * es));
  std::vector<char> host(padded * es);
  char* own = static_cast<char*>(buf) + l.shard_offset(rank) * es;
  Status st = dev.CopyAsync(own, own_shard_host, shard * es, device::CopyKind::kHostToDevice,
                            *comm_stream);
  if (st.ok()) st = comm.AllGather(own, buf, shard, dtype, *comm_stream);
  if (st.ok()) {
    st = dev.CopyAsync(host.data(), buf, host.size(), device::CopyKind::kDeviceToHost,
                       *comm_stream);
  }
  if (st.ok()) st = dev.Synchronize(*comm_stream);
  dev.Free(buf);
  STRATA_RETURN_IF_ERROR(st);
  std::vector<float> out(static_cast<size_t>(l.used_numel));
  device::ConvertHost(host.data(), dtype, out.data(), DType::kF32, out.size());
  return out;
}


// ---- Engine -------------------------------------------------------------------------------------

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

Result<std::unique_ptr<Engine>> Engine::Create(Model& model, EngineOptions options) {
  if (options.device == nullptr) return InvalidArgumentError("engine: no device");
  if (options.comm == nullptr) return InvalidArgumentError("engine: no collective");
  auto impl = std::make_unique<Impl>(model, std::move(options));
  STRATA_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Result<uint64_t> Engine::PlanPinnedPoolBytes(const std::vector<UnitSpec>& units,
                                              const Config& config, int world_size,
                                              int optimizer_pipeline_depth,
                                              device::DeviceType device_type) {
  STRATA_ASSIGN_OR_RETURN(std::vector<UnitLayout> layouts, LayoutModel(units, world_size));
  const int stage = config.zero.stage;
  const uint64_t csz = device::DTypeSize(ComputeDType(config));
  const Tier param_home = stage == 3 ? HomeOf(config.zero.offload_param.device) : Tier::kDevice;
  const Tier optim_home = stage == 0 ? Tier::kDevice : HomeOf(config.zero.offload_optimizer.device);
  const bool cpu_optimizer = optim_home != Tier::kDevice;
  auto cls = [](uint64_t bytes) { return static_cast<uint64_t>(device::PinnedPool::SizeClass(bytes)); };
  uint64_t total = 0, largest_param = 0, largest_group = 0, max_shard = 0, params_all = 0;
  int64_t sg = config.zero.sub_group_size;
  for (const auto& l : layouts) max_shard = std::max<uint64_t>(max_shard, l.shard_numel);
  if (sg <= 0) sg = static_cast<int64_t>(max_shard);
  sg = (sg + kShardAlignElems - 1) / kShardAlignElems * kShardAlignElems;
  uint64_t groups_all = 0;
  for (const auto& l : layouts) {
    const uint64_t shard = static_cast<uint64_t>(l.shard_numel);
    largest_param = std::max(largest_param, cls(shard * csz));
    params_all += cls(shard * csz);
    if (cpu_optimizer) {
      total += cls(shard * 4);                                     // gradient shard
      if (stage <= 2 || param_home == Tier::kDevice) total += cls(shard * csz);  // staging
      for (int64_t off = 0; off < l.shard_numel; off += sg) {
        const uint64_t g = cls(12 * static_cast<uint64_t>(std::min<int64_t>(sg, l.shard_numel - off)));
        groups_all += g;
        largest_group = std::max(largest_group, g);
      }
    }
  }
  if (cpu_optimizer) {
    total += cls(max_shard * 4);  // landing buffer
    total += optim_home == Tier::kHost
                 ? groups_all
                 : static_cast<uint64_t>(optimizer_pipeline_depth) * largest_group;
  }
  if (stage == 3) {
    if (param_home == Tier::kHost) total += params_all + 2 * largest_param;
    else if (param_home == Tier::kNvme) {
      total += 4 * largest_param;
      if (SharesHostMemory(config, device_type)) {
        total += OffloadedParamDeviceBudget(
            params_all, largest_param,
            offload::PrefetchOptions::FromConfig(config, csz).device_lookahead_bytes);
      }
    }
    else total += 2 * largest_param;
  }
  // Fragmentation margin, and never less than 16 MiB.
  return std::max<uint64_t>(total + total / 4 + (4u << 20), 16u << 20);
}

Result<StepResult> Engine::TrainStep(std::span<const Batch* const> micro_batches) {
  return impl_->Step(micro_batches);
}

const std::vector<UnitLayout>& Engine::layouts() const { return impl_->layouts; }
device::DType Engine::compute_dtype() const { return impl_->cdt; }

Result<std::vector<float>> Engine::GatherParams(int unit) {
  Impl& m = *impl_;
  if (unit < 0 || unit >= static_cast<int>(m.layouts.size())) {
    return InvalidArgumentError(fmt::format("GatherParams: no unit {}", unit));
  }
  const auto& l = m.layouts[unit];
  if (m.stage <= 2) {
    std::vector<char> host(static_cast<size_t>(l.padded_numel()) * m.csz);
    STRATA_RETURN_IF_ERROR(m.dev.CopyAsync(host.data(), m.full_params[unit], host.size(),
                                           device::CopyKind::kDeviceToHost, *m.comm_stream));
    STRATA_RETURN_IF_ERROR(m.dev.Synchronize(*m.comm_stream));
    std::vector<float> out(static_cast<size_t>(l.used_numel));
    device::ConvertHost(host.data(), m.cdt, out.data(), DType::kF32, out.size());
    return out;
  }
  std::vector<char> shard(static_cast<size_t>(l.shard_numel) * m.csz);
  STRATA_RETURN_IF_ERROR(m.ReadParamShard(unit, shard.data()));
  return m.GatherShards(unit, shard.data(), m.cdt);
}

Result<std::vector<float>> Engine::GatherMaster(int unit) {
  Impl& m = *impl_;
  if (unit < 0 || unit >= static_cast<int>(m.layouts.size())) {
    return InvalidArgumentError(fmt::format("GatherMaster: no unit {}", unit));
  }
  const auto& l = m.layouts[unit];
  std::vector<float> shard(static_cast<size_t>(l.shard_numel));
  if (!m.cpu_optimizer) {
    const size_t n = m.stage == 0 ? static_cast<size_t>(l.padded_numel()) : shard.size();
    std::vector<float> host(n);
    STRATA_RETURN_IF_ERROR(m.dev.CopyAsync(host.data(), m.master_dev[unit], n * 4,
                                           device::CopyKind::kDeviceToHost, *m.comm_stream));
    STRATA_RETURN_IF_ERROR(m.dev.Synchronize(*m.comm_stream));
    if (m.stage == 0) {
      host.resize(static_cast<size_t>(l.used_numel));
      return host;
    }
    shard = std::move(host);
  } else {
    for (const SubGroup& g : m.ostates->groups(unit)) {
      STRATA_ASSIGN_OR_RETURN(Lease lease, m.ostates->Acquire(g, Access::kRead, "gather"));
      std::memcpy(shard.data() + g.offset, lease.data(), static_cast<size_t>(g.numel) * 4);
    }
  }
  return m.GatherShards(unit, shard.data(), DType::kF32);
}

std::string_view StateKindName(StateKind kind) {
  switch (kind) {
    case StateKind::kParams:
      return "params";
    case StateKind::kMaster:
      return "master";
    case StateKind::kExpAvg:
      return "exp_avg";
    case StateKind::kExpAvgSq:
      break;
  }
  return "exp_avg_sq";
}

Status Engine::SaveStates(const StateWriter& write, const StateProgress& progress) {
  Impl& m = *impl_;
  if (!write) return InvalidArgumentError("SaveStates: no writer");
  if (m.in_step) return FailedPreconditionError("SaveStates: a step is in progress");
  const int n = static_cast<int>(m.layouts.size());
  for (int u = 0; u < n; ++u) {
    STRATA_RETURN_IF_ERROR(m.SaveUnitStates(u, write));
    if (progress) progress(u + 1, n);
  }
  return Status::Ok();
}

Status Engine::LoadStates(const InitialStates& initial) {
  Impl& m = *impl_;
  if (m.in_step) return FailedPreconditionError("LoadStates: a step is in progress");
  const int n = static_cast<int>(m.layouts.size());
  for (int u = 0; u < n; ++u) {
    STRATA_RETURN_IF_ERROR(m.LoadUnitStates(u, initial));
    if (initial.progress) initial.progress(u + 1, n);
  }
  return Status::Ok();
}

EngineCounters Engine::counters() const {
  EngineCounters c;
  c.optimizer_steps = impl_->steps_taken;
  if (impl_->scaler) c.loss_scaler = impl_->scaler->state();
  return c;
}

Status Engine::RestoreCounters(const EngineCounters& c) {
  Impl& m = *impl_;
  if (c.optimizer_steps < 0) {
    return InvalidArgumentError(
        fmt::format("optimizer step count {}: expected >= 0", c.optimizer_steps));
  }
  if (c.loss_scaler.has_value() != m.scaler.has_value()) {
    return InvalidArgumentError(
        m.scaler ? "the checkpoint has no loss-scaler state, but fp16 is enabled"
                 : "the checkpoint has a loss-scaler state (fp16), but fp16 is not enabled");
  }
  if (m.scaler) STRATA_RETURN_IF_ERROR(m.scaler->Restore(*c.loss_scaler));
  m.steps_taken = c.optimizer_steps;
  return Status::Ok();
}

EngineStats Engine::stats() const {
  const Impl& m = *impl_;
  EngineStats s;
  if (m.ptm) {
    const auto nvme = m.ptm->stats(Tier::kNvme);
    const auto host = m.ptm->stats(Tier::kHost);
    s.param_nvme_write_bytes = nvme.writeback_bytes;
    s.param_nvme_read_bytes = host.fill_bytes;
    s.host_peak_bytes += host.peak;
    s.prefetch_hit_rate = m.sched->stats().hit_rate();
    const auto dev_tier = m.ptm->stats(Tier::kDevice);
    s.param_device_peak_bytes = dev_tier.peak;
    s.param_device_budget_bytes = dev_tier.budget;
  }
  if (m.ostates) {
    const auto nvme = m.ostates->stats(Tier::kNvme);
    const auto host = m.ostates->stats(Tier::kHost);
    s.optim_nvme_write_bytes = nvme.writeback_bytes;
    s.optim_nvme_read_bytes = host.fill_bytes;
    s.host_peak_bytes += host.peak;
  }
  s.device_peak_bytes = m.dev.memory_stats().peak;
  return s;
}

}  // namespace strata::zero

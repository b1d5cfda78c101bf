#include "zero/engine.h"

#include "zero/engine_internal.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

namespace strata::zero {

Engine::Impl::Impl(Model& m, EngineOptions o)
    : model(m),
      options(std::move(o)),
      config(options.config),
      device(*options.device),
      collective(*options.comm),
      clock(device, streams),
      live(device),
      cpu_worker(device),
      scalars(device, collective, streams),
      params({setup, options, device, collective, streams, clock, live, node_groups}),
      adam(setup, options, device, streams),
      reducer({setup, config, device, collective, options.pool, options.cpu_adam_threads, streams,
               clock, live, cpu_worker, scalars, node_groups},
              [this](int u, std::shared_ptr<device::Event> ready) {
                return QueueUpdate(u, std::move(ready));
              }) {}

// The optimizer's thread first (its jobs use every other component), then the streams (their
// tasks free live buffers and read the clock), then the tier managers; the components free their
// own buffers as they are destroyed.
Engine::Impl::~Impl() {
  cpu_worker.Stop();
  streams.SynchronizeQuietly(device);
  params.StopTiers();
  adam.StopOffloaded();
}

// ---- set-up -----------------------------------------------------------------------------------

namespace {

Status CheckShareHostMemory(const Config& cfg, device::DeviceType type) {
  if (cfg.strata.memory.share_host_memory != Toggle::kOn || type == device::DeviceType::kCpu) {
    return Status::Ok();
  }
  return Status(StatusCode::kInvalidArgument,
                "strata.memory.share_host_memory is \"on\", but the device is " +
                    std::string(device::DeviceTypeName(type)) +
                    ": only a device whose memory is host memory (cpu) can share it; use "
                    "\"auto\" or \"off\"");
}

}  // namespace

Status Engine::Impl::Init() {
  STRATA_ASSIGN_OR_RETURN(setup, ResolveSetup(model, options, collective));
  if (setup.hpz > 1 || setup.quantized_grads) {
    STRATA_ASSIGN_OR_RETURN(node_groups, comm::SplitNodeGroups(collective, setup.topology));
  }
  STRATA_RETURN_IF_ERROR(streams.Create(device));
  STRATA_RETURN_IF_ERROR(InitSchedules());
  STRATA_RETURN_IF_ERROR(CheckShareHostMemory(config, device.type()));
  const offload::NvmeLayoutOptions nvme = NvmeLayout();
  if (setup.stage == 3) STRATA_RETURN_IF_ERROR(params.StartTiers(nvme));
  if (setup.cpu_optimizer) STRATA_RETURN_IF_ERROR(adam.CreateOffloaded(nvme));
  live.set_limit(MaxLiveBytes());
  for (int u = 0; u < setup.units(); ++u) STRATA_RETURN_IF_ERROR(AllocateUnit(u));
  STRATA_RETURN_IF_ERROR(reducer.AllocateShared());
  STRATA_RETURN_IF_ERROR(scalars.Allocate());
  STRATA_RETURN_IF_ERROR(InitialValues());
  cpu_worker.Prepare(setup.units());
  if (setup.cpu_optimizer) StartCpuOptimizer();
  return Status::Ok();
}

// The LR schedule, and loss scaling with fp16.
Status Engine::Impl::InitSchedules() {
  STRATA_ASSIGN_OR_RETURN(optim::LrSchedule schedule,
                          optim::LrSchedule::Create(config.scheduler, config.optimizer));
  lr_schedule.emplace(std::move(schedule));
  if (config.fp16.enabled) {
    STRATA_ASSIGN_OR_RETURN(optim::LossScaler scaler, optim::LossScaler::Create(config.fp16));
    loss_scaler.emplace(std::move(scaler));
  }
  return Status::Ok();
}

offload::NvmeLayoutOptions Engine::Impl::NvmeLayout() const {
  offload::NvmeLayoutOptions nvme;
  nvme.paths = setup.nvme_paths;
  nvme.rank = setup.file_rank;
  nvme.stripe_unit = config.strata.io.stripe_unit;
  nvme.durable_writes = config.strata.io.durable_writes;
  return nvme;
}

// The live-buffer limit: gathered units (stage 3) and per-unit fp32 gradients. At least two
// units' worth, so that one unit's gather and another's gradient reduction can be in flight. (A
// frozen unit has no gradient buffer: LoRA's base units count their gathered copy only.)
uint64_t Engine::Impl::MaxLiveBytes() const {
  const uint64_t gathered_bytes = setup.stage == 3 ? setup.compute_bytes : 0;
  // With zero_quantized_weights a gather also holds every rank's quantized shard.
  const bool quantized = setup.stage == 3 && config.zero.zero_quantized_weights;
  uint64_t largest = 0;
  for (const auto& l : setup.layouts) {
    largest = std::max<uint64_t>(
        largest, static_cast<uint64_t>(l.padded_numel()) *
                         (gathered_bytes + (setup.frozen[static_cast<size_t>(l.index)] ? 0 : 4)) +
                     (quantized ? QuantizedShardBytes(l.shard_numel) *
                                      static_cast<uint64_t>(setup.world_size)
                                : 0));
  }
  const uint64_t configured =
      setup.stage == 3
          ? static_cast<uint64_t>(config.zero.stage3_max_live_parameters) * setup.compute_bytes
          : 0;
  // A tying unit holds its shared units gathered, and their gradients until their own
  // backward, on top of that.
  return std::max<uint64_t>(configured, 2 * largest) + setup.shared_live_bytes;
}

// Unit u's long-lived buffers, in the order the engine has always allocated them (device: the
// gathered parameters, the gradient accumulator, master / m / v, the gradient shard; pinned
// pool: the host gradient shard, the staged parameters), so that the allocators see the same
// sequence. Each component keeps one entry per unit, empty where the unit has none.
Status Engine::Impl::AllocateUnit(int u) {
  STRATA_RETURN_IF_ERROR(params.AllocateGathered(u));
  STRATA_RETURN_IF_ERROR(reducer.AllocateAccumulator(u));
  STRATA_RETURN_IF_ERROR(adam.AllocateDevice(u));
  STRATA_RETURN_IF_ERROR(reducer.AllocateShard(u));
  return adam.AllocateStaging(u);
}

// Initial values: from the caller's reader, or every rank computes each unit in full (fp32)
// and keeps what it owns.
Status Engine::Impl::InitialValues() {
  const std::optional<InitialStates>& initial = options.initial;
  const int n_units = setup.units();
  for (int u = 0; u < n_units; ++u) {
    const bool from_model = initial.has_value() &&
                            static_cast<size_t>(u) < initial->init_from_model.size() &&
                            initial->init_from_model[static_cast<size_t>(u)] != 0;
    if (initial.has_value() && !from_model) {
      STRATA_RETURN_IF_ERROR(LoadUnitStates(u, *initial));
      if (initial->progress) initial->progress(u + 1, n_units);
    } else {
      STRATA_RETURN_IF_ERROR(InitUnitFromModel(u));
    }
  }
  return Status::Ok();
}

Status Engine::Impl::InitUnitFromModel(int u) {
  const auto& l = layout(u);
  const DType dtype = setup.compute_dtype;
  if (setup.stage == 0) {
    // Every rank keeps the whole unit and all of its optimizer states.
    std::vector<float> full(static_cast<size_t>(l.padded_numel()), 0.0f);
    STRATA_RETURN_IF_ERROR(
        model.InitUnit(u, l.slots, std::span<float>(full.data(), l.used_numel)));
    std::vector<char> cast(full.size() * setup.compute_bytes);
    device::ConvertHost(full.data(), DType::kF32, cast.data(), dtype, full.size());
    STRATA_RETURN_IF_ERROR(device.CopyAsync(params.gathered(u), cast.data(), cast.size(),
                                            device::CopyKind::kHostToDevice, *streams.compute));
    STRATA_RETURN_IF_ERROR(device.Synchronize(*streams.compute));
    return adam.InitUnit(u, full.data());
  }
  // Stages 1-3: the rank initialises its shard only (the model's values for those elements,
  // the same on every rank), and stages 1-2 all-gather the parameters as loading does. Set-up
  // holds one shard, not one unit, on each rank.
  std::vector<float> shard(static_cast<size_t>(l.shard_numel));
  STRATA_RETURN_IF_ERROR(model.InitUnitRange(u, l.slots, l.used_numel, l.shard_offset(setup.rank),
                                             std::span<float>(shard)));
  {
    std::vector<char> cast(shard.size() * setup.compute_bytes);
    device::ConvertHost(shard.data(), DType::kF32, cast.data(), dtype, shard.size());
    STRATA_RETURN_IF_ERROR(params.StoreShard(u, cast.data()));
  }
  return adam.InitUnit(u, shard.data());
}

// The CPU optimizer's jobs: the unit's share of the gradient norm (overlapped), its update, and
// freeing its streamed gradient shard.
void Engine::Impl::StartCpuOptimizer() {
  CpuOptimizerWorker::Work work;
  work.take_sum_squares = setup.overlapped_optimizer;
  work.free_grad_shards = setup.stream_grad_shards;
  work.grad_sum_squares = [this](int u) {
    return reducer.HostShardSumSquares(u, reducer.HostShard(u), options.cpu_adam_threads);
  };
  work.update = [this](int u, const optim::AdamHyper& hyper) { return CpuOptimizerUnit(u, hyper); };
  work.free_grad_shard = [this](int u) { reducer.FreeHostShard(u); };
  cpu_worker.Start(std::move(work));
}

// ---- Engine -------------------------------------------------------------------------------------

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

Result<std::unique_ptr<Engine>> Engine::Create(Model& model, EngineOptions options) {
  if (options.device == nullptr) return InvalidArgumentError("engine: no device");
  if (options.comm == nullptr) return InvalidArgumentError("engine: no collective");
  STRATA_RETURN_IF_ERROR(engine_internal::CheckResolved(options.config));
  auto impl = std::make_unique<Impl>(model, std::move(options));
  STRATA_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Result<StepResult> Engine::TrainStep(std::span<const Batch* const> micro_batches) {
  return impl_->Step(micro_batches);
}

Result<double> Engine::EvalLoss(std::span<const Batch* const> micro_batches) {
  return impl_->Eval(micro_batches);
}

const std::vector<UnitLayout>& Engine::layouts() const { return impl_->setup.layouts; }
const std::vector<char>& Engine::frozen_units() const { return impl_->setup.frozen; }
device::DType Engine::compute_dtype() const { return impl_->setup.compute_dtype; }

Result<std::vector<float>> Engine::GatherParams(int unit) {
  Impl& m = *impl_;
  const EngineSetup& setup = m.setup;
  if (unit < 0 || unit >= setup.units()) {
    return InvalidArgumentError(fmt::format("GatherParams: no unit {}", unit));
  }
  const auto& l = m.layout(unit);
  if (setup.stage <= 2) {
    std::vector<char> host(static_cast<size_t>(l.padded_numel()) * setup.compute_bytes);
    STRATA_RETURN_IF_ERROR(m.device.CopyAsync(host.data(), m.params.gathered(unit), host.size(),
                                              device::CopyKind::kDeviceToHost, *m.streams.comm));
    STRATA_RETURN_IF_ERROR(m.device.Synchronize(*m.streams.comm));
    std::vector<float> out(static_cast<size_t>(l.used_numel));
    device::ConvertHost(host.data(), setup.compute_dtype, out.data(), DType::kF32, out.size());
    return out;
  }
  std::vector<char> shard(setup.shard_bytes(unit));
  STRATA_RETURN_IF_ERROR(m.params.ReadShard(unit, shard.data()));
  return m.GatherShards(unit, shard.data(), setup.compute_dtype);
}

Result<std::vector<float>> Engine::GatherMaster(int unit) {
  Impl& m = *impl_;
  const EngineSetup& setup = m.setup;
  if (unit < 0 || unit >= setup.units()) {
    return InvalidArgumentError(fmt::format("GatherMaster: no unit {}", unit));
  }
  const auto& l = m.layout(unit);
  if (setup.is_frozen(unit)) return GatherParams(unit);  // no master weights: the parameters are it
  std::vector<float> shard(static_cast<size_t>(l.shard_numel));
  if (!setup.on_cpu(unit)) {
    const size_t n = setup.stage == 0 ? static_cast<size_t>(l.padded_numel()) : shard.size();
    std::vector<float> host(n);
    STRATA_RETURN_IF_ERROR(m.device.CopyAsync(host.data(), m.adam.master(unit), n * 4,
                                              device::CopyKind::kDeviceToHost, *m.streams.comm));
    STRATA_RETURN_IF_ERROR(m.device.Synchronize(*m.streams.comm));
    if (setup.stage == 0) {
      host.resize(static_cast<size_t>(l.used_numel));
      return host;
    }
    shard = std::move(host);
  } else {
    for (const SubGroup& g : m.adam.groups(unit)) {
      STRATA_ASSIGN_OR_RETURN(Lease lease, m.adam.offloaded().Acquire(g, Access::kRead, "gather"));
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
  const int n = m.setup.units();
  for (int u = 0; u < n; ++u) {
    STRATA_RETURN_IF_ERROR(m.SaveUnitStates(u, write));
    if (progress) progress(u + 1, n);
  }
  return Status::Ok();
}

Status Engine::LoadStates(const InitialStates& initial) {
  Impl& m = *impl_;
  if (m.in_step) return FailedPreconditionError("LoadStates: a step is in progress");
  const int n = m.setup.units();
  for (int u = 0; u < n; ++u) {
    if (static_cast<size_t>(u) < initial.init_from_model.size() && initial.init_from_model[u]) {
      continue;  // keeps what it holds
    }
    STRATA_RETURN_IF_ERROR(m.LoadUnitStates(u, initial));
    if (initial.progress) initial.progress(u + 1, n);
  }
  return Status::Ok();
}

EngineCounters Engine::counters() const {
  EngineCounters c;
  c.optimizer_steps = impl_->steps_taken;
  if (impl_->loss_scaler) c.loss_scaler = impl_->loss_scaler->state();
  return c;
}

Status Engine::RestoreCounters(const EngineCounters& c) {
  Impl& m = *impl_;
  if (c.optimizer_steps < 0) {
    return InvalidArgumentError(
        fmt::format("optimizer step count {}: expected >= 0", c.optimizer_steps));
  }
  if (c.loss_scaler.has_value() != m.loss_scaler.has_value()) {
    return InvalidArgumentError(
        m.loss_scaler ? "the checkpoint has no loss-scaler state, but fp16 is enabled"
                      : "the checkpoint has a loss-scaler state (fp16), but fp16 is not enabled");
  }
  if (m.loss_scaler) STRATA_RETURN_IF_ERROR(m.loss_scaler->Restore(*c.loss_scaler));
  m.steps_taken = c.optimizer_steps;
  return Status::Ok();
}

EngineStats Engine::stats() const {
  const Impl& m = *impl_;
  const EngineSetup& setup = m.setup;
  EngineStats s;
  s.units = setup.units();
  s.frozen_units = static_cast<int>(std::count(setup.frozen.begin(), setup.frozen.end(), 1));
  s.offloaded_optimizer_units = static_cast<int>(
      std::count(setup.cpu_optimizer_unit.begin(), setup.cpu_optimizer_unit.end(), 1));
  m.params.AddStats(s);
  m.adam.AddStats(s);
  s.device_peak_bytes = m.device.memory_stats().peak;
  s.qgz_staging_bytes = m.reducer.qgz_staging_bytes();
  if (m.options.traffic != nullptr) {
    for (int p = 0; p < comm::kTrafficPhases; ++p) {
      s.traffic[static_cast<size_t>(p)] = m.options.traffic->of(static_cast<comm::TrafficPhase>(p));
    }
  }
  return s;
}

}  // namespace strata::zero

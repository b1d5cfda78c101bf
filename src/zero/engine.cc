#include "zero/engine.h"

#include "zero/engine_internal.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace strata::zero {

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
  if (scalars_host_registered) (void)dev.UnregisterHost(scalars_host.data());
}

// ---- set-up -----------------------------------------------------------------------------------

Status Engine::Impl::Init() {
  rank = comm.rank();
  world = comm.world_size();
  cdt = ComputeDType(cfg);
  const Placement placement = PlacementOf(cfg);
  stage = placement.stage;
  csz = placement.csz;
  param_home = placement.param_home;
  optim_home = placement.optim_home;
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
  STRATA_ASSIGN_OR_RETURN(layouts, LayoutModel(model.units(), world));
  STRATA_ASSIGN_OR_RETURN(frozen, FrozenUnitsOf(cfg, model.units()));
  cpu_unit = CpuOptimizerUnits(cfg, layouts, frozen);
  cpu_optimizer = std::count(cpu_unit.begin(), cpu_unit.end(), 1) > 0;
  device_optimizer = false;
  for (size_t u = 0; u < layouts.size(); ++u) device_optimizer |= !cpu_unit[u] && !frozen[u];
  if (optim_home != Tier::kDevice && !cpu_optimizer && device_optimizer && rank == 0) {
    // offload_optimizer.ratio below half of the last trainable unit's share selects no unit.
    int64_t total = 0, last = 0;
    for (size_t u = 0; u < layouts.size(); ++u) {
      if (frozen[u]) continue;
      total += layouts[u].shard_numel;
      last = layouts[u].shard_numel;
    }
    STRATA_LOG(warn, zero,
               "offload_optimizer.ratio {:g} offloads no unit (the engine offloads whole units; "
               "the smallest ratio that takes the last one is {:.3g}): every optimizer state "
               "stays on the device",
               cfg.zero.offload_optimizer.ratio,
               0.5 * static_cast<double>(last) / static_cast<double>(std::max<int64_t>(total, 1)));
  }
  // The CPU optimizer overlaps backward only when an update never depends on the global gradient
  // norm: no clipping, no fp16 overflow skipping, no skipping of non-finite steps.
  overlapped_optimizer = cpu_optimizer && opt.overlap_optimizer && OverlapsOptimizer(cfg);
  stream_grad_shards = overlapped_optimizer && StreamsGradShards(cfg, world, opt.overlap_optimizer);
  const bool needs_pool = cpu_optimizer || param_home != Tier::kDevice;
  if (needs_pool && opt.pool == nullptr) {
    return InvalidArgumentError(
        "engine: offload to cpu or nvme needs a pinned pool (EngineOptions::pool)");
  }
  const bool needs_nvme = param_home == Tier::kNvme || (cpu_optimizer && optim_home == Tier::kNvme);
  std::vector<std::string> paths = opt.nvme_paths;
  if (paths.empty()) paths = cfg.strata.io.nvme_paths;
  if (needs_nvme && (opt.store == nullptr || paths.empty())) {
    return InvalidArgumentError(
        "engine: NVMe offload needs a block store and at least one NVMe path "
        "(offload_param / offload_optimizer nvme_path, or strata.io.nvme_paths)");
  }

  for (const auto& l : layouts) {
    max_shard = std::max(max_shard, l.shard_numel);
  }
  const size_t n_units = layouts.size();
  shared.resize(n_units);
  recompute.resize(n_units);
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
  for (size_t u = 0; u < n_units; ++u) {
    recompute[u] = model.RecomputeUnits(static_cast<int>(u));
    for (const int r : recompute[u]) {
      if (r < 0 || r >= static_cast<int>(u) || !shared[static_cast<size_t>(r)].empty()) {
        return InvalidArgumentError(fmt::format(
            "model: unit {} ('{}') recomputes unit {}; a unit may recompute only earlier units "
            "that share none",
            u, layouts[u].name, r));
      }
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
      to.host_budget = opt.param_host_budget != 0
                           ? opt.param_host_budget
                           : NvmeParamHostBudget(shard_bytes_total, largest, to.device_budget,
                                                 to.share_host_memory);
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
      // A unit on the device optimizer has no sub-groups.
      oo.unit_elems.push_back(cpu_unit[static_cast<size_t>(l.index)] ? l.shard_numel : 0);
      oo.unit_names.push_back(l.name);
    }
    STRATA_ASSIGN_OR_RETURN(ostates, offload::OptimizerStates::Create(oo));
  }

  // Transient buffers: gathered units (stage 3) and per-unit fp32 gradients. At least two units'
  // worth, so that one unit's gather and another's gradient reduction can be in flight. (A frozen
  // unit has no gradient buffer: LoRA's base units count their gathered copy only.)
  {
    uint64_t largest = 0;
    for (const auto& l : layouts) {
      largest = std::max<uint64_t>(
          largest, static_cast<uint64_t>(l.padded_numel()) *
                       ((stage == 3 ? csz : 0) + (frozen[static_cast<size_t>(l.index)] ? 0 : 4)));
    }
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
    // Per-unit vectors keep one entry per unit: nullptr / empty where the unit's optimizer
    // lives elsewhere, or where it has none (frozen).
    if (frozen[u]) {
      for (auto* vec : {&full_grads, &master_dev, &m_dev, &v_dev, &grad_shard_dev}) {
        vec->push_back(nullptr);
      }
      grad_shard_host.emplace_back();
      param_stage.emplace_back();
      continue;
    }
    if (stage <= 1) STRATA_RETURN_IF_ERROR(alloc(full_grads, padded * 4));
    if (!cpu_unit[u]) {
      const uint64_t n = stage == 0 ? padded : shard;
      STRATA_RETURN_IF_ERROR(alloc(master_dev, n * 4));
      STRATA_RETURN_IF_ERROR(alloc(m_dev, n * 4));
      STRATA_RETURN_IF_ERROR(alloc(v_dev, n * 4));
      if (stage >= 2) {
        STRATA_RETURN_IF_ERROR(alloc(grad_shard_dev, shard * 4));
      } else {
        grad_shard_dev.push_back(nullptr);
      }
      grad_shard_host.emplace_back();
      param_stage.emplace_back();
    } else {
      for (auto* vec : {&master_dev, &m_dev, &v_dev, &grad_shard_dev}) vec->push_back(nullptr);
      if (stream_grad_shards) {
        grad_shard_host.emplace_back();  // allocated when it lands (LandGradShard)
      } else {
        STRATA_ASSIGN_OR_RETURN(HostBuffer g,
                                HostBuffer::Make(opt.pool, shard * 4, "gradient shard (host)"));
        grad_shard_host.push_back(std::move(g));
      }
      if (stage <= 2 || param_home == Tier::kDevice) {
        STRATA_ASSIGN_OR_RETURN(HostBuffer p, HostBuffer::Make(opt.pool, shard * csz,
                                                               "updated parameter shard (host)"));
        param_stage.push_back(std::move(p));
      } else {
        param_stage.emplace_back();
      }
    }
  }
  // The reduction bucket (ReduceBucketCapacity).
  bucket_cap = ReduceBucketCapacity(cfg, layouts, frozen, world, overlapped_optimizer);
  if (bucket_cap > 0) {
    STRATA_ASSIGN_OR_RETURN(bucket, dev.Alloc(static_cast<uint64_t>(bucket_cap) * world * 4));
  }
  if (cpu_optimizer) {
    int64_t largest_offloaded = 0;
    for (size_t u = 0; u < n_units; ++u) {
      if (cpu_unit[u]) largest_offloaded = std::max(largest_offloaded, layouts[u].shard_numel);
    }
    STRATA_ASSIGN_OR_RETURN(grad_landing, HostBuffer::Make(opt.pool, largest_offloaded * 4,
                                                           "gradient landing buffer (host)"));
  }
  STRATA_ASSIGN_OR_RETURN(scalars_dev, dev.Alloc(16));
  STRATA_ASSIGN_OR_RETURN(scalars_host, HostRegion::Allocate(4096, HugePages::kOff));
  STRATA_RETURN_IF_ERROR(dev.RegisterHost(scalars_host.data(), scalars_host.size()));
  scalars_host_registered = true;

  // Initial values: from the caller's reader, or every rank computes each unit in full (fp32)
  // and keeps what it owns.
  for (size_t u = 0; u < n_units; ++u) {
    const bool from_model = opt.initial.has_value() && u < opt.initial->init_from_model.size() &&
                            opt.initial->init_from_model[u] != 0;
    if (opt.initial.has_value() && !from_model) {
      STRATA_RETURN_IF_ERROR(LoadUnitStates(static_cast<int>(u), *opt.initial));
      if (opt.initial->progress) opt.initial->progress(static_cast<int>(u) + 1, static_cast<int>(n_units));
    } else {
      STRATA_RETURN_IF_ERROR(InitUnitFromModel(static_cast<int>(u)));
    }
  }
  host_sumsq.assign(n_units, 0.0);
  host_sumsq_ready.assign(n_units, 0);
  if (cpu_optimizer) opt_thread = std::thread([this] { OptimizerThread(); });
  return Status::Ok();
}

Status Engine::Impl::InitUnitFromModel(int u) {
  const auto& l = layouts[u];
  if (stage == 0) {
    // Every rank keeps the whole unit and all of its optimizer states.
    std::vector<float> full(static_cast<size_t>(l.padded_numel()), 0.0f);
    STRATA_RETURN_IF_ERROR(
        model.InitUnit(u, l.slots, std::span<float>(full.data(), l.used_numel)));
    std::vector<char> cast(full.size() * csz);
    device::ConvertHost(full.data(), DType::kF32, cast.data(), cdt, full.size());
    STRATA_RETURN_IF_ERROR(dev.CopyAsync(full_params[u], cast.data(), cast.size(),
                                         device::CopyKind::kHostToDevice, *compute));
    STRATA_RETURN_IF_ERROR(dev.Synchronize(*compute));
    return InitOptimizerStates(u, full.data());
  }
  // Stages 1-3: the rank initialises its shard only (the model's values for those elements,
  // the same on every rank), and stages 1-2 all-gather the parameters as loading does. Set-up
  // holds one shard, not one unit, on each rank.
  std::vector<float> shard(static_cast<size_t>(l.shard_numel));
  STRATA_RETURN_IF_ERROR(model.InitUnitRange(u, l.slots, l.used_numel, l.shard_offset(rank),
                                             std::span<float>(shard)));
  {
    std::vector<char> cast(shard.size() * csz);
    device::ConvertHost(shard.data(), DType::kF32, cast.data(), cdt, shard.size());
    STRATA_RETURN_IF_ERROR(StoreParamShard(u, cast.data()));
  }
  return InitOptimizerStates(u, shard.data());
}

// `src`: what the rank keeps of unit u in fp32, the whole unit at stage 0, else its shard.
Status Engine::Impl::InitOptimizerStates(int u, const float* src) {
  if (frozen[u]) return Status::Ok();  // no optimizer state
  const auto& l = layouts[u];
  if (!cpu_unit[u]) {
    const size_t n = stage == 0 ? static_cast<size_t>(l.padded_numel())
                                : static_cast<size_t>(l.shard_numel);
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
    std::memcpy(p, src + (stage == 0 ? l.shard_offset(rank) : 0) + g.offset, g.numel * 4);
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

Result<StepResult> Engine::TrainStep(std::span<const Batch* const> micro_batches) {
  return impl_->Step(micro_batches);
}

Result<double> Engine::EvalLoss(std::span<const Batch* const> micro_batches) {
  return impl_->Eval(micro_batches);
}

const std::vector<UnitLayout>& Engine::layouts() const { return impl_->layouts; }
const std::vector<char>& Engine::frozen_units() const { return impl_->frozen; }
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
  if (m.frozen[unit]) return GatherParams(unit);  // no master weights: the parameters are it
  std::vector<float> shard(static_cast<size_t>(l.shard_numel));
  if (!m.cpu_unit[unit]) {
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
  s.units = static_cast<int>(m.layouts.size());
  s.frozen_units = static_cast<int>(std::count(m.frozen.begin(), m.frozen.end(), 1));
  s.offloaded_optimizer_units = static_cast<int>(std::count(m.cpu_unit.begin(), m.cpu_unit.end(), 1));
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

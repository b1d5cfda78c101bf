#include "zero/parameter_store.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "common/log.h"
#include "device/pinned_pool.h"
#include "strata/trace.h"

namespace strata::zero::engine_internal {

ParameterStore::~ParameterStore() {
  StopTiers();
  FreeSecondaries();
  for (auto* buffers : {&gathered_, &persistent_gathered_}) {
    for (void* p : *buffers) device_.Free(p);
  }
}

void ParameterStore::StopTiers() {
  prefetcher_.reset();
  tiers_.reset();
}

// ---- set-up -------------------------------------------------------------------------------------

// The parameter tier manager's budgets. Device-homed shards all live on the device. Offloaded
// ones are cached there only as far as the prefetch scheduler looks ahead
// (stage3_prefetch_bucket_size), plus the unit in use and the one being gathered: device memory
// for parameters stays within the prefetch budget whatever the model size.
offload::TierManagerOptions ParameterStore::TierOptions(
    const offload::NvmeLayoutOptions& nvme) const {
  offload::TierManagerOptions to;
  to.device = &device_;
  to.pool = options_.pool;
  to.store = options_.store;
  to.nvme = nvme;
  to.trace = options_.trace;
  // The CPU device's memory is host memory: parameter shards are read in place in their pinned
  // host copies rather than copied into a second buffer (strata.memory.share_host_memory).
  to.share_host_memory = SharesHostMemory(config_, device_.type());
  uint64_t shard_bytes_total = 0;
  uint64_t largest = 0;
  for (const auto& l : setup_.layouts) {
    const uint64_t held = device::PinnedPool::SizeClass(static_cast<uint64_t>(l.shard_numel) *
                                                        setup_.compute_bytes);
    shard_bytes_total += held;
    largest = std::max<uint64_t>(largest, held);
  }
  const offload::PrefetchOptions pf =
      offload::PrefetchOptions::FromConfig(config_, setup_.compute_bytes);
  const Tier home = setup_.param_home;
  to.device_budget =
      options_.param_device_budget != 0 ? options_.param_device_budget
      : home == Tier::kDevice
          ? std::max(shard_bytes_total, 4 * largest)
          : OffloadedParamDeviceBudget(shard_bytes_total, largest, pf.device_lookahead_bytes);
  if (home == Tier::kNvme) {
    // Shared device copies are host copies: the host tier also holds what the device tier
    // caches (PlanPinnedPoolBytes counts the same).
    to.host_budget = options_.param_host_budget != 0
                         ? options_.param_host_budget
                         : NvmeParamHostBudget(shard_bytes_total, largest, to.device_budget,
                                               to.share_host_memory);
    // The optimizer holds one unit's host copy while backward stages another through host
    // memory: two of the largest shard is the least that cannot run dry.
    if (to.host_budget < 2 * largest) {
      STRATA_LOG(warn, zero, "parameter host budget {} B raised to {} B (two of the largest shard)",
                 to.host_budget, 2 * largest);
      to.host_budget = 2 * largest;
    }
  } else if (home == Tier::kHost) {
    to.host_budget = shard_bytes_total + 2 * largest;
  } else {
    to.host_budget = 2 * largest;  // staging for CPU-optimizer writes of device-homed shards
  }
  return to;
}

Status ParameterStore::StartTiers(const offload::NvmeLayoutOptions& nvme) {
  STRATA_ASSIGN_OR_RETURN(tiers_, offload::TierManager::Create(TierOptions(nvme)));
  const size_t n_units = setup_.layouts.size();
  for (size_t u = 0; u < n_units; ++u) {
    offload::ShardSpec spec;
    spec.id = u;
    spec.bytes = setup_.shard_bytes(static_cast<int>(u));
    spec.home = setup_.param_home;
    spec.name = fmt::format("{} param shard", setup_.layouts[u].name);
    spec.state_class = "param";
    STRATA_RETURN_IF_ERROR(tiers_->Register(spec));
  }
  STRATA_RETURN_IF_ERROR(tiers_->Start());
  offload::PrefetchOptions po = offload::PrefetchOptions::FromConfig(config_, setup_.compute_bytes);
  po.enabled = options_.prefetch;
  po.trace = options_.trace;
  // The engine keeps small units gathered itself (persistent_gathered_); the scheduler must not
  // also hold their shards with leases, which the optimizer's writes would wait on.
  po.persistence_threshold_bytes = 0;
  prefetcher_ = std::make_unique<offload::PrefetchScheduler>(*tiers_, po);
  persistent_.assign(n_units, false);
  persistent_gathered_.assign(n_units, nullptr);
  secondary_.assign(n_units, nullptr);
  uses_left_.assign(n_units, 0);
  backward_uses_.assign(n_units, 1);  // its own backward
  for (size_t v = 0; v < n_units; ++v) {
    for (const int s : setup_.shared[v]) ++backward_uses_[static_cast<size_t>(s)];
    for (const int r : setup_.recompute[v]) ++backward_uses_[static_cast<size_t>(r)];
  }
  for (size_t u = 0; u < n_units; ++u) {
    STRATA_RETURN_IF_ERROR(prefetcher_->AddUnit(u, {u}, setup_.layouts[u].name));
    persistent_[u] = setup_.layouts[u].numel < config_.zero.stage3_param_persistence_threshold;
  }
  return Status::Ok();
}

Status ParameterStore::AllocateGathered(int u) {
  if (setup_.stage > 2) return Status::Ok();
  const auto padded = static_cast<uint64_t>(setup_.layouts[static_cast<size_t>(u)].padded_numel());
  STRATA_ASSIGN_OR_RETURN(void* p, device_.Alloc(padded * setup_.compute_bytes));
  gathered_.push_back(p);
  return Status::Ok();
}

// ---- parameters for compute ---------------------------------------------------------------------

Result<UnitView> ParameterStore::Acquire(int u, GatherUse use, std::string_view owner,
                                         int64_t* io_wait_ns) {
  const bool eval = use == GatherUse::kEval;
  const auto& l = setup_.layouts[static_cast<size_t>(u)];
  UnitView view;
  view.dtype = setup_.compute_dtype;
  view.slots = &l.slots;
  if (setup_.stage <= 2) {
    view.data = gathered_[static_cast<size_t>(u)];
    return view;
  }
  if (!eval && persistent_[u] && persistent_gathered_[u] != nullptr) {
    view.data = persistent_gathered_[u];
    return view;
  }
  STRATA_ASSIGN_OR_RETURN(view.data, Gather(u, use, owner, io_wait_ns));
  if (!eval && persistent_[u]) {
    // Kept for the rest of the step (freed at its end, or by the clean-up).
    live_.Keep(view.data);
    persistent_gathered_[u] = view.data;
  }
  return view;
}

// All-gathers unit u's shard into a new live buffer on the comm stream; compute waits for it.
// Back-pressure: at most the live limit of gathered units and gradients in flight. A failure
// leaves the buffer owned by the live budget, whose clean-up after the failed step frees it.
Result<void*> ParameterStore::Gather(int u, GatherUse use, std::string_view owner,
                                     int64_t* io_wait_ns) {
  const auto& l = setup_.layouts[static_cast<size_t>(u)];
  const uint64_t bytes = static_cast<uint64_t>(l.padded_numel()) * setup_.compute_bytes;
  STRATA_ASSIGN_OR_RETURN(void* full, live_.Alloc(bytes));
  const int64_t t0 = TraceRecorder::NowNs();
  if (use != GatherUse::kEval && secondary_[static_cast<size_t>(u)] != nullptr) {
    // hpZ: from the node's secondary slices; no shard is read and nothing crosses nodes.
    STRATA_RETURN_IF_ERROR(GatherFromSecondary(u, full));
    if (use == GatherUse::kBackward) STRATA_RETURN_IF_ERROR(UsedSecondary(u));
  } else if (use == GatherUse::kEval) {
    // Straight from the tier manager: an evaluation's accesses are not the training step's
    // trace, which the scheduler would otherwise relearn twice per evaluation.
    Result<Lease> lease = tiers_->Acquire(u, Tier::kDevice, Access::kRead, owner);
    *io_wait_ns += TraceRecorder::NowNs() - t0;
    if (!lease.ok()) return lease.status();
    Status st = AllGatherShard(u, lease->data(), full);
    lease->Release(false, streams_.comm.get());
    STRATA_RETURN_IF_ERROR(st);
  } else {
    auto leases = prefetcher_->Acquire(u, Access::kRead, owner);
    *io_wait_ns += TraceRecorder::NowNs() - t0;
    if (!leases.ok()) return leases.status();
    // The shard is ready (Acquire returned); gather it on the comm stream.
    Status st = AllGatherShard(u, (*leases)[0].data(), full);
    Status rel = prefetcher_->Release(u, *leases, false, streams_.comm.get());
    STRATA_RETURN_IF_ERROR(st);
    STRATA_RETURN_IF_ERROR(rel);
    // hpZ: persistent units stay gathered to the end of the step and need no slice.
    if (setup_.hpz > 1 && use == GatherUse::kForward && !persistent_[static_cast<size_t>(u)]) {
      STRATA_RETURN_IF_ERROR(KeepSecondary(u, full));
    }
  }
  STRATA_RETURN_IF_ERROR(clock_.ComputeWaitsForComm());
  return full;
}

// The all-gather of unit u's shard into `full` on the comm stream: the 16-bit values, or with
// zero_quantized_weights their int8 blocks and scales (a live buffer of every rank's quantized
// shard, gathered in place), dequantized into `full`. The shard itself is never changed.
Status ParameterStore::AllGatherShard(int u, const void* shard, void* full) {
  const auto& l = setup_.layouts[static_cast<size_t>(u)];
  device::Stream& comm = *streams_.comm;
  if (!config_.zero.zero_quantized_weights) {
    return collective_.AllGather(shard, full, l.shard_numel, setup_.compute_dtype, comm);
  }
  const uint64_t per_rank = QuantizedShardBytes(l.shard_numel);
  const auto n = static_cast<size_t>(l.shard_numel);
  const auto block = static_cast<size_t>(kQuantBlockElems);
  STRATA_ASSIGN_OR_RETURN(void* staging,
                          live_.Alloc(per_rank * static_cast<uint64_t>(setup_.world_size)));
  auto* base = static_cast<char*>(staging);
  char* own = base + per_rank * static_cast<uint64_t>(setup_.rank);
  Status st = device_.QuantizeInt8(shard, setup_.compute_dtype, n, block, own,
                                   reinterpret_cast<float*>(own + n), comm);
  // An all-gather moves bytes: 16-bit elements carry the packed int8 values and scales.
  if (st.ok()) st = collective_.AllGather(own, staging, per_rank / 2, device::DType::kBF16, comm);
  for (int q = 0; st.ok() && q < setup_.world_size; ++q) {
    const char* part = base + per_rank * static_cast<uint64_t>(q);
    st = device_.DequantizeInt8(part, reinterpret_cast<const float*>(part + n), n, block,
                                static_cast<char*>(full) + l.shard_offset(q) * setup_.compute_bytes,
                                setup_.compute_dtype, comm);
  }
  // On failure the staging stays owned by the live budget, whose clean-up frees it.
  STRATA_RETURN_IF_ERROR(st);
  return live_.FreeAfter(comm, staging);
}

// ---- hpZ: the secondary copy ---------------------------------------------------------------------

uint64_t ParameterStore::SecondaryElems(int u) const {
  return static_cast<uint64_t>(setup_.layouts[static_cast<size_t>(u)].padded_numel()) /
         static_cast<uint64_t>(setup_.hpz);
}

// This rank's slice of the unit just gathered into `full` (comm-stream order), held on the device
// until the unit's last backward use. Counted by the device's budget; `strata estimate` plans it.
Status ParameterStore::KeepSecondary(int u, const void* full) {
  const uint64_t bytes = SecondaryElems(u) * setup_.compute_bytes;
  Result<void*> slice = device_.Alloc(bytes);
  if (!slice.ok()) {
    return slice.status().WithContext(fmt::format(
        "hpZ (zero_optimization.zero_hpz_partition_size): unit {} ('{}')'s node-local copy of "
        "{} B",
        u, setup_.layouts[static_cast<size_t>(u)].name, bytes));
  }
  secondary_[static_cast<size_t>(u)] = *slice;
  uses_left_[static_cast<size_t>(u)] = backward_uses_[static_cast<size_t>(u)];
  secondary_bytes_ += bytes;
  secondary_peak_bytes_ = std::max(secondary_peak_bytes_, secondary_bytes_);
  const uint64_t offset = static_cast<uint64_t>(setup_.topology.local_rank()) * bytes;
  return device_.CopyAsync(*slice, static_cast<const char*>(full) + offset, bytes,
                           device::CopyKind::kDeviceToDevice, *streams_.comm);
}

// The node's ranks hold the unit's slices in local-rank order, which is the intra-node group's
// order: one all-gather of them is the whole unit.
Status ParameterStore::GatherFromSecondary(int u, void* full) {
  return groups_.intra->AllGather(secondary_[static_cast<size_t>(u)], full, SecondaryElems(u),
                                  setup_.compute_dtype, *streams_.comm);
}

// After the last backward use is enqueued, the slice is freed once the comm stream is past it.
Status ParameterStore::UsedSecondary(int u) {
  const auto i = static_cast<size_t>(u);
  if (--uses_left_[i] > 0) return Status::Ok();
  void* slice = std::exchange(secondary_[i], nullptr);
  Status st = device_.Notify(*streams_.comm,
                             [device = &device_, slice](const Status&) { device->Free(slice); });
  if (!st.ok()) {
    secondary_[i] = slice;  // not enqueued: the clean-up after the step frees it
    return st;
  }
  secondary_bytes_ -= SecondaryElems(u) * setup_.compute_bytes;
  return st;
}

// After a step's streams have drained (its end, or a failed step's clean-up).
void ParameterStore::FreeSecondaries() {
  for (void*& p : secondary_) {
    if (p != nullptr) device_.Free(p);
    p = nullptr;
  }
  secondary_bytes_ = 0;
}

Status ParameterStore::Release(int u, const UnitView& view, bool eval) {
  if (setup_.stage <= 2 || (!eval && persistent_[u])) return Status::Ok();
  return live_.FreeAfter(*streams_.compute, view.data);
}

// ---- shards -------------------------------------------------------------------------------------

Status ParameterStore::ReadShard(int u, void* host_dst) {
  const uint64_t bytes = setup_.shard_bytes(u);
  device::Stream& comm = *streams_.comm;
  if (setup_.stage <= 2) {
    const char* own = static_cast<const char*>(gathered_[static_cast<size_t>(u)]) +
                      setup_.layouts[static_cast<size_t>(u)].shard_offset(setup_.rank) *
                          setup_.compute_bytes;
    STRATA_RETURN_IF_ERROR(
        device_.CopyAsync(host_dst, own, bytes, device::CopyKind::kDeviceToHost, comm));
    return device_.Synchronize(comm);
  }
  if (setup_.param_home == Tier::kDevice) {
    STRATA_ASSIGN_OR_RETURN(Lease lease,
                            tiers_->Acquire(u, Tier::kDevice, Access::kRead, "checkpoint"));
    STRATA_RETURN_IF_ERROR(
        device_.CopyAsync(host_dst, lease.data(), bytes, device::CopyKind::kDeviceToHost, comm));
    return device_.Synchronize(comm);
  }
  STRATA_ASSIGN_OR_RETURN(Lease lease, tiers_->Acquire(u, Tier::kHost, Access::kRead, "checkpoint"));
  std::memcpy(host_dst, lease.data(), bytes);
  return Status::Ok();
}

Status ParameterStore::WriteShard(int u, const void* host_src) {
  const uint64_t bytes = setup_.shard_bytes(u);
  if (setup_.param_home == Tier::kDevice) {
    STRATA_ASSIGN_OR_RETURN(
        Lease lease, tiers_->Acquire(u, Tier::kDevice, Access::kOverwrite, "parameter write"));
    STRATA_RETURN_IF_ERROR(device_.CopyAsync(lease.data(), host_src, bytes,
                                             device::CopyKind::kHostToDevice, *streams_.comm));
    STRATA_RETURN_IF_ERROR(device_.Synchronize(*streams_.comm));
    lease.Release(true);
    return Status::Ok();
  }
  STRATA_ASSIGN_OR_RETURN(Lease lease,
                          tiers_->Acquire(u, Tier::kHost, Access::kOverwrite, "parameter write"));
  std::memcpy(lease.data(), host_src, bytes);
  lease.Release(true);
  return Status::Ok();
}

// Puts the rank's shard of unit u's parameters (host memory, compute dtype) in place: into the
// full copy every rank keeps (stages 0-2, all-gathered) or into the shard's home (stage 3).
Status ParameterStore::StoreShard(int u, const char* shard) {
  const auto& l = setup_.layouts[static_cast<size_t>(u)];
  if (setup_.stage >= 3) return WriteShard(u, shard);
  void* full = gathered_[static_cast<size_t>(u)];
  char* own = static_cast<char*>(full) + l.shard_offset(setup_.rank) * setup_.compute_bytes;
  device::Stream& comm = *streams_.comm;
  STRATA_RETURN_IF_ERROR(device_.CopyAsync(own, shard,
                                           static_cast<size_t>(l.shard_numel) * setup_.compute_bytes,
                                           device::CopyKind::kHostToDevice, comm));
  STRATA_RETURN_IF_ERROR(
      collective_.AllGather(own, full, l.shard_numel, setup_.compute_dtype, comm));
  return device_.Synchronize(comm);
}

Result<offload::Lease> ParameterStore::LeaseShard(int u, Tier tier, Access access,
                                                  std::string_view owner) {
  return tiers_->Acquire(u, tier, access, owner);
}

// ---- the step -----------------------------------------------------------------------------------

void ParameterStore::BeginStep() {
  if (prefetcher_) prefetcher_->BeginStep();
}

void ParameterStore::EndStep() {
  if (setup_.stage != 3) return;
  FreePersistent();
  FreeSecondaries();  // none is left unless a unit had fewer backward uses than counted
  prefetcher_->EndStep();
}

void ParameterStore::FreePersistent() {
  for (void*& p : persistent_gathered_) {
    if (p != nullptr) device_.Free(p);
    p = nullptr;
  }
}

Status ParameterStore::TakeWritebackError() {
  if (tiers_) return tiers_->TakeWritebackError();
  return Status::Ok();
}

void ParameterStore::ForgetStep(bool in_step) {
  FreePersistent();
  FreeSecondaries();
  if (tiers_) (void)tiers_->TakeWritebackError();
  if (prefetcher_ && in_step) prefetcher_->EndStep();
}

void ParameterStore::AddStats(EngineStats& s) const {
  s.hpz_copies_peak_bytes = secondary_peak_bytes_;
  if (!tiers_) return;
  const auto nvme = tiers_->stats(Tier::kNvme);
  const auto host = tiers_->stats(Tier::kHost);
  s.param_nvme_write_bytes = nvme.writeback_bytes;
  s.param_nvme_read_bytes = host.fill_bytes;
  s.host_peak_bytes += host.peak;
  s.prefetch_hit_rate = prefetcher_->stats().hit_rate();
  const auto dev_tier = tiers_->stats(Tier::kDevice);
  s.param_device_peak_bytes = dev_tier.peak;
  s.param_device_budget_bytes = dev_tier.budget;
}

}  // namespace strata::zero::engine_internal

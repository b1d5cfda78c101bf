#include "zero/adam_states.h"

#include <cstring>

namespace strata::zero::engine_internal {

AdamStates::~AdamStates() {
  StopOffloaded();
  for (auto* buffers : {&master_, &exp_avg_, &exp_avg_sq_}) {
    for (void* p : *buffers) device_.Free(p);
  }
}

Status AdamStates::CreateOffloaded(const offload::NvmeLayoutOptions& nvme) {
  const Config& cfg = options_.config;
  // sub_group_size 0 means no tiling: one sub-group per unit shard.
  int64_t sub_group = cfg.zero.sub_group_size > 0 ? cfg.zero.sub_group_size : setup_.max_shard;
  sub_group = (sub_group + kShardAlignElems - 1) / kShardAlignElems * kShardAlignElems;
  offload::OptimizerStatesOptions oo;
  oo.tiers.device = &device_;
  oo.tiers.pool = options_.pool;
  oo.tiers.store = options_.store;
  oo.tiers.nvme = nvme;
  oo.tiers.trace = options_.trace;
  oo.home = setup_.optim_home;
  oo.pipeline_depth = options_.optimizer_pipeline_depth;
  oo.sub_group_elems = sub_group;
  for (const auto& l : setup_.layouts) {
    // A unit on the device optimizer has no sub-groups.
    oo.unit_elems.push_back(setup_.on_cpu(l.index) ? l.shard_numel : 0);
    oo.unit_names.push_back(l.name);
  }
  STRATA_ASSIGN_OR_RETURN(offloaded_, offload::OptimizerStates::Create(oo));
  return Status::Ok();
}

Status AdamStates::AllocateDevice(int u) {
  void* states[3] = {nullptr, nullptr, nullptr};
  if (!setup_.is_frozen(u) && !setup_.on_cpu(u)) {
    const auto& l = setup_.layouts[static_cast<size_t>(u)];
    const auto n = static_cast<uint64_t>(setup_.stage == 0 ? l.padded_numel() : l.shard_numel);
    for (void*& state : states) {
      Result<void*> p = device_.Alloc(n * 4);
      if (!p.ok()) {
        // Keep what was allocated, so that the destructor frees it.
        master_.push_back(states[0]);
        exp_avg_.push_back(states[1]);
        exp_avg_sq_.push_back(states[2]);
        return p.status();
      }
      state = *p;
    }
  }
  master_.push_back(states[0]);
  exp_avg_.push_back(states[1]);
  exp_avg_sq_.push_back(states[2]);
  return Status::Ok();
}

Status AdamStates::AllocateStaging(int u) {
  HostBuffer staged;
  if (setup_.on_cpu(u) && (setup_.stage <= 2 || setup_.param_home == Tier::kDevice)) {
    STRATA_ASSIGN_OR_RETURN(staged, HostBuffer::Make(options_.pool, setup_.shard_bytes(u),
                                                     "updated parameter shard (host)"));
  }
  staged_.push_back(std::move(staged));
  return Status::Ok();
}

Status AdamStates::InitUnit(int u, const float* src) {
  if (setup_.is_frozen(u)) return Status::Ok();  // no optimizer state
  const auto& l = setup_.layouts[static_cast<size_t>(u)];
  if (!setup_.on_cpu(u)) {
    const size_t n = setup_.stage == 0 ? static_cast<size_t>(l.padded_numel())
                                       : static_cast<size_t>(l.shard_numel);
    device::Stream& compute = *streams_.compute;
    STRATA_RETURN_IF_ERROR(
        device_.CopyAsync(master(u), src, n * 4, device::CopyKind::kHostToDevice, compute));
    STRATA_RETURN_IF_ERROR(device_.Fill(exp_avg(u), DType::kF32, 0.0f, n, compute));
    STRATA_RETURN_IF_ERROR(device_.Fill(exp_avg_sq(u), DType::kF32, 0.0f, n, compute));
    return device_.Synchronize(compute);
  }
  for (const SubGroup& g : groups(u)) {
    STRATA_ASSIGN_OR_RETURN(Lease lease,
                            offloaded_->Acquire(g, Access::kOverwrite, "optimizer init"));
    auto* p = static_cast<float*>(lease.data());
    std::memcpy(p, src + (setup_.stage == 0 ? l.shard_offset(setup_.rank) : 0) + g.offset,
                g.numel * 4);
    std::memset(p + g.numel, 0, 2 * g.numel * 4);
    lease.Release(true);
  }
  return Status::Ok();
}

Status AdamStates::TakeWritebackError() {
  if (offloaded_) return offloaded_->TakeWritebackError();
  return Status::Ok();
}

void AdamStates::AddStats(EngineStats& s) const {
  if (!offloaded_) return;
  const auto nvme = offloaded_->stats(Tier::kNvme);
  const auto host = offloaded_->stats(Tier::kHost);
  s.optim_nvme_write_bytes = nvme.writeback_bytes;
  s.optim_nvme_read_bytes = host.fill_bytes;
  s.host_peak_bytes += host.peak;
}

}  // namespace strata::zero::engine_internal

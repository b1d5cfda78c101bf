// One unit's optimizer step: the fused device kernel (units whose states are on the device) or
// the CPU AdamW over the unit's offloaded sub-groups (on the CPU optimizer's thread).
#include "zero/engine_internal.h"

#include "optim/device_adam.h"

namespace strata::zero {

Status Engine::Impl::DeviceOptimizerStep(int u) {
  const auto& l = layout(u);
  optim::AdamShard s;
  s.n = setup.stage == 0 ? static_cast<size_t>(l.padded_numel())
                         : static_cast<size_t>(l.shard_numel);
  s.master = static_cast<float*>(adam.master(u));
  s.m = static_cast<float*>(adam.exp_avg(u));
  s.v = static_cast<float*>(adam.exp_avg_sq(u));
  s.grad = reducer.DeviceGradient(u);
  s.out_dtype = setup.compute_dtype;
  optim::CpuAdamOptions co{setup.isa, options.cpu_adam_threads};
  if (setup.stage <= 2) {
    // Into the gathered copy: the whole unit at stage 0, else the rank's shard of it.
    s.out16 = static_cast<char*>(params.gathered(u)) +
              (setup.stage == 0 ? 0 : l.shard_offset(setup.rank) * setup.compute_bytes);
    return optim::DeviceAdamStep(device, *streams.compute, step_hyper, s, co);
  }
  // An offloaded shard's device copy would be a second buffer where device memory is host
  // memory (the CPU device sharing it): the update then writes the host copy in place, as the
  // CPU optimizer does. On a GPU it writes a device copy, which the tier manager sends home.
  const Tier where = setup.param_home != Tier::kDevice && SharesHostMemory(config, device.type())
                         ? Tier::kHost
                         : Tier::kDevice;
  STRATA_ASSIGN_OR_RETURN(Lease lease, params.LeaseShard(u, where, Access::kOverwrite, "optimizer"));
  s.out16 = lease.data();
  STRATA_RETURN_IF_ERROR(optim::DeviceAdamStep(device, *streams.compute, step_hyper, s, co));
  lease.Release(true, streams.compute.get());
  return Status::Ok();
}

// One unit's CPU optimizer step: its sub-groups in order, each read ahead (the next one is
// prefetched before the current one is updated) and written behind (released dirty; the tier
// manager writes it to NVMe when it needs the room). Runs on the CPU optimizer's thread.
Status Engine::Impl::CpuOptimizerUnit(int u, const optim::AdamHyper& hyper) {
  const float* grad = reducer.HostShard(u);
  Lease param_lease;
  char* out = nullptr;
  if (setup.stage == 3 && setup.param_home != Tier::kDevice) {
    // Read-write, not overwrite: if a sub-group fails, the ones not yet updated keep their
    // current values (consistent with their master weights).
    STRATA_ASSIGN_OR_RETURN(param_lease,
                            params.LeaseShard(u, Tier::kHost, Access::kReadWrite, "optimizer"));
    out = static_cast<char*>(param_lease.data());
  } else {
    out = adam.staged(u);
  }
  offload::OptimizerStates& states = adam.offloaded();
  const auto& groups = states.groups(u);
  optim::CpuAdamOptions co{setup.isa, options.cpu_adam_threads};
  // Sub-groups updated so far: their parameters changed in place in the leased copy, and must
  // become the shard's current version even when a later sub-group fails (a clean release would
  // let the tier manager drop them in favour of the old home copy, leaving the parameters behind
  // their master weights).
  size_t updated = 0;
  Status loop = [&]() -> Status {
    for (size_t k = 0; k < groups.size(); ++k) {
      const SubGroup& g = groups[k];
      STRATA_RETURN_IF_ERROR(states.Visit(g));
      STRATA_ASSIGN_OR_RETURN(Lease lease, states.Acquire(g, Access::kReadWrite, "optimizer"));
      auto* base = static_cast<float*>(lease.data());
      optim::AdamShard s;
      s.master = base;
      s.m = base + g.numel;
      s.v = base + 2 * g.numel;
      s.grad = grad + g.offset;
      s.n = static_cast<size_t>(g.numel);
      s.out16 = out + g.offset * setup.compute_bytes;
      s.out_dtype = setup.compute_dtype;
      Status st = optim::CpuAdamStep(hyper, s, co);
      lease.Release(st.ok());
      STRATA_RETURN_IF_ERROR(st);
      ++updated;
      states.Visited(g);
    }
    return Status::Ok();
  }();
  if (param_lease) param_lease.Release(/*dirty=*/updated > 0);
  STRATA_RETURN_IF_ERROR(loop);
  // A write-behind of this or an earlier sub-group that failed in the background.
  return states.TakeWritebackError();
}

// Unit u's gradient shard is final once the comm stream reaches `ready`: its overlapped CPU
// optimizer step is queued with this step's hyper-parameters.
Status Engine::Impl::QueueUpdate(int u, std::shared_ptr<device::Event> ready) {
  cpu_worker.Queue({u, std::move(ready), step_hyper});
  return Status::Ok();
}

}  // namespace strata::zero

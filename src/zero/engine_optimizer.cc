#include "zero/engine_internal.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace strata::zero {

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
    // An offloaded shard's device copy would be a second buffer where device memory is host
    // memory (the CPU device sharing it): the update then writes the host copy in place, as
    // the CPU optimizer does. On a GPU it writes a device copy, which the tier manager sends home.
    const Tier where = param_home != Tier::kDevice && SharesHostMemory(cfg, dev.type())
                           ? Tier::kHost
                           : Tier::kDevice;
    STRATA_ASSIGN_OR_RETURN(Lease lease, ptm->Acquire(u, where, Access::kOverwrite, "optimizer"));
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
    // Overlapped with backward: the unit's gradient is final, so its share of the gradient norm
    // is taken here too, off the step's critical path (on one H100 machine the norm of a 1.1B
    // model's host gradients, summed after backward, was most of a 1.65 s step).
    double sumsq = 0.0;
    const bool take_norm = st.ok() && !skip && overlapped_optimizer;
    if (take_norm) {
      sumsq = device::SumSquaresHost(grad_shard_host[static_cast<size_t>(job.unit)].data(),
                                     DType::kF32,
                                     static_cast<size_t>(layouts[job.unit].shard_numel),
                                     opt.cpu_adam_threads);
    }
    if (st.ok() && !skip) st = CpuOptimizerUnit(job.unit, job.hyper);
    const int64_t t1 = TraceRecorder::NowNs();
    // A streamed gradient shard is done with once its update succeeded (its share of the norm
    // is taken); a failed or skipped job keeps it for the step's norm.
    const bool free_grad = stream_grad_shards && st.ok() && !skip;
    if (free_grad) grad_shard_host[static_cast<size_t>(job.unit)] = HostBuffer{};
    {
      std::lock_guard<std::mutex> lock(opt_mu);
      if (free_grad) ++grad_freed;
      if (take_norm) {
        host_sumsq[static_cast<size_t>(job.unit)] = sumsq;
        host_sumsq_ready[static_cast<size_t>(job.unit)] = true;
      }
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

}  // namespace strata::zero

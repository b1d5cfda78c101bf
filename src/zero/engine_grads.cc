#include "zero/engine_internal.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace strata::zero {

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
  if (!cpu_unit[u] && mb == 0) {
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
    if (cpu_unit[u]) {
      STRATA_RETURN_IF_ERROR(LandGradShard(u, own, mb));
    } else if (mb == 0) {
      STRATA_RETURN_IF_ERROR(dev.CopyAsync(grad_shard_dev[u], own, shard * 4,
                                           device::CopyKind::kDeviceToDevice, *comm_stream));
    } else {
      STRATA_RETURN_IF_ERROR(
          dev.Axpy(1.0f, own, grad_shard_dev[u], DType::kF32, shard, *comm_stream));
    }
  }
  if (last && overlapped_optimizer && cpu_unit[u]) {
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
  if (stream_grad_shards) {
    // Allocated now and freed by the unit's optimizer job; with the pool full, wait for a job to
    // free one (each holder's job is queued already, so one will).
    for (;;) {
      Result<HostBuffer> b = HostBuffer::Make(opt.pool, shard * 4, "gradient shard (host)");
      if (b.ok()) {
        grad_shard_host[u] = std::move(*b);
        break;
      }
      if (b.status().code() != StatusCode::kResourceExhausted) return b.status();
      std::unique_lock<std::mutex> lock(opt_mu);
      if (!opt_error.ok()) return opt_error;
      if (opt_pending == 0) {
        return b.status().WithContext(fmt::format(
            "unit {} ('{}'): no optimizer job holds a gradient shard to free (the pinned pool is "
            "smaller than its plan: strata.memory.pinned_pool)",
            u, layouts[u].name));
      }
      const uint64_t seen = grad_freed;
      opt_cv.wait(lock, [&] { return grad_freed != seen || opt_pending == 0 || !opt_error.ok(); });
    }
  }
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

// Sum of squares of this rank's part of the (summed, unscaled) gradients, in double.
Result<double> Engine::Impl::LocalGradSumSquares(int64_t* optimizer_wait_ns) {
  // Units on the device optimizer: a device reduction over their gradients; one double comes
  // back.
  double total = 0.0;
  if (device_optimizer) {
    auto* host = reinterpret_cast<double*>(scalars_host.data());
    auto* sum = static_cast<double*>(scalars_dev);
    host[0] = 0.0;
    STRATA_RETURN_IF_ERROR(
        dev.CopyAsync(sum, host, sizeof(double), device::CopyKind::kHostToDevice, *comm_stream));
    for (size_t u = 0; u < layouts.size(); ++u) {
      if (cpu_unit[u] || frozen[u]) continue;
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
    total = host[0];
  }
  // Offloaded units (the last ones): their gradient shards already sit in host memory, where the
  // optimizer reads them.
  for (size_t u = 0; u < layouts.size(); ++u) {
    if (!cpu_unit[u]) continue;
    total += HostGradSumSquares(static_cast<int>(u), optimizer_wait_ns);
  }
  return total;
}

// A host-homed unit's sum of squares of its gradient shard: taken by the overlapped optimizer's
// job when it updated the unit (during backward), else computed now on the CPU AdamW's threads.
double Engine::Impl::HostGradSumSquares(int u, int64_t* optimizer_wait_ns) {
  {
    std::unique_lock<std::mutex> lock(opt_mu);
    // Overlapped: the unit's job takes it (the step waits for every job right after the norm
    // anyway); a job that failed or was skipped leaves it to be computed here. The wait is for
    // the optimizer's work (its NVMe reads and updates), so it is counted as the optimizer's.
    if (overlapped_optimizer) {
      const int64_t t0 = TraceRecorder::NowNs();
      opt_cv.wait(lock, [&] { return host_sumsq_ready[static_cast<size_t>(u)] || opt_pending == 0; });
      *optimizer_wait_ns += TraceRecorder::NowNs() - t0;
    }
    if (host_sumsq_ready[static_cast<size_t>(u)]) return host_sumsq[static_cast<size_t>(u)];
  }
  // A streamed shard that never landed (the step failed before it): the step reports that.
  if (grad_shard_host[static_cast<size_t>(u)].data() == nullptr) return 0.0;
  return device::SumSquaresHost(grad_shard_host[static_cast<size_t>(u)].data(), DType::kF32,
                                static_cast<size_t>(layouts[static_cast<size_t>(u)].shard_numel),
                                opt.cpu_adam_threads);
}

Result<float> Engine::Impl::AllReduceHostFloat(float value) {
  auto* host = reinterpret_cast<float*>(scalars_host.data() + 8);
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

}  // namespace strata::zero

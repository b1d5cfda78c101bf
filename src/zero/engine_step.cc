#include "zero/engine_internal.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace strata::zero {

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

// ---- parameters for compute -------------------------------------------------------------------

Result<UnitView> Engine::Impl::AcquireParams(int u, std::string_view owner,
                                             int64_t* io_wait_ns, bool eval) {
  const auto& l = layouts[u];
  UnitView view;
  view.dtype = cdt;
  view.slots = &l.slots;
  if (stage <= 2) {
    view.data = full_params[u];
    return view;
  }
  if (!eval && persistent[u] && persistent_full[u] != nullptr) {
    view.data = persistent_full[u];
    return view;
  }
  const uint64_t bytes = static_cast<uint64_t>(l.padded_numel()) * csz;
  if (eval) {
    // Straight from the tier manager: an evaluation's accesses are not the training step's
    // trace, which the scheduler would otherwise relearn twice per evaluation.
    STRATA_ASSIGN_OR_RETURN(void* full, AllocLive(bytes));
    const int64_t t0 = TraceRecorder::NowNs();
    Result<Lease> lease = ptm->Acquire(u, Tier::kDevice, Access::kRead, owner);
    *io_wait_ns += TraceRecorder::NowNs() - t0;
    if (!lease.ok()) return lease.status();
    Status st = comm.AllGather(lease->data(), full, l.shard_numel, cdt, *comm_stream);
    lease->Release(false, comm_stream.get());
    STRATA_RETURN_IF_ERROR(st);
    STRATA_RETURN_IF_ERROR(ComputeWaitComm());
    view.data = full;
    return view;
  }
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

Status Engine::Impl::ReleaseParams(int u, const UnitView& view, bool eval) {
  if (stage <= 2 || (!eval && persistent[u])) return Status::Ok();
  return FreeLiveAfter(*compute, view.data);
}

// ---- evaluation -----------------------------------------------------------------------------------

Result<double> Engine::Impl::Eval(std::span<const Batch* const> micro_batches) {
  if (micro_batches.empty()) return InvalidArgumentError("EvalLoss: no micro-batches");
  Result<double> r = EvalImpl(micro_batches);
  if (!r.ok()) CleanUpFailedStep();
  return r;
}

Result<double> Engine::Impl::EvalImpl(std::span<const Batch* const> micro_batches) {
  const int n_units = static_cast<int>(layouts.size());
  int64_t io_wait_ns = 0;
  double loss_sum = 0.0;
  for (const Batch* batch : micro_batches) {
    STRATA_RETURN_IF_ERROR(model.BeginMicroBatch(*batch, 1.0f, *compute));
    for (int u = 0; u < n_units; ++u) {
      STRATA_ASSIGN_OR_RETURN(UnitView p, AcquireParams(u, "eval", &io_wait_ns, true));
      if (shared[u].empty()) {
        STRATA_RETURN_IF_ERROR(model.Forward(u, p, *compute));
        STRATA_RETURN_IF_ERROR(StampCompute());
        STRATA_RETURN_IF_ERROR(ReleaseParams(u, p, true));
        continue;
      }
      std::vector<UnitView> views{p};
      for (int s : shared[u]) {
        STRATA_ASSIGN_OR_RETURN(UnitView ps, AcquireParams(s, "eval (tied)", &io_wait_ns, true));
        views.push_back(ps);
      }
      STRATA_RETURN_IF_ERROR(model.ForwardShared(u, views, *compute));
      STRATA_RETURN_IF_ERROR(StampCompute());
      STRATA_RETURN_IF_ERROR(ReleaseParams(u, p, true));
      for (size_t i = 0; i < shared[u].size(); ++i) {
        STRATA_RETURN_IF_ERROR(ReleaseParams(shared[u][i], views[i + 1], true));
      }
    }
    STRATA_ASSIGN_OR_RETURN(double loss, model.EndMicroBatch(*compute));
    loss_sum += loss;
  }
  STRATA_RETURN_IF_ERROR(dev.Synchronize(*compute));
  STRATA_RETURN_IF_ERROR(dev.Synchronize(*comm_stream));
  double mean = loss_sum / static_cast<double>(micro_batches.size());
  if (world > 1) {
    STRATA_ASSIGN_OR_RETURN(float total, AllReduceHostFloat(static_cast<float>(mean)));
    mean = static_cast<double>(total) / world;
  }
  return mean;
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
    std::lock_guard<std::mutex> lock(opt_mu);  // the previous step's jobs are all done
    optimizer_ns = 0;
    std::fill(host_sumsq_ready.begin(), host_sumsq_ready.end(), 0);
  }
  const int n_mb = static_cast<int>(micro_batches.size());
  const int n_units = static_cast<int>(layouts.size());
  if (stream_grad_shards && n_mb != 1) {
    return FailedPreconditionError(fmt::format(
        "engine: a step of {} micro-batches, but gradient_accumulation_steps is 1 (the gradient "
        "shards stream through the pinned pool, one micro-batch a step)",
        n_mb));
  }
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
    if (stage <= 1 && !frozen[u]) {
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
      // Units whose internals this backward reads run their forward again first, each gathered
      // for it (activation checkpointing across units: Model::RecomputeUnits).
      for (const int r : recompute[static_cast<size_t>(u)]) {
        const int64_t t1 = TraceRecorder::NowNs();
        STRATA_ASSIGN_OR_RETURN(UnitView pr, AcquireParams(r, "recompute", &io_wait_ns));
        exposed_io += ExposedSince(t1);
        STRATA_RETURN_IF_ERROR(model.Recompute(r, pr, *compute));
        STRATA_RETURN_IF_ERROR(StampCompute());
        STRATA_RETURN_IF_ERROR(ReleaseParams(r, pr));
      }
      const int64_t t0 = TraceRecorder::NowNs();
      STRATA_ASSIGN_OR_RETURN(UnitView p, AcquireParams(u, "backward", &io_wait_ns));
      // The unit's gradient buffer: the one a tying unit already added to, or a zeroed one.
      // A frozen unit has none: the model sees a null gradient view and computes only the
      // input gradients.
      auto grad_buffer = [&](int v) -> Result<void*> {
        if (frozen[v]) return nullptr;
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
      if (frozen[u]) {
        // Frozen parameters have no gradient; a bucket still waiting for the end of this
        // micro-batch's backward is reduced now.
        if (u == 0 && bucket_fill > 0) STRATA_RETURN_IF_ERROR(FlushBucket());
      } else {
        STRATA_RETURN_IF_ERROR(ReduceGrads(u, g, mb, last));
      }
    }
    STRATA_ASSIGN_OR_RETURN(double loss, model.EndMicroBatch(*compute));
    loss_sum += loss;
  }

  // Stages 0-1: reduce the accumulated full gradients once.
  if (stage <= 1) {
    STRATA_RETURN_IF_ERROR(dev.Record(*ev_compute, *compute));
    STRATA_RETURN_IF_ERROR(dev.Wait(*comm_stream, *ev_compute));
    for (int u = n_units - 1; u >= 0; --u) {
      if (frozen[u]) continue;
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
        if (cpu_unit[u]) STRATA_RETURN_IF_ERROR(LandGradShard(u, own, 0));
      }
    }
    if (overlapped_optimizer) {
      std::shared_ptr<device::Event> ready;
      STRATA_ASSIGN_OR_RETURN(auto ev, dev.CreateEvent());
      ready = std::move(ev);
      STRATA_RETURN_IF_ERROR(dev.Record(*ready, *comm_stream));
      for (int u = n_units - 1; u >= 0; --u) {
        if (cpu_unit[u]) STRATA_RETURN_IF_ERROR(QueueOptimizer(u, ready, step_hyper));
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
  // Time the host waits for CPU optimizer work: exposed optimizer time.
  int64_t opt_wait_ns = 0;
  {
    const int64_t t0 = TraceRecorder::NowNs();
    // With the overlapped optimizer, host-homed units' sums come from their optimizer jobs, so
    // this waits for those jobs: that part is the optimizer's, not the collective's.
    int64_t norm_opt_wait_ns = 0;
    STRATA_ASSIGN_OR_RETURN(double local, LocalGradSumSquares(&norm_opt_wait_ns));
    opt_wait_ns += norm_opt_wait_ns;
    double total = local;
    if (stage >= 1 && world > 1) {
      const float local_f = static_cast<float>(local);
      STRATA_ASSIGN_OR_RETURN(float all, AllReduceHostFloat(local_f));
      total = all;
    }
    exposed_comm_ns += TraceRecorder::NowNs() - t0 - norm_opt_wait_ns;
    overflow = !std::isfinite(total);
    const double norm = std::sqrt(total) * inv;
    result.grad_norm = norm;
    if (cfg.gradient_clipping > 0.0 && std::isfinite(norm)) {
      const double coef = cfg.gradient_clipping / (norm + 1e-6);
      if (coef < 1.0) clip_coef = coef;
    }
  }
  // fp32 / bf16: a non-finite norm is never applied where it can still be held back (not when
  // the CPU optimizer overlapped backward: those updates are done). strata.on_nonfinite "error"
  // stops the run below, once the step's work has drained; "skip" goes on.
  const bool nonfinite = !scaler && overflow;
  if (scaler) {
    result.skipped = scaler->Update(overflow);
  } else if (nonfinite) {
    result.skipped = true;
  }

  if (!result.skipped && !overlapped) {
    step_hyper.grad_scale = inv * clip_coef;  // (overlapped jobs already have theirs: no clipping)
  }
  if (!result.skipped) {
    // Offloaded units first (the CPU optimizer's thread works on them while the device updates
    // the others), unless they were already queued during backward.
    if (cpu_optimizer && !overlapped) {
      for (int u = n_units - 1; u >= 0; --u) {
        if (cpu_unit[u]) STRATA_RETURN_IF_ERROR(QueueOptimizer(u, nullptr, step_hyper));
      }
    }
    if (device_optimizer) {
      const int64_t t0 = TraceRecorder::NowNs();
      for (int u = n_units - 1; u >= 0; --u) {
        if (!cpu_unit[u] && !frozen[u]) STRATA_RETURN_IF_ERROR(DeviceOptimizerStep(u));
      }
      STRATA_RETURN_IF_ERROR(dev.Synchronize(*compute));
      opt_wait_ns += TraceRecorder::NowNs() - t0;
      std::lock_guard<std::mutex> lock(opt_mu);
      optimizer_ns += TraceRecorder::NowNs() - t0;
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
      if (frozen[u]) continue;  // unchanged
      const auto& l = layouts[u];
      const size_t shard = static_cast<size_t>(l.shard_numel);
      if (stage <= 2) {
        char* own = static_cast<char*>(full_params[u]) + l.shard_offset(rank) * csz;
        if (cpu_unit[u] && !result.skipped) {
          STRATA_RETURN_IF_ERROR(dev.CopyAsync(own, param_stage[u].data(), shard * csz,
                                               device::CopyKind::kHostToDevice, *comm_stream));
        }
        STRATA_RETURN_IF_ERROR(comm.AllGather(own, full_params[u], shard, cdt, *comm_stream));
      } else if (cpu_unit[u] && param_home == Tier::kDevice && !result.skipped) {
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
  if (!scaler && (nonfinite || !std::isfinite(result.loss)) &&
      cfg.strata.on_nonfinite == NonFinitePolicy::kError) {
    return Status(
        StatusCode::kAborted,
        fmt::format("step {}: the loss is {} and the gradient norm is {}: stopping (strata."
                    "on_nonfinite \"error\"); {}. Lower the learning rate, set gradient_clipping, "
                    "or set strata.on_nonfinite to \"skip\" to skip such steps",
                    steps_taken + 1, std::isnan(result.loss) ? "NaN" : fmt::format("{}", result.loss),
                    std::isnan(result.grad_norm) ? "NaN" : fmt::format("{}", result.grad_norm),
                    overlapped && nonfinite
                        ? "the overlapped CPU optimizer had already applied this step's update, "
                          "so the weights in memory are no longer usable; saved checkpoints are "
                          "not affected"
                        : "this step's update was not applied"));
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

}  // namespace strata::zero

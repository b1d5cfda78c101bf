// The training step and evaluation as phases over the engine's components (engine_internal.h).
#include "zero/engine_internal.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace strata::zero {

// ---- the step -----------------------------------------------------------------------------------

Result<StepResult> Engine::Impl::Step(std::span<const Batch* const> micro_batches) {
  if (micro_batches.empty()) return InvalidArgumentError("TrainStep: no micro-batches");
  Result<StepResult> r = StepImpl(micro_batches);
  if (!r.ok()) CleanUpFailedStep();
  return r;
}

// One optimizer step: every micro-batch's forward and backward (gradients reduced as each unit's
// backward ends; the overlapped CPU optimizer updating units as their gradients land), the
// global norm, the update of the units not yet updated, and the new parameters put in place.
Result<StepResult> Engine::Impl::StepImpl(std::span<const Batch* const> micro_batches) {
  StepTimes times;
  times.start_ns = TraceRecorder::NowNs();
  StepResult result;
  const int n_mb = static_cast<int>(micro_batches.size());
  STRATA_RETURN_IF_ERROR(BeginStep(n_mb, result));
  double loss_sum = 0.0;
  for (int mb = 0; mb < n_mb; ++mb) {
    STRATA_ASSIGN_OR_RETURN(
        double loss, TrainMicroBatch(*micro_batches[mb], mb, mb == n_mb - 1, result.loss_scale,
                                     times));
    loss_sum += loss;
  }
  Phase(comm::TrafficPhase::kReduce);
  if (setup.stage <= 1) STRATA_RETURN_IF_ERROR(reducer.ReduceAccumulated());
  Phase(comm::TrafficPhase::kOther);
  STRATA_RETURN_IF_ERROR(DrainBackward(times));

  // The gradients are summed over ranks and micro-batches and scaled by the loss scale;
  // BeginStep set the factor that averages and unscales them.
  const double inv = step_hyper.grad_scale;
  STRATA_ASSIGN_OR_RETURN(const GradientNorm norm, ComputeGradientNorm(inv, times));
  result.grad_norm = norm.norm;
  // fp32 / bf16: a non-finite norm is never applied where it can still be held back (not when
  // the CPU optimizer overlapped backward: those updates are done). strata.on_nonfinite "error"
  // stops the run below, once the step's work has drained; "skip" goes on.
  const bool nonfinite = !loss_scaler && norm.overflow;
  if (loss_scaler) {
    result.skipped = loss_scaler->Update(norm.overflow);
  } else if (nonfinite) {
    result.skipped = true;
  }
  STRATA_RETURN_IF_ERROR(UpdateUnits(result.skipped, inv * norm.clip_coef, times));
  if (!result.skipped) ++steps_taken;
  STRATA_RETURN_IF_ERROR(PublishParameters(result.skipped, times));
  params.EndStep();
  in_step = false;
  STRATA_RETURN_IF_ERROR(FinishResult(loss_sum, n_mb, nonfinite, times, result));
  return result;
}

// The step's books, hyper-parameters and accumulators, before its first micro-batch.
Status Engine::Impl::BeginStep(int micro_batches, StepResult& result) {
  clock.ResetCommWait();
  cpu_worker.BeginStep();  // the previous step's jobs are all done
  if (setup.stream_grad_shards && micro_batches != 1) {
    return FailedPreconditionError(fmt::format(
        "engine: a step of {} micro-batches, but gradient_accumulation_steps is 1 (the gradient "
        "shards stream through the pinned pool, one micro-batch a step)",
        micro_batches));
  }
  const float loss_scale = loss_scaler ? loss_scaler->scale() : 1.0f;
  result.loss_scale = loss_scale;

  // Hyper-parameters of this step (the overlapped optimizer starts during backward).
  result.lr = lr_schedule->LrAt(steps_taken);
  step_hyper = optim::AdamHyper{};
  step_hyper.lr = result.lr;
  step_hyper.beta1 = config.optimizer.beta1;
  step_hyper.beta2 = config.optimizer.beta2;
  step_hyper.eps = config.optimizer.eps;
  step_hyper.weight_decay = config.optimizer.weight_decay;
  step_hyper.decoupled = config.optimizer.decoupled_weight_decay;
  step_hyper.bias_correction = config.optimizer.bias_correction;
  step_hyper.step = steps_taken + 1;
  step_hyper.grad_scale =
      1.0 / (static_cast<double>(setup.world_size) * micro_batches * loss_scale);

  params.BeginStep();
  in_step = true;
  return reducer.ZeroAccumulators();
}

// Forward over every unit, then backward from the last unit to the first; returns the
// micro-batch's loss.
Result<double> Engine::Impl::TrainMicroBatch(const Batch& batch, int mb, bool last,
                                             float loss_scale, StepTimes& times) {
  STRATA_RETURN_IF_ERROR(model.BeginMicroBatch(batch, loss_scale, *streams.compute));
  for (int u = 0; u < setup.units(); ++u) STRATA_RETURN_IF_ERROR(ForwardUnit(u, false, times));
  if (last && setup.cpu_optimizer && !setup.overlapped_optimizer) {
    // The step waits for every gradient (clipping, fp16): read its first optimizer states
    // from NVMe during this backward, while the disk has little else to do.
    STRATA_RETURN_IF_ERROR(adam.offloaded().ReadAheadFirst());
  }
  for (int u = setup.units() - 1; u >= 0; --u) {
    STRATA_RETURN_IF_ERROR(BackwardUnit(u, mb, last, times));
  }
  return model.EndMicroBatch(*streams.compute);
}

// Unit u's forward, with the units it shares gathered beside it (`eval`: for EvalLoss, outside
// the step's books).
Status Engine::Impl::ForwardUnit(int u, bool eval, StepTimes& times) {
  const int64_t t0 = TraceRecorder::NowNs();
  Phase(eval ? comm::TrafficPhase::kOther : comm::TrafficPhase::kForwardGather);
  STRATA_ASSIGN_OR_RETURN(UnitView p,
                          params.Acquire(u, eval ? GatherUse::kEval : GatherUse::kForward,
                                         eval ? "eval" : "forward", &times.io_wait_ns));
  std::vector<UnitView> views{p};
  for (int s : setup.shared[static_cast<size_t>(u)]) {
    STRATA_ASSIGN_OR_RETURN(
        UnitView ps,
        params.Acquire(s, eval ? GatherUse::kEval : GatherUse::kForward,
                       eval ? "eval (tied)" : "forward (tied)", &times.io_wait_ns));
    views.push_back(ps);
  }
  if (!eval) times.exposed_io_s += clock.ExposedSince(t0);
  if (views.size() == 1) {
    STRATA_RETURN_IF_ERROR(model.Forward(u, p, *streams.compute));
  } else {
    STRATA_RETURN_IF_ERROR(model.ForwardShared(u, views, *streams.compute));
  }
  STRATA_RETURN_IF_ERROR(clock.Stamp());
  return ReleaseViews(u, views, eval);
}

// Lets unit u's view (views[0]) and those of the units it shares go after their use.
Status Engine::Impl::ReleaseViews(int u, const std::vector<UnitView>& views, bool eval) {
  STRATA_RETURN_IF_ERROR(params.Release(u, views[0], eval));
  const std::vector<int>& shared = setup.shared[static_cast<size_t>(u)];
  for (size_t i = 0; i < shared.size(); ++i) {
    STRATA_RETURN_IF_ERROR(params.Release(shared[i], views[i + 1], eval));
  }
  return Status::Ok();
}

// Units whose internals u's backward reads run their forward again first, each gathered for it
// (activation checkpointing across units: Model::RecomputeUnits).
Status Engine::Impl::RecomputeFor(int u, StepTimes& times) {
  for (const int r : setup.recompute[static_cast<size_t>(u)]) {
    const int64_t t1 = TraceRecorder::NowNs();
    Phase(comm::TrafficPhase::kBackwardGather);
    STRATA_ASSIGN_OR_RETURN(
        UnitView pr, params.Acquire(r, GatherUse::kBackward, "recompute", &times.io_wait_ns));
    times.exposed_io_s += clock.ExposedSince(t1);
    STRATA_RETURN_IF_ERROR(model.Recompute(r, pr, *streams.compute));
    STRATA_RETURN_IF_ERROR(clock.Stamp());
    STRATA_RETURN_IF_ERROR(params.Release(r, pr));
  }
  return Status::Ok();
}

// Unit u's backward into its gradient buffer (and into those of the units it shares, whose
// gradients then wait for their own backward), then the gradient's reduction.
Status Engine::Impl::BackwardUnit(int u, int mb, bool last, StepTimes& times) {
  STRATA_RETURN_IF_ERROR(RecomputeFor(u, times));
  const int64_t t0 = TraceRecorder::NowNs();
  Phase(comm::TrafficPhase::kBackwardGather);
  STRATA_ASSIGN_OR_RETURN(
      UnitView p, params.Acquire(u, GatherUse::kBackward, "backward", &times.io_wait_ns));
  // The unit's gradient buffer: the one a tying unit already added to, or a zeroed one. A frozen
  // unit has none: the model sees a null gradient view and computes only the input gradients.
  STRATA_ASSIGN_OR_RETURN(void* g, reducer.GradientBuffer(u));
  std::vector<UnitView> views{p};
  std::vector<UnitView> grad_views{UnitView{g, DType::kF32, &layout(u).slots}};
  for (int s : setup.shared[static_cast<size_t>(u)]) {
    STRATA_ASSIGN_OR_RETURN(UnitView ps, params.Acquire(s, GatherUse::kBackward, "backward (tied)",
                                                    &times.io_wait_ns));
    views.push_back(ps);
    STRATA_ASSIGN_OR_RETURN(void* gs, reducer.GradientBuffer(s));
    reducer.HoldUntilOwnBackward(s, gs);  // reduced after s's own backward
    grad_views.push_back(UnitView{gs, DType::kF32, &layout(s).slots});
  }
  times.exposed_io_s += clock.ExposedSince(t0);
  if (views.size() == 1) {
    STRATA_RETURN_IF_ERROR(model.Backward(u, p, grad_views[0], *streams.compute));
  } else {
    STRATA_RETURN_IF_ERROR(model.BackwardShared(u, views, grad_views, *streams.compute));
  }
  STRATA_RETURN_IF_ERROR(clock.Stamp());
  STRATA_RETURN_IF_ERROR(ReleaseViews(u, views, false));
  // A frozen unit reduces nothing of its own, but unit 0's end of backward flushes the bucket.
  Phase(comm::TrafficPhase::kReduce);
  const Status reduced =
      setup.is_frozen(u) ? reducer.SkipFrozen(u) : reducer.Reduce(u, g, mb, last);
  Phase(comm::TrafficPhase::kOther);
  return reduced;
}

// Everything backward enqueued has run; what the host waited for beyond compute is exposed.
Status Engine::Impl::DrainBackward(StepTimes& times) {
  STRATA_RETURN_IF_ERROR(device.Synchronize(*streams.compute));
  const int64_t t_comm = TraceRecorder::NowNs();
  STRATA_RETURN_IF_ERROR(device.Synchronize(*streams.comm));
  times.exposed_comm_ns = clock.comm_wait_ns() + (TraceRecorder::NowNs() - t_comm);
  return Status::Ok();
}

// The global gradient norm (for clipping, the overflow check and reporting). `grad_scale`: what
// turns the summed, loss-scaled gradients into the averaged ones.
Result<GradientNorm> Engine::Impl::ComputeGradientNorm(double grad_scale, StepTimes& times) {
  const int64_t t0 = TraceRecorder::NowNs();
  // With the overlapped optimizer, host-homed units' sums come from their optimizer jobs, so
  // this waits for those jobs: that part is the optimizer's, not the collective's.
  int64_t norm_opt_wait_ns = 0;
  STRATA_ASSIGN_OR_RETURN(double local, reducer.LocalSumSquares(&norm_opt_wait_ns));
  times.exposed_optimizer_ns += norm_opt_wait_ns;
  double total = local;
  if (setup.stage >= 1 && setup.world_size > 1) {
    const float local_f = static_cast<float>(local);
    STRATA_ASSIGN_OR_RETURN(float all, scalars.AllReduce(local_f));
    total = all;
  }
  // Tensor parallelism: the group's ranks hold different parts of the split parameters (each
  // rank's sum counts the whole ones at 1/T).
  if (setup.tensor_parallel > 1) {
    STRATA_ASSIGN_OR_RETURN(float all, scalars.AllReduce(static_cast<float>(total),
                                                         options.tensor_parallel));
    total = all;
  }
  times.exposed_comm_ns += TraceRecorder::NowNs() - t0 - norm_opt_wait_ns;
  GradientNorm norm;
  norm.overflow = !std::isfinite(total);
  norm.norm = std::sqrt(total) * grad_scale;
  if (config.gradient_clipping > 0.0 && std::isfinite(norm.norm)) {
    const double coef = config.gradient_clipping / (norm.norm + 1e-6);
    if (coef < 1.0) norm.clip_coef = coef;
  }
  return norm;
}

// Every unit not yet updated, unless the step is skipped: the CPU optimizer's units queued to
// its thread (unless they were queued during backward), the device's updated meanwhile; then
// waits for the CPU optimizer. `grad_scale` includes the clipping factor.
Status Engine::Impl::UpdateUnits(bool skipped, double grad_scale, StepTimes& times) {
  const bool overlapped = setup.overlapped_optimizer;
  // (Overlapped jobs already have theirs: no clipping.)
  if (!skipped && !overlapped) step_hyper.grad_scale = grad_scale;
  if (!skipped) {
    // Offloaded units first (the CPU optimizer's thread works on them while the device updates
    // the others), unless they were already queued during backward.
    if (setup.cpu_optimizer && !overlapped) {
      for (int u = setup.units() - 1; u >= 0; --u) {
        if (setup.on_cpu(u)) cpu_worker.Queue({u, nullptr, step_hyper});
      }
    }
    if (setup.device_optimizer) {
      const int64_t t0 = TraceRecorder::NowNs();
      for (int u = setup.units() - 1; u >= 0; --u) {
        if (!setup.on_cpu(u) && !setup.is_frozen(u)) STRATA_RETURN_IF_ERROR(DeviceOptimizerStep(u));
      }
      STRATA_RETURN_IF_ERROR(device.Synchronize(*streams.compute));
      times.exposed_optimizer_ns += TraceRecorder::NowNs() - t0;
      cpu_worker.AddWorkTime(TraceRecorder::NowNs() - t0);
    }
  }
  if (setup.cpu_optimizer) {
    STRATA_RETURN_IF_ERROR(cpu_worker.Wait(&times.exposed_optimizer_ns));
    STRATA_RETURN_IF_ERROR(adam.TakeWritebackError());
  }
  return params.TakeWritebackError();
}

// Updated shards back into the gathered parameters (stages 1-2: copied from the CPU optimizer's
// staging, then all-gathered) or into the device-homed parameter shards (stage 3 with a CPU
// optimizer).
Status Engine::Impl::PublishParameters(bool skipped, StepTimes& times) {
  const int64_t t0 = TraceRecorder::NowNs();
  device::Stream& comm = *streams.comm;
  for (int u = 0; u < setup.units() && setup.stage >= 1; ++u) {
    if (setup.is_frozen(u)) continue;  // unchanged
    const auto& l = layout(u);
    const size_t shard = static_cast<size_t>(l.shard_numel);
    if (setup.stage <= 2) {
      void* full = params.gathered(u);
      char* own = static_cast<char*>(full) + l.shard_offset(setup.rank) * setup.compute_bytes;
      if (setup.on_cpu(u) && !skipped) {
        STRATA_RETURN_IF_ERROR(device.CopyAsync(own, adam.staged(u), shard * setup.compute_bytes,
                                                device::CopyKind::kHostToDevice, comm));
      }
      STRATA_RETURN_IF_ERROR(collective.AllGather(own, full, shard, setup.compute_dtype, comm));
    } else if (setup.on_cpu(u) && setup.param_home == Tier::kDevice && !skipped) {
      STRATA_RETURN_IF_ERROR(params.WriteShard(u, adam.staged(u)));
    }
  }
  STRATA_RETURN_IF_ERROR(device.Synchronize(comm));
  times.exposed_comm_ns += TraceRecorder::NowNs() - t0;
  return Status::Ok();
}

// The step's mean loss over every rank and its time split; a non-finite step stops the run
// under strata.on_nonfinite "error".
Status Engine::Impl::FinishResult(double loss_sum, int micro_batches, bool nonfinite,
                                  const StepTimes& times, StepResult& result) {
  result.step = steps_taken;
  result.loss = loss_sum / micro_batches;
  if (setup.world_size > 1) {
    STRATA_ASSIGN_OR_RETURN(float total, scalars.AllReduce(static_cast<float>(result.loss)));
    result.loss = static_cast<double>(total) / setup.world_size;
  }
  if (!loss_scaler && (nonfinite || !std::isfinite(result.loss)) &&
      config.strata.on_nonfinite == NonFinitePolicy::kError) {
    return Status(
        StatusCode::kAborted,
        fmt::format("step {}: the loss is {} and the gradient norm is {}: stopping (strata."
                    "on_nonfinite \"error\"); {}. Lower the learning rate, set gradient_clipping, "
                    "or set strata.on_nonfinite to \"skip\" to skip such steps",
                    steps_taken + 1, std::isnan(result.loss) ? "NaN" : fmt::format("{}", result.loss),
                    std::isnan(result.grad_norm) ? "NaN" : fmt::format("{}", result.grad_norm),
                    setup.overlapped_optimizer && nonfinite
                        ? "the overlapped CPU optimizer had already applied this step's update, "
                          "so the weights in memory are no longer usable; saved checkpoints are "
                          "not affected"
                        : "this step's update was not applied"));
  }
  result.step_s = Seconds(TraceRecorder::NowNs() - times.start_ns);
  result.exposed_io_s = times.exposed_io_s;
  result.exposed_comm_s = Seconds(times.exposed_comm_ns);
  result.exposed_optimizer_s = Seconds(times.exposed_optimizer_ns);
  result.optimizer_s = Seconds(cpu_worker.work_ns());
  result.compute_s = std::max(0.0, result.step_s - result.exposed_io_s - result.exposed_comm_s -
                                       result.exposed_optimizer_s);
  return Status::Ok();
}

// After a failed step: no optimizer work may outlive TrainStep, and no transient buffer may leak.
void Engine::Impl::CleanUpFailedStep() {
  cpu_worker.CancelQueued();
  streams.SynchronizeQuietly(device);
  live.FreeOwned();
  reducer.ForgetStep();  // its held gradient buffers were freed with the live ones
  (void)adam.TakeWritebackError();
  params.ForgetStep(in_step);
  in_step = false;
}

// ---- evaluation -----------------------------------------------------------------------------------

Result<double> Engine::Impl::Eval(std::span<const Batch* const> micro_batches) {
  if (micro_batches.empty()) return InvalidArgumentError("EvalLoss: no micro-batches");
  Result<double> r = EvalImpl(micro_batches);
  if (!r.ok()) CleanUpFailedStep();
  return r;
}

Result<double> Engine::Impl::EvalImpl(std::span<const Batch* const> micro_batches) {
  StepTimes times;  // not reported
  double loss_sum = 0.0;
  for (const Batch* batch : micro_batches) {
    STRATA_RETURN_IF_ERROR(model.BeginMicroBatch(*batch, 1.0f, *streams.compute));
    for (int u = 0; u < setup.units(); ++u) STRATA_RETURN_IF_ERROR(ForwardUnit(u, true, times));
    STRATA_ASSIGN_OR_RETURN(double loss, model.EndMicroBatch(*streams.compute));
    loss_sum += loss;
  }
  STRATA_RETURN_IF_ERROR(device.Synchronize(*streams.compute));
  STRATA_RETURN_IF_ERROR(device.Synchronize(*streams.comm));
  double mean = loss_sum / static_cast<double>(micro_batches.size());
  if (setup.world_size > 1) {
    STRATA_ASSIGN_OR_RETURN(float total, scalars.AllReduce(static_cast<float>(mean)));
    mean = static_cast<double>(total) / setup.world_size;
  }
  return mean;
}

}  // namespace strata::zero

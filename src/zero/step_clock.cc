#include "zero/step_clock.h"

#include <algorithm>

#include "strata/trace.h"
#include "zero/engine_setup.h"

namespace strata::zero::engine_internal {

Status EngineStreams::Create(device::Device& device) {
  STRATA_ASSIGN_OR_RETURN(compute, device.CreateStream("compute"));
  STRATA_ASSIGN_OR_RETURN(comm, device.CreateStream("comm"));
  STRATA_ASSIGN_OR_RETURN(compute_event, device.CreateEvent());
  STRATA_ASSIGN_OR_RETURN(comm_event, device.CreateEvent());
  return Status::Ok();
}

void EngineStreams::SynchronizeQuietly(device::Device& device) {
  if (compute) (void)device.Synchronize(*compute);
  if (comm) (void)device.Synchronize(*comm);
}

Status StepClock::Stamp() {
  ++enqueued_;
  return device_.HostTask(
      *streams_.compute,
      [this]() {
        done_ns_.store(TraceRecorder::NowNs(), std::memory_order_relaxed);
        done_.fetch_add(1, std::memory_order_release);
        return Status::Ok();
      },
      "stamp");
}

Status StepClock::ComputeWaitsForComm() {
  auto t0 = std::make_shared<std::atomic<int64_t>>(0);
  STRATA_RETURN_IF_ERROR(device_.HostTask(
      *streams_.compute,
      [t0]() {
        t0->store(TraceRecorder::NowNs());
        return Status::Ok();
      },
      "wait-comm begin"));
  STRATA_RETURN_IF_ERROR(device_.Record(*streams_.comm_event, *streams_.comm));
  STRATA_RETURN_IF_ERROR(device_.Wait(*streams_.compute, *streams_.comm_event));
  return device_.HostTask(
      *streams_.compute,
      [this, t0]() {
        comm_wait_ns_.fetch_add(TraceRecorder::NowNs() - t0->load());
        return Status::Ok();
      },
      "wait-comm end");
}

double StepClock::ExposedSince(int64_t t0_ns) const {
  const int64_t now = TraceRecorder::NowNs();
  if (done_.load(std::memory_order_acquire) < enqueued_) return 0.0;  // busy
  const int64_t idle_from = std::max(t0_ns, done_ns_.load(std::memory_order_relaxed));
  return now > idle_from ? Seconds(now - idle_from) : 0.0;
}

}  // namespace strata::zero::engine_internal

// EngineStreams and StepClock: the engine's two streams, and the clock that splits a step's
// wall time into compute and exposed waits. Private to src/zero.
//
// The engine enqueues all of a step's compute (the model's forward and backward, the device
// optimizer) on one compute stream and all of its communication (gathers, reductions, gradient
// copies to the host) on one comm stream. A wait of the host is *exposed* only for the part of it
// during which the compute stream had nothing left to run; to tell, the clock stamps the compute
// stream after each piece of work:
//
//   driving thread                      compute stream thread
//   Stamp():  ++enqueued ──enqueue──▶   stamp task: done_ns = now; ++done (release)
//   ExposedSince(t0): done (acquire) < enqueued ? 0 : now - max(t0, done_ns)
//
// ComputeWaitsForComm makes the compute stream wait for everything enqueued on the comm stream
// so far, and measures, on the compute stream, how long it actually waited (exposed
// communication, summed into comm_wait_ns until ResetCommWait).
//
// Threading: Stamp, ComputeWaitsForComm, ExposedSince and ResetCommWait are called by the
// driving thread only; `enqueued_` is the driving thread's. The stream tasks they enqueue run on
// the compute stream's thread and touch only the atomics. No lock: each atomic is one value, and
// `done_` is released after `done_ns_` is written, so a reader that sees the count sees the time.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "strata/device.h"
#include "strata/status.h"

namespace strata::zero::engine_internal {

struct EngineStreams {
  std::unique_ptr<device::Stream> compute;
  std::unique_ptr<device::Stream> comm;
  std::unique_ptr<device::Event> compute_event;  // recorded on compute for comm to wait on
  std::unique_ptr<device::Event> comm_event;     // recorded on comm for compute to wait on

  Status Create(device::Device& device);
  // Waits for both streams (errors ignored: for clean-up and the engine's destructor).
  void SynchronizeQuietly(device::Device& device);
};

class StepClock {
 public:
  StepClock(device::Device& device, EngineStreams& streams) : device_(device), streams_(streams) {}
  StepClock(const StepClock&) = delete;
  StepClock& operator=(const StepClock&) = delete;

  // Marks the end of the compute enqueued so far.
  Status Stamp();
  // The compute stream waits for the comm stream's work so far (timed on the compute stream).
  Status ComputeWaitsForComm();
  // Seconds of the host's wait since t0_ns (TraceRecorder::NowNs) during which the compute
  // stream was idle; 0 while it still has stamped work to run.
  double ExposedSince(int64_t t0_ns) const;

  void ResetCommWait() { comm_wait_ns_.store(0); }
  int64_t comm_wait_ns() const { return comm_wait_ns_.load(); }

 private:
  device::Device& device_;
  EngineStreams& streams_;
  uint64_t enqueued_ = 0;                   // stamps enqueued (driving thread)
  std::atomic<uint64_t> done_{0};           // stamps run (compute stream)
  std::atomic<int64_t> done_ns_{0};         // when the last one ran
  std::atomic<int64_t> comm_wait_ns_{0};    // compute's measured waits for comm this step
};

}  // namespace strata::zero::engine_internal

// Fault injection for the Device seam, for tests: make a chosen allocation, copy, host task or
// element-wise operation fail, or make it slow — the device's counterpart of io/fault_injection.h.
//
// A DeviceFaultInjector holds rules and decides, for each call it is asked about, whether to
// inject a fault. A FaultInjectingDevice (a DeviceWrapper) asks it once per Alloc, CopyAsync,
// HostTask, and element-wise call (Cast, Scale, Axpy, Fill, SumSquares), and then:
//   Alloc, failed      returns ResourceExhausted at once, as a device out of memory does; the
//                      failed_allocs counter of memory_stats() does not move (it is the inner
//                      device's).
//   work, failed       by default the work fails *as it runs*, as a GPU copy or kernel does: in
//                      its place a host task that returns the error is enqueued on the stream,
//                      so the error becomes the device's sticky error (strata/device.h), named
//                      "stream '<stream>': host task '<op>' failed: injected fault: <op> #<n>
//                      ...". With FailWhen::kEnqueue the call itself returns the error instead
//                      and enqueues nothing (an argument or launch error).
//   work, slow         a host task that sleeps `delay` on the injector's clock is enqueued just
//                      before the work, so the work holds its stream that much longer (and
//                      everything waiting on it waits too). With a ManualClock the work stays
//                      queued until the test advances the clock (ManualClock::AwaitSleepers
//                      tells when the delay has started).
// Everything else (streams, events, synchronisation, Notify) goes to the wrapped device as is.
//
// Thread safety: all methods of both classes may be called from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/clock.h"
#include "common/fault_rules.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata::device {

enum class DeviceOp : uint8_t { kAlloc, kCopy, kHostTask, kElementwise };
std::string_view DeviceOpName(DeviceOp op);  // "alloc", "copy", "host task", "element-wise"

enum class DeviceFaultKind : uint8_t {
  kFail,  // the call or its work fails
  kSlow,  // the work waits `delay` on its stream before it runs (not for kAlloc)
};

// When a failed piece of work (not an allocation) reports its error.
enum class FailWhen : uint8_t {
  kRunning,  // when the stream reaches it: the device's sticky error
  kEnqueue,  // the enqueueing call returns it; nothing is enqueued
};

struct DeviceFaultRule {
  DeviceOp op = DeviceOp::kCopy;
  DeviceFaultKind kind = DeviceFaultKind::kFail;
  // Which calls the rule considers (all must hold):
  std::optional<CopyKind> copy_kind{};  // kCopy: only this direction
  // Work on streams whose name contains this ("" = any; an Alloc, which has no stream, is
  // considered only when this is empty).
  std::string stream_contains{};
  std::string label_contains{};  // kHostTask: tasks whose label contains this ("" = any)
  // Among the considered calls, which get the fault: the listed ordinals (0-based, in the order
  // the injector saw them), or every one when the list is empty.
  std::vector<uint64_t> ordinals{};
  int64_t max_hits = -1;  // stop after this many injections (-1 = no limit)
  // kFail: the error's code (Alloc: always ResourceExhausted) and when work reports it.
  StatusCode code = StatusCode::kInternal;
  FailWhen when = FailWhen::kRunning;
  // kSlow:
  std::chrono::nanoseconds delay{0};
};

// What the injector decided for one call.
struct DeviceFaultDecision {
  bool fail = false;
  StatusCode code = StatusCode::kInternal;
  FailWhen when = FailWhen::kRunning;
  std::chrono::nanoseconds delay{0};  // > 0: slow
  uint64_t ordinal = 0;  // the call's number among the calls of its op the injector saw (0-based)
};

class DeviceFaultInjector {
 public:
  // `clock` times the delays of kSlow rules (RealClock() when null); it must outlive every
  // device that uses this injector.
  explicit DeviceFaultInjector(Clock* clock = nullptr);

  // Adds a rule; returns its index (for hits()).
  size_t AddRule(DeviceFaultRule rule);
  void Clear();

  // Asked once per call. `copy_kind` for copies; `label` for host tasks.
  DeviceFaultDecision Decide(DeviceOp op, std::optional<CopyKind> copy_kind,
                             std::string_view stream, std::string_view label);

  // How many faults rule `index` injected, and in total.
  uint64_t hits(size_t index) const;
  uint64_t total_hits() const;
  // Calls of `op` seen so far (faulted or not).
  uint64_t seen(DeviceOp op) const;

  Clock& clock() const { return *clock_; }

 private:
  Clock* const clock_;
  mutable std::mutex mu_;
  FaultRules<DeviceFaultRule> rules_;
  uint64_t seen_[4] = {0, 0, 0, 0};
};

// Wraps `inner` (which it owns) and injects the faults `faults` decides. name():
// "faulty(<inner's name>)".
std::unique_ptr<Device> CreateFaultInjectingDevice(std::unique_ptr<Device> inner,
                                                   std::shared_ptr<DeviceFaultInjector> faults);

}  // namespace strata::device

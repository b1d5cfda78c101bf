// StepScalars: the few scalars a step reads back from the device — the gradient norm's sum of
// squares (a double) and a float all-reduced over the ranks (the norm, the loss) — in 16 bytes
// of device memory and one registered host page, allocated once at Init so that reading them
// costs no allocation and no pageable copy per step. Private to src/zero.
//
//   device  [0, 8): double sum of squares   [8, 12): float for the all-reduce
//           [16, 48): doubles, sums of squares of parameters other tensor-parallel ranks hold too
//           (one per count of copies, EngineSetup::tp_copies)
//   host    the same offsets in a 4 KiB page registered with the device
//
// Threading: the engine's driving thread only; every copy is on the comm stream, synchronized
// before the host reads the page. No lock.
#pragma once

#include "common/host_memory.h"
#include "strata/collective.h"
#include "strata/device.h"
#include "strata/status.h"
#include "zero/step_clock.h"

namespace strata::zero::engine_internal {

class StepScalars {
 public:
  StepScalars(device::Device& device, comm::Collective& collective, EngineStreams& streams)
      : device_(device), collective_(collective), streams_(streams) {}
  ~StepScalars();
  StepScalars(const StepScalars&) = delete;
  StepScalars& operator=(const StepScalars&) = delete;

  Status Allocate();

  double* host_sum() { return reinterpret_cast<double*>(on_host_.data()); }
  double* device_sum() { return static_cast<double*>(on_device_); }
  double* host_copied_sums() { return reinterpret_cast<double*>(on_host_.data() + 16); }
  double* device_copied_sums() {
    return reinterpret_cast<double*>(static_cast<char*>(on_device_) + 16);
  }

  // The sum of `value` over the ranks of `over` (null: the engine's collective), through the
  // device and the collective, on the comm stream, waited for.
  Result<float> AllReduce(float value, comm::Collective* over = nullptr);

 private:
  device::Device& device_;
  comm::Collective& collective_;
  EngineStreams& streams_;
  void* on_device_ = nullptr;  // 48 bytes
  HostRegion on_host_;          // one page, registered with the device
  bool on_host_registered_ = false;
};

}  // namespace strata::zero::engine_internal

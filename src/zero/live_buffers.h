// LiveBuffers: the budget of a step's transient device buffers — stage-3 gathered units and
// per-unit fp32 gradients. Private to src/zero.
//
// At most `limit` bytes of them exist at once (Init sizes it: at least two units' worth, so that
// one unit's gather and another's gradient reduction can be in flight). Alloc blocks until the
// request fits, or until nothing is live (one buffer larger than the limit still goes through);
// that is the step's back-pressure. A buffer's life:
//
//   Alloc ──▶ owned ──FreeAfter(stream)──▶ queued ──stream reaches it──▶ freed, bytes returned
//              │
//              ├──Keep──▶ the caller's (out of the budget; the caller frees it: persistent units)
//              └──FreeOwned (after a failed step)──▶ freed
//
// `owned` holds the buffers not yet handed to a stream, so that the clean-up after a failed step
// frees exactly those: the ones already queued are freed by their streams.
//
// Threading: Alloc, FreeAfter, Keep and FreeOwned are called by the engine's driving thread. The
// frees queued by FreeAfter run on the stream's thread (Device::Notify) and return their bytes
// under mu_, waking a blocked Alloc. mu_ guards live_bytes_ and owned_; it is never held across
// a device call.
#pragma once

#include <cstdint>
#include <unordered_map>

#include "common/mutex.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata::zero::engine_internal {

class LiveBuffers {
 public:
  explicit LiveBuffers(device::Device& device) : device_(device) {}
  LiveBuffers(const LiveBuffers&) = delete;
  LiveBuffers& operator=(const LiveBuffers&) = delete;

  // Before the first Alloc (Init).
  void set_limit(uint64_t max_live_bytes) { limit_ = max_live_bytes; }
  uint64_t limit() const { return limit_; }

  // Waits until `bytes` more fit under the limit (or nothing is live), then allocates them on
  // the device. The buffer is owned until FreeAfter or Keep.
  Result<void*> Alloc(uint64_t bytes) EXCLUDES(mu_);
  // Frees an owned buffer once the work enqueued on `stream` so far has run. Internal for a
  // buffer that is not owned; if the free cannot be enqueued the buffer stays owned.
  Status FreeAfter(device::Stream& stream, void* ptr) EXCLUDES(mu_);
  // Takes an owned buffer out of the budget: the caller keeps it and frees it with
  // Device::Free (a persistent unit kept gathered for the rest of the step).
  void Keep(void* ptr) EXCLUDES(mu_);
  // After a failed step (its streams drained): frees every owned buffer.
  void FreeOwned() EXCLUDES(mu_);

 private:
  device::Device& device_;
  uint64_t limit_ = 0;  // written once by Init, before any other thread reads it

  Mutex mu_;
  CondVar freed_;  // signalled when live_bytes_ falls
  uint64_t live_bytes_ GUARDED_BY(mu_) = 0;
  std::unordered_map<void*, uint64_t> owned_ GUARDED_BY(mu_);  // buffer -> bytes
};

}  // namespace strata::zero::engine_internal

// Device: Strata's seam to the accelerator (memory, streams, events, copies, a few element-wise
// operations).
//
// Two backends implement it (see CreateDevice):
//   cpu   "device memory" is host memory under its own byte budget; each Stream is a worker
//         thread that runs its queue in order; an Event is a completion marker. Runs anywhere, so
//         the whole engine can be tested without a GPU.
//   cuda  real CUDA streams and events, a caching allocator that honours the budget, host memory
//         registration with cudaHostRegister. Built when the CUDA toolkit is found; its tests skip
//         on machines without a GPU.
//
// Ordering semantics are CUDA's, on both backends:
//   - Work enqueued on one Stream runs in enqueue order; each item starts after the previous one
//     finished.
//   - Streams are independent: nothing orders work on stream A against work on stream B except an
//     Event recorded on A and waited on by B (Wait). A missing Wait is a data race: on the CPU
//     device it shows up as a wrong result or a ThreadSanitizer report.
//   - Enqueueing never blocks for the work to run (one exception: on CUDA, a copy to or from
//     host memory that is not registered may wait for the copy itself; see CopyAsync).
//     Synchronize blocks the calling host thread.
//   - Record(event, stream) captures "all work enqueued on `stream` so far"; re-recording an
//     event replaces what it captures. Waiting on or querying a never-recorded event is a no-op /
//     "complete", as in CUDA.
//
// Memory: Alloc/Free work under a hard byte budget (DeviceOptions::memory_budget). Alloc beyond it
// is ResourceExhausted naming the budget, what is in use and the request — never a silent overrun.
// Free must only be called when no enqueued work still uses the memory (synchronize an event
// recorded after the last use first). Pointers are aligned to kDeviceAlignment.
//
// Errors: enqueue calls validate their arguments and return InvalidArgument at once. A failure
// while the work runs (a CUDA launch error, a host task that reported one) is sticky: it is
// returned by the next Synchronize / Query of any stream or event and by every later enqueue,
// naming the stream and the operation.
//
// Threading: every method may be called from any thread. HostTask and Notify functions run on
// device-owned threads (see each). Streams and Events are created by the Device and must not
// outlive it; destroying a Stream waits for its queued work.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "strata/status.h"

namespace strata {
class TraceRecorder;
}

namespace strata::device {

inline constexpr size_t kDeviceAlignment = 256;

enum class DType : uint8_t { kF32, kBF16, kF16 };
std::string_view DTypeName(DType dtype);  // "fp32", "bf16", "fp16"
size_t DTypeSize(DType dtype);            // 4, 2, 2

enum class CopyKind : uint8_t {
  kHostToDevice,
  kDeviceToHost,
  kDeviceToDevice,
};
std::string_view CopyKindName(CopyKind kind);  // "h2d", "d2h", "d2d"

enum class DeviceType : uint8_t { kCpu, kCuda };
std::string_view DeviceTypeName(DeviceType type);  // "cpu", "cuda"

// An ordered queue of work. Opaque; created by Device::CreateStream.
class Stream {
 public:
  virtual ~Stream() = default;
  virtual std::string_view name() const = 0;

 protected:
  Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

// A completion marker. Opaque; created by Device::CreateEvent.
class Event {
 public:
  virtual ~Event() = default;

 protected:
  Event() = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

struct DeviceMemoryStats {
  uint64_t budget = 0;       // hard limit for Alloc
  uint64_t in_use = 0;       // bytes currently allocated (as requested, rounded to the alignment)
  uint64_t peak = 0;         // highest in_use since creation (or ResetPeak)
  uint64_t allocs = 0;       // successful Alloc calls
  uint64_t failed_allocs = 0;
  // Freed blocks the device keeps for reuse (its allocator's cache); in_use + cached stays within
  // the budget, the cache giving way when a new block needs the room.
  uint64_t cached = 0;
  // Host<->device copies (CopyAsync h2d / d2h) whose host side is not inside registered host
  // memory, since creation: pageable copies, which on a GPU are staged through a driver buffer
  // and may block. Strata's own transfers never make them during a training step.
  uint64_t pageable_copies = 0;
  uint64_t pageable_copy_bytes = 0;
};

struct DeviceOptions {
  DeviceType type = DeviceType::kCpu;
  int ordinal = 0;                 // CUDA device index
  uint64_t memory_budget = 0;      // bytes; 0 = all free memory (cuda) / 1/4 of RAM (cpu)
  std::string name;                // for logs and traces; default "<type>:<ordinal>"
  // When set, every copy, host task and element-wise operation is recorded on a track named
  // after its stream (CPU device: actual run times; CUDA: timed with events). Must outlive the
  // device.
  TraceRecorder* trace = nullptr;
};

class Device {
 public:
  virtual ~Device() = default;
  Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  virtual DeviceType type() const = 0;
  virtual std::string_view name() const = 0;

  // ---- memory ----------------------------------------------------------------------------------
  // `bytes` > 0. ResourceExhausted (naming budget, in use, request) beyond the budget.
  virtual Result<void*> Alloc(size_t bytes) = 0;
  // Frees memory from Alloc (nullptr is ignored). No enqueued work may still use it.
  virtual void Free(void* ptr) = 0;
  virtual DeviceMemoryStats memory_stats() const = 0;
  virtual void ResetPeak() = 0;

  // Makes host memory usable for fast asynchronous copies (cudaHostRegister; a bookkeeping
  // no-op on the CPU device). The range must stay mapped until UnregisterHost.
  virtual Status RegisterHost(void* ptr, size_t bytes) = 0;
  virtual Status UnregisterHost(void* ptr) = 0;
  // From now on (for the device's lifetime), registered host memory is accepted wherever device
  // memory is expected. Only a device whose memory is host memory can (the CPU device); a tier
  // manager sharing host memory (TierManagerOptions::share_host_memory) calls it, so that
  // without sharing a pinned-pool pointer passed as device memory is still an error.
  virtual Status UseHostMemoryAsDeviceMemory() {
    return Status(StatusCode::kFailedPrecondition,
                  std::string(name()) + ": device memory is not host memory; registered host "
                                        "memory cannot stand in for it");
  }

  // ---- streams and events ------------------------------------------------------------------------
  virtual Result<std::unique_ptr<Stream>> CreateStream(std::string_view name) = 0;
  virtual Result<std::unique_ptr<Event>> CreateEvent() = 0;

  // Captures the work enqueued on `stream` so far.
  virtual Status Record(Event& event, Stream& stream) = 0;
  // Work enqueued on `stream` after this call starts only after `event` (as recorded now)
  // completes. Does not block the caller.
  virtual Status Wait(Stream& stream, const Event& event) = 0;
  // True when the recorded work has completed (or the event was never recorded). Returns the
  // sticky error if that work failed.
  virtual Result<bool> Query(const Event& event) = 0;
  // Blocks until the event's work completed; returns the sticky error if any.
  virtual Status Synchronize(const Event& event) = 0;
  // Blocks until every item enqueued on `stream` so far completed.
  virtual Status Synchronize(Stream& stream) = 0;

  // ---- work ----------------------------------------------------------------------------------
  // Copies `bytes` in stream order. Host pointers may be any host memory (registered memory is
  // faster on CUDA). The memory must stay valid until the copy completes.
  // On CUDA, a copy between device memory and unregistered (pageable) host memory may return
  // only after the copy ran (d2h always does), i.e. after the earlier work on `stream`: code
  // that must not block (a Notify function, a thread that stream work waits for) copies from
  // and to registered memory.
  virtual Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                           Stream& stream) = 0;

  // Runs `fn` on the host in stream order: it starts after earlier work on `stream` and later
  // work waits for it. This is how the CPU device runs compute. On CUDA it is cudaLaunchHostFunc,
  // so `fn` must not call into the Device or CUDA; and since the runtime may run the host tasks of
  // all streams one at a time on one thread, `fn` must not wait for anything another stream's
  // host task does (that would deadlock), and a long `fn` delays the host tasks of every stream.
  // If `fn` returns an error it becomes the device's sticky error and later host tasks are
  // skipped. The CPU device skips all later work on every stream; on CUDA, kernels and copies
  // already enqueued behind the failed task still run, so work that must not follow a failure
  // is enqueued only after Synchronize or Query of an event recorded after the task succeeds.
  // Keep HostTask for work that must be ordered with the stream; use Notify for bookkeeping.
  virtual Status HostTask(Stream& stream, std::function<Status()> fn, std::string_view label) = 0;

  // Calls `fn(status)` once the work enqueued on `stream` so far has completed (status = the
  // sticky error, if any). Later work on the stream does not wait for `fn`. `fn` runs on a
  // device-owned thread and may call the Device's non-blocking methods (Alloc, Free, CopyAsync,
  // Record, Notify, ...) but must not block (no Synchronize).
  virtual Status Notify(Stream& stream, std::function<void(const Status&)> fn) = 0;

  // Element-wise operations on device memory, in stream order. `n` is the element count.
  // y[i] = convert(x[i]) from `from` to `to` (fp32 -> bf16/fp16 rounds to nearest even; NaN and
  // Inf are preserved). x and y may not overlap unless they are the same pointer and dtype.
  virtual Status Cast(const void* x, DType from, void* y, DType to, size_t n, Stream& stream) = 0;
  // Scale and Axpy compute in fp32 (a product and a sum are rounded separately, never fused)
  // and store in `dtype`; a NaN result is always stored as the NaN 0x7fffffff (bf16 and fp16:
  // 0x7fff), whatever NaN went in, as NVIDIA's arithmetic does, so that every device gives the
  // same bits.
  // x[i] *= alpha
  virtual Status Scale(void* x, DType dtype, float alpha, size_t n, Stream& stream) = 0;
  // y[i] += alpha * x[i]
  virtual Status Axpy(float alpha, const void* x, void* y, DType dtype, size_t n,
                      Stream& stream) = 0;
  // x[i] = value
  virtual Status Fill(void* x, DType dtype, float value, size_t n, Stream& stream) = 0;

  // *sum (one double of device memory, 8-byte aligned) += the sum over i < n of float(x[i])^2,
  // in double arithmetic: the reduction behind the gradient norm, clipping and fp16 overflow
  // detection, so that one scalar, not the gradients, goes to the host. A NaN or Inf element
  // makes *sum non-finite. CPU device: in index order, continuing from *sum (consecutive calls
  // give, bit for bit, one running sum over their concatenation). CUDA: per-block partial sums
  // added in a fixed order: the same bits on every run, not necessarily the CPU's (they differ
  // in the last bits of a double).
  virtual Status SumSquares(const void* x, DType dtype, size_t n, double* sum, Stream& stream) {
    (void)x, (void)dtype, (void)n, (void)sum, (void)stream;
    return Status(StatusCode::kUnimplemented,
                  std::string(name()) + ": SumSquares is not implemented by this device");
  }

  // Blockwise symmetric int8 quantization (ZeRO++'s quantized weight all-gather, docs/zero.md):
  // for each block b of `block` elements (n a multiple of block), scales[b] = max |x| over the
  // block / 127 in fp32, and q[i] = x[i] / scales[b] (one fp32 division) rounded to the nearest
  // integer, ties to even: |x[i] - q[i] * scales[b]| <= scales[b] / 2. An all-zero block has
  // scale 0 and q 0; a NaN element quantizes to 0. q: n bytes of device memory; scales: n / block
  // floats of device memory. Every device gives the same bits.
  virtual Status QuantizeInt8(const void* x, DType dtype, size_t n, size_t block, void* q,
                              float* scales, Stream& stream) {
    (void)x, (void)dtype, (void)n, (void)block, (void)q, (void)scales, (void)stream;
    return Status(StatusCode::kUnimplemented,
                  std::string(name()) + ": QuantizeInt8 is not implemented by this device");
  }
  // The inverse: y[i] = float(q[i]) * scales[i / block] (one fp32 product), rounded once to
  // `dtype`.
  virtual Status DequantizeInt8(const void* q, const float* scales, size_t n, size_t block,
                                void* y, DType dtype, Stream& stream) {
    (void)q, (void)scales, (void)n, (void)block, (void)y, (void)dtype, (void)stream;
    return Status(StatusCode::kUnimplemented,
                  std::string(name()) + ": DequantizeInt8 is not implemented by this device");
  }
};

// Creates a device. DeviceType::kCuda in a build without CUDA is Unimplemented; with CUDA but no
// GPU or driver it is Unavailable with the CUDA error text.
Result<std::unique_ptr<Device>> CreateDevice(const DeviceOptions& options);

// Scalar conversions used by the CPU device and tests.
uint16_t FloatToBf16(float f);
float Bf16ToFloat(uint16_t h);
uint16_t FloatToF16(float f);
float F16ToFloat(uint16_t h);
// Host-side bulk conversion: dst[i] = src[i] for n elements, from `from` to `to` through fp32
// (exact from the 16-bit formats; one round to nearest even into them; a plain copy when the
// dtypes match). src and dst are host memory, need not be aligned, and must not overlap.
void ConvertHost(const void* src, DType from, void* dst, DType to, size_t n);
// Host-side sum of squares: sum_i float(x[i])^2 in double, in an order fixed by n alone (blocks
// of 64 Ki elements, each summed by 8 interleaved accumulators combined pairwise, the blocks'
// sums added in index order), so that the result's bits never depend on `threads` (the threads
// that share the blocks when n is large). The CPU device's SumSquares and the engine's
// host-homed gradient shards both use it: the same data gives the same bits in either home.
double SumSquaresHost(const void* x, DType dtype, size_t n, int threads = 1);

}  // namespace strata::device

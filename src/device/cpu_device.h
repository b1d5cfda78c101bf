// The CPU device: the Device seam implemented with host memory and threads, so that the whole
// engine runs and is tested on a machine without a GPU. Its ordering semantics are CUDA's (see
// strata/device.h), and it is stricter than a GPU wherever that is cheap, so that a bug shows up
// in CPU tests rather than on the first GPU run:
//
//   Memory    Alloc returns host memory aligned to 4096 bytes (so shards are O_DIRECT-aligned),
//             charged at its size rounded up to kDeviceAlignment against the budget (0 = a
//             quarter of physical RAM). Under AddressSanitizer the bytes past the request are
//             off limits.
//   Streams   one worker thread each, running a FIFO queue. Items are numbered in enqueue order;
//             the stream's "completed" counter advances after each item, under a mutex and a
//             condition variable.
//   Events    an event is a (stream timeline, sequence number) pair; Record sets it to the
//             stream's last enqueued item. Wait enqueues an item that blocks the waiting stream's
//             worker until that item has completed, which is also the happens-before edge that
//             ThreadSanitizer sees: with the Wait, consumer reads are ordered after producer
//             writes; without it, they race and TSan reports it. Nothing else in the device links
//             two workers (the sticky-error check is a lone atomic load) unless tracing is on
//             (TraceRecorder takes a lock) or work calls Alloc/Free.
//   Checks    CopyAsync, Cast, Scale, Axpy and Fill check at enqueue time that every device
//             operand lies inside one live allocation from this device and every host operand
//             lies outside all of them (InvalidArgument otherwise).
//   Errors    after the sticky error is set, queued copies, host tasks and element-wise work are
//             skipped (as on a GPU whose context failed); waits and notifications still run, so
//             every Synchronize returns (with the error).
//   Notify    `fn` runs on the stream's worker after the earlier items, so on this device later
//             work does wait for it; it must not block (Synchronize from there would deadlock and
//             is refused with FailedPrecondition).
//
// Threading: as Device. A stream must not be destroyed from its own work.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "device/device_internal.h"
#include "strata/device.h"

namespace strata::device {

// Creates the CPU device. options.type must be kCpu.
Result<std::unique_ptr<Device>> CreateCpuDevice(const DeviceOptions& options);

class CpuStream;
struct CpuWorkItem;

class CpuDevice final : public Device {
 public:
  // `budget` is the resolved byte budget (> 0). Use CreateCpuDevice.
  CpuDevice(const DeviceOptions& options, uint64_t budget);
  // Frees memory that was never freed (logged). Streams and events must be gone already.
  ~CpuDevice() override;

  DeviceType type() const override { return DeviceType::kCpu; }
  std::string_view name() const override { return name_; }

  Result<void*> Alloc(size_t bytes) override;
  void Free(void* ptr) override;
  DeviceMemoryStats memory_stats() const override;
  void ResetPeak() override;

  Status RegisterHost(void* ptr, size_t bytes) override;
  Status UnregisterHost(void* ptr) override;
  Status UseHostMemoryAsDeviceMemory() override;

  Result<std::unique_ptr<Stream>> CreateStream(std::string_view name) override;
  Result<std::unique_ptr<Event>> CreateEvent() override;

  Status Record(Event& event, Stream& stream) override;
  Status Wait(Stream& stream, const Event& event) override;
  Result<bool> Query(const Event& event) override;
  Status Synchronize(const Event& event) override;
  Status Synchronize(Stream& stream) override;

  Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                   Stream& stream) override;
  Status HostTask(Stream& stream, std::function<Status()> fn, std::string_view label) override;
  Status Notify(Stream& stream, std::function<void(const Status&)> fn) override;

  Status Cast(const void* x, DType from, void* y, DType to, size_t n, Stream& stream) override;
  Status Scale(void* x, DType dtype, float alpha, size_t n, Stream& stream) override;
  Status Axpy(float alpha, const void* x, void* y, DType dtype, size_t n, Stream& stream) override;
  Status Fill(void* x, DType dtype, float value, size_t n, Stream& stream) override;
  Status SumSquares(const void* x, DType dtype, size_t n, double* sum, Stream& stream) override;
  Status QuantizeInt8(const void* x, DType dtype, size_t n, size_t block, void* q, float* scales,
                      Stream& stream) override;
  Status DequantizeInt8(const void* q, const float* scales, size_t n, size_t block, void* y,
                        DType dtype, Stream& stream) override;

 private:
  friend class CpuStream;

  struct Allocation {
    size_t bytes = 0;     // as requested
    uint64_t charge = 0;  // against the budget: bytes rounded up to kDeviceAlignment
  };

  // The CpuStream behind `stream`, or InvalidArgument when it belongs to another device.
  Result<CpuStream*> Own(Stream& stream);
  // InvalidArgument unless [ptr, ptr + bytes) lies inside one live allocation.
  Status CheckDeviceRange(std::string_view op, std::string_view what, const void* ptr,
                          size_t bytes) const;
  // QuantizeInt8 / DequantizeInt8's operands: `values` (x or y, `what`) of n `dtype` elements,
  // the int8 values and the scales, each checked and (n > 0) inside one live allocation.
  Status CheckInt8Operands(std::string_view op, std::string_view what, const void* values,
                           DType dtype, size_t n, size_t block, const void* q,
                           const float* scales) const;
  // InvalidArgument if [ptr, ptr + bytes) overlaps any live allocation.
  Status CheckHostRange(std::string_view op, std::string_view what, const void* ptr,
                        size_t bytes) const;
  // Checks the sticky error and the stream, then queues `item`.
  Status Enqueue(Stream& stream, CpuWorkItem item);
  // Runs one item on `stream`'s worker (skips it after a sticky error unless it always runs).
  void Execute(const CpuStream& stream, CpuWorkItem& item);
  bool tracing() const { return trace_ != nullptr; }

  const std::string name_;
  TraceRecorder* const trace_;

  // Frees cached blocks until `need` more bytes fit beside what is in use and cached, within the
  // budget and the peak in use (raised to in use + need).
  void TrimCacheLocked(uint64_t need);

  mutable std::mutex mem_mu_;  // guards allocations_, stats_, cache_, cached_bytes_
  std::map<uintptr_t, Allocation> allocations_;
  DeviceMemoryStats stats_;
  // Freed blocks kept for reuse by a request of the same charge, as a GPU caching allocator
  // does: a fresh heap block of several MiB would have every page faulted in again on first
  // touch (during a copy). In use + cached never exceeds the peak in use (nor the budget): the
  // host memory the device holds is at most the most its callers held at once, which is what
  // strata estimate's device peak counts, however large the budget. (Capped by the budget alone,
  // freed blocks of sizes no later request matched could fill it: with the "auto" budget of a
  // quarter of RAM per rank, two ranks' caches took more than the node had.)
  std::multimap<uint64_t, void*> cache_;
  uint64_t cached_bytes_ = 0;

  mutable std::mutex host_mu_;  // guards registry_, stream_counter_
  internal::HostRegistry registry_;
  internal::PageableCopies pageable_;
  // Registered host memory passes CheckDeviceRange (UseHostMemoryAsDeviceMemory).
  std::atomic<bool> host_memory_as_device_{false};
  uint64_t stream_counter_ = 0;

  internal::StickyError sticky_;
};

}  // namespace strata::device

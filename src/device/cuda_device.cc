// The CUDA device. C++20, compiled by the host compiler against the CUDA runtime headers; the
// kernels live in cuda_kernels.cu (C++17, nvcc).
//
// Every CUDA runtime return value becomes a Status in one place, CudaStatus (used through the
// STRATA_CUDA macro, which names the call). Every thread that calls CUDA first selects the
// device's GPU (Bind / cudaSetDevice): the calling thread in each method, and the callback
// threads.
//
// Pieces:
//   - Allocator: cudaMalloc with a cache of freed blocks, bucketed by size (powers of two up to
//     1 MiB, multiples of 2 MiB above), reused on an exact bucket match. The budget is checked
//     like the CPU device's (requests rounded to kDeviceAlignment). Before a new block would take
//     the GPU memory held past the budget, cached blocks are given back (cudaFree, largest
//     first) until it fits; when cudaMalloc runs out of memory, the whole cache. cudaFree and
//     cudaMalloc run outside the allocator's lock (cudaFree synchronizes the device). Operands
//     of copies and kernels must lie inside one live allocation (CheckDeviceRange), so that a
//     wrong pointer is an InvalidArgument rather than a fault that ends the CUDA context.
//   - HostTask: cudaLaunchHostFunc; the CUDA runtime's thread runs `fn` (no CUDA calls there),
//     and its error becomes the sticky error. After a CUDA context error the runtime does not
//     call host functions at all (their captured state is then leaked, with the context).
//   - Notify and tracing: an event recorded on the stream, handed to the stream's callback
//     thread (started on first use), which cudaEventSynchronize's the events in order and then
//     runs `fn` (so `fn` may call CUDA) or records the traced operation's GPU start and end.
//     One thread per stream, so a slow stream never delays another stream's notifications.
//     Its events are created with cudaEventBlockingSync so that waiting does not spin a core.
//   - Tracing: each copy and kernel is bracketed by two timing events; their times are mapped
//     to TraceRecorder::NowNs() through an epoch event recorded at creation.
#include "device/cuda_device.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/log.h"
#include "common/units.h"
#include "device/cuda_kernels.h"
#include "device/device_internal.h"
#include "strata/trace.h"

namespace strata::device {

// ---- the one place where a CUDA error becomes a Status -------------------------------------

namespace {

// "cudaMemcpyAsync(dst, src, ...)" -> "cudaMemcpyAsync".
constexpr std::string_view CudaCallName(std::string_view call_text) {
  return call_text.substr(0, call_text.find('('));
}

// OK for cudaSuccess. Otherwise clears the thread's last-error state (cudaGetLastError) so the
// error is not reported again by an unrelated call, and returns
// "<context>: <call> failed: <text> (<cudaErrorName>)" with a code that says what to do about it.
Status CudaStatus(cudaError_t err, std::string_view call, std::string_view context) {
  if (err == cudaSuccess) return Status::Ok();
  (void)cudaGetLastError();
  const std::string message = fmt::format("{}: {} failed: {} ({})", context, call,
                                          cudaGetErrorString(err), cudaGetErrorName(err));
  switch (err) {
    case cudaErrorMemoryAllocation:
      return ResourceExhaustedError(message);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidMemcpyDirection:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidConfiguration:
    case cudaErrorHostMemoryAlreadyRegistered:
    case cudaErrorHostMemoryNotRegistered:
      return InvalidArgumentError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInitializationError:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return UnavailableError(message);
    case cudaErrorNotSupported:
      return UnimplementedError(message);
    default:
      return InternalError(message);
  }
}

}  // namespace

Status CudaErrorToStatus(int cuda_error, std::string_view call, std::string_view context) {
  return CudaStatus(static_cast<cudaError_t>(cuda_error), call, context);
}

// Evaluates one CUDA runtime call and converts its result; `context` names the device.
#define STRATA_CUDA(context, call) CudaStatus((call), CudaCallName(#call), (context))

// ---- pieces ----------------------------------------------------------------------------------

namespace {

using cuda_kernels::KernelDType;
static_assert(static_cast<int>(DType::kF32) == static_cast<int>(KernelDType::kF32) &&
              static_cast<int>(DType::kBF16) == static_cast<int>(KernelDType::kBF16) &&
              static_cast<int>(DType::kF16) == static_cast<int>(KernelDType::kF16));
KernelDType ToKernel(DType dtype) {
  return static_cast<KernelDType>(static_cast<int>(dtype));
}

cudaMemcpyKind ToCuda(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice:
      return cudaMemcpyHostToDevice;
    case CopyKind::kDeviceToHost:
      return cudaMemcpyDeviceToHost;
    case CopyKind::kDeviceToDevice:
      return cudaMemcpyDeviceToDevice;
  }
  return cudaMemcpyDefault;
}

constexpr size_t kMiB = size_t{1} << 20;

// The cache bucket (and cudaMalloc size) for a request.
size_t BlockSize(size_t bytes) {
  if (bytes <= kMiB) return std::max<size_t>(512, std::bit_ceil(bytes));
  return RoundUp(bytes, 2 * kMiB);
}

// GPU memory left out of a default budget for the CUDA context, cuBLAS workspaces and NCCL
// buffers.
uint64_t DefaultMargin(uint64_t total) {
  return std::max<uint64_t>(uint64_t{512} * kMiB, total / 20);
}


}  // namespace

class CudaDevice;

class CudaEvent final : public Event {
 public:
  CudaEvent(const CudaDevice* device, cudaEvent_t handle) : device_(device), handle_(handle) {}
  ~CudaEvent() override;

  const CudaDevice* device() const { return device_; }
  cudaEvent_t handle() const { return handle_; }

 private:
  const CudaDevice* const device_;
  const cudaEvent_t handle_;
};

// Work for a stream's callback thread: wait for `done`, then record a trace event (when
// `trace_start` is set) or run `notify`.
struct CudaCallback {
  cudaEvent_t done = nullptr;
  bool timing = false;  // `done` came from the timing pool
  std::function<void(const Status&)> notify;
  cudaEvent_t trace_start = nullptr;
  std::string name;
  std::string_view category;
  std::vector<std::pair<std::string, double>> args;
};

class CudaStream final : public Stream {
 public:
  CudaStream(CudaDevice* device, std::string name, uint32_t track, cudaStream_t handle,
             double* partials)
      : device_(device), name_(std::move(name)), track_(track), handle_(handle),
        partials_(partials) {}
  // Runs the pending callbacks, waits for the stream's work, destroys the stream.
  ~CudaStream() override;

  std::string_view name() const override { return name_; }
  CudaDevice* device() const { return device_; }
  uint32_t track() const { return track_; }
  cudaStream_t handle() const { return handle_; }
  // SumSquares' per-block partial sums (cuda_kernels::kSumSquaresBlocks doubles), allocated with
  // the stream (8 KiB, outside the budget) so that no step allocates; work on one stream runs in
  // order, so one buffer per stream is enough.
  double* partials() const { return partials_; }

  // An event for the callback thread, from the pool or new. `timing`: with timing data (for
  // traces); all are cudaEventBlockingSync.
  Result<cudaEvent_t> AcquireEvent(bool timing);
  void ReleaseEvent(cudaEvent_t event, bool timing);
  // Queues `callback` for the callback thread, starting it on first use.
  Status Push(CudaCallback callback);

 private:
  void RunCallbacks();

  CudaDevice* const device_;
  const std::string name_;
  const uint32_t track_;
  const cudaStream_t handle_;
  double* const partials_;

  std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  std::deque<CudaCallback> callbacks_;
  bool stop_ = false;
  std::thread thread_;
  std::vector<cudaEvent_t> free_events_[2];  // [timing]
};

class CudaDevice final : public Device {
 public:
  CudaDevice(const DeviceOptions& options, std::string name, uint64_t budget)
      : ordinal_(options.ordinal), name_(std::move(name)), trace_(options.trace) {
    stats_.budget = budget;
  }
  ~CudaDevice() override;

  // Records the epoch event that maps GPU times to TraceRecorder::NowNs() (tracing only).
  Status InitTracing();

  DeviceType type() const override { return DeviceType::kCuda; }
  std::string_view name() const override { return name_; }

  Result<void*> Alloc(size_t bytes) override;
  void Free(void* ptr) override;
  DeviceMemoryStats memory_stats() const override;
  void ResetPeak() override;

  Status RegisterHost(void* ptr, size_t bytes) override;
  Status UnregisterHost(void* ptr) override;

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

  // Selects this device's GPU on the calling thread.
  Status Bind() const { return STRATA_CUDA(name_, cudaSetDevice(ordinal_)); }
  internal::StickyError& sticky() { return sticky_; }
  TraceRecorder* trace() const { return trace_; }
  // GPU time of `event` (completed, with timing) on the TraceRecorder::NowNs() clock.
  Result<int64_t> TraceTimeNs(cudaEvent_t event) const;

 private:
  struct Block {
    size_t block_bytes = 0;  // cudaMalloc size (the cache bucket)
    uint64_t charge = 0;     // against the budget: the request rounded to kDeviceAlignment
    size_t bytes = 0;        // the request: what operations may touch
  };
  struct HostTaskCall {
    CudaDevice* device;
    std::function<Status()> fn;
    std::string stream_name;
    std::string label;
    uint32_t track;
  };
  static void RunHostTask(void* data);

  Result<CudaStream*> Own(Stream& stream);
  // InvalidArgument unless [ptr, ptr + bytes) lies inside one live allocation from Alloc: a wrong
  // pointer is refused here instead of faulting on the GPU, which would end the CUDA context.
  Status CheckDeviceRange(std::string_view op, std::string_view what, const void* ptr,
                          size_t bytes) const;
  // QuantizeInt8 / DequantizeInt8's operands: `values` (x or y, `what`) of n `dtype` elements,
  // the int8 values and the scales, each checked and (n > 0) inside one live allocation.
  Status CheckInt8Operands(std::string_view op, std::string_view what, const void* values,
                           DType dtype, size_t n, size_t block, const void* q,
                           const float* scales) const;
  // cudaFree's every cached block. Caller holds mem_mu_ (destruction only).
  void ReleaseCacheLocked();
  // Removes cached blocks, largest first, until they add up to at least `need` bytes (or the
  // cache is empty), counts them in freeing_bytes_ and returns them (with their sizes) for
  // FreeBlocks. Caller holds mem_mu_.
  std::vector<std::pair<void*, size_t>> TakeCacheLocked(uint64_t need);
  // cudaFree's `blocks`, then takes them out of freeing_bytes_ and wakes Allocs waiting for
  // that. The caller has selected the GPU and does not hold mem_mu_.
  void FreeBlocks(const std::vector<std::pair<void*, size_t>>& blocks);
  // What a traced operation looks like in the trace.
  struct TraceInfo {
    std::string name;
    std::string_view category;  // a literal
    std::vector<std::pair<std::string, double>> args;
  };
  // Brackets one traced operation on `stream`: Begin records the start event, End the end
  // event, and hands both to the stream's callback thread. Both do nothing when not tracing.
  Result<cudaEvent_t> TraceBegin(CudaStream& stream);
  Status TraceEnd(CudaStream& stream, cudaEvent_t start, TraceInfo info);
  // Sticky error, stream ownership and device selection: the preamble of every enqueue.
  Result<CudaStream*> BeginEnqueue(Stream& stream);
  // Runs `launch` (returns the cudaError_t of `call`) between TraceBegin and TraceEnd.
  // `describe` (returns a TraceInfo) is only called when tracing.
  template <typename Describe, typename Launch>
  Status Traced(CudaStream& stream, std::string_view call, Describe&& describe, Launch&& launch);

  const int ordinal_;
  const std::string name_;
  TraceRecorder* const trace_;
  cudaEvent_t epoch_ = nullptr;  // tracing only
  int64_t epoch_ns_ = 0;

  // Guards live_, cache_, cached_bytes_, reserved_bytes_, freeing_bytes_, pending_charge_, stats_.
  mutable std::mutex mem_mu_;
  std::condition_variable freed_cv_;  // freeing_bytes_ went down
  // Start address -> block; ordered, so that CheckDeviceRange finds the enclosing one.
  std::map<uintptr_t, Block> live_;
  std::map<size_t, std::vector<void*>> cache_;  // block size -> free blocks
  uint64_t cached_bytes_ = 0;
  uint64_t reserved_bytes_ = 0;  // live and cached blocks, and blocks being allocated
  uint64_t freeing_bytes_ = 0;   // blocks taken from the cache, their cudaFree not yet done
  uint64_t pending_charge_ = 0;  // budget charges of Allocs waiting for cudaMalloc
  DeviceMemoryStats stats_;

  std::mutex host_mu_;  // guards registry_, stream_counter_
  internal::HostRegistry registry_;
  internal::PageableCopies pageable_;
  uint64_t stream_counter_ = 0;

  internal::StickyError sticky_;
};

// ---- CudaEvent / CudaStream ------------------------------------------------------------------

CudaEvent::~CudaEvent() {
  Status status = device_->Bind();
  if (status.ok()) status = STRATA_CUDA(device_->name(), cudaEventDestroy(handle_));
  if (!status.ok()) STRATA_LOG(warn, device, "destroying an event: {}", status.ToString());
}

Result<cudaEvent_t> CudaStream::AcquireEvent(bool timing) {
  {
    std::lock_guard lock(mu_);
    auto& pool = free_events_[timing ? 1 : 0];
    if (!pool.empty()) {
      cudaEvent_t event = pool.back();
      pool.pop_back();
      return event;
    }
  }
  const unsigned flags = cudaEventBlockingSync | (timing ? 0u : unsigned{cudaEventDisableTiming});
  cudaEvent_t event = nullptr;
  STRATA_RETURN_IF_ERROR(STRATA_CUDA(device_->name(), cudaEventCreateWithFlags(&event, flags)));
  return event;
}

void CudaStream::ReleaseEvent(cudaEvent_t event, bool timing) {
  std::lock_guard lock(mu_);
  free_events_[timing ? 1 : 0].push_back(event);
}

Status CudaStream::Push(CudaCallback callback) {
  {
    std::lock_guard lock(mu_);
    // While the destructor drains (stop_), the thread is still running and takes what callbacks
    // push from there.
    if (!thread_.joinable() && !stop_) {
      try {
        thread_ = std::thread([this] { RunCallbacks(); });
      } catch (const std::system_error& e) {
        return ResourceExhaustedError(
            fmt::format("{}: cannot start the callback thread of stream '{}': {}", device_->name(),
                        name_, e.what()));
      }
    }
    callbacks_.push_back(std::move(callback));
  }
  cv_.notify_one();
  return Status::Ok();
}

void CudaStream::RunCallbacks() {
  const Status bound = device_->Bind();
  if (!bound.ok()) device_->sticky().Set(bound);
  while (true) {
    CudaCallback callback;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !callbacks_.empty(); });
      if (callbacks_.empty()) return;  // stopping, and drained
      callback = std::move(callbacks_.front());
      callbacks_.pop_front();
    }
    if (bound.ok()) {
      Status waited = STRATA_CUDA(device_->name(), cudaEventSynchronize(callback.done));
      if (!waited.ok()) {
        device_->sticky().Set(waited.WithContext(fmt::format("stream '{}'", name_)));
      }
      if (waited.ok() && callback.trace_start != nullptr) {
        // The start from the epoch (a float of milliseconds: coarse after a long run), the
        // duration from the operation's own two events (as fine as the GPU clock).
        Result<int64_t> start = device_->TraceTimeNs(callback.trace_start);
        Result<int64_t> end = start;
        if (start.ok()) {
          float ms = 0;
          Status timed = STRATA_CUDA(device_->name(),
                                     cudaEventElapsedTime(&ms, callback.trace_start, callback.done));
          end = timed.ok() ? Result<int64_t>(*start + static_cast<int64_t>(double{ms} * 1e6))
                           : Result<int64_t>(timed);
        }
        if (start.ok() && end.ok()) {
          device_->trace()->Complete(track_, callback.name, callback.category, *start,
                                     std::max(*start, *end), std::move(callback.args));
        } else {
          STRATA_LOG_ONCE(warn, device, "trace of stream '{}' incomplete: {}", name_,
                          (start.ok() ? end.status() : start.status()).ToString());
        }
      }
    }
    if (callback.notify) {
      const Status sticky = device_->sticky().Get();
      Status ran = internal::RunCatching([&] {
        callback.notify(sticky);
        return Status::Ok();
      });
      if (!ran.ok()) {
        device_->sticky().Set(InternalError(
            fmt::format("stream '{}': notify callback failed: {}", name_, ran.message())));
      }
    }
    if (callback.trace_start != nullptr) ReleaseEvent(callback.trace_start, /*timing=*/true);
    if (callback.done != nullptr) ReleaseEvent(callback.done, callback.timing);
  }
}

CudaStream::~CudaStream() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  // Push no longer starts a thread, so thread_ is not written concurrently.
  if (thread_.joinable()) thread_.join();

  Status status = device_->Bind();
  if (status.ok()) status = STRATA_CUDA(device_->name(), cudaStreamSynchronize(handle_));
  if (!status.ok()) {
    device_->sticky().Set(status.WithContext(fmt::format("destroying stream '{}'", name_)));
  }
  for (auto& pool : free_events_) {
    for (cudaEvent_t event : pool) {
      Status destroyed = STRATA_CUDA(device_->name(), cudaEventDestroy(event));
      if (!destroyed.ok()) STRATA_LOG(warn, device, "{}", destroyed.ToString());
    }
  }
  Status freed = STRATA_CUDA(device_->name(), cudaFree(partials_));
  if (!freed.ok()) STRATA_LOG(warn, device, "{}", freed.ToString());
  Status destroyed = STRATA_CUDA(device_->name(), cudaStreamDestroy(handle_));
  if (!destroyed.ok()) STRATA_LOG(warn, device, "{}", destroyed.ToString());
}

// ---- CudaDevice: creation, memory --------------------------------------------------------------

Result<std::unique_ptr<Device>> CreateCudaDevice(const DeviceOptions& options) {
  if (options.type != DeviceType::kCuda) {
    return InvalidArgumentError(fmt::format("CreateCudaDevice: device type is {}, expected cuda",
                                            DeviceTypeName(options.type)));
  }
  const std::string name =
      options.name.empty() ? fmt::format("cuda:{}", options.ordinal) : options.name;
  int count = 0;
  Status counted = STRATA_CUDA(name, cudaGetDeviceCount(&count));
  if (!counted.ok()) return UnavailableError(counted.message());
  if (count == 0) return UnavailableError(fmt::format("{}: the CUDA driver reports no GPU", name));
  if (options.ordinal < 0 || options.ordinal >= count) {
    return InvalidArgumentError(fmt::format("{}: GPU ordinal {} does not exist ({} GPU(s) visible)",
                                            name, options.ordinal, count));
  }
  Status bound = STRATA_CUDA(name, cudaSetDevice(options.ordinal));
  if (!bound.ok()) return UnavailableError(bound.message());
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  STRATA_RETURN_IF_ERROR(STRATA_CUDA(name, cudaMemGetInfo(&free_bytes, &total_bytes)));

  uint64_t budget = options.memory_budget;
  if (budget == 0) {
    const uint64_t margin = DefaultMargin(total_bytes);
    if (free_bytes <= margin) {
      return ResourceExhaustedError(fmt::format(
          "{}: only {} of {} GPU memory is free, less than the {} kept for the CUDA "
          "context and libraries; set a memory budget or free the GPU",
          name, FormatBytes(free_bytes), FormatBytes(total_bytes), FormatBytes(margin)));
    }
    budget = free_bytes - margin;
  } else if (budget > free_bytes) {
    STRATA_LOG(warn, device, "{}: memory budget {} is more than the {} of GPU memory free", name,
               FormatBytes(budget), FormatBytes(free_bytes));
  }
  auto device = std::make_unique<CudaDevice>(options, name, budget);
  if (options.trace != nullptr) STRATA_RETURN_IF_ERROR(device->InitTracing());
  STRATA_LOG(info, device, "{}: {} of {} GPU memory free; memory budget {}", name,
             FormatBytes(free_bytes), FormatBytes(total_bytes), FormatBytes(budget));
  return std::unique_ptr<Device>(std::move(device));
}

Status CudaDevice::InitTracing() {
  STRATA_RETURN_IF_ERROR(Bind());
  STRATA_RETURN_IF_ERROR(STRATA_CUDA(name_, cudaEventCreate(&epoch_)));
  STRATA_RETURN_IF_ERROR(STRATA_CUDA(name_, cudaEventRecord(epoch_, nullptr)));
  STRATA_RETURN_IF_ERROR(STRATA_CUDA(name_, cudaEventSynchronize(epoch_)));
  epoch_ns_ = TraceRecorder::NowNs();
  return Status::Ok();
}

Result<int64_t> CudaDevice::TraceTimeNs(cudaEvent_t event) const {
  float ms = 0;
  STRATA_RETURN_IF_ERROR(STRATA_CUDA(name_, cudaEventElapsedTime(&ms, epoch_, event)));
  return epoch_ns_ + static_cast<int64_t>(static_cast<double>(ms) * 1e6);
}

CudaDevice::~CudaDevice() {
  Status bound = Bind();
  if (!bound.ok()) {
    STRATA_LOG(warn, device, "{}: cannot release GPU resources: {}", name_, bound.ToString());
    return;
  }
  {
    std::lock_guard lock(mem_mu_);
    if (!live_.empty()) {
      STRATA_LOG(warn, device, "{}: {} allocation(s) ({}) never freed; freeing them", name_,
                 live_.size(), FormatBytes(stats_.in_use));
    }
    for (const auto& [address, block] : live_) {
      void* ptr = reinterpret_cast<void*>(address);
      Status freed = STRATA_CUDA(name_, cudaFree(ptr));
      if (!freed.ok()) STRATA_LOG(warn, device, "{}", freed.ToString());
    }
    live_.clear();
    ReleaseCacheLocked();
  }
  {
    std::lock_guard lock(host_mu_);
    for (const auto& [address, bytes] : registry_.ranges()) {
      STRATA_LOG(warn, device, "{}: host range [{:#x}, +{} B) still registered; unregistering",
                 name_, address, bytes);
      Status unregistered =
          STRATA_CUDA(name_, cudaHostUnregister(reinterpret_cast<void*>(address)));
      if (!unregistered.ok()) STRATA_LOG(warn, device, "{}", unregistered.ToString());
    }
  }
  if (epoch_ != nullptr) {
    Status destroyed = STRATA_CUDA(name_, cudaEventDestroy(epoch_));
    if (!destroyed.ok()) STRATA_LOG(warn, device, "{}", destroyed.ToString());
  }
}

void CudaDevice::ReleaseCacheLocked() {
  for (auto& [size, blocks] : cache_) {
    for (void* ptr : blocks) {
      Status freed = STRATA_CUDA(name_, cudaFree(ptr));
      if (!freed.ok()) STRATA_LOG(warn, device, "{}", freed.ToString());
      reserved_bytes_ -= size;
    }
  }
  cache_.clear();
  cached_bytes_ = 0;
}

std::vector<std::pair<void*, size_t>> CudaDevice::TakeCacheLocked(uint64_t need) {
  // Largest blocks first: the fewest cudaFree calls (each synchronizes the device) for the room.
  std::vector<std::pair<void*, size_t>> taken;
  while (need > 0 && !cache_.empty()) {
    auto largest = std::prev(cache_.end());
    if (largest->second.empty()) {
      cache_.erase(largest);
      continue;
    }
    taken.emplace_back(largest->second.back(), largest->first);
    largest->second.pop_back();
    cached_bytes_ -= largest->first;
    reserved_bytes_ -= largest->first;
    freeing_bytes_ += largest->first;
    need -= std::min<uint64_t>(need, largest->first);
    if (largest->second.empty()) cache_.erase(largest);
  }
  return taken;
}

void CudaDevice::FreeBlocks(const std::vector<std::pair<void*, size_t>>& blocks) {
  if (blocks.empty()) return;
  uint64_t bytes = 0;
  for (const auto& [ptr, size] : blocks) {
    Status freed = STRATA_CUDA(name_, cudaFree(ptr));
    if (!freed.ok()) STRATA_LOG(warn, device, "{}", freed.ToString());
    bytes += size;
  }
  {
    std::lock_guard lock(mem_mu_);
    freeing_bytes_ -= bytes;
  }
  freed_cv_.notify_all();
}

Result<void*> CudaDevice::Alloc(size_t bytes) {
  if (bytes == 0) return InvalidArgumentError(fmt::format("{}: Alloc of 0 bytes", name_));
  STRATA_RETURN_IF_ERROR(Bind());
  const size_t block_bytes = BlockSize(bytes);
  uint64_t charge = 0;
  std::vector<std::pair<void*, size_t>> evicted;
  {
    std::lock_guard lock(mem_mu_);
    charge = bytes > stats_.budget ? uint64_t{bytes} : RoundUp(bytes, kDeviceAlignment);
    if (charge > stats_.budget - stats_.in_use - pending_charge_) {
      ++stats_.failed_allocs;
      return ResourceExhaustedError(internal::BudgetExceededMessage(
          name_, charge, stats_.in_use + pending_charge_, stats_.budget));
    }
    auto cached = cache_.find(block_bytes);
    if (cached != cache_.end() && !cached->second.empty()) {
      void* ptr = cached->second.back();
      cached->second.pop_back();
      cached_bytes_ -= block_bytes;
      live_[reinterpret_cast<uintptr_t>(ptr)] = Block{block_bytes, charge, bytes};
      stats_.in_use += charge;
      stats_.peak = std::max(stats_.peak, stats_.in_use);
      ++stats_.allocs;
      return ptr;
    }
    // Reserved now (pending until cudaMalloc returns), so that concurrent Allocs see it: the
    // budget check above counts it, the peak does not.
    pending_charge_ += charge;
    // Keep what is held from the GPU (live, cached, and blocks other Allocs are freeing right
    // now) within the budget: give back just enough cached blocks.
    const uint64_t held = reserved_bytes_ + freeing_bytes_ + block_bytes;
    if (held > stats_.budget) evicted = TakeCacheLocked(held - stats_.budget);
    reserved_bytes_ += block_bytes;
  }
  // cudaFree synchronizes the device and cudaMalloc may wait too: neither runs under mem_mu_,
  // so Free, memory_stats and Notify callbacks are never held up behind the GPU's queue.
  FreeBlocks(evicted);
  void* ptr = nullptr;
  Status status = STRATA_CUDA(name_, cudaMalloc(&ptr, block_bytes));
  if (status.code() == StatusCode::kResourceExhausted) {
    // The GPU itself is full (other processes, the context, libraries): give back the whole
    // cache, wait for the blocks other Allocs are giving back, and try once more.
    std::vector<std::pair<void*, size_t>> rest;
    {
      std::lock_guard lock(mem_mu_);
      rest = TakeCacheLocked(cached_bytes_);
    }
    FreeBlocks(rest);
    {
      std::unique_lock lock(mem_mu_);
      freed_cv_.wait(lock, [&] { return freeing_bytes_ == 0; });
    }
    status = STRATA_CUDA(name_, cudaMalloc(&ptr, block_bytes));
  }
  std::lock_guard lock(mem_mu_);
  pending_charge_ -= charge;
  if (!status.ok()) {
    reserved_bytes_ -= block_bytes;
    ++stats_.failed_allocs;
    return Status(status.code(),
                  fmt::format("{} (Alloc of {} B as a {} block; {} of the {} budget in use)",
                              status.message(), bytes, FormatBytes(block_bytes),
                              FormatBytes(stats_.in_use), FormatBytes(stats_.budget)));
  }
  live_[reinterpret_cast<uintptr_t>(ptr)] = Block{block_bytes, charge, bytes};
  stats_.in_use += charge;
  stats_.peak = std::max(stats_.peak, stats_.in_use);
  ++stats_.allocs;
  return ptr;
}

void CudaDevice::Free(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard lock(mem_mu_);
  auto it = live_.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == live_.end()) {
    STRATA_LOG(error, device, "{}: Free({}) of memory that did not come from Alloc; ignored", name_,
               ptr);
    return;
  }
  // The caller guarantees no queued work uses the block, so it is reusable at once.
  stats_.in_use -= it->second.charge;
  cache_[it->second.block_bytes].push_back(ptr);
  cached_bytes_ += it->second.block_bytes;
  live_.erase(it);
}

DeviceMemoryStats CudaDevice::memory_stats() const {
  std::lock_guard lock(mem_mu_);
  DeviceMemoryStats s = stats_;
  s.cached = cached_bytes_;
  pageable_.Report(s);
  return s;
}

void CudaDevice::ResetPeak() {
  std::lock_guard lock(mem_mu_);
  stats_.peak = stats_.in_use;
}

Status CudaDevice::RegisterHost(void* ptr, size_t bytes) {
  std::lock_guard lock(host_mu_);
  const std::string context = fmt::format("{}: RegisterHost", name_);
  STRATA_RETURN_IF_ERROR(registry_.Add(ptr, bytes).WithContext(context));
  Status status = Bind();
  if (status.ok()) {
    status = STRATA_CUDA(name_, cudaHostRegister(ptr, bytes, cudaHostRegisterPortable));
  }
  if (!status.ok()) registry_.Remove(ptr).IgnoreError();
  return status;
}

Status CudaDevice::UnregisterHost(void* ptr) {
  std::lock_guard lock(host_mu_);
  STRATA_RETURN_IF_ERROR(
      registry_.Remove(ptr).WithContext(fmt::format("{}: UnregisterHost", name_)));
  STRATA_RETURN_IF_ERROR(Bind());
  return STRATA_CUDA(name_, cudaHostUnregister(ptr));
}

// ---- CudaDevice: streams and events ----------------------------------------------------------

Result<std::unique_ptr<Stream>> CudaDevice::CreateStream(std::string_view name) {
  std::string stream_name(name);
  {
    std::lock_guard lock(host_mu_);
    const uint64_t index = stream_counter_++;
    if (stream_name.empty()) stream_name = fmt::format("stream{}", index);
  }
  STRATA_RETURN_IF_ERROR(Bind());
  cudaStream_t handle = nullptr;
  STRATA_RETURN_IF_ERROR(
      STRATA_CUDA(name_, cudaStreamCreateWithFlags(&handle, cudaStreamNonBlocking)));
  void* partials = nullptr;
  Status allocated = STRATA_CUDA(
      name_, cudaMalloc(&partials, cuda_kernels::kSumSquaresBlocks * sizeof(double)));
  if (!allocated.ok()) {
    (void)cudaStreamDestroy(handle);
    return allocated;
  }
  const uint32_t track = trace_ != nullptr ? trace_->Track(stream_name) : 0;
  return std::unique_ptr<Stream>(std::make_unique<CudaStream>(
      this, std::move(stream_name), track, handle, static_cast<double*>(partials)));
}

Result<std::unique_ptr<Event>> CudaDevice::CreateEvent() {
  STRATA_RETURN_IF_ERROR(Bind());
  cudaEvent_t handle = nullptr;
  // Blocking sync: a thread in Synchronize(event) sleeps instead of spinning a core that the I/O,
  // optimizer and callback threads need.
  const unsigned flags = cudaEventBlockingSync |
                         (trace_ != nullptr ? 0u : unsigned{cudaEventDisableTiming});
  STRATA_RETURN_IF_ERROR(STRATA_CUDA(name_, cudaEventCreateWithFlags(&handle, flags)));
  return std::unique_ptr<Event>(std::make_unique<CudaEvent>(this, handle));
}

Result<CudaStream*> CudaDevice::Own(Stream& stream) {
  auto* cuda = dynamic_cast<CudaStream*>(&stream);
  if (cuda == nullptr || cuda->device() != this) {
    return InvalidArgumentError(
        fmt::format("{}: stream '{}' belongs to another device", name_, stream.name()));
  }
  return cuda;
}

Status CudaDevice::CheckDeviceRange(std::string_view op, std::string_view what, const void* ptr,
                                    size_t bytes) const {
  {
    std::lock_guard lock(mem_mu_);
    if (internal::InsideOneRange(live_, ptr, bytes, [](const Block& b) { return b.bytes; })) {
      return Status::Ok();
    }
  }
  return InvalidArgumentError(
      fmt::format("{}: {}: {} [{:#x}, +{} B) is not inside one allocation from this device's Alloc",
                  name_, op, what, reinterpret_cast<uintptr_t>(ptr), bytes));
}

namespace {
Result<const CudaEvent*> OwnEvent(const CudaDevice* device, const Event& event) {
  const auto* cuda = dynamic_cast<const CudaEvent*>(&event);
  if (cuda == nullptr || cuda->device() != device) {
    return InvalidArgumentError(fmt::format("{}: event belongs to another device", device->name()));
  }
  return cuda;
}
}  // namespace

Result<CudaStream*> CudaDevice::BeginEnqueue(Stream& stream) {
  STRATA_RETURN_IF_ERROR(sticky_.Get());
  STRATA_ASSIGN_OR_RETURN(CudaStream * cuda, Own(stream));
  STRATA_RETURN_IF_ERROR(Bind());
  return cuda;
}

Status CudaDevice::Record(Event& event, Stream& stream) {
  STRATA_ASSIGN_OR_RETURN(CudaStream * cuda, Own(stream));
  STRATA_ASSIGN_OR_RETURN(const CudaEvent* ev, OwnEvent(this, event));
  STRATA_RETURN_IF_ERROR(Bind());
  return STRATA_CUDA(name_, cudaEventRecord(ev->handle(), cuda->handle()));
}

Status CudaDevice::Wait(Stream& stream, const Event& event) {
  STRATA_ASSIGN_OR_RETURN(CudaStream * cuda, BeginEnqueue(stream));
  STRATA_ASSIGN_OR_RETURN(const CudaEvent* ev, OwnEvent(this, event));
  return STRATA_CUDA(name_, cudaStreamWaitEvent(cuda->handle(), ev->handle(), 0));
}

Result<bool> CudaDevice::Query(const Event& event) {
  STRATA_ASSIGN_OR_RETURN(const CudaEvent* ev, OwnEvent(this, event));
  STRATA_RETURN_IF_ERROR(Bind());
  const cudaError_t err = cudaEventQuery(ev->handle());
  // cudaErrorNotReady is the answer "not yet", not a failure. The runtime also leaves it as the
  // thread's last error, where the next kernel launch's cudaGetLastError() would report it as
  // that launch's failure: clear it.
  const bool done = err != cudaErrorNotReady;
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
  } else {
    Status status = CudaStatus(err, "cudaEventQuery", name_);
    if (!status.ok()) sticky_.Set(status);
  }
  STRATA_RETURN_IF_ERROR(sticky_.Get());
  return done;
}

Status CudaDevice::Synchronize(const Event& event) {
  STRATA_ASSIGN_OR_RETURN(const CudaEvent* ev, OwnEvent(this, event));
  STRATA_RETURN_IF_ERROR(Bind());
  Status status = STRATA_CUDA(name_, cudaEventSynchronize(ev->handle()));
  if (!status.ok()) sticky_.Set(status);
  return sticky_.Get();
}

Status CudaDevice::Synchronize(Stream& stream) {
  STRATA_ASSIGN_OR_RETURN(CudaStream * cuda, Own(stream));
  STRATA_RETURN_IF_ERROR(Bind());
  // Through a blocking-sync event rather than cudaStreamSynchronize, which spins a core under
  // the default scheduling.
  STRATA_ASSIGN_OR_RETURN(cudaEvent_t marker, cuda->AcquireEvent(/*timing=*/false));
  Status status = STRATA_CUDA(name_, cudaEventRecord(marker, cuda->handle()));
  if (status.ok()) status = STRATA_CUDA(name_, cudaEventSynchronize(marker));
  cuda->ReleaseEvent(marker, /*timing=*/false);
  if (!status.ok()) sticky_.Set(status.WithContext(fmt::format("stream '{}'", cuda->name())));
  return sticky_.Get();
}

// ---- CudaDevice: work ------------------------------------------------------------------------

Result<cudaEvent_t> CudaDevice::TraceBegin(CudaStream& stream) {
  if (trace_ == nullptr) return static_cast<cudaEvent_t>(nullptr);
  STRATA_ASSIGN_OR_RETURN(cudaEvent_t start, stream.AcquireEvent(/*timing=*/true));
  Status recorded = STRATA_CUDA(name_, cudaEventRecord(start, stream.handle()));
  if (!recorded.ok()) {
    stream.ReleaseEvent(start, /*timing=*/true);
    return recorded;
  }
  return start;
}

Status CudaDevice::TraceEnd(CudaStream& stream, cudaEvent_t start, TraceInfo info) {
  if (start == nullptr) return Status::Ok();
  Result<cudaEvent_t> end = stream.AcquireEvent(/*timing=*/true);
  Status status = end.status();
  if (status.ok()) status = STRATA_CUDA(name_, cudaEventRecord(*end, stream.handle()));
  if (!status.ok()) {
    stream.ReleaseEvent(start, /*timing=*/true);
    if (end.ok()) stream.ReleaseEvent(*end, /*timing=*/true);
    return status;
  }
  CudaCallback callback;
  callback.done = *end;
  callback.timing = true;
  callback.trace_start = start;
  callback.name = std::move(info.name);
  callback.category = info.category;
  callback.args = std::move(info.args);
  return stream.Push(std::move(callback));
}

template <typename Describe, typename Launch>
Status CudaDevice::Traced(CudaStream& stream, std::string_view call, Describe&& describe,
                          Launch&& launch) {
  STRATA_ASSIGN_OR_RETURN(cudaEvent_t start, TraceBegin(stream));
  Status launched = CudaStatus(launch(), call, name_);
  if (!launched.ok()) {
    if (start != nullptr) stream.ReleaseEvent(start, /*timing=*/true);
    return launched;
  }
  if (start == nullptr) return Status::Ok();
  return TraceEnd(stream, start, describe());
}

Status CudaDevice::CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                             Stream& stream) {
  STRATA_ASSIGN_OR_RETURN(CudaStream * cuda, BeginEnqueue(stream));
  STRATA_RETURN_IF_ERROR(internal::ValidateCopy(dst, src, bytes, kind));
  if (bytes == 0) return Status::Ok();
  const std::string op = fmt::format("{} copy", CopyKindName(kind));
  if (kind != CopyKind::kDeviceToHost) {
    STRATA_RETURN_IF_ERROR(CheckDeviceRange(op, "destination", dst, bytes));
  }
  if (kind != CopyKind::kHostToDevice) {
    STRATA_RETURN_IF_ERROR(CheckDeviceRange(op, "source", src, bytes));
  }
  if (kind != CopyKind::kDeviceToDevice) {
    pageable_.Count(host_mu_, registry_, kind == CopyKind::kHostToDevice ? src : dst, bytes);
  }
  auto describe = [&] {
    return TraceInfo{
        std::string(CopyKindName(kind)), "copy", {{"bytes", static_cast<double>(bytes)}}};
  };
  return Traced(*cuda, "cudaMemcpyAsync", describe,
                [&] { return cudaMemcpyAsync(dst, src, bytes, ToCuda(kind), cuda->handle()); });
}

void CudaDevice::RunHostTask(void* data) {
  // Runs on the CUDA runtime's thread: no CUDA calls from here.
  std::unique_ptr<HostTaskCall> call(static_cast<HostTaskCall*>(data));
  CudaDevice* device = call->device;
  if (device->sticky_.has_error()) return;  // as on the CPU device: work after a failure is skipped
  const int64_t start_ns = device->trace_ != nullptr ? TraceRecorder::NowNs() : 0;
  Status status = internal::RunCatching(call->fn);
  if (device->trace_ != nullptr) {
    device->trace_->Complete(call->track, call->label, "host", start_ns, TraceRecorder::NowNs());
  }
  if (!status.ok()) {
    device->sticky_.Set(internal::HostTaskError(call->stream_name, call->label, status));
  }
}

Status CudaDevice::HostTask(Stream& stream, std::function<Status()> fn, std::string_view label) {
  if (!fn) return InvalidArgumentError(fmt::format("{}: HostTask '{}': no function", name_, label));
  STRATA_ASSIGN_OR_RETURN(CudaStream * cuda, BeginEnqueue(stream));
  auto call = std::make_unique<HostTaskCall>(HostTaskCall{
      this, std::move(fn), std::string(cuda->name()), std::string(label), cuda->track()});
  STRATA_RETURN_IF_ERROR(
      STRATA_CUDA(name_, cudaLaunchHostFunc(cuda->handle(), &CudaDevice::RunHostTask, call.get())));
  (void)call.release();  // RunHostTask owns it now
  return Status::Ok();
}

Status CudaDevice::Notify(Stream& stream, std::function<void(const Status&)> fn) {
  if (!fn) return InvalidArgumentError(fmt::format("{}: Notify: no function", name_));
  STRATA_ASSIGN_OR_RETURN(CudaStream * cuda, BeginEnqueue(stream));
  STRATA_ASSIGN_OR_RETURN(cudaEvent_t done, cuda->AcquireEvent(/*timing=*/false));
  Status recorded = STRATA_CUDA(name_, cudaEventRecord(done, cuda->handle()));
  if (!recorded.ok()) {
    cuda->ReleaseEvent(done, /*timing=*/false);
    return recorded;
  }
  CudaCallback callback;
  callback.done = done;
  callback.notify = std::move(fn);
  return cuda->Push(std::move(callback));
}

Status CudaDevice::Cast(const void* x, DType from, void* y, DType to, size_t n, Stream& stream) {
  STRATA_ASSIGN_OR_RETURN(CudaStream * cuda, BeginEnqueue(stream));
  STRATA_RETURN_IF_ERROR(internal::ValidateCast(x, from, y, to, n));
  if (n == 0) return Status::Ok();
  const std::string op = internal::CastName(from, to);
  STRATA_RETURN_IF_ERROR(CheckDeviceRange(op, "x", x, n * DTypeSize(from)));
  STRATA_RETURN_IF_ERROR(CheckDeviceRange(op, "y", y, n * DTypeSize(to)));
  auto describe = [&] {
    return TraceInfo{internal::CastName(from, to),
                     "compute",
                     {{"elements", static_cast<double>(n)},
                      {"bytes", static_cast<double>(n * (DTypeSize(from) + DTypeSize(to)))}}};
  };
  return Traced(*cuda, "LaunchCast", describe, [&] {
    return cuda_kernels::LaunchCast(x, ToKernel(from), y, ToKernel(to), n, cuda->handle());
  });
}

Status CudaDevice::Scale(void* x, DType dtype, float alpha, size_t n, Stream& stream) {
  STRATA_ASSIGN_OR_RETURN(CudaStream * cuda, BeginEnqueue(stream));
  STRATA_RETURN_IF_ERROR(internal::ValidateOperand("scale", "x", x, dtype, n));
  if (n == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckDeviceRange("scale", "x", x, n * DTypeSize(dtype)));
  auto describe = [&] {
    return TraceInfo{fmt::format("scale {}", DTypeName(dtype)),
                     "compute",
                     {{"elements", static_cast<double>(n)},
                      {"bytes", static_cast<double>(2 * n * DTypeSize(dtype))}}};
  };
  return Traced(*cuda, "LaunchScale", describe, [&] {
    return cuda_kernels::LaunchScale(x, ToKernel(dtype), alpha, n, cuda->handle());
  });
}

Status CudaDevice::Axpy(float alpha, const void* x, void* y, DType dtype, size_t n,
                        Stream& stream) {
  STRATA_ASSIGN_OR_RETURN(CudaStream * cuda, BeginEnqueue(stream));
  STRATA_RETURN_IF_ERROR(internal::ValidateOperand("axpy", "x", x, dtype, n));
  STRATA_RETURN_IF_ERROR(internal::ValidateOperand("axpy", "y", y, dtype, n));
  if (n == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckDeviceRange("axpy", "x", x, n * DTypeSize(dtype)));
  STRATA_RETURN_IF_ERROR(CheckDeviceRange("axpy", "y", y, n * DTypeSize(dtype)));
  auto describe = [&] {
    return TraceInfo{fmt::format("axpy {}", DTypeName(dtype)),
                     "compute",
                     {{"elements", static_cast<double>(n)},
                      {"bytes", static_cast<double>(3 * n * DTypeSize(dtype))}}};
  };
  return Traced(*cuda, "LaunchAxpy", describe, [&] {
    return cuda_kernels::LaunchAxpy(alpha, x, y, ToKernel(dtype), n, cuda->handle());
  });
}

Status CudaDevice::Fill(void* x, DType dtype, float value, size_t n, Stream& stream) {
  STRATA_ASSIGN_OR_RETURN(CudaStream * cuda, BeginEnqueue(stream));
  STRATA_RETURN_IF_ERROR(internal::ValidateOperand("fill", "x", x, dtype, n));
  if (n == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckDeviceRange("fill", "x", x, n * DTypeSize(dtype)));
  auto describe = [&] {
    return TraceInfo{fmt::format("fill {}", DTypeName(dtype)),
                     "compute",
                     {{"elements", static_cast<double>(n)},
                      {"bytes", static_cast<double>(n * DTypeSize(dtype))}}};
  };
  return Traced(*cuda, "LaunchFill", describe, [&] {
    return cuda_kernels::LaunchFill(x, ToKernel(dtype), value, n, cuda->handle());
  });
}

Status CudaDevice::SumSquares(const void* x, DType dtype, size_t n, double* sum,
                              Stream& stream) {
  STRATA_ASSIGN_OR_RETURN(CudaStream * cuda, BeginEnqueue(stream));
  STRATA_RETURN_IF_ERROR(internal::ValidateOperand("sum_squares", "x", x, dtype, n));
  if (sum == nullptr || reinterpret_cast<uintptr_t>(sum) % alignof(double) != 0) {
    return InvalidArgumentError(fmt::format(
        "{}: sum_squares: the result must be an 8-byte aligned double of device memory", name_));
  }
  STRATA_RETURN_IF_ERROR(CheckDeviceRange("sum_squares", "sum", sum, sizeof(double)));
  if (n == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckDeviceRange("sum_squares", "x", x, n * DTypeSize(dtype)));
  auto describe = [&] {
    return TraceInfo{fmt::format("sum_squares {}", DTypeName(dtype)),
                     "compute",
                     {{"elements", static_cast<double>(n)},
                      {"bytes", static_cast<double>(n * DTypeSize(dtype))}}};
  };
  return Traced(*cuda, "LaunchSumSquares", describe, [&] {
    return cuda_kernels::LaunchSumSquares(x, ToKernel(dtype), n, cuda->partials(), sum,
                                          cuda->handle());
  });
}

Status CudaDevice::CheckInt8Operands(std::string_view op, std::string_view what,
                                    const void* values, DType dtype, size_t n, size_t block,
                                    const void* q, const float* scales) const {
  STRATA_RETURN_IF_ERROR(internal::ValidateOperand(op, what, values, dtype, n));
  STRATA_RETURN_IF_ERROR(internal::ValidateQuantize(name_, op, n, block, q, scales));
  if (n == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckDeviceRange(op, what, values, n * DTypeSize(dtype)));
  STRATA_RETURN_IF_ERROR(CheckDeviceRange(op, "q", q, n));
  return CheckDeviceRange(op, "scales", scales, n / block * sizeof(float));
}

Status CudaDevice::QuantizeInt8(const void* x, DType dtype, size_t n, size_t block, void* q,
                                float* scales, Stream& stream) {
  STRATA_ASSIGN_OR_RETURN(CudaStream * cuda, BeginEnqueue(stream));
  STRATA_RETURN_IF_ERROR(CheckInt8Operands("quantize_int8", "x", x, dtype, n, block, q, scales));
  if (n == 0) return Status::Ok();
  auto describe = [&] {
    return TraceInfo{fmt::format("quantize_int8 {}", DTypeName(dtype)),
                     "compute",
                     {{"elements", static_cast<double>(n)}}};
  };
  return Traced(*cuda, "LaunchQuantizeInt8", describe, [&] {
    return cuda_kernels::LaunchQuantizeInt8(x, ToKernel(dtype), n, block, static_cast<int8_t*>(q),
                                            scales, cuda->handle());
  });
}

Status CudaDevice::DequantizeInt8(const void* q, const float* scales, size_t n, size_t block,
                                  void* y, DType dtype, Stream& stream) {
  STRATA_ASSIGN_OR_RETURN(CudaStream * cuda, BeginEnqueue(stream));
  STRATA_RETURN_IF_ERROR(
      CheckInt8Operands("dequantize_int8", "y", y, dtype, n, block, q, scales));
  if (n == 0) return Status::Ok();
  auto describe = [&] {
    return TraceInfo{fmt::format("dequantize_int8 {}", DTypeName(dtype)),
                     "compute",
                     {{"elements", static_cast<double>(n)}}};
  };
  return Traced(*cuda, "LaunchDequantizeInt8", describe, [&] {
    return cuda_kernels::LaunchDequantizeInt8(static_cast<const int8_t*>(q), scales, n, block, y,
                                              ToKernel(dtype), cuda->handle());
  });
}

}  // namespace strata::device

namespace strata::device {

Result<void*> NativeCudaStream(Stream& stream) {
  auto* cuda = dynamic_cast<CudaStream*>(&stream);
  if (cuda == nullptr) {
    return InvalidArgumentError(
        fmt::format("stream '{}' is not a CUDA stream", stream.name()));
  }
  return static_cast<void*>(cuda->handle());
}

size_t CudaAllocationBytes(size_t bytes) {
  return BlockSize(bytes);
}

}  // namespace strata::device

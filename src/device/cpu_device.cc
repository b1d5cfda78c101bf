#include "device/cpu_device.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <limits>
#include <new>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/log.h"
#include "common/units.h"
#include "device/dtype_convert.h"
#include "strata/trace.h"

namespace strata::device {

// One queued operation. `fn` does the work; its error (already worded with the stream and the
// operation) becomes the sticky error.
struct CpuWorkItem {
  CpuWorkItem() = default;
  CpuWorkItem(std::string_view category_in, std::string name_in, bool always_run_in = false)
      : category(category_in), name(std::move(name_in)), always_run(always_run_in) {}

  std::string_view category;  // a literal: "copy", "host", "compute", "wait", "notify"
  std::string name;
  std::function<Status()> fn;
  bool always_run = false;  // waits and notifications run even after a sticky error
  std::vector<std::pair<std::string, double>> args;  // trace arguments (only when tracing)
};

namespace {

// Allocations are page-aligned so that a shard can be the buffer of an O_DIRECT request.
constexpr size_t kHostAlignment = 4096;

// How far a stream has got. Shared with the events recorded on it, which may outlive it.
struct Timeline {
  std::mutex mu;
  std::condition_variable done_cv;
  uint64_t completed = 0;  // items finished (items finish in sequence order)
  std::thread::id worker;  // set before the stream is handed out

  bool Reached(uint64_t seq) {
    std::lock_guard lock(mu);
    return completed >= seq;
  }
  void WaitFor(uint64_t seq) {
    std::unique_lock lock(mu);
    done_cv.wait(lock, [&] { return completed >= seq; });
  }
};

class CpuEvent final : public Event {
 public:
  explicit CpuEvent(const CpuDevice* device) : device_(device) {}

  const CpuDevice* device() const { return device_; }

  // What the event captures now: (nullptr, 0) when never recorded.
  std::pair<std::shared_ptr<Timeline>, uint64_t> Snapshot() const {
    std::lock_guard lock(mu_);
    return {timeline_, seq_};
  }
  void Set(std::shared_ptr<Timeline> timeline, uint64_t seq) {
    std::lock_guard lock(mu_);
    timeline_ = std::move(timeline);
    seq_ = seq;
  }

 private:
  const CpuDevice* const device_;
  mutable std::mutex mu_;  // guards timeline_, seq_ (Record may race with Query on other threads)
  std::shared_ptr<Timeline> timeline_;
  uint64_t seq_ = 0;
};

std::string Hex(const void* ptr) {
  return fmt::format("{:#x}", reinterpret_cast<uintptr_t>(ptr));
}

// Element access per dtype; 16-bit values are stored as their bit patterns.
template <DType D>
struct Elem;
template <>
struct Elem<DType::kF32> {
  using T = float;
  static float Load(T v) { return v; }
  static T Store(float f) { return f; }
};
template <>
struct Elem<DType::kBF16> {
  using T = uint16_t;
  static float Load(T v) { return convert::Bf16ToFloat(v); }
  static T Store(float f) { return convert::FloatToBf16(f); }
};
template <>
struct Elem<DType::kF16> {
  using T = uint16_t;
  static float Load(T v) { return convert::F16ToFloat(v); }
  static T Store(float f) { return convert::FloatToF16(f); }
};

// Calls fn(Elem<dtype>{}).
template <typename Fn>
void Dispatch(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32:
      fn(Elem<DType::kF32>{});
      return;
    case DType::kBF16:
      fn(Elem<DType::kBF16>{});
      return;
    case DType::kF16:
      fn(Elem<DType::kF16>{});
      return;
  }
}

// The loops below are the reference for the CUDA kernels (cuda_kernels.cu): same conversions,
// same fp32 arithmetic, the same NaN (convert::CanonicalNaN). This file is compiled with
// -ffp-contract=off (src/device/CMakeLists.txt), so a * x + y is two roundings, as __fmul_rn /
// __fadd_rn are on the GPU, even where the target has FMA.
void CastLoop(const void* x, DType from, void* y, DType to, size_t n) {
  if (from == to) {
    if (x != y) std::memcpy(y, x, n * DTypeSize(from));
    return;
  }
  Dispatch(from, [&](auto src) {
    Dispatch(to, [&](auto dst) {
      using S = decltype(src);
      using D = decltype(dst);
      const auto* in = static_cast<const typename S::T*>(x);
      auto* out = static_cast<typename D::T*>(y);
      for (size_t i = 0; i < n; ++i)
        out[i] = D::Store(S::Load(in[i]));
    });
  });
}

void ScaleLoop(void* x, DType dtype, float alpha, size_t n) {
  Dispatch(dtype, [&](auto e) {
    using E = decltype(e);
    auto* p = static_cast<typename E::T*>(x);
    for (size_t i = 0; i < n; ++i)
      p[i] = E::Store(convert::CanonicalNaN(E::Load(p[i]) * alpha));
  });
}

void AxpyLoop(float alpha, const void* x, void* y, DType dtype, size_t n) {
  Dispatch(dtype, [&](auto e) {
    using E = decltype(e);
    const auto* in = static_cast<const typename E::T*>(x);
    auto* out = static_cast<typename E::T*>(y);
    for (size_t i = 0; i < n; ++i) {
      const float product = alpha * E::Load(in[i]);
      out[i] = E::Store(convert::CanonicalNaN(E::Load(out[i]) + product));
    }
  });
}

// One quantization block (QuantizeInt8): the reference of the CUDA kernel.
void QuantizeLoop(const void* x, DType dtype, size_t n, size_t block, int8_t* q, float* scales) {
  Dispatch(dtype, [&](auto e) {
    using E = decltype(e);
    const auto* in = static_cast<const typename E::T*>(x);
    for (size_t b = 0; b < n / block; ++b) {
      const typename E::T* v = in + b * block;
      float amax = 0.0f;
      for (size_t i = 0; i < block; ++i)
        amax = std::fmax(amax, std::fabs(E::Load(v[i])));
      const float scale = amax / 127.0f;
      scales[b] = scale;
      for (size_t i = 0; i < block; ++i)
        q[b * block + i] = convert::QuantizeToInt8(E::Load(v[i]), scale);
    }
  });
}

void DequantizeLoop(const int8_t* q, const float* scales, size_t n, size_t block, void* y,
                    DType dtype) {
  Dispatch(dtype, [&](auto e) {
    using E = decltype(e);
    auto* out = static_cast<typename E::T*>(y);
    for (size_t i = 0; i < n; ++i)
      out[i] = E::Store(static_cast<float>(q[i]) * scales[i / block]);
  });
}

void FillLoop(void* x, DType dtype, float value, size_t n) {
  Dispatch(dtype, [&](auto e) {
    using E = decltype(e);
    auto* p = static_cast<typename E::T*>(x);
    const typename E::T stored = E::Store(value);
    for (size_t i = 0; i < n; ++i)
      p[i] = stored;
  });
}


}  // namespace

// ---- CpuStream -------------------------------------------------------------------------------

class CpuStream final : public Stream {
 public:
  CpuStream(CpuDevice* device, std::string name, uint32_t track)
      : device_(device),
        name_(std::move(name)),
        track_(track),
        timeline_(std::make_shared<Timeline>()) {}

  Status Start() {
    try {
      worker_ = std::thread([this] { Run(); });
    } catch (const std::system_error& e) {
      return ResourceExhaustedError(fmt::format("{}: cannot start the worker of stream '{}': {}",
                                                device_->name(), name_, e.what()));
    }
    std::lock_guard lock(timeline_->mu);
    timeline_->worker = worker_.get_id();
    return Status::Ok();
  }

  // Runs everything queued so far, then stops the worker.
  ~CpuStream() override {
    if (!worker_.joinable()) return;
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_one();
    worker_.join();
  }

  std::string_view name() const override { return name_; }
  const CpuDevice* device() const { return device_; }
  uint32_t track() const { return track_; }
  const std::shared_ptr<Timeline>& timeline() const { return timeline_; }
  bool OnWorker() const { return std::this_thread::get_id() == worker_.get_id(); }

  void Push(CpuWorkItem item) {
    {
      std::lock_guard lock(mu_);
      queue_.push_back(std::move(item));
      ++enqueued_;
    }
    work_cv_.notify_one();
  }

  // The sequence number of the last item queued (0 when none).
  uint64_t enqueued() const {
    std::lock_guard lock(mu_);
    return enqueued_;
  }

 private:
  void Run() {
    while (true) {
      CpuWorkItem item;
      {
        std::unique_lock lock(mu_);
        work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and drained
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      device_->Execute(*this, item);
      item = {};  // release what the work captured before the item counts as complete
      {
        std::lock_guard lock(timeline_->mu);
        ++timeline_->completed;
      }
      timeline_->done_cv.notify_all();
    }
  }

  CpuDevice* const device_;
  const std::string name_;
  const uint32_t track_;
  const std::shared_ptr<Timeline> timeline_;

  mutable std::mutex mu_;  // guards queue_, enqueued_, stop_
  std::condition_variable work_cv_;
  std::deque<CpuWorkItem> queue_;
  uint64_t enqueued_ = 0;
  bool stop_ = false;
  std::thread worker_;
};

// ---- CpuDevice -------------------------------------------------------------------------------

Result<std::unique_ptr<Device>> CreateCpuDevice(const DeviceOptions& options) {
  if (options.type != DeviceType::kCpu) {
    return InvalidArgumentError(fmt::format("CreateCpuDevice: device type is {}, expected cpu",
                                            DeviceTypeName(options.type)));
  }
  uint64_t budget = options.memory_budget;
  if (budget == 0) {
    const long pages = ::sysconf(_SC_PHYS_PAGES);
    const long page_size = ::sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page_size <= 0) {
      return UnavailableError(
          "cpu device: cannot read the physical memory size (sysconf); set memory_budget");
    }
    budget = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size) / 4;
  }
  return std::unique_ptr<Device>(new CpuDevice(options, budget));
}

CpuDevice::CpuDevice(const DeviceOptions& options, uint64_t budget)
    : name_(options.name.empty() ? fmt::format("cpu:{}", options.ordinal) : options.name),
      trace_(options.trace) {
  stats_.budget = budget;
}

CpuDevice::~CpuDevice() {
  std::lock_guard lock(mem_mu_);
  if (!allocations_.empty()) {
    STRATA_LOG(warn, device, "{}: {} allocation(s) ({}) never freed; freeing them", name_,
               allocations_.size(), FormatBytes(stats_.in_use));
  }
  for (const auto& [address, allocation] : allocations_) {
    ::operator delete (reinterpret_cast<void*>(address), std::align_val_t{kHostAlignment});
  }
  TrimCacheLocked(std::numeric_limits<uint64_t>::max());
}

void CpuDevice::TrimCacheLocked(uint64_t need) {
  // In use + cached + need may reach the peak so far (or, when the request raises the peak, the
  // request's own in-use total), never the budget beyond it.
  const uint64_t limit = std::min(stats_.budget, std::max(stats_.peak, stats_.in_use + need));
  while (!cache_.empty() && (need > stats_.budget || stats_.in_use + cached_bytes_ + need > limit)) {
    auto largest = std::prev(cache_.end());
    ::operator delete (largest->second, std::align_val_t{kHostAlignment});
    cached_bytes_ -= largest->first;
    cache_.erase(largest);
  }
}

Result<void*> CpuDevice::Alloc(size_t bytes) {
  if (bytes == 0) return InvalidArgumentError(fmt::format("{}: Alloc of 0 bytes", name_));
  std::lock_guard lock(mem_mu_);
  const uint64_t charge =
      bytes > stats_.budget ? uint64_t{bytes} : RoundUp(bytes, kDeviceAlignment);
  if (charge > stats_.budget - stats_.in_use) {
    ++stats_.failed_allocs;
    return ResourceExhaustedError(
        internal::BudgetExceededMessage(name_, charge, stats_.in_use, stats_.budget));
  }
  void* ptr = nullptr;
  if (auto cached = cache_.find(charge); cached != cache_.end()) {
    ptr = cached->second;
    cached_bytes_ -= charge;
    cache_.erase(cached);
  } else {
    TrimCacheLocked(charge);
    ptr = ::operator new (static_cast<size_t>(charge), std::align_val_t{kHostAlignment},
                          std::nothrow);
  }
  if (ptr == nullptr) {
    ++stats_.failed_allocs;
    return ResourceExhaustedError(fmt::format(
        "{}: Alloc of {} ({} B): the host allocation failed although the budget allows it", name_,
        FormatBytes(bytes), bytes));
  }
  allocations_[reinterpret_cast<uintptr_t>(ptr)] = Allocation{bytes, charge};
  stats_.in_use += charge;
  stats_.peak = std::max(stats_.peak, stats_.in_use);
  ++stats_.allocs;
  return ptr;
}

void CpuDevice::Free(void* ptr) {
  if (ptr == nullptr) return;
  {
    std::lock_guard lock(mem_mu_);
    auto it = allocations_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it != allocations_.end()) {
      const uint64_t charge = it->second.charge;
      stats_.in_use -= charge;
      allocations_.erase(it);
      if (stats_.in_use + cached_bytes_ + charge <= std::min(stats_.budget, stats_.peak)) {
        cache_.emplace(charge, ptr);  // kept for the next request of this size
        cached_bytes_ += charge;
      } else {
        ::operator delete (ptr, std::align_val_t{kHostAlignment});
      }
      return;
    }
  }
  // Freeing what Alloc did not return is a bug in the caller; freeing it would corrupt the heap.
  STRATA_LOG(error, device, "{}: Free({}) of memory that did not come from Alloc; ignored", name_,
             Hex(ptr));
}

DeviceMemoryStats CpuDevice::memory_stats() const {
  std::lock_guard lock(mem_mu_);
  DeviceMemoryStats s = stats_;
  s.cached = cached_bytes_;
  pageable_.Report(s);
  return s;
}

void CpuDevice::ResetPeak() {
  std::lock_guard lock(mem_mu_);
  stats_.peak = stats_.in_use;
}

Status CpuDevice::RegisterHost(void* ptr, size_t bytes) {
  std::lock_guard lock(host_mu_);
  return registry_.Add(ptr, bytes).WithContext(fmt::format("{}: RegisterHost", name_));
}

Status CpuDevice::UnregisterHost(void* ptr) {
  std::lock_guard lock(host_mu_);
  return registry_.Remove(ptr).WithContext(fmt::format("{}: UnregisterHost", name_));
}

Result<std::unique_ptr<Stream>> CpuDevice::CreateStream(std::string_view name) {
  std::string stream_name(name);
  {
    std::lock_guard lock(host_mu_);
    const uint64_t index = stream_counter_++;
    if (stream_name.empty()) stream_name = fmt::format("stream{}", index);
  }
  const uint32_t track = tracing() ? trace_->Track(stream_name) : 0;
  auto stream = std::make_unique<CpuStream>(this, std::move(stream_name), track);
  STRATA_RETURN_IF_ERROR(stream->Start());
  return std::unique_ptr<Stream>(std::move(stream));
}

Result<std::unique_ptr<Event>> CpuDevice::CreateEvent() {
  return std::unique_ptr<Event>(std::make_unique<CpuEvent>(this));
}

Result<CpuStream*> CpuDevice::Own(Stream& stream) {
  auto* cpu = dynamic_cast<CpuStream*>(&stream);
  if (cpu == nullptr || cpu->device() != this) {
    return InvalidArgumentError(
        fmt::format("{}: stream '{}' belongs to another device", name_, stream.name()));
  }
  return cpu;
}

namespace {
// The CpuEvent behind `event` (const or not), or InvalidArgument when another device made it.
template <typename E>
auto OwnEvent(const CpuDevice* device, E& event)
    -> Result<std::conditional_t<std::is_const_v<E>, const CpuEvent*, CpuEvent*>> {
  auto* cpu =
      dynamic_cast<std::conditional_t<std::is_const_v<E>, const CpuEvent*, CpuEvent*>>(&event);
  if (cpu == nullptr || cpu->device() != device) {
    return InvalidArgumentError(fmt::format("{}: event belongs to another device", device->name()));
  }
  return cpu;
}
}  // namespace

Status CpuDevice::Record(Event& event, Stream& stream) {
  STRATA_ASSIGN_OR_RETURN(CpuStream * cpu, Own(stream));
  STRATA_ASSIGN_OR_RETURN(CpuEvent * ev, OwnEvent(this, event));
  ev->Set(cpu->timeline(), cpu->enqueued());
  return Status::Ok();
}

Status CpuDevice::Wait(Stream& stream, const Event& event) {
  STRATA_ASSIGN_OR_RETURN(CpuStream * cpu, Own(stream));
  STRATA_ASSIGN_OR_RETURN(const CpuEvent* ev, OwnEvent(this, event));
  auto [timeline, seq] = ev->Snapshot();
  // A never-recorded event waits for nothing; the stream's own work is already in order.
  if (timeline == nullptr || timeline == cpu->timeline()) return Status::Ok();
  CpuWorkItem item("wait", "wait", /*always_run=*/true);
  item.fn = [timeline = std::move(timeline), seq = seq] {
    timeline->WaitFor(seq);
    return Status::Ok();
  };
  return Enqueue(stream, std::move(item));
}

Result<bool> CpuDevice::Query(const Event& event) {
  STRATA_ASSIGN_OR_RETURN(const CpuEvent* ev, OwnEvent(this, event));
  auto [timeline, seq] = ev->Snapshot();
  const bool done = timeline == nullptr || timeline->Reached(seq);
  STRATA_RETURN_IF_ERROR(sticky_.Get());
  return done;
}

Status CpuDevice::Synchronize(const Event& event) {
  STRATA_ASSIGN_OR_RETURN(const CpuEvent* ev, OwnEvent(this, event));
  auto [timeline, seq] = ev->Snapshot();
  if (timeline != nullptr && !timeline->Reached(seq)) {
    bool on_worker;
    {
      std::lock_guard lock(timeline->mu);
      on_worker = timeline->worker == std::this_thread::get_id();
    }
    if (on_worker) {
      return FailedPreconditionError(fmt::format(
          "{}: Synchronize on an event from work of the stream it waits for would deadlock",
          name_));
    }
    timeline->WaitFor(seq);
  }
  return sticky_.Get();
}

Status CpuDevice::Synchronize(Stream& stream) {
  STRATA_ASSIGN_OR_RETURN(CpuStream * cpu, Own(stream));
  if (cpu->OnWorker()) {
    return FailedPreconditionError(fmt::format(
        "{}: Synchronize of stream '{}' from its own work would deadlock", name_, cpu->name()));
  }
  cpu->timeline()->WaitFor(cpu->enqueued());
  return sticky_.Get();
}

Status CpuDevice::Enqueue(Stream& stream, CpuWorkItem item) {
  STRATA_RETURN_IF_ERROR(sticky_.Get());
  STRATA_ASSIGN_OR_RETURN(CpuStream * cpu, Own(stream));
  cpu->Push(std::move(item));
  return Status::Ok();
}

void CpuDevice::Execute(const CpuStream& stream, CpuWorkItem& item) {
  if (!item.always_run && sticky_.has_error()) return;
  const int64_t start_ns = tracing() ? TraceRecorder::NowNs() : 0;
  Status status = item.fn();
  if (tracing() && item.category != "notify") {
    trace_->Complete(stream.track(), item.name, item.category, start_ns, TraceRecorder::NowNs(),
                     std::move(item.args));
  }
  if (!status.ok()) sticky_.Set(status);
}

Status CpuDevice::CheckDeviceRange(std::string_view op, std::string_view what, const void* ptr,
                                   size_t bytes) const {
  {
    std::lock_guard lock(mem_mu_);
    if (internal::InsideOneRange(allocations_, ptr, bytes,
                                 [](const Allocation& a) { return a.bytes; })) {
      return Status::Ok();
    }
  }
  // Once a tier manager shares host memory, registered host memory is device-accessible, as
  // mapped pinned memory is to a GPU: it hands out pinned-pool pointers as device copies.
  const bool host_ok = host_memory_as_device_.load(std::memory_order_acquire);
  if (host_ok) {
    std::lock_guard lock(host_mu_);
    if (registry_.Contains(ptr, bytes)) return Status::Ok();
  }
  return InvalidArgumentError(
      fmt::format("{}: {}: {} [{}, +{} B) is not inside one allocation from this device's "
                  "Alloc{}",
                  name_, op, what, Hex(ptr), bytes,
                  host_ok ? " nor inside registered host memory" : ""));
}

Status CpuDevice::UseHostMemoryAsDeviceMemory() {
  host_memory_as_device_.store(true, std::memory_order_release);
  return Status::Ok();
}

Status CpuDevice::CheckHostRange(std::string_view op, std::string_view what, const void* ptr,
                                 size_t bytes) const {
  const auto begin = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard lock(mem_mu_);
  // The first allocation that starts at or after `begin + bytes` cannot overlap; check the one
  // before it.
  auto it = allocations_.lower_bound(begin + bytes);
  if (it != allocations_.begin()) {
    --it;
    if (it->first + it->second.bytes > begin) {
      return InvalidArgumentError(
          fmt::format("{}: {}: {} [{}, +{} B) is device memory (from Alloc), expected host memory",
                      name_, op, what, Hex(ptr), bytes));
    }
  }
  return Status::Ok();
}

Status CpuDevice::CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                            Stream& stream) {
  STRATA_RETURN_IF_ERROR(sticky_.Get());
  STRATA_RETURN_IF_ERROR(internal::ValidateCopy(dst, src, bytes, kind));
  if (bytes == 0) return Own(stream).status();
  const std::string op = fmt::format("{} copy", CopyKindName(kind));
  const bool dst_device = kind != CopyKind::kDeviceToHost;
  const bool src_device = kind != CopyKind::kHostToDevice;
  STRATA_RETURN_IF_ERROR(dst_device ? CheckDeviceRange(op, "destination", dst, bytes)
                                    : CheckHostRange(op, "destination", dst, bytes));
  STRATA_RETURN_IF_ERROR(src_device ? CheckDeviceRange(op, "source", src, bytes)
                                    : CheckHostRange(op, "source", src, bytes));
  if (kind != CopyKind::kDeviceToDevice) {
    pageable_.Count(host_mu_, registry_, kind == CopyKind::kHostToDevice ? src : dst, bytes);
  }
  CpuWorkItem item("copy", std::string(CopyKindName(kind)));
  item.fn = [dst, src, bytes] {
    std::memcpy(dst, src, bytes);
    return Status::Ok();
  };
  if (tracing()) item.args = {{"bytes", static_cast<double>(bytes)}};
  return Enqueue(stream, std::move(item));
}

Status CpuDevice::HostTask(Stream& stream, std::function<Status()> fn, std::string_view label) {
  if (!fn) return InvalidArgumentError(fmt::format("{}: HostTask '{}': no function", name_, label));
  CpuWorkItem item("host", std::string(label));
  item.fn = [fn = std::move(fn), stream_name = std::string(stream.name()),
             label = std::string(label)] {
    Status status = internal::RunCatching(fn);
    if (status.ok()) return status;
    return internal::HostTaskError(stream_name, label, status);
  };
  return Enqueue(stream, std::move(item));
}

Status CpuDevice::Notify(Stream& stream, std::function<void(const Status&)> fn) {
  if (!fn) return InvalidArgumentError(fmt::format("{}: Notify: no function", name_));
  CpuWorkItem item("notify", "notify", /*always_run=*/true);
  item.fn = [this, fn = std::move(fn), stream_name = std::string(stream.name())] {
    const Status sticky = sticky_.Get();
    Status status = internal::RunCatching([&] {
      fn(sticky);
      return Status::Ok();
    });
    if (status.ok()) return status;
    return InternalError(
        fmt::format("stream '{}': notify callback failed: {}", stream_name, status.message()));
  };
  return Enqueue(stream, std::move(item));
}

Status CpuDevice::Cast(const void* x, DType from, void* y, DType to, size_t n, Stream& stream) {
  STRATA_RETURN_IF_ERROR(sticky_.Get());
  STRATA_RETURN_IF_ERROR(internal::ValidateCast(x, from, y, to, n));
  if (n == 0) return Own(stream).status();
  const std::string op = internal::CastName(from, to);
  STRATA_RETURN_IF_ERROR(CheckDeviceRange(op, "x", x, n * DTypeSize(from)));
  STRATA_RETURN_IF_ERROR(CheckDeviceRange(op, "y", y, n * DTypeSize(to)));
  CpuWorkItem item("compute", op);
  item.fn = [=] {
    CastLoop(x, from, y, to, n);
    return Status::Ok();
  };
  if (tracing()) {
    item.args = {{"elements", static_cast<double>(n)},
                 {"bytes", static_cast<double>(n * (DTypeSize(from) + DTypeSize(to)))}};
  }
  return Enqueue(stream, std::move(item));
}

Status CpuDevice::Scale(void* x, DType dtype, float alpha, size_t n, Stream& stream) {
  STRATA_RETURN_IF_ERROR(sticky_.Get());
  STRATA_RETURN_IF_ERROR(internal::ValidateOperand("scale", "x", x, dtype, n));
  if (n == 0) return Own(stream).status();
  STRATA_RETURN_IF_ERROR(CheckDeviceRange("scale", "x", x, n * DTypeSize(dtype)));
  CpuWorkItem item("compute", fmt::format("scale {}", DTypeName(dtype)));
  item.fn = [=] {
    ScaleLoop(x, dtype, alpha, n);
    return Status::Ok();
  };
  if (tracing()) {
    item.args = {{"elements", static_cast<double>(n)},
                 {"bytes", static_cast<double>(2 * n * DTypeSize(dtype))}};
  }
  return Enqueue(stream, std::move(item));
}

Status CpuDevice::Axpy(float alpha, const void* x, void* y, DType dtype, size_t n, Stream& stream) {
  STRATA_RETURN_IF_ERROR(sticky_.Get());
  STRATA_RETURN_IF_ERROR(internal::ValidateOperand("axpy", "x", x, dtype, n));
  STRATA_RETURN_IF_ERROR(internal::ValidateOperand("axpy", "y", y, dtype, n));
  if (n == 0) return Own(stream).status();
  STRATA_RETURN_IF_ERROR(CheckDeviceRange("axpy", "x", x, n * DTypeSize(dtype)));
  STRATA_RETURN_IF_ERROR(CheckDeviceRange("axpy", "y", y, n * DTypeSize(dtype)));
  CpuWorkItem item("compute", fmt::format("axpy {}", DTypeName(dtype)));
  item.fn = [=] {
    AxpyLoop(alpha, x, y, dtype, n);
    return Status::Ok();
  };
  if (tracing()) {
    item.args = {{"elements", static_cast<double>(n)},
                 {"bytes", static_cast<double>(3 * n * DTypeSize(dtype))}};
  }
  return Enqueue(stream, std::move(item));
}

Status CpuDevice::Fill(void* x, DType dtype, float value, size_t n, Stream& stream) {
  STRATA_RETURN_IF_ERROR(sticky_.Get());
  STRATA_RETURN_IF_ERROR(internal::ValidateOperand("fill", "x", x, dtype, n));
  if (n == 0) return Own(stream).status();
  STRATA_RETURN_IF_ERROR(CheckDeviceRange("fill", "x", x, n * DTypeSize(dtype)));
  CpuWorkItem item("compute", fmt::format("fill {}", DTypeName(dtype)));
  item.fn = [=] {
    FillLoop(x, dtype, value, n);
    return Status::Ok();
  };
  if (tracing()) {
    item.args = {{"elements", static_cast<double>(n)},
                 {"bytes", static_cast<double>(n * DTypeSize(dtype))}};
  }
  return Enqueue(stream, std::move(item));
}

Status CpuDevice::SumSquares(const void* x, DType dtype, size_t n, double* sum,
                             Stream& stream) {
  STRATA_RETURN_IF_ERROR(sticky_.Get());
  STRATA_RETURN_IF_ERROR(internal::ValidateOperand("sum_squares", "x", x, dtype, n));
  if (sum == nullptr || reinterpret_cast<uintptr_t>(sum) % alignof(double) != 0) {
    return InvalidArgumentError(fmt::format(
        "{}: sum_squares: the result must be an 8-byte aligned double of device memory", name_));
  }
  STRATA_RETURN_IF_ERROR(CheckDeviceRange("sum_squares", "sum", sum, sizeof(double)));
  if (n > 0) STRATA_RETURN_IF_ERROR(CheckDeviceRange("sum_squares", "x", x, n * DTypeSize(dtype)));
  CpuWorkItem item("compute", fmt::format("sum_squares {}", DTypeName(dtype)));
  item.fn = [=] {
    // The engine's host-homed gradient shards sum with the same function: the same bits.
    *sum += SumSquaresHost(x, dtype, n);
    return Status::Ok();
  };
  if (tracing()) {
    item.args = {{"elements", static_cast<double>(n)},
                 {"bytes", static_cast<double>(n * DTypeSize(dtype))}};
  }
  return Enqueue(stream, std::move(item));
}

Status CpuDevice::CheckInt8Operands(std::string_view op, std::string_view what,
                                   const void* values, DType dtype, size_t n, size_t block,
                                   const void* q, const float* scales) const {
  STRATA_RETURN_IF_ERROR(internal::ValidateOperand(op, what, values, dtype, n));
  STRATA_RETURN_IF_ERROR(internal::ValidateQuantize(name_, op, n, block, q, scales));
  if (n == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckDeviceRange(op, what, values, n * DTypeSize(dtype)));
  STRATA_RETURN_IF_ERROR(CheckDeviceRange(op, "q", q, n));
  return CheckDeviceRange(op, "scales", scales, n / block * sizeof(float));
}

Status CpuDevice::QuantizeInt8(const void* x, DType dtype, size_t n, size_t block, void* q,
                               float* scales, Stream& stream) {
  STRATA_RETURN_IF_ERROR(sticky_.Get());
  STRATA_RETURN_IF_ERROR(CheckInt8Operands("quantize_int8", "x", x, dtype, n, block, q, scales));
  if (n == 0) return Own(stream).status();
  CpuWorkItem item("compute", fmt::format("quantize_int8 {}", DTypeName(dtype)));
  item.fn = [=] {
    QuantizeLoop(x, dtype, n, block, static_cast<int8_t*>(q), scales);
    return Status::Ok();
  };
  if (tracing()) item.args = {{"elements", static_cast<double>(n)}};
  return Enqueue(stream, std::move(item));
}

Status CpuDevice::DequantizeInt8(const void* q, const float* scales, size_t n, size_t block,
                                 void* y, DType dtype, Stream& stream) {
  STRATA_RETURN_IF_ERROR(sticky_.Get());
  STRATA_RETURN_IF_ERROR(
      CheckInt8Operands("dequantize_int8", "y", y, dtype, n, block, q, scales));
  if (n == 0) return Own(stream).status();
  CpuWorkItem item("compute", fmt::format("dequantize_int8 {}", DTypeName(dtype)));
  item.fn = [=] {
    DequantizeLoop(static_cast<const int8_t*>(q), scales, n, block, y, dtype);
    return Status::Ok();
  };
  if (tracing()) item.args = {{"elements", static_cast<double>(n)}};
  return Enqueue(stream, std::move(item));
}

}  // namespace strata::device

#include "device/fault_device.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "common/units.h"
#include "device/device_wrapper.h"

namespace strata::device {

std::string_view DeviceOpName(DeviceOp op) {
  switch (op) {
    case DeviceOp::kAlloc:
      return "alloc";
    case DeviceOp::kCopy:
      return "copy";
    case DeviceOp::kHostTask:
      return "host task";
    case DeviceOp::kElementwise:
      return "element-wise";
  }
  return "unknown";
}

DeviceFaultInjector::DeviceFaultInjector(Clock* clock)
    : clock_(clock != nullptr ? clock : &RealClock()) {}

size_t DeviceFaultInjector::AddRule(DeviceFaultRule rule) {
  std::lock_guard lock(mu_);
  return rules_.Add(std::move(rule));
}

void DeviceFaultInjector::Clear() {
  std::lock_guard lock(mu_);
  rules_.Clear();
}

namespace {

bool Considers(const DeviceFaultRule& r, DeviceOp op, std::optional<CopyKind> copy_kind,
               std::string_view stream, std::string_view label) {
  if (r.op != op) return false;
  if (r.copy_kind && r.copy_kind != copy_kind) return false;
  if (!r.stream_contains.empty() && stream.find(r.stream_contains) == std::string_view::npos) {
    return false;
  }
  return r.label_contains.empty() || label.find(r.label_contains) != std::string_view::npos;
}

}  // namespace

DeviceFaultDecision DeviceFaultInjector::Decide(DeviceOp op, std::optional<CopyKind> copy_kind,
                                                std::string_view stream, std::string_view label) {
  DeviceFaultDecision d;
  std::lock_guard lock(mu_);
  d.ordinal = seen_[static_cast<int>(op)]++;
  for (auto& rs : rules_.entries()) {
    const DeviceFaultRule& r = rs.rule;
    if (!Considers(r, op, copy_kind, stream, label)) continue;
    if (r.max_hits >= 0 && rs.hits >= static_cast<uint64_t>(r.max_hits)) continue;
    const uint64_t ordinal = rs.seen++;
    if (!r.ordinals.empty() &&
        std::find(r.ordinals.begin(), r.ordinals.end(), ordinal) == r.ordinals.end()) {
      continue;
    }
    if (r.kind == DeviceFaultKind::kFail && !d.fail) {
      d.fail = true;
      d.code = op == DeviceOp::kAlloc ? StatusCode::kResourceExhausted : r.code;
      d.when = r.when;
      ++rs.hits;
    } else if (r.kind == DeviceFaultKind::kSlow && op != DeviceOp::kAlloc) {
      d.delay = std::max(d.delay, r.delay);
      ++rs.hits;
    }
  }
  return d;
}

uint64_t DeviceFaultInjector::hits(size_t index) const {
  std::lock_guard lock(mu_);
  return rules_.hits(index);
}

uint64_t DeviceFaultInjector::total_hits() const {
  std::lock_guard lock(mu_);
  return rules_.total_hits();
}

uint64_t DeviceFaultInjector::seen(DeviceOp op) const {
  std::lock_guard lock(mu_);
  return seen_[static_cast<int>(op)];
}

namespace {

class FaultInjectingDevice final : public DeviceWrapper {
 public:
  FaultInjectingDevice(std::unique_ptr<Device> inner, std::string name,
                       std::shared_ptr<DeviceFaultInjector> faults)
      : DeviceWrapper(std::move(inner), std::move(name)), faults_(std::move(faults)) {}

  Result<void*> Alloc(size_t bytes) override {
    const DeviceFaultDecision d = faults_->Decide(DeviceOp::kAlloc, std::nullopt, "", "");
    if (d.fail) {
      return ResourceExhaustedError(fmt::format("{}: Alloc of {}: injected fault (allocation #{})",
                                                name(), FormatBytes(bytes), d.ordinal));
    }
    return DeviceWrapper::Alloc(bytes);
  }

  Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                   Stream& stream) override {
    const std::string op = fmt::format("{} copy", CopyKindName(kind));
    return Faulted(DeviceOp::kCopy, kind, stream, op, fmt::format("{} B", bytes),
                   [&] { return DeviceWrapper::CopyAsync(dst, src, bytes, kind, stream); });
  }

  Status HostTask(Stream& stream, std::function<Status()> fn, std::string_view label) override {
    return Faulted(DeviceOp::kHostTask, std::nullopt, stream, label, "",
                   [&] { return DeviceWrapper::HostTask(stream, std::move(fn), label); });
  }

  Status Cast(const void* x, DType from, void* y, DType to, size_t n, Stream& stream) override {
    return Elementwise("cast", n, stream,
                       [&] { return DeviceWrapper::Cast(x, from, y, to, n, stream); });
  }
  Status Scale(void* x, DType dtype, float alpha, size_t n, Stream& stream) override {
    return Elementwise("scale", n, stream,
                       [&] { return DeviceWrapper::Scale(x, dtype, alpha, n, stream); });
  }
  Status Axpy(float alpha, const void* x, void* y, DType dtype, size_t n, Stream& stream) override {
    return Elementwise("axpy", n, stream,
                       [&] { return DeviceWrapper::Axpy(alpha, x, y, dtype, n, stream); });
  }
  Status Fill(void* x, DType dtype, float value, size_t n, Stream& stream) override {
    return Elementwise("fill", n, stream,
                       [&] { return DeviceWrapper::Fill(x, dtype, value, n, stream); });
  }
  Status SumSquares(const void* x, DType dtype, size_t n, double* sum, Stream& stream) override {
    return Elementwise("sum of squares", n, stream,
                       [&] { return DeviceWrapper::SumSquares(x, dtype, n, sum, stream); });
  }

 private:
  template <typename Enqueue>
  Status Elementwise(std::string_view op, size_t n, Stream& stream, Enqueue&& enqueue) {
    return Faulted(DeviceOp::kElementwise, std::nullopt, stream, op, fmt::format("{} elements", n),
                   std::forward<Enqueue>(enqueue));
  }

  // Asks the injector about one piece of work `op` (a copy's direction, a task's label) on
  // `stream`, then fails it, delays it, or just enqueues it.
  template <typename Enqueue>
  Status Faulted(DeviceOp kind, std::optional<CopyKind> copy_kind, Stream& stream,
                 std::string_view op, std::string_view size, Enqueue&& enqueue) {
    const DeviceFaultDecision d = faults_->Decide(kind, copy_kind, stream.name(), op);
    if (d.fail) {
      Status error(d.code, fmt::format("injected fault: {} ({} #{} of this device){}{} on stream "
                                       "'{}'",
                                       op, DeviceOpName(kind), d.ordinal,
                                       size.empty() ? "" : " of ", size, stream.name()));
      if (d.when == FailWhen::kEnqueue) return error.WithContext(name());
      return DeviceWrapper::HostTask(
          stream, [error = std::move(error)] { return error; }, op);
    }
    if (d.delay.count() > 0) {
      Clock* clock = &faults_->clock();
      STRATA_RETURN_IF_ERROR(DeviceWrapper::HostTask(
          stream,
          [clock, delay = d.delay] {
            clock->SleepFor(delay);
            return Status::Ok();
          },
          fmt::format("injected delay before {}", op)));
    }
    return enqueue();
  }

  const std::shared_ptr<DeviceFaultInjector> faults_;
};

}  // namespace

std::unique_ptr<Device> CreateFaultInjectingDevice(std::unique_ptr<Device> inner,
                                                   std::shared_ptr<DeviceFaultInjector> faults) {
  std::string name = fmt::format("faulty({})", inner->name());
  return std::make_unique<FaultInjectingDevice>(std::move(inner), std::move(name),
                                                std::move(faults));
}

}  // namespace strata::device

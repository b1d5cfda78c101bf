// Pieces shared by the Device backends (CPU and CUDA): argument validation and the words of their
// error messages, the host-registration bookkeeping and the sticky error, so that both backends
// reject the same calls with the same messages. Implemented in device.cc.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

#include "strata/device.h"
#include "strata/status.h"

namespace strata::device::internal {

// "<device>: Alloc of 1.00 MiB (1048576 B) exceeds the memory budget: 3.00 MiB (3145728 B) of
// 4.00 MiB (4194304 B) in use" (sizes under 1 KiB only as "256 B"). `request` is what the
// allocation would be charged.
std::string BudgetExceededMessage(std::string_view device, uint64_t request, uint64_t in_use,
                                  uint64_t budget);

// InvalidArgument unless dst and src are non-null (bytes == 0 is valid and does nothing).
Status ValidateCopy(const void* dst, const void* src, size_t bytes, CopyKind kind);

// InvalidArgument when `n` > 0 and `ptr` is null or not aligned to the dtype's size. `op` and
// `what` name the call and the operand in the message ("scale x").
Status ValidateOperand(std::string_view op, std::string_view what, const void* ptr, DType dtype,
                       size_t n);

// QuantizeInt8 / DequantizeInt8's shape: InvalidArgument (naming `device` and `op`) unless n is
// a whole number of blocks and, when n > 0, q and scales are non-null with scales 4-byte aligned.
Status ValidateQuantize(std::string_view device, std::string_view op, size_t n, size_t block,
                        const void* q, const float* scales);

// ValidateOperand for x and y, plus: x and y may overlap only if they are the same pointer with
// the same dtype.
Status ValidateCast(const void* x, DType from, const void* y, DType to, size_t n);

// "cast fp32->bf16", the name of a Cast in traces and messages.
std::string CastName(DType from, DType to);

// The sticky error of a failed host task: keeps the code of `error`, message
// "stream '<stream>': host task '<label>' failed: <message>".
Status HostTaskError(std::string_view stream, std::string_view label, const Status& error);

// Whether [ptr, ptr + bytes) lies inside one of `ranges`: an ordered map from a range's start
// address to what `size_of(value)` turns into its length. Shared by the devices' operand checks
// and HostRegistry.
template <typename Map, typename SizeOf>
bool InsideOneRange(const Map& ranges, const void* ptr, size_t bytes, SizeOf size_of) {
  const auto begin = reinterpret_cast<uintptr_t>(ptr);
  auto it = ranges.upper_bound(begin);
  if (it == ranges.begin()) return false;
  --it;
  const size_t length = size_of(it->second);
  return begin - it->first <= length && bytes <= length - (begin - it->first);
}

// Host ranges given to RegisterHost. Not thread-safe: the owner locks.
class HostRegistry {
 public:
  // InvalidArgument for a null pointer, zero bytes, or a range overlapping one already registered
  // (the message names both ranges).
  Status Add(const void* ptr, size_t bytes);
  // NotFound unless `ptr` is the start of a registered range; otherwise removes it.
  Status Remove(const void* ptr);
  // Whether [ptr, ptr + bytes) lies inside one registered range.
  bool Contains(const void* ptr, size_t bytes) const;
  size_t count() const { return ranges_.size(); }
  // The registered ranges, start -> bytes (for cleanup at destruction).
  const std::map<uintptr_t, size_t>& ranges() const { return ranges_; }

 private:
  std::map<uintptr_t, size_t> ranges_;
};

// Host<->device copies whose host side is not registered (DeviceMemoryStats::pageable_copies),
// counted the same way by every device.
class PageableCopies {
 public:
  // Counts the copy of [host, +bytes) unless `registry` (guarded by `mu`) holds it.
  void Count(std::mutex& mu, const HostRegistry& registry, const void* host, size_t bytes) {
    {
      std::lock_guard lock(mu);
      if (registry.Contains(host, bytes)) return;
    }
    copies_.fetch_add(1, std::memory_order_relaxed);
    bytes_.fetch_add(bytes, std::memory_order_relaxed);
  }
  // Fills the two counters of `stats`.
  void Report(DeviceMemoryStats& stats) const {
    stats.pageable_copies = copies_.load(std::memory_order_relaxed);
    stats.pageable_copy_bytes = bytes_.load(std::memory_order_relaxed);
  }

 private:
  std::atomic<uint64_t> copies_{0}, bytes_{0};
};

// A device's sticky error: the first failure reported by work that ran asynchronously. Once set
// it never clears. Thread-safe. Reading it while it is unset costs one atomic load and creates no
// happens-before edge between threads (so it hides no data race from ThreadSanitizer).
class StickyError {
 public:
  bool has_error() const { return set_.load(std::memory_order_acquire); }
  // The error, or OK when none was set.
  Status Get() const;
  // Keeps `error` if it is the first one; later ones are dropped (and logged at debug level).
  void Set(const Status& error);

 private:
  std::atomic<bool> set_{false};
  mutable std::mutex mu_;
  Status error_;
};

// Runs a caller-supplied function (a host task, a notification); an exception (Strata code
// throws none, but std:: calls in user code may) becomes an Internal error instead of
// terminating the thread that runs it.
template <typename Fn>
Status RunCatching(Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return InternalError(std::string("threw an exception: ") + e.what());
  } catch (...) {
    return InternalError("threw an exception");
  }
}

}  // namespace strata::device::internal

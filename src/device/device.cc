// What both Device backends share: names, the factory, the scalar conversions and the validation
// and bookkeeping of device_internal.h.
#include "strata/device.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/log.h"
#include "common/parallel_blocks.h"
#include "common/units.h"
#include "device/cpu_device.h"
#include "device/device_internal.h"
#include "device/dtype_convert.h"

#if defined(STRATA_WITH_CUDA)
#include "device/cuda_device.h"
#endif

namespace strata::device {

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "fp32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "fp16";
  }
  return "unknown";
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
  }
  return 0;
}

std::string_view CopyKindName(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice:
      return "h2d";
    case CopyKind::kDeviceToHost:
      return "d2h";
    case CopyKind::kDeviceToDevice:
      return "d2d";
  }
  return "unknown";
}

std::string_view DeviceTypeName(DeviceType type) {
  switch (type) {
    case DeviceType::kCpu:
      return "cpu";
    case DeviceType::kCuda:
      return "cuda";
  }
  return "unknown";
}

Result<std::unique_ptr<Device>> CreateDevice(const DeviceOptions& options) {
  switch (options.type) {
    case DeviceType::kCpu:
      return CreateCpuDevice(options);
    case DeviceType::kCuda:
#if defined(STRATA_WITH_CUDA)
      return CreateCudaDevice(options);
#else
      return UnimplementedError(
          "cuda device: this binary was built without CUDA (configure with the CUDA toolkit "
          "installed, or -DSTRATA_WITH_CUDA=ON)");
#endif
  }
  return InvalidArgumentError(
      fmt::format("unknown device type {}", static_cast<int>(options.type)));
}

uint16_t FloatToBf16(float f) {
  return convert::FloatToBf16(f);
}
float Bf16ToFloat(uint16_t h) {
  return convert::Bf16ToFloat(h);
}
uint16_t FloatToF16(float f) {
  return convert::FloatToF16(f);
}
float F16ToFloat(uint16_t h) {
  return convert::F16ToFloat(h);
}

void ConvertHost(const void* src, DType from, void* dst, DType to, size_t n) {
  if (from == to) {
    std::memcpy(dst, src, n * DTypeSize(from));
    return;
  }
  const auto* in = static_cast<const char*>(src);
  auto* out = static_cast<char*>(dst);
  for (size_t i = 0; i < n; ++i) {
    float f = 0.0f;
    if (from == DType::kF32) {
      std::memcpy(&f, in + i * 4, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, in + i * 2, 2);
      f = from == DType::kBF16 ? convert::Bf16ToFloat(h) : convert::F16ToFloat(h);
    }
    if (to == DType::kF32) {
      std::memcpy(out + i * 4, &f, 4);
    } else {
      const uint16_t h = to == DType::kBF16 ? convert::FloatToBf16(f) : convert::FloatToF16(f);
      std::memcpy(out + i * 2, &h, 2);
    }
  }
}

namespace {

template <typename T, typename ToFloat>
double SumSquaresBlock(const T* v, size_t n, ToFloat to_float) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (size_t j = 0; j < 8; ++j) {
      const double f = to_float(v[i + j]);
      acc[j] += f * f;
    }
  }
  for (size_t j = 0; i < n; ++i, ++j) {
    const double f = to_float(v[i]);
    acc[j] += f * f;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

}  // namespace

double SumSquaresHost(const void* x, DType dtype, size_t n, int threads) {
  constexpr size_t kBlock = size_t{1} << 16;
  const size_t blocks = (n + kBlock - 1) / kBlock;
  auto block_sum = [&](size_t b) -> double {
    const size_t first = b * kBlock, count = std::min(kBlock, n - first);
    switch (dtype) {
      case DType::kF32:
        return SumSquaresBlock(static_cast<const float*>(x) + first, count,
                               [](float f) { return f; });
      case DType::kBF16:
        return SumSquaresBlock(static_cast<const uint16_t*>(x) + first, count,
                               [](uint16_t h) { return convert::Bf16ToFloat(h); });
      case DType::kF16:
        return SumSquaresBlock(static_cast<const uint16_t*>(x) + first, count,
                               [](uint16_t h) { return convert::F16ToFloat(h); });
    }
    return 0.0;
  };
  std::vector<double> sums(blocks, 0.0);
  ParallelBlocks(blocks, static_cast<size_t>(std::max(1, threads)), 8,
                 [&](size_t b) { sums[b] = block_sum(b); });
  double total = 0.0;
  for (double s : sums) total += s;
  return total;
}

namespace internal {

namespace {
std::string Hex(uintptr_t address) {
  return fmt::format("{:#x}", address);
}
// "256 B", "1.00 MiB (1048576 B)": rounded for reading, exact for checking.
std::string Bytes(uint64_t bytes) {
  if (bytes < 1024) return FormatBytes(bytes);
  return fmt::format("{} ({} B)", FormatBytes(bytes), bytes);
}
// True when [a, a + a_bytes) and [b, b + b_bytes) share a byte.
bool Overlap(uintptr_t a, size_t a_bytes, uintptr_t b, size_t b_bytes) {
  return a < b + b_bytes && b < a + a_bytes;
}
}  // namespace

std::string BudgetExceededMessage(std::string_view device, uint64_t request, uint64_t in_use,
                                  uint64_t budget) {
  return fmt::format("{}: Alloc of {} exceeds the memory budget: {} of {} in use", device,
                     Bytes(request), Bytes(in_use), Bytes(budget));
}

Status ValidateCopy(const void* dst, const void* src, size_t bytes, CopyKind kind) {
  if (bytes == 0) return Status::Ok();
  if (dst == nullptr || src == nullptr) {
    return InvalidArgumentError(fmt::format("{} copy of {} B: null {} pointer", CopyKindName(kind),
                                            bytes, dst == nullptr ? "destination" : "source"));
  }
  const auto d = reinterpret_cast<uintptr_t>(dst);
  const auto s = reinterpret_cast<uintptr_t>(src);
  if (Overlap(d, bytes, s, bytes)) {
    return InvalidArgumentError(fmt::format("{} copy of {} B: source {} and destination {} overlap",
                                            CopyKindName(kind), bytes, Hex(s), Hex(d)));
  }
  return Status::Ok();
}

Status ValidateQuantize(std::string_view device, std::string_view op, size_t n, size_t block,
                        const void* q, const float* scales) {
  if (block == 0 || n % block != 0) {
    return InvalidArgumentError(fmt::format(
        "{}: {}: {} elements are not a whole number of blocks of {}", device, op, n, block));
  }
  if (n > 0 && (q == nullptr || scales == nullptr ||
                reinterpret_cast<uintptr_t>(scales) % alignof(float) != 0)) {
    return InvalidArgumentError(fmt::format(
        "{}: {}: the int8 values and the (4-byte aligned) scales must be device memory", device,
        op));
  }
  return Status::Ok();
}

Status ValidateOperand(std::string_view op, std::string_view what, const void* ptr, DType dtype,
                       size_t n) {
  if (n == 0) return Status::Ok();
  if (ptr == nullptr) return InvalidArgumentError(fmt::format("{}: {} is null", op, what));
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  if (address % DTypeSize(dtype) != 0) {
    return InvalidArgumentError(fmt::format("{}: {} = {} is not aligned to the {} B of {}", op,
                                            what, Hex(address), DTypeSize(dtype),
                                            DTypeName(dtype)));
  }
  return Status::Ok();
}

std::string CastName(DType from, DType to) {
  return fmt::format("cast {}->{}", DTypeName(from), DTypeName(to));
}

Status ValidateCast(const void* x, DType from, const void* y, DType to, size_t n) {
  const std::string op = CastName(from, to);
  STRATA_RETURN_IF_ERROR(ValidateOperand(op, "x", x, from, n));
  STRATA_RETURN_IF_ERROR(ValidateOperand(op, "y", y, to, n));
  if (n == 0 || (x == y && from == to)) return Status::Ok();
  const auto xa = reinterpret_cast<uintptr_t>(x);
  const auto ya = reinterpret_cast<uintptr_t>(y);
  if (Overlap(xa, n * DTypeSize(from), ya, n * DTypeSize(to))) {
    return InvalidArgumentError(
        fmt::format("{} of {} elements: x = {} and y = {} overlap (only an in-place cast to the "
                    "same dtype may)",
                    op, n, Hex(xa), Hex(ya)));
  }
  return Status::Ok();
}

Status HostTaskError(std::string_view stream, std::string_view label, const Status& error) {
  return Status(error.code(), fmt::format("stream '{}': host task '{}' failed: {}", stream, label,
                                          error.message()));
}

Status HostRegistry::Add(const void* ptr, size_t bytes) {
  if (ptr == nullptr || bytes == 0) {
    return InvalidArgumentError(fmt::format("cannot register {} bytes at {}", bytes,
                                            Hex(reinterpret_cast<uintptr_t>(ptr))));
  }
  const auto begin = reinterpret_cast<uintptr_t>(ptr);
  // Only the last range starting before our end can overlap us.
  auto it = ranges_.lower_bound(begin + bytes);
  if (it != ranges_.begin()) {
    --it;
    if (Overlap(begin, bytes, it->first, it->second)) {
      return InvalidArgumentError(
          fmt::format("[{}, +{} B) overlaps the registered range [{}, +{} B)", Hex(begin), bytes,
                      Hex(it->first), it->second));
    }
  }
  ranges_.emplace(begin, bytes);
  return Status::Ok();
}

Status HostRegistry::Remove(const void* ptr) {
  const auto begin = reinterpret_cast<uintptr_t>(ptr);
  auto it = ranges_.find(begin);
  if (it == ranges_.end()) {
    return NotFoundError(fmt::format("{} is not the start of a registered range", Hex(begin)));
  }
  ranges_.erase(it);
  return Status::Ok();
}

bool HostRegistry::Contains(const void* ptr, size_t bytes) const {
  return InsideOneRange(ranges_, ptr, bytes, [](size_t length) { return length; });
}

Status StickyError::Get() const {
  if (!has_error()) return Status::Ok();
  std::lock_guard lock(mu_);
  return error_;
}

void StickyError::Set(const Status& error) {
  if (error.ok()) return;
  std::lock_guard lock(mu_);
  if (!error_.ok()) {
    STRATA_LOG(debug, device, "a later asynchronous error is dropped (the first one is kept): {}",
               error.ToString());
    return;
  }
  error_ = error;
  set_.store(true, std::memory_order_release);
  STRATA_LOG(warn, device, "asynchronous error, sticky from now on: {}", error.ToString());
}

}  // namespace internal

}  // namespace strata::device

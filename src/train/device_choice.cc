#include "train/device_choice.h"

#include <fmt/format.h>

namespace strata::train {

Result<DeviceKind> ParseDeviceKind(const std::string& text) {
  if (text == "cpu") return DeviceKind::kCpu;
  if (text == "cuda") return DeviceKind::kCuda;
  if (text == "auto") return DeviceKind::kAuto;
  return InvalidArgumentError(
      fmt::format("--device {}: expected cpu, cuda or auto", text.empty() ? "''" : text));
}

Result<DeviceChoice> ChooseDevice(DeviceKind requested, int rank, int local_rank,
                                  const device::GpuReport& gpus,
                                  const std::optional<std::string>& visible_devices) {
  const int count = static_cast<int>(gpus.gpus.size());
  if (requested == DeviceKind::kCpu) {
    return DeviceChoice{device::DeviceType::kCpu, 0, "the CPU device (as configured)"};
  }
  if (count == 0) {
    const std::string why = gpus.none_reason.empty() ? "no GPU is visible" : gpus.none_reason;
    if (requested == DeviceKind::kAuto) {
      return DeviceChoice{device::DeviceType::kCpu, 0,
                          fmt::format("the CPU device (device \"auto\": {})", why)};
    }
    return InvalidArgumentError(fmt::format(
        "device \"cuda\" (--device or strata.device): {}; use --device cpu to train on the CPU",
        why));
  }
  const std::string source = requested == DeviceKind::kAuto ? "device \"auto\"" : "device \"cuda\"";
  int ordinal = local_rank;
  std::string binding = fmt::format("local rank {}", local_rank);
  if (count == 1 && local_rank > 0 && visible_devices.has_value()) {
    ordinal = 0;
    binding = fmt::format("CUDA_VISIBLE_DEVICES={} (one GPU per rank)", *visible_devices);
  } else if (local_rank >= count) {
    return InvalidArgumentError(fmt::format(
        "rank {} (local rank {}) has no GPU of its own: this node shows {} GPU(s){}, so it would "
        "share GPU {} with local rank {}. Start at most {} rank(s) per node, or give each rank "
        "its own GPU through CUDA_VISIBLE_DEVICES",
        rank, local_rank, count,
        visible_devices ? fmt::format(" (CUDA_VISIBLE_DEVICES={})", *visible_devices) : "",
        local_rank % count, local_rank % count, count));
  }
  const device::GpuInfo& g = gpus.gpus[static_cast<size_t>(ordinal)];
  return DeviceChoice{device::DeviceType::kCuda, ordinal,
                      fmt::format("GPU {} ({}, {:.0f} GiB, sm_{}{}) by {} ({})", ordinal, g.name,
                                  static_cast<double>(g.memory_bytes) / (1ull << 30),
                                  g.compute_major, g.compute_minor, binding, source)};
}

}  // namespace strata::train

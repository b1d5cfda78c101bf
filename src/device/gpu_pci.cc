// PCIe link facts from sysfs, for GpuInfo and `strata env`. No CUDA: the CUDA runtime says which
// PCI device a GPU is, and the kernel says how it is attached.
#include <cctype>
#include <cmath>
#include <optional>
#include <string>
#include <string_view>

#include "common/proc_files.h"
#include "device/gpu_info.h"

namespace strata::device {
namespace {

// "16.0 GT/s PCIe" (newer kernels) or "8 GT/s" (older): the leading number; 0 when the file says
// "Unknown" or is absent.
double ReadSpeed(const std::string& path) {
  std::optional<std::string> text = procfs::ReadSmallFile(path, 256);
  if (!text) return 0;
  const std::string_view t = procfs::Trim(*text);
  size_t end = 0;
  while (end < t.size() && (std::isdigit(static_cast<unsigned char>(t[end])) || t[end] == '.'))
    ++end;
  if (end == 0 || t.substr(end).find("GT/s") == std::string_view::npos) return 0;
  double v = 0;
  try {
    v = std::stod(std::string(t.substr(0, end)));
  } catch (...) {
    return 0;
  }
  return std::isfinite(v) && v > 0 ? v : 0;
}

// A lane count; the kernel writes 255 (or 0) when the width is unknown.
int ReadWidth(const std::string& path) {
  std::optional<std::string> text = procfs::ReadSmallFile(path, 64);
  if (!text) return 0;
  std::optional<uint64_t> v = procfs::ParseUint(*text);
  if (!v || *v == 0 || *v > 64) return 0;
  return static_cast<int>(*v);
}

}  // namespace

PcieLink ReadPcieLink(const std::string& device_dir) {
  PcieLink link;
  link.current_gts = ReadSpeed(device_dir + "/current_link_speed");
  link.max_gts = ReadSpeed(device_dir + "/max_link_speed");
  link.current_width = ReadWidth(device_dir + "/current_link_width");
  link.max_width = ReadWidth(device_dir + "/max_link_width");
  if (std::optional<std::string> node = procfs::ReadSmallFile(device_dir + "/numa_node", 64)) {
    // "-1" when the platform has no NUMA information.
    std::optional<uint64_t> v = procfs::ParseUint(*node);
    if (v && *v < 4096) link.numa_node = static_cast<int>(*v);
  }
  return link;
}

int PcieGeneration(double gts) {
  constexpr double kRates[] = {2.5, 5.0, 8.0, 16.0, 32.0, 64.0};
  for (int i = 0; i < 6; ++i) {
    if (std::abs(gts - kRates[i]) < 0.01 * kRates[i]) return i + 1;
  }
  return 0;
}

double PcieBytesPerSecond(double gts, int width) {
  const int gen = PcieGeneration(gts);
  if (gen == 0 || width <= 0) return 0;
  const double efficiency = gen <= 2 ? 8.0 / 10.0 : gen <= 5 ? 128.0 / 130.0 : 242.0 / 256.0;
  return gts * 1e9 * width * efficiency / 8.0;
}

}  // namespace strata::device

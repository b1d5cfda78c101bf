// GPU discovery for `strata env` and the logs. Works in every build: without CUDA it reports that
// the binary was built without it; with CUDA but no GPU or driver it says why none was found.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace strata::device {

struct GpuInfo {
  int index = 0;
  std::string name;
  uint64_t memory_bytes = 0;
  int compute_major = 0, compute_minor = 0;
  int multiprocessors = 0;
  std::string pci_bus_id;  // "0000:3b:00.0"
  // The PCIe link and NUMA node, from sysfs (ReadPcieLink); zeros and -1 when unknown, as in
  // a virtual machine that shows no link.
  double pcie_current_gts = 0;  // transfer rate per lane now (an idle GPU may train down)
  int pcie_current_width = 0;   // lanes now
  double pcie_max_gts = 0;      // what the link can reach
  int pcie_max_width = 0;
  int numa_node = -1;
};

// What sysfs says of one PCI device: the link's speed (GT/s per lane) and width (lanes), now and
// at most, and the NUMA node it is attached to.
struct PcieLink {
  double current_gts = 0;
  int current_width = 0;
  double max_gts = 0;
  int max_width = 0;
  int numa_node = -1;
};

// Reads current_link_speed ("16.0 GT/s PCIe"), current_link_width ("16"), max_link_speed,
// max_link_width and numa_node from `device_dir` (e.g. "/sys/bus/pci/devices/0000:3b:00.0").
// A file that is absent or unparsable ("Unknown", "255") leaves its field unknown. Never fails.
PcieLink ReadPcieLink(const std::string& device_dir);

// The PCIe generation of a per-lane rate: 2.5 -> 1, 5 -> 2, 8 -> 3, 16 -> 4, 32 -> 5, 64 -> 6;
// 0 for anything else.
int PcieGeneration(double gts);

// The link's raw data rate in bytes per second per direction: lanes x rate x line-code
// efficiency (8b/10b for generations 1-2, 128b/130b for 3-5, 242/256 FLIT for 6) / 8. 0 when
// the rate or width is unknown. Packet headers take another 5-15% in practice, so no copy
// reaches it; it is the ceiling measured copies are quoted against.
double PcieBytesPerSecond(double gts, int width);

struct GpuReport {
  bool built_with_cuda = false;
  int runtime_version = 0;   // e.g. 13000
  int driver_version = 0;    // 0 when no driver
  std::string nccl_version;  // from the headers at build time; "" without NCCL
  std::string none_reason;   // why `gpus` is empty ("no CUDA driver", "built without CUDA", ...)
  std::vector<GpuInfo> gpus;
};

GpuReport QueryGpus();

}  // namespace strata::device

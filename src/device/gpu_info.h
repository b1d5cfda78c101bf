// GPU discovery for `strata env` and the logs. Works in every build: without CUDA it reports that
// the binary was built without it; with CUDA but no GPU or driver it says why none was found.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata::device {

struct GpuInfo {
  int index = 0;
  std::string name;
  uint64_t memory_bytes = 0;
  int compute_major = 0, compute_minor = 0;
  int multiprocessors = 0;
  std::string pci_bus_id;  // "0000:3b:00.0"
};

struct GpuReport {
  bool built_with_cuda = false;
  int runtime_version = 0;  // e.g. 13000
  int driver_version = 0;   // 0 when no driver
  std::string nccl_version; // from the headers at build time; "" without NCCL
  std::string none_reason;  // why `gpus` is empty ("no CUDA driver", "built without CUDA", ...)
  std::vector<GpuInfo> gpus;
};

GpuReport QueryGpus();

}  // namespace strata::device

// GPU discovery with the CUDA runtime. Compiled as CUDA C++17 and linked with the static runtime,
// so it must cope with a machine that has no driver: every call is checked, and a failure becomes
// GpuReport::none_reason, never an abort. The runtime's errors are converted only in this file.
#include <cuda_runtime.h>

#include <cctype>
#include <cstdio>
#include <string>

#include "device/gpu_info.h"

#if defined(STRATA_WITH_NCCL)
#include <nccl.h>
#endif

namespace strata::device {

namespace {

std::string ErrorText(cudaError_t err) {
  std::string text = cudaGetErrorString(err);
  text += " (";
  text += cudaGetErrorName(err);
  text += ")";
  return text;
}

// Why no GPU is usable, in words a user can act on.
std::string NoneReason(cudaError_t err, int driver_version) {
  switch (err) {
    case cudaErrorInsufficientDriver:
      if (driver_version == 0) {
        return "no CUDA driver is installed (libcuda.so.1 not found): " + ErrorText(err);
      }
      return "the CUDA driver is older than this binary's runtime needs: " + ErrorText(err);
    case cudaErrorNoDevice:
      return "the CUDA driver reports no GPU (check CUDA_VISIBLE_DEVICES and the container's GPU "
             "access): " +
             ErrorText(err);
    default:
      return "cudaGetDeviceCount failed: " + ErrorText(err);
  }
}

}  // namespace

GpuReport QueryGpus() {
  GpuReport report;
  report.built_with_cuda = true;
#if defined(STRATA_WITH_NCCL)
  report.nccl_version = std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." +
                        std::to_string(NCCL_PATCH);
#endif

  int runtime = 0;
  if (cudaRuntimeGetVersion(&runtime) == cudaSuccess) report.runtime_version = runtime;
  int driver = 0;
  if (cudaDriverGetVersion(&driver) == cudaSuccess) report.driver_version = driver;
  (void)cudaGetLastError();

  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    report.none_reason = NoneReason(err, report.driver_version);
    (void)cudaGetLastError();  // clear the sticky error so later CUDA calls start clean
    return report;
  }
  if (count == 0) {
    report.none_reason = "the CUDA driver reports 0 GPUs";
    return report;
  }

  for (int i = 0; i < count; ++i) {
    GpuInfo gpu;
    gpu.index = i;
    cudaDeviceProp prop{};
    cudaError_t perr = cudaGetDeviceProperties(&prop, i);
    if (perr != cudaSuccess) {
      gpu.name = "unavailable: " + ErrorText(perr);
      (void)cudaGetLastError();
      report.gpus.push_back(gpu);
      continue;
    }
    gpu.name = prop.name;
    gpu.memory_bytes = static_cast<uint64_t>(prop.totalGlobalMem);
    gpu.compute_major = prop.major;
    gpu.compute_minor = prop.minor;
    gpu.multiprocessors = prop.multiProcessorCount;
    char bus_id[32] = {};
    if (cudaDeviceGetPCIBusId(bus_id, static_cast<int>(sizeof(bus_id)), i) == cudaSuccess) {
      // The runtime writes "0000:3B:00.0"; sysfs and lspci write lower case.
      for (char* c = bus_id; *c != '\0'; ++c)
        *c = static_cast<char>(std::tolower(*c));
      gpu.pci_bus_id = bus_id;
    } else {
      (void)cudaGetLastError();
      char fallback[32];
      std::snprintf(fallback, sizeof(fallback), "%04x:%02x:%02x.0", prop.pciDomainID, prop.pciBusID,
                    prop.pciDeviceID);
      gpu.pci_bus_id = fallback;
    }
    const PcieLink link = ReadPcieLink("/sys/bus/pci/devices/" + gpu.pci_bus_id);
    gpu.pcie_current_gts = link.current_gts;
    gpu.pcie_current_width = link.current_width;
    gpu.pcie_max_gts = link.max_gts;
    gpu.pcie_max_width = link.max_width;
    gpu.numa_node = link.numa_node;
    report.gpus.push_back(gpu);
  }
  return report;
}

}  // namespace strata::device

// NUMA placement through hwloc: which node a block device hangs off, and binding I/O threads
// near it so that completions are handled on the socket that owns the device's PCIe root.
//
// The hwloc topology (with PCI and OS devices, so block devices can be placed) is loaded on the
// first call, once per process, and kept until exit; loading takes a few milliseconds.
// Thread safety: all functions may be called from any thread.
#pragma once

#include <string>
#include <vector>

#include "strata/status.h"

namespace strata::io {

struct NumaNode {
  int index = 0;     // OS index
  std::string cpus;  // e.g. "0-15,32-47"
  uint64_t memory_bytes = 0;
};

struct NumaTopology {
  int packages = 0;
  int cores = 0;
  int pus = 0;  // hardware threads
  std::vector<NumaNode> nodes;
};

// The machine's NUMA layout.
Result<NumaTopology> QueryNumaTopology();

// The NUMA node of the block device behind `path`, or -1 if unknown (no block device, a single
// node, or a virtual device without locality). The device is found as in BlockDeviceForPath
// (io/path_info.h); for a dm/md device, the first of its backing disks that hwloc can place.
int NumaNodeOfPath(const std::string& path);

// Binds the calling thread to the CPUs of NUMA node `node` (CPU affinity only; memory policy is
// left alone). InvalidArgument for an unknown node or a node without CPUs; the errno-derived
// error when the kernel refuses (e.g. the CPUs are outside the process's cpuset).
Status BindCurrentThreadToNumaNode(int node);

}  // namespace strata::io

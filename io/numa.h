// NUMA placement through hwloc: which node a block device hangs off, and binding I/O threads
// near it so that completions are handled on the socket that owns the device's PCIe root.
//
// Thread safety: all functions may be called from any thread (the topology is loaded once).
#pragma once

#include <string>
#include <vector>

#include "strata/status.h"

namespace strata::io {

struct NumaNode {
  int index = 0;            // OS index
  std::string cpus;         // e.g. "0-15,32-47"
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
// node, or a virtual device without locality).
int NumaNodeOfPath(const std::string& path);

// Binds the calling thread to the CPUs of NUMA node `node`. InvalidArgument for an unknown node.
Status BindCurrentThreadToNumaNode(int node);

}  // namespace strata::io

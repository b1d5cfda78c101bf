#include "io/numa.h"

#include <fmt/format.h>
#include <hwloc.h>

#include <cerrno>
#include <cstdlib>
#include <memory>
#include <string_view>
#include <utility>

#include "common/errno.h"
#include "common/log.h"
#include "io/path_info.h"

namespace strata::io {

namespace {

// The machine's topology, loaded once with I/O devices kept so that block devices can be found.
// hwloc allows concurrent read-only queries and binding calls on a loaded topology.
struct Topology {
  hwloc_topology_t topo = nullptr;
  Status status;  // why `topo` is null
};

Topology Load() {
  Topology t;
  hwloc_topology_t topo = nullptr;
  if (hwloc_topology_init(&topo) != 0) {
    t.status = ErrnoToStatus(errno, "hwloc_topology_init");
    return t;
  }
  // Keep PCI devices and OS devices (nvme0n1, vda, ...) so paths can be placed.
  if (hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_ALL) != 0) {
    STRATA_LOG(debug, io, "hwloc: I/O devices cannot be kept; NUMA placement of paths disabled");
  }
  if (hwloc_topology_load(topo) != 0) {
    t.status = ErrnoToStatus(errno, "hwloc_topology_load");
    hwloc_topology_destroy(topo);
    return t;
  }
  t.topo = topo;
  return t;
}

// Never destroyed: threads may still be using it while static destructors run at exit.
const Topology& GetTopology() {
  static const Topology* topology = new Topology(Load());
  return *topology;
}

// hwloc's list syntax for a bitmap of OS indices: "0-15,32-47".
std::string BitmapList(hwloc_const_bitmap_t bitmap) {
  if (bitmap == nullptr) return "";
  char* text = nullptr;
  if (hwloc_bitmap_list_asprintf(&text, bitmap) < 0 || text == nullptr) return "";
  std::string out(text);
  std::free(text);
  return out;
}

// The NUMA node of the hwloc OS device named `name`, or -1.
int NodeOfOsDevice(hwloc_topology_t topo, const std::string& name) {
  for (hwloc_obj_t osdev = hwloc_get_next_osdev(topo, nullptr); osdev != nullptr;
       osdev = hwloc_get_next_osdev(topo, osdev)) {
    if (osdev->name == nullptr || name != osdev->name) continue;
    hwloc_obj_t ancestor = hwloc_get_non_io_ancestor_obj(topo, osdev);
    if (ancestor == nullptr || ancestor->nodeset == nullptr) return -1;
    // A device under a package or the whole machine spans several nodes: no single answer.
    if (hwloc_bitmap_weight(ancestor->nodeset) != 1) return -1;
    return hwloc_bitmap_first(ancestor->nodeset);
  }
  return -1;
}

}  // namespace

Result<NumaTopology> QueryNumaTopology() {
  const Topology& t = GetTopology();
  if (t.topo == nullptr) return t.status;
  NumaTopology out;
  out.packages = hwloc_get_nbobjs_by_type(t.topo, HWLOC_OBJ_PACKAGE);
  out.cores = hwloc_get_nbobjs_by_type(t.topo, HWLOC_OBJ_CORE);
  out.pus = hwloc_get_nbobjs_by_type(t.topo, HWLOC_OBJ_PU);
  for (hwloc_obj_t node = hwloc_get_next_obj_by_type(t.topo, HWLOC_OBJ_NUMANODE, nullptr);
       node != nullptr; node = hwloc_get_next_obj_by_type(t.topo, HWLOC_OBJ_NUMANODE, node)) {
    NumaNode n;
    n.index = static_cast<int>(node->os_index);
    n.cpus = BitmapList(node->cpuset);
    n.memory_bytes = node->attr != nullptr ? node->attr->numanode.local_memory : 0;
    out.nodes.push_back(std::move(n));
  }
  return out;
}

int NumaNodeOfPath(const std::string& path) {
  const Topology& t = GetTopology();
  if (t.topo == nullptr) return -1;
  if (hwloc_get_nbobjs_by_type(t.topo, HWLOC_OBJ_NUMANODE) <= 1) return -1;
  auto device = BlockDeviceForPath(path);
  if (!device) return -1;
  // A stacked device (dm, md) is placed where its first locatable disk is.
  for (const std::string& disk : device->backing_disks) {
    int node = NodeOfOsDevice(t.topo, disk);
    if (node >= 0) return node;
  }
  return -1;
}

Status BindCurrentThreadToNumaNode(int node) {
  const Topology& t = GetTopology();
  if (t.topo == nullptr) return t.status;
  hwloc_obj_t obj =
      node >= 0 ? hwloc_get_numanode_obj_by_os_index(t.topo, static_cast<unsigned>(node)) : nullptr;
  if (obj == nullptr) {
    std::string nodes;
    for (hwloc_obj_t n = hwloc_get_next_obj_by_type(t.topo, HWLOC_OBJ_NUMANODE, nullptr);
         n != nullptr; n = hwloc_get_next_obj_by_type(t.topo, HWLOC_OBJ_NUMANODE, n)) {
      nodes += fmt::format("{}{}", nodes.empty() ? "" : ", ", n->os_index);
    }
    return InvalidArgumentError(
        fmt::format("NUMA node {} does not exist; this machine has node(s) {}", node, nodes));
  }
  if (obj->cpuset == nullptr || hwloc_bitmap_iszero(obj->cpuset)) {
    return InvalidArgumentError(fmt::format(
        "NUMA node {} has no CPUs (a memory-only node); threads cannot run there", node));
  }
  if (hwloc_set_cpubind(t.topo, obj->cpuset, HWLOC_CPUBIND_THREAD) != 0) {
    return ErrnoToStatus(errno, fmt::format("binding a thread to the CPUs of NUMA node {} ({})",
                                            node, BitmapList(obj->cpuset)));
  }
  return Status::Ok();
}

}  // namespace strata::io

// Topology: which node each rank is on, the sub-groups a run makes from it, and the bytes each
// rank sends within its node and across nodes.
//
// Nodes. At start-up every rank all-gathers a fixed-size record: a hash of its host identity (the
// host name, which is per UTS namespace, so the network-namespace multi-node test sees two nodes)
// and the launcher's local rank. Ranks with the same hash form a node. Strata requires what
// mpirun's default mapping and srun's block distribution give: every node holds the same number
// of ranks, and a node's ranks are contiguous in world order (rank = node * ranks_per_node +
// local). Anything else is refused at start-up, naming the ranks.
//
// Groups (Collective::Split): `intra`, the ranks of this node ordered by local rank, and `inter`,
// the ranks with this local rank, one per node, ordered by node.
//
// Traffic. A CountingCollective counts, as each operation is enqueued, the bytes this rank sends
// to ranks of its own node and of other nodes: the logical volume of a direct exchange, which is
// what the MPI backend does. An all-gather sends this rank's part to every peer; a reduce-scatter
// sends every peer that peer's part; an all-reduce sends every peer 2 * count / world elements (a
// reduce-scatter and an all-gather of its result); an all-to-all sends every peer its part; a
// broadcast's root sends the buffer to every peer. Counts go to the phase the engine set
// (TrafficCounters::SetPhase), so that a claim such as "backward gathers stay within the node" is
// read off the counters, never computed.
//
// Threading: Topology is a value. TrafficCounters may be read and written from any thread.
// CountingCollective as strata/collective.h.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "comm/collective_wrapper.h"
#include "strata/collective.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata::comm {

struct Topology {
  int rank = 0;
  int world = 1;
  int ranks_per_node = 1;

  int nodes() const { return world / ranks_per_node; }
  int node() const { return node_of(rank); }
  int local_rank() const { return rank % ranks_per_node; }
  int node_of(int r) const { return r / ranks_per_node; }

  // `world` ranks in nodes of `ranks_per_node` (a divisor of world): InvalidArgument otherwise,
  // naming both numbers.
  static Result<Topology> Uniform(int rank, int world, int ranks_per_node);
  // "2 nodes x 2 ranks"
  std::string Describe() const;
};

// This host's identity: the host name (uname), or STRATA_NODE_NAME when set (a launcher that runs
// several "nodes" on one host names them).
std::string HostIdentity();

// Every rank of `world` all-gathers the hash of `host_identity` and its launcher local rank, and
// the nodes are formed as the header says. InvalidArgument names the ranks when nodes hold
// different numbers of ranks or a node's ranks are not contiguous. Blocks until done (a stream of
// `device` is made for the exchange).
Result<Topology> DiscoverTopology(Collective& world, device::Device& device,
                                  std::string_view host_identity, int launcher_local_rank);

// What the engine is doing when it enqueues an operation.
enum class TrafficPhase : uint8_t { kOther, kForwardGather, kBackwardGather, kReduce };
inline constexpr int kTrafficPhases = 4;
std::string_view TrafficPhaseName(TrafficPhase phase);  // "other", "forward gathers", ...

struct Traffic {
  uint64_t intra_bytes = 0;  // sent to ranks on this node
  uint64_t inter_bytes = 0;  // sent to ranks on other nodes
};

class TrafficCounters {
 public:
  void SetPhase(TrafficPhase phase) { phase_.store(phase, std::memory_order_relaxed); }
  TrafficPhase phase() const { return phase_.load(std::memory_order_relaxed); }
  void Add(uint64_t intra, uint64_t inter);
  Traffic total() const;
  Traffic of(TrafficPhase phase) const;

 private:
  std::atomic<TrafficPhase> phase_{TrafficPhase::kOther};
  std::array<std::atomic<uint64_t>, kTrafficPhases> intra_{};
  std::array<std::atomic<uint64_t>, kTrafficPhases> inter_{};
};

// Counts what `inner`'s operations send. `members[r]` is the world rank behind rank r of
// `inner`; `topology` says where each world rank is. `counters` must outlive it.
class CountingCollective final : public CollectiveWrapper {
 public:
  CountingCollective(std::unique_ptr<Collective> inner, std::vector<int> members,
                     const Topology& topology, TrafficCounters* counters, device::Device& device);

  Status AllGather(const void* send, void* recv, size_t count, device::DType dtype,
                   device::Stream& stream) override;
  Status ReduceScatter(const void* send, void* recv, size_t count, device::DType dtype,
                       ReduceOp op, device::Stream& stream) override;
  Status AllReduce(const void* send, void* recv, size_t count, device::DType dtype, ReduceOp op,
                   device::Stream& stream) override;
  Status AllToAll(const void* send, void* recv, size_t count, device::DType dtype,
                  device::Stream& stream) override;
  Status Broadcast(void* buf, size_t bytes, int root, device::Stream& stream) override;
  // The inner split, counted too: its members' world ranks are all-gathered over it.
  Result<std::unique_ptr<Collective>> Split(int color, int key) override;

  TrafficCounters& counters() const { return *counters_; }
  const Topology& topology() const { return topology_; }

 private:
  // Adds `per_peer` bytes sent to every other member.
  void Count(uint64_t per_peer);

  const std::vector<int> members_;
  const Topology topology_;
  TrafficCounters* const counters_;
  device::Device& device_;
  int same_node_peers_ = 0;
  int other_node_peers_ = 0;
};

// Wraps `world` (rank r = world rank r) in a CountingCollective.
std::unique_ptr<CountingCollective> CountTraffic(std::unique_ptr<Collective> world,
                                                 const Topology& topology,
                                                 TrafficCounters* counters,
                                                 device::Device& device);

// The node groups of the header, split from `world` (every rank calls it).
struct NodeGroups {
  std::unique_ptr<Collective> intra;
  std::unique_ptr<Collective> inter;
};
Result<NodeGroups> SplitNodeGroups(Collective& world, const Topology& topology);

}  // namespace strata::comm

#include "comm/topology.h"

#include <fmt/format.h>
#include <sys/utsname.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <utility>

namespace strata::comm {

namespace {

// Every rank's `words` 32-bit words, all-gathered over `comm` through device memory (an
// all-gather moves bytes: fp32 is only the element size). Blocks until done.
Result<std::vector<uint32_t>> AllGatherWords(Collective& comm, device::Device& device,
                                             const std::vector<uint32_t>& mine) {
  const size_t words = mine.size();
  const size_t world = static_cast<size_t>(comm.world_size());
  const size_t bytes = words * world * sizeof(uint32_t);
  STRATA_ASSIGN_OR_RETURN(auto stream, device.CreateStream("topology"));
  STRATA_ASSIGN_OR_RETURN(void* buf, device.Alloc(bytes));
  std::vector<uint32_t> all(words * world);
  char* own = static_cast<char*>(buf) + static_cast<size_t>(comm.rank()) * words * 4;
  Status st = device.CopyAsync(own, mine.data(), words * 4, device::CopyKind::kHostToDevice,
                               *stream);
  if (st.ok()) st = comm.AllGather(own, buf, words, device::DType::kF32, *stream);
  if (st.ok()) {
    st = device.CopyAsync(all.data(), buf, bytes, device::CopyKind::kDeviceToHost, *stream);
  }
  Status synced = device.Synchronize(*stream);
  if (st.ok()) st = synced;
  device.Free(buf);
  STRATA_RETURN_IF_ERROR(st);
  return all;
}

uint64_t Fnv1a(std::string_view text) {
  uint64_t h = 1469598103934665603ull;
  for (const char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

Result<Topology> Topology::Uniform(int rank, int world, int ranks_per_node) {
  if (world < 1 || ranks_per_node < 1 || world % ranks_per_node != 0 || rank < 0 ||
      rank >= world) {
    return InvalidArgumentError(fmt::format(
        "topology: {} rank(s) cannot form nodes of {} rank(s) each (rank {}): every node must "
        "hold the same number of ranks",
        world, ranks_per_node, rank));
  }
  return Topology{.rank = rank, .world = world, .ranks_per_node = ranks_per_node};
}

std::string Topology::Describe() const {
  return fmt::format("{} node(s) x {} rank(s)", nodes(), ranks_per_node);
}

std::string HostIdentity() {
  if (const char* name = std::getenv("STRATA_NODE_NAME"); name != nullptr && *name != '\0') {
    return name;
  }
  utsname u{};
  if (uname(&u) != 0) return "unknown-host";
  return u.nodename;
}

Result<Topology> DiscoverTopology(Collective& world, device::Device& device,
                                  std::string_view host_identity, int launcher_local_rank) {
  const uint64_t h = Fnv1a(host_identity);
  const std::vector<uint32_t> mine = {static_cast<uint32_t>(h), static_cast<uint32_t>(h >> 32),
                                      static_cast<uint32_t>(launcher_local_rank), 0};
  STRATA_ASSIGN_OR_RETURN(std::vector<uint32_t> all, AllGatherWords(world, device, mine));
  const int n = world.world_size();
  auto hash_of = [&](int r) {
    const size_t at = static_cast<size_t>(r) * 4;
    return uint64_t{all[at]} | (uint64_t{all[at + 1]} << 32);
  };
  // Nodes in order of their first rank; each must be one contiguous run of ranks.
  std::vector<std::pair<uint64_t, int>> runs;  // (hash, ranks)
  std::map<uint64_t, int> seen;                // hash -> index in runs
  for (int r = 0; r < n; ++r) {
    const uint64_t hr = hash_of(r);
    if (!runs.empty() && runs.back().first == hr) {
      ++runs.back().second;
      continue;
    }
    if (auto it = seen.find(hr); it != seen.end()) {
      return InvalidArgumentError(fmt::format(
          "topology: rank {} is on the same node as ranks before rank {}, which is on another "
          "node: a node's ranks must be contiguous in rank order (mpirun --map-by slot, srun "
          "--distribution=block)",
          r, r - 1));
    }
    seen[hr] = static_cast<int>(runs.size());
    runs.emplace_back(hr, 1);
  }
  const int per_node = runs.front().second;
  for (size_t k = 0; k < runs.size(); ++k) {
    if (runs[k].second != per_node) {
      int first = 0;
      for (size_t j = 0; j < k; ++j)
        first += runs[j].second;
      return InvalidArgumentError(fmt::format(
          "topology: node {} (ranks {}-{}) holds {} rank(s) where node 0 holds {}: every node "
          "must hold the same number of ranks",
          k, first, first + runs[k].second - 1, runs[k].second, per_node));
    }
  }
  return Topology::Uniform(world.rank(), n, per_node);
}

std::string_view TrafficPhaseName(TrafficPhase phase) {
  switch (phase) {
    case TrafficPhase::kOther:
      return "other";
    case TrafficPhase::kForwardGather:
      return "forward gathers";
    case TrafficPhase::kBackwardGather:
      return "backward gathers";
    case TrafficPhase::kReduce:
      return "gradient reductions";
  }
  return "?";
}

void TrafficCounters::Add(uint64_t intra, uint64_t inter) {
  const auto p = static_cast<size_t>(phase());
  intra_[p].fetch_add(intra, std::memory_order_relaxed);
  inter_[p].fetch_add(inter, std::memory_order_relaxed);
}

Traffic TrafficCounters::of(TrafficPhase phase) const {
  const auto p = static_cast<size_t>(phase);
  return Traffic{.intra_bytes = intra_[p].load(std::memory_order_relaxed),
                 .inter_bytes = inter_[p].load(std::memory_order_relaxed)};
}

Traffic TrafficCounters::total() const {
  Traffic t;
  for (int p = 0; p < kTrafficPhases; ++p) {
    const Traffic one = of(static_cast<TrafficPhase>(p));
    t.intra_bytes += one.intra_bytes;
    t.inter_bytes += one.inter_bytes;
  }
  return t;
}

CountingCollective::CountingCollective(std::unique_ptr<Collective> inner, std::vector<int> members,
                                       const Topology& topology, TrafficCounters* counters,
                                       device::Device& device)
    : CollectiveWrapper(std::move(inner)),
      members_(std::move(members)),
      topology_(topology),
      counters_(counters),
      device_(device) {
  const int me = topology_.node_of(members_[static_cast<size_t>(rank())]);
  for (size_t q = 0; q < members_.size(); ++q) {
    if (static_cast<int>(q) == rank()) continue;
    if (topology_.node_of(members_[q]) == me) {
      ++same_node_peers_;
    } else {
      ++other_node_peers_;
    }
  }
}

void CountingCollective::Count(uint64_t per_peer) {
  counters_->Add(per_peer * static_cast<uint64_t>(same_node_peers_),
                 per_peer * static_cast<uint64_t>(other_node_peers_));
}

Status CountingCollective::AllGather(const void* send, void* recv, size_t count,
                                     device::DType dtype, device::Stream& stream) {
  STRATA_RETURN_IF_ERROR(CollectiveWrapper::AllGather(send, recv, count, dtype, stream));
  Count(count * device::DTypeSize(dtype));
  return Status::Ok();
}

Status CountingCollective::ReduceScatter(const void* send, void* recv, size_t count,
                                         device::DType dtype, ReduceOp op,
                                         device::Stream& stream) {
  STRATA_RETURN_IF_ERROR(CollectiveWrapper::ReduceScatter(send, recv, count, dtype, op, stream));
  Count(count * device::DTypeSize(dtype));
  return Status::Ok();
}

Status CountingCollective::AllReduce(const void* send, void* recv, size_t count,
                                     device::DType dtype, ReduceOp op, device::Stream& stream) {
  STRATA_RETURN_IF_ERROR(CollectiveWrapper::AllReduce(send, recv, count, dtype, op, stream));
  const auto w = static_cast<uint64_t>(world_size());
  Count(w > 1 ? 2 * count * device::DTypeSize(dtype) / w : 0);
  return Status::Ok();
}

Status CountingCollective::AllToAll(const void* send, void* recv, size_t count,
                                    device::DType dtype, device::Stream& stream) {
  STRATA_RETURN_IF_ERROR(CollectiveWrapper::AllToAll(send, recv, count, dtype, stream));
  Count(count * device::DTypeSize(dtype));
  return Status::Ok();
}

Status CountingCollective::Broadcast(void* buf, size_t bytes, int root, device::Stream& stream) {
  STRATA_RETURN_IF_ERROR(CollectiveWrapper::Broadcast(buf, bytes, root, stream));
  if (root == rank()) Count(bytes);
  return Status::Ok();
}

Result<std::unique_ptr<Collective>> CountingCollective::Split(int color, int key) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Collective> sub, inner().Split(color, key));
  const std::vector<uint32_t> mine = {
      static_cast<uint32_t>(members_[static_cast<size_t>(rank())])};
  STRATA_ASSIGN_OR_RETURN(std::vector<uint32_t> all, AllGatherWords(*sub, device_, mine));
  std::vector<int> members(all.begin(), all.end());
  return std::unique_ptr<Collective>(std::make_unique<CountingCollective>(
      std::move(sub), std::move(members), topology_, counters_, device_));
}

std::unique_ptr<CountingCollective> CountTraffic(std::unique_ptr<Collective> world,
                                                 const Topology& topology,
                                                 TrafficCounters* counters,
                                                 device::Device& device) {
  std::vector<int> members(static_cast<size_t>(world->world_size()));
  for (size_t r = 0; r < members.size(); ++r)
    members[r] = static_cast<int>(r);
  return std::make_unique<CountingCollective>(std::move(world), std::move(members), topology,
                                              counters, device);
}

Result<NodeGroups> SplitNodeGroups(Collective& world, const Topology& topology) {
  NodeGroups groups;
  STRATA_ASSIGN_OR_RETURN(groups.intra, world.Split(topology.node(), topology.local_rank()));
  STRATA_ASSIGN_OR_RETURN(groups.inter, world.Split(topology.local_rank(), topology.node()));
  return groups;
}

}  // namespace strata::comm

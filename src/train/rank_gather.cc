#include "train/rank_gather.h"

#include <algorithm>

namespace strata::train {

Result<std::unique_ptr<RankGather>> RankGather::Create(device::Device& dev,
                                                       comm::Collective& comm) {
  std::unique_ptr<RankGather> g(new RankGather(dev, comm));
  if (comm.world_size() == 1) return g;
  const size_t bytes = static_cast<size_t>(comm.world_size()) * sizeof(float);
  STRATA_ASSIGN_OR_RETURN(g->host_,
                          HostRegion::Allocate(std::max<size_t>(bytes, 4096), HugePages::kOff));
  STRATA_RETURN_IF_ERROR(dev.RegisterHost(g->host_.data(), g->host_.size()));
  g->registered_ = true;
  STRATA_ASSIGN_OR_RETURN(g->buffer_, dev.Alloc(bytes));
  STRATA_ASSIGN_OR_RETURN(g->stream_, dev.CreateStream("rank-gather"));
  return g;
}

RankGather::~RankGather() {
  if (stream_ != nullptr) (void)dev_.Synchronize(*stream_);
  if (buffer_ != nullptr) dev_.Free(buffer_);
  if (registered_) (void)dev_.UnregisterHost(host_.data());
}

Result<std::vector<float>> RankGather::Gather(float mine) {
  const int world = comm_.world_size();
  if (world == 1) return std::vector<float>{mine};
  auto* host = reinterpret_cast<float*>(host_.data());
  host[0] = mine;
  char* own = static_cast<char*>(buffer_) + static_cast<size_t>(comm_.rank()) * sizeof(float);
  STRATA_RETURN_IF_ERROR(
      dev_.CopyAsync(own, host, sizeof(float), device::CopyKind::kHostToDevice, *stream_));
  STRATA_RETURN_IF_ERROR(comm_.AllGather(own, buffer_, 1, device::DType::kF32, *stream_));
  STRATA_RETURN_IF_ERROR(dev_.CopyAsync(host, buffer_, static_cast<size_t>(world) * sizeof(float),
                                        device::CopyKind::kDeviceToHost, *stream_));
  STRATA_RETURN_IF_ERROR(dev_.Synchronize(*stream_));
  return std::vector<float>(host, host + world);
}

}  // namespace strata::train

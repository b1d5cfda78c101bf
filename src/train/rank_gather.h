// One float from every rank, in rank order: how the trainer's ranks agree between steps (stop
// reasons after a signal, the outcome of a checkpoint save or verification).
//
// The value travels host -> device -> all-gather -> host through memory set up once: a host page
// registered with the device and a device buffer of world_size floats, on a stream of its own.
// No copy is pageable and nothing is allocated per call. Collective: every rank calls Gather the
// same number of times, in the same order as its other collectives on the communicator.
#pragma once

#include <memory>
#include <vector>

#include "common/host_memory.h"
#include "strata/collective.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata::train {

class RankGather {
 public:
  static Result<std::unique_ptr<RankGather>> Create(device::Device& dev, comm::Collective& comm);
  ~RankGather();
  RankGather(const RankGather&) = delete;
  RankGather& operator=(const RankGather&) = delete;

  // Every rank's `mine`, in rank order (a world of one returns {mine} without any device work).
  Result<std::vector<float>> Gather(float mine);

 private:
  RankGather(device::Device& dev, comm::Collective& comm) : dev_(dev), comm_(comm) {}
  device::Device& dev_;
  comm::Collective& comm_;
  HostRegion host_;
  bool registered_ = false;
  void* buffer_ = nullptr;
  std::unique_ptr<device::Stream> stream_;
};

}  // namespace strata::train

// The single-rank backend: the Collective of a world of one process, on any device.
//
// With one rank every operation's result is its input: AllGather, ReduceScatter and AllReduce
// are one device-to-device copy from send to recv (nothing when in place; kAvg divides by 1, the
// identity), Broadcast (root 0) and Barrier enqueue nothing. Stream order holds trivially: the
// copy is stream work like any other. Arguments are checked exactly as the other backends check
// them, so code written against this backend is valid for the others.
//
// Traces: each operation is recorded on the track "comm" from the moment the stream reaches it to
// the moment it completed (two Notify calls, only when a recorder is attached).
#pragma once

#include <atomic>
#include <memory>

#include "comm/op.h"
#include "strata/collective.h"

namespace strata::comm::internal {

class SingleCollective final : public OpCollective {
 public:
  SingleCollective(device::Device& device, const CollectiveOptions& options);

  Backend backend() const override { return Backend::kSingle; }
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  // Another single-rank collective on the same device (a group of one is a world of one).
  Result<std::unique_ptr<Collective>> Split(int color, int key) override;

 private:
  Status Run(const OpDesc& desc, device::Stream& stream) override;

  device::Device& device_;
  const CollectiveOptions options_;
  TraceRecorder* const trace_;
  const uint32_t track_;
  std::atomic<uint64_t> seq_{0};
};

}  // namespace strata::comm::internal

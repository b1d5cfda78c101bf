#include "comm/single_collective.h"

#include <utility>

#include "strata/trace.h"

namespace strata::comm::internal {

SingleCollective::SingleCollective(device::Device& device, const CollectiveOptions& options)
    : device_(device),
      options_(options),
      trace_(options.trace),
      track_(options.trace != nullptr ? options.trace->Track("comm") : 0) {}

Result<std::unique_ptr<Collective>> SingleCollective::Split(int color, int /*key*/) {
  STRATA_RETURN_IF_ERROR(ValidateSplit("single", color));
  return std::unique_ptr<Collective>(std::make_unique<SingleCollective>(device_, options_));
}

Status SingleCollective::Run(const OpDesc& desc, device::Stream& stream) {
  STRATA_RETURN_IF_ERROR(ValidateOp("single", desc, /*rank=*/0, /*world=*/1));
  if (IsEmpty(desc)) return Status::Ok();
  const uint64_t seq = seq_.fetch_add(1, std::memory_order_relaxed) + 1;
  const bool copies = desc.kind == OpKind::kAllGather || desc.kind == OpKind::kReduceScatter ||
                      desc.kind == OpKind::kAllReduce || desc.kind == OpKind::kAllToAll;

  auto start_ns = std::make_shared<std::atomic<int64_t>>(0);
  if (trace_ != nullptr) {
    STRATA_RETURN_IF_ERROR(device_.Notify(stream, [start_ns](const Status&) {
      start_ns->store(TraceRecorder::NowNs(), std::memory_order_relaxed);
    }));
  }
  if (copies && !IsInPlace(desc, /*rank=*/0)) {
    STRATA_RETURN_IF_ERROR(device_.CopyAsync(desc.recv, desc.send,
                                             desc.count * device::DTypeSize(desc.dtype),
                                             device::CopyKind::kDeviceToDevice, stream));
  }
  if (trace_ != nullptr) {
    STRATA_RETURN_IF_ERROR(device_.Notify(stream, [trace = trace_, track = track_, start_ns,
                                                   name = TraceName(desc), seq,
                                                   bytes = OpBytes(desc, 1)](const Status&) {
      const int64_t end = TraceRecorder::NowNs();
      const int64_t start = start_ns->load(std::memory_order_relaxed);
      trace->Complete(track, name, "comm", start != 0 ? start : end, end,
                      {{"bytes", static_cast<double>(bytes)}, {"seq", static_cast<double>(seq)}});
    }));
  }
  return Status::Ok();
}

}  // namespace strata::comm::internal

#include "comm/mpi_collective.h"

#include <fmt/format.h>

#include <utility>

#include "comm/op.h"
#include "strata/trace.h"

namespace strata::comm::internal {

namespace {

class MpiCollective final : public OpCollective {
 public:
  MpiCollective(device::Device& device, const CollectiveOptions& options, MpiRuntime& runtime,
                const MpiTuning& tuning, MpiGroup group)
      : device_(device),
        options_(options),
        runtime_(runtime),
        group_(group),
        timeout_(options.timeout),
        tuning_(tuning),
        trace_(options.trace),
        track_(options.trace != nullptr ? options.trace->Track("comm") : 0) {}

  Backend backend() const override { return Backend::kMpi; }
  int rank() const override { return group_.rank; }
  int world_size() const override { return group_.size; }

  Result<std::unique_ptr<Collective>> Split(int color, int key) override {
    STRATA_ASSIGN_OR_RETURN(MpiGroup group, runtime_.Split(group_.id, color, key, timeout_));
    return std::unique_ptr<Collective>(
        std::make_unique<MpiCollective>(device_, options_, runtime_, tuning_, group));
  }

 private:
  Status Run(const OpDesc& desc, device::Stream& stream) override {
    STRATA_RETURN_IF_ERROR(ValidateOp("mpi", desc, rank(), world_size()));
    // An empty operation is empty on every rank (the counts must agree): nothing to run.
    if (IsEmpty(desc)) return runtime_.failure();
    auto op = std::make_shared<MpiOp>();
    op->desc = desc;
    op->timeout = timeout_;
    op->tuning = tuning_;
    op->trace = trace_;
    op->track = track_;
    op->group = group_.id;
    return runtime_.Submit(std::move(op), &device_, &stream);
  }

  device::Device& device_;
  const CollectiveOptions options_;
  MpiRuntime& runtime_;
  const MpiGroup group_;
  const std::chrono::milliseconds timeout_;
  const MpiTuning tuning_;
  TraceRecorder* const trace_;
  const uint32_t track_;
};

}  // namespace

Result<std::unique_ptr<Collective>> CreateMpiCollective(device::Device& device,
                                                        const CollectiveOptions& options,
                                                        const LaunchInfo& launch,
                                                        const MpiTuning& tuning) {
  if (device.type() != device::DeviceType::kCpu) {
    return InvalidArgumentError(
        fmt::format("the mpi backend works on the cpu device; '{}' is a {} device (use nccl)",
                    device.name(), device::DeviceTypeName(device.type())));
  }
  if (options.timeout.count() <= 0) {
    return InvalidArgumentError(
        fmt::format("collective timeout must be positive, got {} ms", options.timeout.count()));
  }
  STRATA_ASSIGN_OR_RETURN(MpiRuntime * runtime, MpiRuntime::Instance(options.timeout));
  if (launch.launcher != "none" &&
      (launch.world_size != runtime->world_size() || launch.rank != runtime->rank())) {
    return UnavailableError(fmt::format(
        "the launcher ({}) started this process as rank {} of {}, but MPI reports rank {} of {}: "
        "is this binary linked with the MPI library of the launcher that started it?",
        launch.launcher, launch.rank, launch.world_size, runtime->rank(), runtime->world_size()));
  }
  return std::unique_ptr<Collective>(
      std::make_unique<MpiCollective>(device, options, *runtime, tuning, runtime->world_group()));
}

}  // namespace strata::comm::internal

#include "zero/step_scalars.h"

namespace strata::zero::engine_internal {

StepScalars::~StepScalars() {
  device_.Free(on_device_);
  if (on_host_registered_) (void)device_.UnregisterHost(on_host_.data());
}

Status StepScalars::Allocate() {
  STRATA_ASSIGN_OR_RETURN(on_device_, device_.Alloc(48));
  STRATA_ASSIGN_OR_RETURN(on_host_, HostRegion::Allocate(4096, HugePages::kOff));
  STRATA_RETURN_IF_ERROR(device_.RegisterHost(on_host_.data(), on_host_.size()));
  on_host_registered_ = true;
  return Status::Ok();
}

Result<float> StepScalars::AllReduce(float value, comm::Collective* over) {
  auto* host = reinterpret_cast<float*>(on_host_.data() + 8);
  void* buf = static_cast<char*>(on_device_) + 8;
  *host = value;
  device::Stream& comm = *streams_.comm;
  STRATA_RETURN_IF_ERROR(
      device_.CopyAsync(buf, host, sizeof(float), device::CopyKind::kHostToDevice, comm));
  STRATA_RETURN_IF_ERROR(
      (over != nullptr ? *over : collective_)
          .AllReduce(buf, buf, 1, device::DType::kF32, comm::ReduceOp::kSum, comm));
  STRATA_RETURN_IF_ERROR(
      device_.CopyAsync(host, buf, sizeof(float), device::CopyKind::kDeviceToHost, comm));
  STRATA_RETURN_IF_ERROR(device_.Synchronize(comm));
  return *host;
}

}  // namespace strata::zero::engine_internal

#include "optim/device_adam.h"

#include <fmt/format.h>

#include "optim/adam_internal.h"

#if defined(STRATA_WITH_CUDA)
#include <cuda_runtime.h>

#include "device/cuda_device.h"
#include "optim/adam_cuda_kernel.h"
#endif

namespace strata::optim {
namespace {

#if defined(STRATA_WITH_CUDA)
// The one place in strata_optim where a CUDA error becomes a Status. Clears CUDA's last-error
// state so the error is not reported again by an unrelated call.
Status CudaStatus(cudaError_t err, std::string_view call) {
  return device::CudaErrorToStatus(err, call, "DeviceAdamStep");
}

detail::OutKind OutKindOf(const AdamShard& shard) {
  if (shard.out16 == nullptr) return detail::OutKind::kNone;
  switch (shard.out_dtype) {
    case device::DType::kF32:
      return detail::OutKind::kF32;
    case device::DType::kBF16:
      return detail::OutKind::kBF16;
    case device::DType::kF16:
      return detail::OutKind::kF16;
  }
  return detail::OutKind::kNone;  // rejected by ValidateAdamStep before this is asked
}

Status CudaAdamStep(device::Stream& stream, const AdamHyper& hyper, const AdamShard& shard) {
  STRATA_ASSIGN_OR_RETURN(void* native, device::NativeCudaStream(stream));
  auto* cuda_stream = static_cast<cudaStream_t>(native);
  // Launch on the stream's GPU whatever the calling thread's current device is.
  int ordinal = 0;
  STRATA_RETURN_IF_ERROR(
      CudaStatus(cudaStreamGetDevice(cuda_stream, &ordinal), "cudaStreamGetDevice"));
  STRATA_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice"));
  return CudaStatus(detail::LaunchAdamKernel(detail::ComputeAdamStepScalars(hyper), shard.master,
                                             shard.grad, shard.m, shard.v, shard.out16,
                                             OutKindOf(shard), shard.n, cuda_stream),
                    "LaunchAdamKernel");
}
#endif

}  // namespace

Status DeviceAdamStep(device::Device& device, device::Stream& stream, const AdamHyper& hyper,
                      const AdamShard& shard, const CpuAdamOptions& cpu) {
  switch (device.type()) {
    case device::DeviceType::kCpu: {
      // Reject what CpuAdamStep would reject now, rather than as a sticky error later.
      STRATA_RETURN_IF_ERROR(detail::ValidateAdamStep(hyper, shard, "DeviceAdamStep"));
      if (cpu.threads < 1) {
        return InvalidArgumentError(
            fmt::format("DeviceAdamStep: threads is {}; expected >= 1", cpu.threads));
      }
      bool isa_ok = false;
      for (Isa isa : SupportedIsas())
        isa_ok = isa_ok || isa == cpu.isa;
      if (!isa_ok) {
        return InvalidArgumentError(
            fmt::format("DeviceAdamStep: ISA {} is not supported by this CPU", IsaName(cpu.isa)));
      }
      return device.HostTask(
          stream, [hyper, shard, cpu] { return CpuAdamStep(hyper, shard, cpu); }, "adam");
    }
    case device::DeviceType::kCuda:
      STRATA_RETURN_IF_ERROR(detail::ValidateAdamStep(hyper, shard, "DeviceAdamStep"));
#if defined(STRATA_WITH_CUDA)
      return CudaAdamStep(stream, hyper, shard);
#else
      return UnimplementedError("DeviceAdamStep: this binary was built without CUDA");
#endif
  }
  return InvalidArgumentError(
      fmt::format("DeviceAdamStep: unknown device type {}", static_cast<int>(device.type())));
}

}  // namespace strata::optim

#include "model/cuda_ops_status.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <string>

#include "device/cuda_device.h"

namespace strata::model::cuda {

static_assert(static_cast<int>(device::DType::kF32) == static_cast<int>(DType::kF32) &&
              static_cast<int>(device::DType::kBF16) == static_cast<int>(DType::kBF16) &&
              static_cast<int>(device::DType::kF16) == static_cast<int>(DType::kF16));
static_assert(cpu::kIgnoreIndex == kIgnoreIndex);

namespace {


Status CublasErrorStatus(cublasStatus_t status, const OpError& error) {
  const std::string message =
      fmt::format("{}: {} failed: {} ({})", error.op, error.what, cublasGetStatusString(status),
                  cublasGetStatusName(status));
  switch (status) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return ResourceExhaustedError(message);
    case CUBLAS_STATUS_INVALID_VALUE:
      return InvalidArgumentError(message);
    case CUBLAS_STATUS_NOT_INITIALIZED:  // no GPU or driver
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return UnavailableError(message);
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return UnimplementedError(message);
    default:
      return InternalError(message);
  }
}

}  // namespace

Status ToStatus(const OpError& error) {
  switch (error.source) {
    case ErrorSource::kNone:
      return Status::Ok();
    case ErrorSource::kArgument:
      return InvalidArgumentError(fmt::format("{}: {}", error.op, error.what));
    case ErrorSource::kCuda:
      return device::CudaErrorToStatus(error.code, error.what, error.op);
    case ErrorSource::kCublas:
      (void)cudaGetLastError();
      return CublasErrorStatus(static_cast<cublasStatus_t>(error.code), error);
    case ErrorSource::kCudnn:
      (void)cudaGetLastError();
      return InternalError(
          fmt::format("{}: {} failed (cuDNN frontend error {}; the log has "
                      "cuDNN's message)",
                      error.op, error.what, error.code));
  }
  return InternalError(fmt::format("{}: unknown error source", error.op));
}

Result<OpsContextPtr> CreateOpsContext(device::Stream& stream) {
  STRATA_ASSIGN_OR_RETURN(void* native, device::NativeCudaStream(stream));
  auto* cuda_stream = static_cast<cudaStream_t>(native);
  const auto cuda_status = [](cudaError_t err, const char* call) {
    return ToStatus(err == cudaSuccess ? OpError{}
                                       : OpError{ErrorSource::kCuda, static_cast<int>(err), call,
                                                 "CreateOpsContext"});
  };
  int ordinal = 0;
  STRATA_RETURN_IF_ERROR(
      cuda_status(cudaStreamGetDevice(cuda_stream, &ordinal), "cudaStreamGetDevice"));
  STRATA_RETURN_IF_ERROR(cuda_status(cudaSetDevice(ordinal), "cudaSetDevice"));
  OpsContextPtr context;
  STRATA_RETURN_IF_ERROR(ToStatus(CreateOpsContext(native, &context)));
  return context;
}

Status CheckDataErrors(OpsContext* context) {
  DataError data;
  STRATA_RETURN_IF_ERROR(ToStatus(TakeDataError(context, &data)));
  switch (data.kind) {
    case DataErrorKind::kNone:
      return Status::Ok();
    case DataErrorKind::kToken:
      return InvalidArgumentError(fmt::format("token id {} at position {} is outside [0, {})",
                                              data.value, data.position, data.bound));
    case DataErrorKind::kTarget:
      return InvalidArgumentError(
          fmt::format("target {} at position {} is outside [0, {}) and is not the ignore index",
                      data.value, data.position, data.bound));
  }
  return InternalError("CheckDataErrors: unknown data error kind");
}

Weight ToCudaWeight(cpu::Weight weight) {
  return Weight{weight.data, ToCudaDType(weight.dtype)};
}

DType ToCudaDType(device::DType dtype) {
  return static_cast<DType>(static_cast<int>(dtype));
}

}  // namespace strata::model::cuda

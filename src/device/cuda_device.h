// The CUDA device (cuda_device.cc): real CUDA streams and events, a caching allocator under the
// byte budget, cudaHostRegister for RegisterHost, and the element-wise kernels of
// cuda_kernels.cu. Only built when STRATA_WITH_CUDA is defined. No CUDA type appears here.
#pragma once

#include <cstddef>
#include <memory>
#include <string_view>

#include "strata/device.h"

namespace strata::device {

// Creates the CUDA device on GPU `options.ordinal` (options.type must be kCuda). Unavailable,
// with the CUDA error text, when there is no driver or GPU; InvalidArgument for an ordinal that
// does not exist.
Result<std::unique_ptr<Device>> CreateCudaDevice(const DeviceOptions& options);

// The cudaStream_t (as void*) behind a stream of a CUDA device, for code that launches its own
// kernels or NCCL calls in stream order (src/optim, src/comm, src/model). InvalidArgument for a
// stream of another device type. The caller converts its own errors; it must not destroy the
// handle.
Result<void*> NativeCudaStream(Stream& stream);

// The bytes the CUDA device's caching allocator reserves (and keeps cached) for an Alloc of
// `bytes`: a power of two of at least 512 B up to 1 MiB, whole 2 MiB pages above. A caller that
// sizes a budget to hold given blocks without the cache giving memory back sums these.
size_t CudaAllocationBytes(size_t bytes);

// The one conversion of a CUDA runtime error (a cudaError_t, passed as int) to a Status: OK for
// cudaSuccess; otherwise it clears the thread's last-error state (so that no unrelated call
// reports the error again) and returns "<context>: <call> failed: <text> (<cudaErrorName>)" with
// a code that says what to do about it (ResourceExhausted, InvalidArgument, Unavailable,
// Unimplemented, else Internal).
Status CudaErrorToStatus(int cuda_error, std::string_view call, std::string_view context);

}  // namespace strata::device

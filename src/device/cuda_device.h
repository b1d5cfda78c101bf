// The CUDA device (cuda_device.cc): real CUDA streams and events, a caching allocator under the
// byte budget, cudaHostRegister for RegisterHost, and the element-wise kernels of
// cuda_kernels.cu. Only built when STRATA_WITH_CUDA is defined. No CUDA type appears here.
#pragma once

#include <memory>

#include "strata/device.h"

namespace strata::device {

// Creates the CUDA device on GPU `options.ordinal` (options.type must be kCuda). Unavailable,
// with the CUDA error text, when there is no driver or GPU; InvalidArgument for an ordinal that
// does not exist.
Result<std::unique_ptr<Device>> CreateCudaDevice(const DeviceOptions& options);

}  // namespace strata::device

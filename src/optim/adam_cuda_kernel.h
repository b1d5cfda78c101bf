// The fused Adam / AdamW kernel for the CUDA device (adam_cuda_kernel.cu). C++17 and CUDA types
// only: nvcc compiles the kernel as C++17, and device_adam.cc (C++20) calls the launcher.
//
// One grid-stride loop over the shard: each element is updated with AdamElementUnfused
// (adam_element.h), the very operations of the CPU scalar path with explicit rounding
// (__fmul_rn, __fadd_rn, __fsub_rn, __fdiv_rn, __fsqrt_rn: nvcc fuses none of them), so the CPU
// scalar path is this kernel's oracle bit for bit; the 16-bit copy uses the conversions of
// device/dtype_convert.h, as the CPU device does.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "optim/adam_element.h"

namespace strata::optim::detail {

// Enqueues one kernel on `stream` (nothing when n == 0) and returns the launch error as
// cudaGetLastError reports it; errors while the kernel runs surface at the next synchronizing
// call. All pointers are device memory of the current device; out16 is null when out == kNone.
// The arrays must not overlap. Converting the code to a Status is the caller's job.
cudaError_t LaunchAdamKernel(const AdamStepScalars& scalars, float* master, const float* grad,
                             float* m, float* v, void* out16, OutKind out, size_t n,
                             cudaStream_t stream);

}  // namespace strata::optim::detail

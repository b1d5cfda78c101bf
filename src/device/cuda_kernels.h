// Element-wise kernels of the CUDA device (cuda_kernels.cu). C++17 and CUDA types only: nvcc
// compiles the kernels as C++17, and cuda_device.cc (C++20) calls these launchers.
//
// Every kernel is a grid-stride loop over n elements, so any n works with a bounded grid. The
// arithmetic matches the CPU device bit for bit: the same conversions (dtype_convert.h) and fp32
// operations with explicit rounding (__fmul_rn, __fadd_rn: no fused multiply-add), so the CPU
// device is the oracle for these kernels.
//
// Each launcher enqueues one kernel on `stream` (nothing when n == 0) and returns the launch
// error as cudaGetLastError reports it; errors while the kernel runs surface later, from the
// next synchronizing call. Pointers are device memory; 16-bit values are stored as their bit
// patterns. Converting the returned code to a Status is the caller's job (cuda_device.cc).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace strata::device::cuda_kernels {

// Numbered as strata::device::DType (cuda_device.cc asserts that they match).
enum class KernelDType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// y[i] = convert(x[i]). x == y with from == to does nothing; otherwise x and y must not overlap.
cudaError_t LaunchCast(const void* x, KernelDType from, void* y, KernelDType to, size_t n,
                       cudaStream_t stream);
// x[i] = x[i] * alpha
cudaError_t LaunchScale(void* x, KernelDType dtype, float alpha, size_t n, cudaStream_t stream);
// y[i] = y[i] + alpha * x[i], in fp32, stored in `dtype`. x and y must not overlap.
cudaError_t LaunchAxpy(float alpha, const void* x, void* y, KernelDType dtype, size_t n,
                       cudaStream_t stream);
// x[i] = value (converted once to `dtype`)
cudaError_t LaunchFill(void* x, KernelDType dtype, float value, size_t n, cudaStream_t stream);

// QuantizeInt8 / DequantizeInt8 (strata/device.h): one CUDA block per quantization block of
// `block` elements; bit for bit the CPU device's loops (convert::QuantizeToInt8).
cudaError_t LaunchQuantizeInt8(const void* x, KernelDType dtype, size_t n, size_t block,
                               int8_t* q, float* scales, cudaStream_t stream);
cudaError_t LaunchDequantizeInt8(const int8_t* q, const float* scales, size_t n, size_t block,
                                 void* y, KernelDType dtype, cudaStream_t stream);

// The blocks of LaunchSumSquares' first pass; `partials` holds one double per block.
inline constexpr unsigned kSumSquaresBlocks = 1024;
// *sum += sum_i float(x[i])^2 in double. Two kernels: up to kSumSquaresBlocks blocks each write
// their partial sum to `partials`, then one block adds them in a fixed order and adds the total
// to *sum. Deterministic. `partials` must not be used by other work running at the same time
// (one buffer per stream).
cudaError_t LaunchSumSquares(const void* x, KernelDType dtype, size_t n, double* partials,
                             double* sum, cudaStream_t stream);

}  // namespace strata::device::cuda_kernels

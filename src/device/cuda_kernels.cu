#include <algorithm>

#include "device/cuda_kernels.h"
#include "device/cuda_dtype_tags.h"
#include "device/dtype_convert.h"

namespace strata::device::cuda_kernels {
namespace {

constexpr unsigned kBlockThreads = 256;
// A grid-stride loop needs only enough blocks to fill the GPU a few times over (an H100 holds
// about a thousand 256-thread blocks at once).
constexpr size_t kMaxBlocks = 4096;

unsigned BlockCount(size_t n) {
  return static_cast<unsigned>(std::min(kMaxBlocks, (n + kBlockThreads - 1) / kBlockThreads));
}

using ::strata::device::cuda_tags::BF16;
using ::strata::device::cuda_tags::F16;
using ::strata::device::cuda_tags::F32;

__device__ inline size_t FirstIndex() {
  return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline size_t Stride() {
  return static_cast<size_t>(gridDim.x) * blockDim.x;
}

template <typename S, typename D>
__global__ void CastKernel(const typename S::T* __restrict__ x, typename D::T* __restrict__ y,
                           size_t n) {
  for (size_t i = FirstIndex(); i < n; i += Stride())
    y[i] = D::Store(S::Load(x[i]));
}

template <typename E>
__global__ void ScaleKernel(typename E::T* x, float alpha, size_t n) {
  for (size_t i = FirstIndex(); i < n; i += Stride())
    x[i] = E::Store(convert::CanonicalNaN(__fmul_rn(E::Load(x[i]), alpha)));
}

template <typename E>
__global__ void AxpyKernel(float alpha, const typename E::T* __restrict__ x,
                           typename E::T* __restrict__ y, size_t n) {
  for (size_t i = FirstIndex(); i < n; i += Stride())
    y[i] = E::Store(
        convert::CanonicalNaN(__fadd_rn(E::Load(y[i]), __fmul_rn(alpha, E::Load(x[i])))));
}

template <typename E>
__global__ void FillKernel(typename E::T* x, typename E::T value, size_t n) {
  for (size_t i = FirstIndex(); i < n; i += Stride())
    x[i] = value;
}

// One CUDA block per quantization block: the block's max |x| (a max is exact in any order),
// then each element divided by the scale, as the CPU device does.
template <typename E>
__global__ void QuantizeKernel(const typename E::T* __restrict__ x, size_t block,
                               int8_t* __restrict__ q, float* __restrict__ scales) {
  __shared__ float shared[kBlockThreads];
  const typename E::T* v = x + static_cast<size_t>(blockIdx.x) * block;
  float amax = 0.0f;
  for (size_t i = threadIdx.x; i < block; i += blockDim.x)
    amax = fmaxf(amax, fabsf(E::Load(v[i])));
  shared[threadIdx.x] = amax;
  __syncthreads();
  for (unsigned width = kBlockThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) shared[threadIdx.x] = fmaxf(shared[threadIdx.x], shared[threadIdx.x + width]);
    __syncthreads();
  }
  const float scale = __fdiv_rn(shared[0], 127.0f);
  if (threadIdx.x == 0) scales[blockIdx.x] = scale;
  int8_t* out = q + static_cast<size_t>(blockIdx.x) * block;
  for (size_t i = threadIdx.x; i < block; i += blockDim.x)
    out[i] = convert::QuantizeToInt8(E::Load(v[i]), scale);
}

template <typename E>
__global__ void DequantizeKernel(const int8_t* __restrict__ q, const float* __restrict__ scales,
                                 size_t n, size_t block, typename E::T* __restrict__ y) {
  for (size_t i = FirstIndex(); i < n; i += Stride())
    y[i] = E::Store(__fmul_rn(static_cast<float>(q[i]), scales[i / block]));
}

// Sums `value` over the block's threads (blockDim.x == kBlockThreads) in a fixed tree order;
// thread 0 gets the total.
__device__ double BlockSum(double value) {
  __shared__ double shared[kBlockThreads];
  shared[threadIdx.x] = value;
  __syncthreads();
  for (unsigned width = kBlockThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) shared[threadIdx.x] += shared[threadIdx.x + width];
    __syncthreads();
  }
  return shared[0];
}

template <typename E>
__global__ void SumSquaresPartialKernel(const typename E::T* __restrict__ x, size_t n,
                                        double* __restrict__ partials) {
  double acc = 0.0;
  for (size_t i = FirstIndex(); i < n; i += Stride()) {
    const double v = E::Load(x[i]);
    acc += v * v;
  }
  const double total = BlockSum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void SumSquaresFinishKernel(const double* __restrict__ partials, unsigned count,
                                       double* sum) {
  double acc = 0.0;
  for (unsigned i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  const double total = BlockSum(acc);
  if (threadIdx.x == 0) *sum += total;
}

template <typename E>
cudaError_t SumSquaresAs(const void* x, size_t n, double* partials, double* sum,
                         cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(
      std::min<size_t>(kSumSquaresBlocks, (n + kBlockThreads - 1) / kBlockThreads));
  SumSquaresPartialKernel<E><<<blocks, kBlockThreads, 0, stream>>>(
      static_cast<const typename E::T*>(x), n, partials);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  SumSquaresFinishKernel<<<1, kBlockThreads, 0, stream>>>(partials, blocks, sum);
  return cudaGetLastError();
}

template <typename S, typename D>
cudaError_t CastAs(const void* x, void* y, size_t n, cudaStream_t stream) {
  CastKernel<S, D><<<BlockCount(n), kBlockThreads, 0, stream>>>(
      static_cast<const typename S::T*>(x), static_cast<typename D::T*>(y), n);
  return cudaGetLastError();
}

template <typename S>
cudaError_t CastFrom(const void* x, void* y, KernelDType to, size_t n, cudaStream_t stream) {
  switch (to) {
    case KernelDType::kF32:
      return CastAs<S, F32>(x, y, n, stream);
    case KernelDType::kBF16:
      return CastAs<S, BF16>(x, y, n, stream);
    case KernelDType::kF16:
      return CastAs<S, F16>(x, y, n, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename E>
cudaError_t ScaleAs(void* x, float alpha, size_t n, cudaStream_t stream) {
  ScaleKernel<E>
      <<<BlockCount(n), kBlockThreads, 0, stream>>>(static_cast<typename E::T*>(x), alpha, n);
  return cudaGetLastError();
}

template <typename E>
cudaError_t AxpyAs(float alpha, const void* x, void* y, size_t n, cudaStream_t stream) {
  AxpyKernel<E><<<BlockCount(n), kBlockThreads, 0, stream>>>(
      alpha, static_cast<const typename E::T*>(x), static_cast<typename E::T*>(y), n);
  return cudaGetLastError();
}

template <typename E>
cudaError_t FillAs(void* x, typename E::T value, size_t n, cudaStream_t stream) {
  FillKernel<E>
      <<<BlockCount(n), kBlockThreads, 0, stream>>>(static_cast<typename E::T*>(x), value, n);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchCast(const void* x, KernelDType from, void* y, KernelDType to, size_t n,
                       cudaStream_t stream) {
  if (n == 0 || (x == y && from == to)) return cudaSuccess;
  switch (from) {
    case KernelDType::kF32:
      return CastFrom<F32>(x, y, to, n, stream);
    case KernelDType::kBF16:
      return CastFrom<BF16>(x, y, to, n, stream);
    case KernelDType::kF16:
      return CastFrom<F16>(x, y, to, n, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchQuantizeInt8(const void* x, KernelDType dtype, size_t n, size_t block,
                               int8_t* q, float* scales, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>(n / block);
  switch (dtype) {
    case KernelDType::kF32:
      QuantizeKernel<F32><<<blocks, kBlockThreads, 0, stream>>>(
          static_cast<const F32::T*>(x), block, q, scales);
      return cudaGetLastError();
    case KernelDType::kBF16:
      QuantizeKernel<BF16><<<blocks, kBlockThreads, 0, stream>>>(
          static_cast<const BF16::T*>(x), block, q, scales);
      return cudaGetLastError();
    case KernelDType::kF16:
      QuantizeKernel<F16><<<blocks, kBlockThreads, 0, stream>>>(
          static_cast<const F16::T*>(x), block, q, scales);
      return cudaGetLastError();
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchDequantizeInt8(const int8_t* q, const float* scales, size_t n, size_t block,
                                 void* y, KernelDType dtype, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (dtype) {
    case KernelDType::kF32:
      DequantizeKernel<F32><<<BlockCount(n), kBlockThreads, 0, stream>>>(
          q, scales, n, block, static_cast<F32::T*>(y));
      return cudaGetLastError();
    case KernelDType::kBF16:
      DequantizeKernel<BF16><<<BlockCount(n), kBlockThreads, 0, stream>>>(
          q, scales, n, block, static_cast<BF16::T*>(y));
      return cudaGetLastError();
    case KernelDType::kF16:
      DequantizeKernel<F16><<<BlockCount(n), kBlockThreads, 0, stream>>>(
          q, scales, n, block, static_cast<F16::T*>(y));
      return cudaGetLastError();
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchScale(void* x, KernelDType dtype, float alpha, size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (dtype) {
    case KernelDType::kF32:
      return ScaleAs<F32>(x, alpha, n, stream);
    case KernelDType::kBF16:
      return ScaleAs<BF16>(x, alpha, n, stream);
    case KernelDType::kF16:
      return ScaleAs<F16>(x, alpha, n, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchAxpy(float alpha, const void* x, void* y, KernelDType dtype, size_t n,
                       cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (dtype) {
    case KernelDType::kF32:
      return AxpyAs<F32>(alpha, x, y, n, stream);
    case KernelDType::kBF16:
      return AxpyAs<BF16>(alpha, x, y, n, stream);
    case KernelDType::kF16:
      return AxpyAs<F16>(alpha, x, y, n, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchFill(void* x, KernelDType dtype, float value, size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  // Converted once on the host, with the same function the CPU device uses.
  switch (dtype) {
    case KernelDType::kF32:
      return FillAs<F32>(x, value, n, stream);
    case KernelDType::kBF16:
      return FillAs<BF16>(x, convert::FloatToBf16(value), n, stream);
    case KernelDType::kF16:
      return FillAs<F16>(x, convert::FloatToF16(value), n, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchSumSquares(const void* x, KernelDType dtype, size_t n, double* partials,
                             double* sum, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (dtype) {
    case KernelDType::kF32:
      return SumSquaresAs<F32>(x, n, partials, sum, stream);
    case KernelDType::kBF16:
      return SumSquaresAs<BF16>(x, n, partials, sum, stream);
    case KernelDType::kF16:
      return SumSquaresAs<F16>(x, n, partials, sum, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace strata::device::cuda_kernels

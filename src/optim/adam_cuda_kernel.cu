#include <algorithm>

#include "device/dtype_convert.h"
#include "optim/adam_cuda_kernel.h"

namespace strata::optim::detail {
namespace {

constexpr unsigned kBlockThreads = 256;
// Enough blocks to fill the GPU a few times over; the grid-stride loop covers the rest.
constexpr size_t kMaxBlocks = 4096;

template <DecayMode kDecay, OutKind kOut>
__global__ void AdamKernel(AdamStepScalars s, float* __restrict__ master,
                           const float* __restrict__ grad, float* __restrict__ m,
                           float* __restrict__ v, void* __restrict__ out16, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float p = master[i];
    float mi = m[i];
    float vi = v[i];
    AdamElementUnfused<kDecay>(s, grad[i], p, mi, vi);
    master[i] = p;
    m[i] = mi;
    v[i] = vi;
    if constexpr (kOut == OutKind::kBF16) {
      static_cast<uint16_t*>(out16)[i] = device::convert::FloatToBf16(p);
    } else if constexpr (kOut == OutKind::kF16) {
      static_cast<uint16_t*>(out16)[i] = device::convert::FloatToF16(p);
    } else if constexpr (kOut == OutKind::kF32) {
      static_cast<float*>(out16)[i] = p;
    }
  }
}

template <DecayMode kDecay, OutKind kOut>
cudaError_t Launch(const AdamStepScalars& s, float* master, const float* grad, float* m, float* v,
                   void* out16, size_t n, cudaStream_t stream) {
  const auto blocks =
      static_cast<unsigned>(std::min(kMaxBlocks, (n + kBlockThreads - 1) / kBlockThreads));
  AdamKernel<kDecay, kOut><<<blocks, kBlockThreads, 0, stream>>>(s, master, grad, m, v, out16, n);
  return cudaGetLastError();
}

template <DecayMode kDecay>
cudaError_t LaunchOut(const AdamStepScalars& s, float* master, const float* grad, float* m,
                      float* v, void* out16, OutKind out, size_t n, cudaStream_t stream) {
  switch (out) {
    case OutKind::kNone:
      return Launch<kDecay, OutKind::kNone>(s, master, grad, m, v, out16, n, stream);
    case OutKind::kBF16:
      return Launch<kDecay, OutKind::kBF16>(s, master, grad, m, v, out16, n, stream);
    case OutKind::kF16:
      return Launch<kDecay, OutKind::kF16>(s, master, grad, m, v, out16, n, stream);
    case OutKind::kF32:
      return Launch<kDecay, OutKind::kF32>(s, master, grad, m, v, out16, n, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchAdamKernel(const AdamStepScalars& scalars, float* master, const float* grad,
                             float* m, float* v, void* out16, OutKind out, size_t n,
                             cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (scalars.decay) {
    case DecayMode::kNone:
      return LaunchOut<DecayMode::kNone>(scalars, master, grad, m, v, out16, out, n, stream);
    case DecayMode::kDecoupled:
      return LaunchOut<DecayMode::kDecoupled>(scalars, master, grad, m, v, out16, out, n, stream);
    case DecayMode::kL2:
      return LaunchOut<DecayMode::kL2>(scalars, master, grad, m, v, out16, out, n, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace strata::optim::detail

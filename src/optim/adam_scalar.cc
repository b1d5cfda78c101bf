// The scalar (reference) CPU Adam kernel: AdamElementUnfused per element, the same operations
// as the CUDA kernel. Compiled for baseline x86-64 with -ffp-contract=off (CMakeLists.txt), so
// that no a * b + c becomes an FMA even if a wider -march is set for the whole build.
#include <cstdint>
#include <cstring>

#include "device/dtype_convert.h"
#include "optim/adam_kernels.h"

namespace strata::optim::detail {
namespace {

template <DecayMode kDecay, OutKind kOut>
void Run(const AdamStepScalars& s, const AdamKernelRange& r) {
  float* __restrict__ master = r.master;
  const float* __restrict__ grad = r.grad;
  float* __restrict__ m = r.m;
  float* __restrict__ v = r.v;
  for (size_t i = 0; i < r.n; ++i) {
    float p = master[i];
    float mi = m[i];
    float vi = v[i];
    AdamElementUnfused<kDecay>(s, grad[i], p, mi, vi);
    master[i] = p;
    m[i] = mi;
    v[i] = vi;
    if constexpr (kOut == OutKind::kBF16) {
      static_cast<uint16_t*>(r.out16)[i] = device::convert::FloatToBf16(p);
    } else if constexpr (kOut == OutKind::kF16) {
      static_cast<uint16_t*>(r.out16)[i] = device::convert::FloatToF16(p);
    } else if constexpr (kOut == OutKind::kF32) {
      static_cast<float*>(r.out16)[i] = p;
    }
  }
}

}  // namespace

void AdamKernelScalar(const AdamStepScalars& s, const AdamKernelRange& r) {
  DispatchAdam(s.decay, r.out, [&]<DecayMode kDecay, OutKind kOut>() { Run<kDecay, kOut>(s, r); });
}

}  // namespace strata::optim::detail

// The CPU Adam kernels, one per instruction set, each in its own translation unit compiled with
// that ISA's flags (adam_scalar.cc: baseline x86-64; adam_avx2.cc: -mavx2 -mfma -mf16c;
// adam_avx512.cc: -mavx512f -mavx512bw -mavx512vl). adam_cpu.cc validates, splits the shard and
// calls the kernel of the chosen ISA only after checking at run time that the CPU has it.
//
// This header is included by all of them, so it declares plain data and functions only: no
// inline code that one ISA's TU could emit and another's could end up calling (the one helper
// with a body, PrefetchAdamInputs, is static: each TU keeps its own copy).
#pragma once

#include <xmmintrin.h>

#include <cstddef>

#include "optim/adam_element.h"

namespace strata::optim::detail {

// One contiguous range of a shard: n elements of each array, out16 (may be null when
// out == kNone) of `out`'s type. Arrays do not overlap.
struct AdamKernelRange {
  float* master;
  const float* grad;
  float* m;
  float* v;
  void* out16;
  size_t n;
  OutKind out;
  // Write out16 with non-temporal (streaming) stores where its alignment allows: worth it when
  // the shard is much larger than the last-level cache (the copy is not read back soon), and
  // it saves the read-for-ownership of out16's lines.
  bool stream_out16;
};

// Calls `kernel.template operator()<kDecay, kOut>()` for the run-time decay mode and output kind:
// each ISA's kernel is a template over both, so the hot loop has no per-element branch on them.
template <typename Kernel>
void DispatchAdam(DecayMode decay, OutKind out, Kernel&& kernel) {
  auto with_out = [&]<DecayMode kDecay>() {
    switch (out) {
      case OutKind::kNone:
        return kernel.template operator()<kDecay, OutKind::kNone>();
      case OutKind::kBF16:
        return kernel.template operator()<kDecay, OutKind::kBF16>();
      case OutKind::kF16:
        return kernel.template operator()<kDecay, OutKind::kF16>();
      case OutKind::kF32:
        return kernel.template operator()<kDecay, OutKind::kF32>();
    }
  };
  switch (decay) {
    case DecayMode::kNone:
      return with_out.template operator()<DecayMode::kNone>();
    case DecayMode::kDecoupled:
      return with_out.template operator()<DecayMode::kDecoupled>();
    case DecayMode::kL2:
      return with_out.template operator()<DecayMode::kL2>();
  }
}

// The SIMD kernels prefetch their four input streams this far ahead (2 KiB of each array):
// measured best of 1, 2, 4 and 8 KiB (docs/benchmarks.md, "CPU AdamW").
inline constexpr size_t kAdamPrefetchElements = 512;

// Software prefetch of master, grad, m and v at index i, into every cache level. The hardware
// prefetcher alone leaves the SIMD loops about 10% below the streaming ceiling on one core (2^27
// elements, Intel AVX-512): the arithmetic between loads limits how many misses stay in flight.
// Prefetches never fault, so i may run past the end. Baseline SSE: every TU may use it.
static inline __attribute__((always_inline)) void PrefetchAdamInputs(const AdamKernelRange& r,
                                                                     size_t i) {
  _mm_prefetch(reinterpret_cast<const char*>(r.master + i), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(r.grad + i), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(r.m + i), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(r.v + i), _MM_HINT_T0);
}

void AdamKernelScalar(const AdamStepScalars& s, const AdamKernelRange& r);
void AdamKernelAvx2(const AdamStepScalars& s, const AdamKernelRange& r);
void AdamKernelAvx512(const AdamStepScalars& s, const AdamKernelRange& r);

}  // namespace strata::optim::detail

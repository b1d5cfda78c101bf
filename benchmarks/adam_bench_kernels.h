// The comparison kernels of strata_adam_bench (adam_bench_kernels.cc), compiled on their own with
// -O3 -march=native: the "peer" Adam (a plain scalar loop, as a C++ programmer would write it,
// left to the compiler's auto-vectoriser) and the streaming ceiling (the same memory traffic as
// Adam with no arithmetic). Plain declarations only, so nothing built for this machine's ISA is
// shared with the rest of the program.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::bench {

struct PeerAdamScalars {
  float beta1, beta2, eps, lr, weight_decay, bias_correction1, bias_correction2_sqrt;
};

// AdamW over [0, n): the textbook loop (decay, moments, bias-corrected update).
void PeerAdamStep(const PeerAdamScalars& s, float* p, const float* g, float* m, float* v, size_t n);

// Which stores of the ceiling pass are non-temporal.
enum class CeilingStores { kOrdinary, kNonTemporal, kNonTemporalOut16 };

// Reads p, g, m, v (n floats each) and writes p, m, v back (and, when out16 is set, n 16-bit
// values taken from p's bits), with no arithmetic; the compiler can drop none of it.
// Non-temporal stores need p, m, v (kNonTemporal) and out16 32-byte aligned.
void CeilingPass(float* p, const float* g, float* m, float* v, uint16_t* out16, size_t n,
                 CeilingStores stores);

// The vector width the ceiling kernel was built with ("avx512", "avx2" or "sse2").
const char* CeilingIsa();

}  // namespace strata::bench

// The per-step scalars of an Adam step and the scalar per-element update, shared by the CPU
// scalar path (adam_scalar.cc) and the CUDA kernel (adam_cuda_kernel.cu), so that the two give
// the same bits: each operation is one IEEE fp32 operation rounded to nearest, never fused (on
// the GPU through __fmul_rn / __fadd_rn / __fsub_rn / __fdiv_rn / __fsqrt_rn, which nvcc does not
// contract; on the CPU the scalar translation unit is compiled with -ffp-contract=off).
//
// C++17 and CUDA-compatible, no Strata header, no std template: it is included by translation
// units compiled with different instruction-set flags, and every function here has internal
// linkage (static), so the linker can never pick one TU's copy for another.
//
// The arithmetic is the one adam.h spells out; AdamStepScalars holds its per-step scalars.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define STRATA_ADAM_HD __host__ __device__
#else
#define STRATA_ADAM_HD
#endif

namespace strata::optim::detail {

// Which weight-decay line the step runs (kNone when weight_decay == 0).
enum class DecayMode : uint8_t { kNone = 0, kDecoupled = 1, kL2 = 2 };

// What the step writes to out16 (numbered as strata::device::DType, plus kNone).
enum class OutKind : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3 };

// Per-step scalars, each computed in double and rounded once to fp32 (ComputeAdamStepScalars in
// adam_cpu.cc). Names as in adam.h.
struct AdamStepScalars {
  float grad_scale;       // gs
  float beta1;            // b1
  float one_minus_beta1;  // c1
  float beta2;            // b2
  float one_minus_beta2;  // c2
  float eps;
  float weight_decay;           // wd, for L2
  float lr_weight_decay;        // lwd, for AdamW
  float step_size;              // ss = lr / (1 - beta1^t), or lr
  float bias_correction2_sqrt;  // sb2 = sqrt(1 - beta2^t), or 1
  float inv_bias_correction2_sqrt;  // isb2 = 1 / sqrt(1 - beta2^t), or 1 (the SIMD paths)
  DecayMode decay;
};

#if defined(__CUDA_ARCH__)
STRATA_ADAM_HD static inline float AdamMul(float a, float b) {
  return __fmul_rn(a, b);
}
STRATA_ADAM_HD static inline float AdamAdd(float a, float b) {
  return __fadd_rn(a, b);
}
STRATA_ADAM_HD static inline float AdamSub(float a, float b) {
  return __fsub_rn(a, b);
}
STRATA_ADAM_HD static inline float AdamDiv(float a, float b) {
  return __fdiv_rn(a, b);
}
STRATA_ADAM_HD static inline float AdamSqrt(float a) {
  return __fsqrt_rn(a);
}
#else
STRATA_ADAM_HD static inline float AdamMul(float a, float b) {
  return a * b;
}
STRATA_ADAM_HD static inline float AdamAdd(float a, float b) {
  return a + b;
}
STRATA_ADAM_HD static inline float AdamSub(float a, float b) {
  return a - b;
}
STRATA_ADAM_HD static inline float AdamDiv(float a, float b) {
  return a / b;
}
STRATA_ADAM_HD static inline float AdamSqrt(float a) {
  return std::sqrt(a);
}
#endif

// One element, unfused: updates p, m, v in place. kDecay is s.decay, lifted to a template
// argument so the loop has no branch.
template <DecayMode kDecay>
STRATA_ADAM_HD static inline void AdamElementUnfused(const AdamStepScalars& s, float grad, float& p,
                                                     float& m, float& v) {
  float g = AdamMul(grad, s.grad_scale);
  if (kDecay == DecayMode::kL2) g = AdamAdd(AdamMul(s.weight_decay, p), g);
  if (kDecay == DecayMode::kDecoupled) p = AdamSub(p, AdamMul(s.lr_weight_decay, p));
  m = AdamAdd(AdamMul(s.beta1, m), AdamMul(s.one_minus_beta1, g));
  v = AdamAdd(AdamMul(s.beta2, v), AdamMul(AdamMul(s.one_minus_beta2, g), g));
  const float d = AdamAdd(AdamDiv(AdamSqrt(v), s.bias_correction2_sqrt), s.eps);
  p = AdamSub(p, AdamMul(s.step_size, AdamDiv(m, d)));
}

}  // namespace strata::optim::detail

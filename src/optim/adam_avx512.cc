// The AVX-512 CPU Adam kernel: 16 elements per vector, the tail with masked loads and stores
// (so every element goes through the very same instructions and the result does not depend on
// where a range starts or ends), the 16-bit copy converted in registers in the same pass.
// Compiled with -mavx512f -mavx512bw -mavx512vl; called only when the CPU has them.
//
// Only intrinsics and this file's own functions: nothing here may be an inline function that
// another translation unit also defines (adam_kernels.h explains why).
// GCC 12's AVX-512 intrinsics start from a deliberately self-initialised "undefined" vector
// (`__m512 __Y = __Y;` in avx512fintrin.h), which -W(maybe-)uninitialized reports at every
// inlined use; the warnings are false (GCC 13 fixed the headers) and would fail -Werror builds.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "optim/adam_kernels.h"

namespace strata::optim::detail {
namespace {

struct Vectors {
  __m512 gs, b1, c1, b2, c2, eps, wd, lwd, ss, isb2;
};

Vectors Broadcast(const AdamStepScalars& s) {
  return {_mm512_set1_ps(s.grad_scale),      _mm512_set1_ps(s.beta1),
          _mm512_set1_ps(s.one_minus_beta1), _mm512_set1_ps(s.beta2),
          _mm512_set1_ps(s.one_minus_beta2), _mm512_set1_ps(s.eps),
          _mm512_set1_ps(s.weight_decay),    _mm512_set1_ps(s.lr_weight_decay),
          _mm512_set1_ps(s.step_size),       _mm512_set1_ps(s.inv_bias_correction2_sqrt)};
}

// adam.h's arithmetic with every a * b + c fused.
template <DecayMode kDecay>
inline __attribute__((always_inline)) void Update(const Vectors& c, __m512 grad, __m512& p,
                                                  __m512& m, __m512& v) {
  __m512 g = _mm512_mul_ps(grad, c.gs);
  if constexpr (kDecay == DecayMode::kL2) g = _mm512_fmadd_ps(c.wd, p, g);
  if constexpr (kDecay == DecayMode::kDecoupled) p = _mm512_fnmadd_ps(c.lwd, p, p);
  m = _mm512_fmadd_ps(c.b1, m, _mm512_mul_ps(c.c1, g));
  v = _mm512_fmadd_ps(c.b2, v, _mm512_mul_ps(_mm512_mul_ps(c.c2, g), g));
  // sqrt(v) / sb2 + eps as one FMA with 1 / sb2: the divider, which also serves the square
  // root and m / d, is what bounds this loop on cores with slow 512-bit division.
  const __m512 d = _mm512_fmadd_ps(_mm512_sqrt_ps(v), c.isb2, c.eps);
  p = _mm512_fnmadd_ps(c.ss, _mm512_div_ps(m, d), p);
}

// fp32 -> bf16 bit patterns in the low 16 bits of each lane, as convert::FloatToBf16: add
// 0x7fff plus the lowest kept bit (round to nearest even), keep the high half; NaN keeps its
// sign and payload with the quiet bit set.
inline __attribute__((always_inline)) __m512i Bf16Lanes(__m512 p) {
  const __m512i u = _mm512_castps_si512(p);
  const __m512i high = _mm512_srli_epi32(u, 16);
  const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
}

// The F16C conversion rounds to nearest even, produces subnormals and quiets NaN exactly as
// convert::FloatToF16 does (tests/optim check it against that function).
constexpr int kF16Rounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// One full vector at index i. kStream: out16 + i is 32-byte aligned (16-bit out) or 64-byte
// aligned (fp32 out) and is written with a non-temporal store.
template <DecayMode kDecay, OutKind kOut, bool kStream>
inline __attribute__((always_inline)) void Full(const Vectors& c, const AdamKernelRange& r,
                                                size_t i) {
  PrefetchAdamInputs(r, i + kAdamPrefetchElements);
  __m512 p = _mm512_loadu_ps(r.master + i);
  __m512 m = _mm512_loadu_ps(r.m + i);
  __m512 v = _mm512_loadu_ps(r.v + i);
  Update<kDecay>(c, _mm512_loadu_ps(r.grad + i), p, m, v);
  _mm512_storeu_ps(r.master + i, p);
  _mm512_storeu_ps(r.m + i, m);
  _mm512_storeu_ps(r.v + i, v);
  if constexpr (kOut == OutKind::kBF16 || kOut == OutKind::kF16) {
    __m256i h;
    if constexpr (kOut == OutKind::kBF16) {
      h = _mm512_cvtepi32_epi16(Bf16Lanes(p));
    } else {
      h = _mm512_cvtps_ph(p, kF16Rounding);
    }
    auto* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(r.out16) + i);
    if constexpr (kStream) {
      _mm256_stream_si256(dst, h);
    } else {
      _mm256_storeu_si256(dst, h);
    }
  } else if constexpr (kOut == OutKind::kF32) {
    float* dst = static_cast<float*>(r.out16) + i;
    if constexpr (kStream) {
      _mm512_stream_ps(dst, p);
    } else {
      _mm512_storeu_ps(dst, p);
    }
  }
}

// count (< 16, > 0) elements at index i, through masked loads and stores.
template <DecayMode kDecay, OutKind kOut>
void Partial(const Vectors& c, const AdamKernelRange& r, size_t i, size_t count) {
  const auto mask = static_cast<__mmask16>((1u << count) - 1u);
  __m512 p = _mm512_maskz_loadu_ps(mask, r.master + i);
  __m512 m = _mm512_maskz_loadu_ps(mask, r.m + i);
  __m512 v = _mm512_maskz_loadu_ps(mask, r.v + i);
  Update<kDecay>(c, _mm512_maskz_loadu_ps(mask, r.grad + i), p, m, v);
  _mm512_mask_storeu_ps(r.master + i, mask, p);
  _mm512_mask_storeu_ps(r.m + i, mask, m);
  _mm512_mask_storeu_ps(r.v + i, mask, v);
  if constexpr (kOut == OutKind::kBF16) {
    _mm512_mask_cvtepi32_storeu_epi16(static_cast<uint16_t*>(r.out16) + i, mask, Bf16Lanes(p));
  } else if constexpr (kOut == OutKind::kF16) {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(r.out16) + i, mask,
                             _mm512_cvtps_ph(p, kF16Rounding));
  } else if constexpr (kOut == OutKind::kF32) {
    _mm512_mask_storeu_ps(static_cast<float*>(r.out16) + i, mask, p);
  }
}

template <DecayMode kDecay, OutKind kOut>
void Run(const AdamStepScalars& s, const AdamKernelRange& r) {
  const Vectors c = Broadcast(s);
  constexpr size_t kW = 16;
  size_t i = 0;
  bool stream = false;
  if constexpr (kOut != OutKind::kNone) {
    // Streaming stores want out16 aligned to a whole cache line: peel a head up to that.
    constexpr size_t kElemBytes = kOut == OutKind::kF32 ? 4 : 2;
    const auto addr = reinterpret_cast<uintptr_t>(r.out16);
    if (r.stream_out16 && addr % kElemBytes == 0) {
      size_t head = ((64 - addr % 64) % 64) / kElemBytes;
      if (head > r.n) head = r.n;
      while (i < head) {
        const size_t count = head - i < kW ? head - i : kW;
        if (count == kW) {
          Full<kDecay, kOut, false>(c, r, i);
        } else {
          Partial<kDecay, kOut>(c, r, i, count);
        }
        i += count;
      }
      stream = true;
    }
  }
  const size_t full_end = i + (r.n - i) / kW * kW;
  if (stream) {
    for (; i < full_end; i += kW)
      Full<kDecay, kOut, true>(c, r, i);
    _mm_sfence();  // order the streaming stores before whatever signals completion
  } else {
    for (; i < full_end; i += kW)
      Full<kDecay, kOut, false>(c, r, i);
  }
  if (i < r.n) Partial<kDecay, kOut>(c, r, i, r.n - i);
}

}  // namespace

void AdamKernelAvx512(const AdamStepScalars& s, const AdamKernelRange& r) {
  DispatchAdam(s.decay, r.out, [&]<DecayMode kDecay, OutKind kOut>() { Run<kDecay, kOut>(s, r); });
}

}  // namespace strata::optim::detail

// The AVX2 CPU Adam kernel: 8 elements per vector, FMA, the tail through masked loads and stores
// (so every element goes through the very same instructions as in the AVX-512 kernel, which
// gives the same bits), the 16-bit copy converted in registers in the same pass.
// Compiled with -mavx2 -mfma -mf16c; called only when the CPU has them.
//
// Only intrinsics and this file's own functions: nothing here may be an inline function that
// another translation unit also defines (adam_kernels.h explains why).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "optim/adam_kernels.h"

namespace strata::optim::detail {
namespace {

struct Vectors {
  __m256 gs, b1, c1, b2, c2, eps, wd, lwd, ss, isb2;
};

Vectors Broadcast(const AdamStepScalars& s) {
  return {_mm256_set1_ps(s.grad_scale),      _mm256_set1_ps(s.beta1),
          _mm256_set1_ps(s.one_minus_beta1), _mm256_set1_ps(s.beta2),
          _mm256_set1_ps(s.one_minus_beta2), _mm256_set1_ps(s.eps),
          _mm256_set1_ps(s.weight_decay),    _mm256_set1_ps(s.lr_weight_decay),
          _mm256_set1_ps(s.step_size),       _mm256_set1_ps(s.inv_bias_correction2_sqrt)};
}

// adam.h's arithmetic with every a * b + c fused (the same sequence as adam_avx512.cc).
template <DecayMode kDecay>
inline __attribute__((always_inline)) void Update(const Vectors& c, __m256 grad, __m256& p,
                                                  __m256& m, __m256& v) {
  __m256 g = _mm256_mul_ps(grad, c.gs);
  if constexpr (kDecay == DecayMode::kL2) g = _mm256_fmadd_ps(c.wd, p, g);
  if constexpr (kDecay == DecayMode::kDecoupled) p = _mm256_fnmadd_ps(c.lwd, p, p);
  m = _mm256_fmadd_ps(c.b1, m, _mm256_mul_ps(c.c1, g));
  v = _mm256_fmadd_ps(c.b2, v, _mm256_mul_ps(_mm256_mul_ps(c.c2, g), g));
  // sqrt(v) / sb2 + eps as one FMA with 1 / sb2: the divider, which also serves the square
  // root and m / d, is what bounds this loop on cores with slow 512-bit division.
  const __m256 d = _mm256_fmadd_ps(_mm256_sqrt_ps(v), c.isb2, c.eps);
  p = _mm256_fnmadd_ps(c.ss, _mm256_div_ps(m, d), p);
}

// fp32 -> 8 bf16 bit patterns, as convert::FloatToBf16 (see adam_avx512.cc).
inline __attribute__((always_inline)) __m128i Bf16(__m256 p) {
  const __m256i u = _mm256_castps_si256(p);
  const __m256i high = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
  const __m256i lanes =
      _mm256_blendv_epi8(rounded, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
  // Every lane is in [0, 0xffff], so the signed-to-unsigned saturating pack is exact.
  return _mm_packus_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
}

constexpr int kF16Rounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

template <OutKind kOut>
inline __attribute__((always_inline)) __m128i Convert16(__m256 p) {
  if constexpr (kOut == OutKind::kBF16) {
    return Bf16(p);
  } else {
    return _mm256_cvtps_ph(p, kF16Rounding);
  }
}

template <DecayMode kDecay, OutKind kOut, bool kStream>
inline __attribute__((always_inline)) void Full(const Vectors& c, const AdamKernelRange& r,
                                                size_t i) {
  PrefetchAdamInputs(r, i + kAdamPrefetchElements);
  __m256 p = _mm256_loadu_ps(r.master + i);
  __m256 m = _mm256_loadu_ps(r.m + i);
  __m256 v = _mm256_loadu_ps(r.v + i);
  Update<kDecay>(c, _mm256_loadu_ps(r.grad + i), p, m, v);
  _mm256_storeu_ps(r.master + i, p);
  _mm256_storeu_ps(r.m + i, m);
  _mm256_storeu_ps(r.v + i, v);
  if constexpr (kOut == OutKind::kBF16 || kOut == OutKind::kF16) {
    const __m128i h = Convert16<kOut>(p);
    auto* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(r.out16) + i);
    if constexpr (kStream) {
      _mm_stream_si128(dst, h);
    } else {
      _mm_storeu_si128(dst, h);
    }
  } else if constexpr (kOut == OutKind::kF32) {
    float* dst = static_cast<float*>(r.out16) + i;
    if constexpr (kStream) {
      _mm256_stream_ps(dst, p);
    } else {
      _mm256_storeu_ps(dst, p);
    }
  }
}

// count (< 8, > 0) elements at index i: masked fp32 loads and stores; the 16-bit copy goes
// through a small buffer (AVX2 has no masked 16-bit store).
template <DecayMode kDecay, OutKind kOut>
void Partial(const Vectors& c, const AdamKernelRange& r, size_t i, size_t count) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lane);
  __m256 p = _mm256_maskload_ps(r.master + i, mask);
  __m256 m = _mm256_maskload_ps(r.m + i, mask);
  __m256 v = _mm256_maskload_ps(r.v + i, mask);
  Update<kDecay>(c, _mm256_maskload_ps(r.grad + i, mask), p, m, v);
  _mm256_maskstore_ps(r.master + i, mask, p);
  _mm256_maskstore_ps(r.m + i, mask, m);
  _mm256_maskstore_ps(r.v + i, mask, v);
  if constexpr (kOut == OutKind::kBF16 || kOut == OutKind::kF16) {
    alignas(16) uint16_t buffer[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(buffer), Convert16<kOut>(p));
    uint16_t* dst = static_cast<uint16_t*>(r.out16) + i;
    for (size_t k = 0; k < count; ++k)
      dst[k] = buffer[k];
  } else if constexpr (kOut == OutKind::kF32) {
    _mm256_maskstore_ps(static_cast<float*>(r.out16) + i, mask, p);
  }
}

template <DecayMode kDecay, OutKind kOut>
void Run(const AdamStepScalars& s, const AdamKernelRange& r) {
  const Vectors c = Broadcast(s);
  constexpr size_t kW = 8;
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

void AdamKernelAvx2(const AdamStepScalars& s, const AdamKernelRange& r) {
  DispatchAdam(s.decay, r.out, [&]<DecayMode kDecay, OutKind kOut>() { Run<kDecay, kOut>(s, r); });
}

}  // namespace strata::optim::detail

// See adam_bench_kernels.h. Compiled with -O3 -march=native -fno-math-errno (the peer's best
// shot: the auto-vectoriser may use every instruction this machine has, and sqrt needs no errno
// path).
#include "adam_bench_kernels.h"

// GCC 12's AVX-512 headers trip -W(maybe-)uninitialized on their own "undefined" vectors (see
// src/optim/adam_avx512.cc); the warnings are false.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

#include <cmath>
#include <cstring>

namespace strata::bench {

void PeerAdamStep(const PeerAdamScalars& s, float* __restrict__ p, const float* __restrict__ g,
                  float* __restrict__ m, float* __restrict__ v, size_t n) {
  const float step_size = s.lr / s.bias_correction1;
  const float decay = 1.0f - s.lr * s.weight_decay;
  for (size_t i = 0; i < n; ++i) {
    const float gi = g[i];
    p[i] *= decay;
    m[i] = s.beta1 * m[i] + (1.0f - s.beta1) * gi;
    v[i] = s.beta2 * v[i] + (1.0f - s.beta2) * gi * gi;
    const float denom = std::sqrt(v[i]) / s.bias_correction2_sqrt + s.eps;
    p[i] -= step_size * m[i] / denom;
  }
}

// An empty asm that claims to change x: the compiler must keep the load and the store, and
// emits no instruction for it.
#define STRATA_OPAQUE(x) asm volatile("" : "+v"(x))

namespace {

template <bool kStreamState, bool kStreamOut16>
void Pass(float* p, const float* g, float* m, float* v, uint16_t* out16, size_t n) {
  size_t i = 0;
#if defined(__AVX512F__)
  constexpr size_t kW = 16;
  for (; i + kW <= n; i += kW) {
    __m512 vp = _mm512_loadu_ps(p + i);
    __m512 vg = _mm512_loadu_ps(g + i);
    __m512 vm = _mm512_loadu_ps(m + i);
    __m512 vv = _mm512_loadu_ps(v + i);
    STRATA_OPAQUE(vp);
    STRATA_OPAQUE(vg);
    STRATA_OPAQUE(vm);
    STRATA_OPAQUE(vv);
    if constexpr (kStreamState) {
      _mm512_stream_ps(p + i, vp);
      _mm512_stream_ps(m + i, vm);
      _mm512_stream_ps(v + i, vv);
    } else {
      _mm512_storeu_ps(p + i, vp);
      _mm512_storeu_ps(m + i, vm);
      _mm512_storeu_ps(v + i, vv);
    }
    if (out16 != nullptr) {
      const __m256i half = _mm512_castsi512_si256(_mm512_castps_si512(vp));
      if constexpr (kStreamOut16) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(out16 + i), half);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out16 + i), half);
      }
    }
  }
#elif defined(__AVX2__)
  constexpr size_t kW = 8;
  for (; i + kW <= n; i += kW) {
    __m256 vp = _mm256_loadu_ps(p + i);
    __m256 vg = _mm256_loadu_ps(g + i);
    __m256 vm = _mm256_loadu_ps(m + i);
    __m256 vv = _mm256_loadu_ps(v + i);
    STRATA_OPAQUE(vp);
    STRATA_OPAQUE(vg);
    STRATA_OPAQUE(vm);
    STRATA_OPAQUE(vv);
    if constexpr (kStreamState) {
      _mm256_stream_ps(p + i, vp);
      _mm256_stream_ps(m + i, vm);
      _mm256_stream_ps(v + i, vv);
    } else {
      _mm256_storeu_ps(p + i, vp);
      _mm256_storeu_ps(m + i, vm);
      _mm256_storeu_ps(v + i, vv);
    }
    if (out16 != nullptr) {
      const __m128i half = _mm256_castsi256_si128(_mm256_castps_si256(vp));
      if constexpr (kStreamOut16) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(out16 + i), half);
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out16 + i), half);
      }
    }
  }
#endif
  for (; i < n; ++i) {
    float a = p[i];
    float b = g[i];
    float c = m[i];
    float d = v[i];
    STRATA_OPAQUE(a);
    STRATA_OPAQUE(b);
    STRATA_OPAQUE(c);
    STRATA_OPAQUE(d);
    p[i] = a;
    m[i] = c;
    v[i] = d;
    if (out16 != nullptr) {
      uint32_t bits;
      std::memcpy(&bits, &a, sizeof(bits));
      out16[i] = static_cast<uint16_t>(bits);
    }
  }
  if constexpr (kStreamState || kStreamOut16) _mm_sfence();
}

}  // namespace

void CeilingPass(float* p, const float* g, float* m, float* v, uint16_t* out16, size_t n,
                 CeilingStores stores) {
  switch (stores) {
    case CeilingStores::kOrdinary:
      return Pass<false, false>(p, g, m, v, out16, n);
    case CeilingStores::kNonTemporal:
      return Pass<true, true>(p, g, m, v, out16, n);
    case CeilingStores::kNonTemporalOut16:
      return Pass<false, true>(p, g, m, v, out16, n);
  }
}

const char* CeilingIsa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "sse2";
#endif
}

}  // namespace strata::bench

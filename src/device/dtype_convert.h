// Scalar conversions between fp32 and the 16-bit formats (bf16, fp16), shared by the CPU device,
// the public FloatToBf16 / ... functions (device.cc) and the CUDA kernels (cuda_kernels.cu), so
// that the CPU device is a bit-exact oracle for the GPU one.
//
// C++17 and CUDA-compatible: nvcc compiles it as C++17 in device code, so it uses no C++20 and
// no Strata header. 16-bit values travel as their bit patterns (uint16_t).
//
// Contracts (both directions, all inputs):
//   - fp32 -> bf16 / fp16 rounds to nearest, ties to even; values beyond the format's range
//     become +-Inf (fp16: |x| >= 65520); fp16 subnormals are produced exactly.
//   - NaN stays NaN with its sign and the top bits of its payload, and is made quiet (the
//     quiet bit set), as x86's and NVIDIA's hardware conversions do. Inf stays Inf.
//   - bf16 / fp16 -> fp32 is exact (every bf16 and fp16 value is an fp32 value).
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define STRATA_HOST_DEVICE __host__ __device__
#else
#define STRATA_HOST_DEVICE
#endif

namespace strata::device::convert {

STRATA_HOST_DEVICE inline uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

STRATA_HOST_DEVICE inline float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// The one NaN that Scale and Axpy store, on every device: 0x7fffffff (sign clear, every payload
// bit set). NVIDIA's fp32 add and multiply return this canonical NaN whatever NaN went in, while
// x86 keeps the input NaN's sign and payload; applying this to every arithmetic result makes the
// backends agree bit for bit. Stored as bf16 it is 0x7fff, as fp16 0x7fff.
STRATA_HOST_DEVICE inline float CanonicalNaN(float r) {
  return r != r ? BitsFloat(0x7fffffffu) : r;
}

// QuantizeInt8's value for element v of a block with scale `scale` (max |x| / 127): v / scale
// in one IEEE division, rounded to nearest, ties to even (rintf in the default rounding mode, as
// on the GPU), within [-127, 127]. 0 for a zero (or NaN) scale and for a NaN element.
STRATA_HOST_DEVICE inline int8_t QuantizeToInt8(float v, float scale) {
  if (!(scale > 0.0f)) return 0;
  const float r = v / scale;
  if (r != r) return 0;
  const float clamped = r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r);
  return static_cast<int8_t>(rintf(clamped));
}

STRATA_HOST_DEVICE inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN: keep sign and payload, set quiet
  }
  // Adding 0x7fff plus the lowest kept bit rounds to nearest even; a carry out of the mantissa
  // moves into the exponent, which is also right (up to and including Inf).
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

STRATA_HOST_DEVICE inline float Bf16ToFloat(uint16_t h) {
  return BitsFloat(static_cast<uint32_t>(h) << 16);
}

STRATA_HOST_DEVICE inline uint16_t FloatToF16(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) {  // NaN: keep sign and the top 10 payload bits, set quiet
    return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  }
  if (a >= 0x477ff000u) {  // >= 65520 (halfway between 65504 and 2^16) or Inf
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (a >= 0x38800000u) {  // >= 2^-14: a normal fp16
    // Rebias the exponent (127 -> 15), then round away the low 13 mantissa bits to even; a carry
    // into the exponent is correct.
    a -= 112u << 23;
    a += 0x0fffu + ((a >> 13) & 1u);
    return static_cast<uint16_t>(sign | (a >> 13));
  }
  if (a <= 0x33000000u) {  // <= 2^-25: rounds to zero (2^-25 itself is a tie, and 0 is even)
    return static_cast<uint16_t>(sign);
  }
  // An fp16 subnormal: the value in units of 2^-24 is m * 2^(e - 126) for the fp32 exponent e
  // (103..112 here) and the 24-bit significand m, so shift by 126 - e (14..23) and round to even.
  const uint32_t e = a >> 23;
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u) != 0)) ++q;  // may become 0x400, the least normal
  return static_cast<uint16_t>(sign | q);
}

STRATA_HOST_DEVICE inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  uint32_t m = h & 0x3ffu;
  if (e == 0x1f) return BitsFloat(sign | 0x7f800000u | (m << 13));  // Inf, NaN (payload kept)
  if (e != 0) return BitsFloat(sign | ((e + 112u) << 23) | (m << 13));
  if (m == 0) return BitsFloat(sign);
  // Subnormal m * 2^-24: normalise so that the leading one lands on bit 10.
  uint32_t exponent = 113;  // fp32 biased exponent of 2^-14
  while ((m & 0x400u) == 0) {
    m <<= 1;
    --exponent;
  }
  return BitsFloat(sign | (exponent << 23) | ((m & 0x3ffu) << 13));
}

}  // namespace strata::device::convert

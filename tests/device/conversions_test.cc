// The scalar fp32 <-> bf16 / fp16 conversions (FloatToBf16, ...), checked against independent
// definitions: decoding against ldexp of the format's fields, encoding by round-to-nearest-even
// at every midpoint between neighbouring 16-bit values, exhaustively over all 65536 patterns.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "strata/device.h"

namespace strata::device {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// The value of a 16-bit pattern with `mantissa_bits` fraction bits and exponent bias `bias`,
// computed from its fields in double (Inf for the all-ones exponent; NaN is not asked for).
double Decode(uint16_t h, int mantissa_bits, int bias) {
  const int exponent_bits = 15 - mantissa_bits;
  const int e = (h >> mantissa_bits) & ((1 << exponent_bits) - 1);
  const int m = h & ((1 << mantissa_bits) - 1);
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (e == (1 << exponent_bits) - 1) return sign * HUGE_VAL;
  if (e == 0) return sign * std::ldexp(m, 1 - bias - mantissa_bits);
  return sign * std::ldexp(m + (1 << mantissa_bits), e - bias - mantissa_bits);
}
double DecodeBf16(uint16_t h) {
  return Decode(h, 7, 127);
}
double DecodeF16(uint16_t h) {
  return Decode(h, 10, 15);
}
bool IsNanBf16(uint16_t h) {
  return (h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0;
}
bool IsNanF16(uint16_t h) {
  return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0;
}

TEST(DTypeConvertTest, Bf16DecodesEveryPatternExactly) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<uint16_t>(i);
    const float f = Bf16ToFloat(h);
    if (IsNanBf16(h)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << i;
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << i;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), DecodeBf16(h)) << std::hex << i;
    ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << i;  // -0 stays -0
  }
}

TEST(DTypeConvertTest, F16DecodesEveryPatternExactly) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<uint16_t>(i);
    const float f = F16ToFloat(h);
    if (IsNanF16(h)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << i;
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << i;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), DecodeF16(h)) << std::hex << i;
    ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << i;
  }
}

TEST(DTypeConvertTest, Bf16RoundTripsEveryPattern) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<uint16_t>(i);
    // Signalling NaNs come back quiet (quiet bit 0x40 set), with sign and payload kept.
    const uint16_t expected = IsNanBf16(h) ? static_cast<uint16_t>(h | 0x40) : h;
    ASSERT_EQ(FloatToBf16(Bf16ToFloat(h)), expected) << std::hex << i;
  }
}

TEST(DTypeConvertTest, F16RoundTripsEveryPattern) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<uint16_t>(i);
    const uint16_t expected = IsNanF16(h) ? static_cast<uint16_t>(h | 0x200) : h;
    ASSERT_EQ(FloatToF16(F16ToFloat(h)), expected) << std::hex << i;
  }
}

// For each pair of neighbours (h, h + 1) among the non-negative finite values, the midpoint
// rounds to the even one of the two, and the floats just below and above it round down and up.
// The largest finite value's upper neighbour is Inf (the encoding after it), which is also where
// values past the midpoint go. Negative values mirror positive ones.
template <typename Encode, typename DecodeFn>
void CheckRoundToNearestEven(Encode encode, DecodeFn decode, uint16_t inf_pattern) {
  for (uint32_t i = 0; i < inf_pattern; ++i) {
    const auto lo = static_cast<uint16_t>(i);
    const auto hi = static_cast<uint16_t>(i + 1);
    const double a = decode(lo);
    // Inf's "value" for the midpoint is where the next binade would start.
    const double b = hi == inf_pattern ? 2 * a - decode(static_cast<uint16_t>(lo - 1)) : decode(hi);
    const auto mid = static_cast<float>((a + b) / 2);
    ASSERT_EQ(static_cast<double>(mid), (a + b) / 2) << "midpoint not exact at " << std::hex << i;
    const uint16_t even = (lo & 1) == 0 ? lo : hi;
    ASSERT_EQ(encode(mid), even) << std::hex << i;
    ASSERT_EQ(encode(std::nextafter(mid, 0.0f)), lo) << std::hex << i;
    ASSERT_EQ(encode(std::nextafter(mid, kInf)), hi) << std::hex << i;
    ASSERT_EQ(encode(static_cast<float>(a)), lo) << std::hex << i;
    ASSERT_EQ(encode(-mid), even | 0x8000) << std::hex << i;
    ASSERT_EQ(encode(-static_cast<float>(a)), lo | 0x8000) << std::hex << i;
  }
}

TEST(DTypeConvertTest, FloatToBf16RoundsToNearestEvenEverywhere) {
  CheckRoundToNearestEven(FloatToBf16, DecodeBf16, 0x7f80);
}

TEST(DTypeConvertTest, FloatToF16RoundsToNearestEvenEverywhere) {
  CheckRoundToNearestEven(FloatToF16, DecodeF16, 0x7c00);
}

TEST(DTypeConvertTest, SpecialValues) {
  // Inf and overflow
  EXPECT_EQ(FloatToBf16(kInf), 0x7f80);
  EXPECT_EQ(FloatToBf16(-kInf), 0xff80);
  EXPECT_EQ(FloatToBf16(FLT_MAX), 0x7f80);  // past bf16's largest finite + half an ulp
  EXPECT_EQ(FloatToF16(kInf), 0x7c00);
  EXPECT_EQ(FloatToF16(-kInf), 0xfc00);
  EXPECT_EQ(FloatToF16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(FloatToF16(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToF16(1e10f), 0x7c00);
  EXPECT_EQ(FloatToF16(-1e10f), 0xfc00);
  // NaN: quiet, sign and top payload bits kept
  EXPECT_EQ(FloatToBf16(FromBits(0x7fc00000u)), 0x7fc0);
  EXPECT_EQ(FloatToBf16(FromBits(0xffc00000u)), 0xffc0);
  EXPECT_EQ(FloatToBf16(FromBits(0x7f800001u)), 0x7fc0);  // signalling, payload below bf16's
  EXPECT_EQ(FloatToBf16(FromBits(0x7fa10000u)), 0x7fe1);
  EXPECT_EQ(FloatToF16(FromBits(0x7fc00000u)), 0x7e00);
  EXPECT_EQ(FloatToF16(FromBits(0xff800001u)), 0xfe00);
  EXPECT_EQ(FloatToF16(FromBits(0x7fa12345u)), 0x7e00 | (0x212345u >> 13));
  EXPECT_TRUE(std::isnan(F16ToFloat(0x7c01)));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(0xff81)));
  // Zeros and underflow
  EXPECT_EQ(FloatToF16(0.0f), 0x0000);
  EXPECT_EQ(FloatToF16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -24)), 0x0001);  // least fp16 subnormal
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -25)), 0x0000);  // tie with 0: even
  EXPECT_EQ(FloatToF16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(FloatToF16(-std::ldexp(1.0f, -26)), 0x8000);
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -14)), 0x0400);                          // least normal
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25)), 0x0400);  // rounds up
  EXPECT_EQ(FloatToF16(FLT_MIN), 0x0000);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(FloatToBf16(FromBits(0x00010000u)), 0x0001);  // fp32 subnormals exist in bf16
  EXPECT_EQ(Bf16ToFloat(0x0001), FromBits(0x00010000u));
  // Ordinary values
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16(-2.5f), 0xc020);
  EXPECT_EQ(FloatToF16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToF16(-2.5f), 0xc100);
  EXPECT_EQ(FloatToF16(0.1f), 0x2e66);
  EXPECT_EQ(F16ToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(Bits(Bf16ToFloat(0x8000)), 0x80000000u);
}

TEST(DTypeConvertTest, NamesAndSizes) {
  EXPECT_EQ(DTypeName(DType::kF32), "fp32");
  EXPECT_EQ(DTypeName(DType::kBF16), "bf16");
  EXPECT_EQ(DTypeName(DType::kF16), "fp16");
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(CopyKindName(CopyKind::kHostToDevice), "h2d");
  EXPECT_EQ(CopyKindName(CopyKind::kDeviceToHost), "d2h");
  EXPECT_EQ(CopyKindName(CopyKind::kDeviceToDevice), "d2d");
  EXPECT_EQ(DeviceTypeName(DeviceType::kCpu), "cpu");
  EXPECT_EQ(DeviceTypeName(DeviceType::kCuda), "cuda");
}

}  // namespace
}  // namespace strata::device

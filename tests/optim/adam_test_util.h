// Helpers shared by the Adam tests (adam_test.cc, device_adam_test.cc): a shard held in vectors,
// tricky test data, and bit-exact comparisons.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "optim/adam.h"
#include "strata/device.h"

namespace strata::optim::testing {

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// One shard's arrays. out16 holds n elements of out_dtype (as raw 16- or 32-bit words).
struct ShardData {
  std::vector<float> master, grad, m, v;
  std::vector<uint32_t> out;  // fp32 copy or 16-bit values (one per word, see Out16)
  std::vector<uint16_t> out16;
  device::DType out_dtype = device::DType::kBF16;
  bool with_out = false;

  size_t n() const { return master.size(); }

  // The shard view; out16 points at `out16` (16-bit types) or `out` (fp32) when with_out.
  AdamShard Shard() {
    AdamShard s{master.data(), grad.data(), m.data(), v.data(), master.size(), nullptr, out_dtype};
    if (with_out) {
      s.out16 = out_dtype == device::DType::kF32 ? static_cast<void*>(out.data())
                                                 : static_cast<void*>(out16.data());
    }
    return s;
  }

  void EnableOut(device::DType dtype) {
    with_out = true;
    out_dtype = dtype;
    out.assign(n(), 0xdeadbeefu);
    out16.assign(n(), 0xdeadu);
  }
};

// Gradients with the values that break careless kernels: zeros, tiny (down to fp32
// subnormals), huge (up to 1e18, whose square still fits fp32), both signs, and ordinary values
// over several decades.
inline float TrickyGrad(std::mt19937& rng, size_t i) {
  std::uniform_real_distribution<float> unit(0.5f, 1.0f);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> decade(-4.0f, 1.0f);
  const float sign = (rng() & 1) != 0 ? -1.0f : 1.0f;
  switch (i % 16) {
    case 0:
      return 0.0f;
    case 1:
      return sign * unit(rng) * 1e-20f;
    case 2:
      return sign * unit(rng) * 1e-38f;  // near FLT_MIN
    case 3:
      return sign * unit(rng) * 1e-42f;  // subnormal
    case 4:
      return sign * unit(rng) * 1e15f;
    case 5:
      return sign * unit(rng) * 1e18f;
    case 6:
      return -0.0f;
    default:
      return normal(rng) * std::pow(10.0f, decade(rng));
  }
}

// A shard of n elements. mid_training: m and v as after many steps (v >= 0, some zeros);
// otherwise zero as at step 1.
inline ShardData MakeShard(size_t n, uint32_t seed, bool mid_training) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> decade(-3.0f, 2.0f);
  std::uniform_real_distribution<float> factor(1.0f, 10.0f);
  ShardData d;
  d.master.resize(n);
  d.grad.resize(n);
  d.m.assign(n, 0.0f);
  d.v.assign(n, 0.0f);
  for (size_t i = 0; i < n; ++i) {
    d.master[i] = i % 23 == 0 ? 0.0f : normal(rng) * std::pow(10.0f, decade(rng));
    if (i % 29 == 5) d.master[i] = 3e-39f;  // a subnormal master weight
    d.grad[i] = TrickyGrad(rng, i + seed);
    if (mid_training && i % 7 != 0) {
      const float m = normal(rng) * std::pow(10.0f, decade(rng) - 2.0f);
      d.m[i] = m;
      d.v[i] = m * m * factor(rng);
    }
  }
  return d;
}

// New gradients for the next step of the same shard.
inline void NewGradients(ShardData& d, uint32_t seed) {
  std::mt19937 rng(seed);
  for (size_t i = 0; i < d.n(); ++i)
    d.grad[i] = TrickyGrad(rng, i + seed);
}

// Index of the first element whose bits differ, or -1. NaNs compare by bits too.
inline int64_t FirstBitDifference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (Bits(a[i]) != Bits(b[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

template <typename T>
int64_t FirstDifference(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

// Expects every array of `a` to equal `b`'s bit for bit.
inline void ExpectBitIdentical(const ShardData& a, const ShardData& b, const std::string& what) {
  EXPECT_EQ(FirstBitDifference(a.master, b.master), -1) << what << ": master";
  EXPECT_EQ(FirstBitDifference(a.m, b.m), -1) << what << ": m";
  EXPECT_EQ(FirstBitDifference(a.v, b.v), -1) << what << ": v";
  EXPECT_EQ(FirstDifference(a.out16, b.out16), -1) << what << ": out16";
  EXPECT_EQ(FirstDifference(a.out, b.out), -1) << what << ": out (fp32)";
}

}  // namespace strata::optim::testing

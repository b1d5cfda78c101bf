// CpuAdamStep against ReferenceAdamStepDouble, on every ISA this CPU supports; the ISAs and
// thread counts against each other; the fused 16-bit copy against the device conversions; the
// argument checks and the ISA selection.
//
// The tolerance against the double reference (ErrorBound below): for each of p, m, v the error
// may be twice a first-order bound of the fp32 rounding errors, i.e. a few units of 2^-24
// relative to the magnitudes of the terms that are summed (not to the result, which can cancel:
// m after a sign change of g is only as exact as b1 * m and c1 * g), plus a few fp32 subnormal
// ulps (2^-149) where values underflow. On ordinary data that is 2-4 ulps of the result.
// Between ISAs: AVX2 and AVX-512 must agree bit for bit (the same FMA sequence), the scalar path
// only within the same bound (it rounds each product; adam.h).
#include "optim/adam.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "device/device_test_util.h"
#include "optim/adam_test_util.h"
#include "strata/device.h"

namespace strata::optim {
namespace {

using testing::Bits;
using testing::FirstBitDifference;
using testing::FirstDifference;
using testing::FromBits;
using testing::MakeShard;
using testing::NewGradients;
using testing::ShardData;

constexpr double kU = 0x1p-24;      // fp32 unit roundoff
constexpr double kTiny = 0x1p-149;  // the fp32 subnormal ulp
constexpr double kSafety = 2.0;

struct Bounds {
  double p, m, v;
};

// A first-order bound of the fp32 rounding error of one element's step (inputs as before the
// step), following adam.h's evaluation: each rounded operation adds kU times the magnitude of
// its result, and errors propagate through the later operations. Loose by design; see the top.
Bounds ErrorBound(const AdamHyper& h, float p0, float grad, float m0, float v0) {
  const double t = static_cast<double>(h.step);
  const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, t) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, t) : 1.0;
  double g = static_cast<double>(grad) * h.grad_scale;
  double eg = 2 * kU * std::abs(g) + kTiny;
  double p = p0;
  double e_p = 0;
  double mag_p = std::abs(p0);
  if (h.weight_decay != 0) {
    const double d = h.weight_decay * p0;
    if (h.decoupled) {
      p = p0 - h.lr * d;
      mag_p = std::abs(p0) + std::abs(h.lr * d);
      e_p = 3 * kU * mag_p + kTiny;
    } else {
      eg += 3 * kU * (std::abs(d) + std::abs(g) + std::abs(g + d));
      g += d;
    }
  }
  const double ag = std::abs(g);
  const double m = h.beta1 * m0 + (1 - h.beta1) * g;
  const double e_m =
      3 * kU * (h.beta1 * std::abs(m0) + (1 - h.beta1) * ag) + (1 - h.beta1) * eg + 2 * kTiny;
  const double v = h.beta2 * v0 + (1 - h.beta2) * g * g;  // >= 0: no cancellation
  const double e_v = 4 * kU * v + 2 * (1 - h.beta2) * ag * eg + 2 * kTiny;
  const double s = std::sqrt(v / bc2);
  const double e_s = (v > 0 ? std::min(0.5 * e_v / std::sqrt(v), std::sqrt(e_v)) : std::sqrt(e_v)) /
                         std::sqrt(bc2) +
                     2 * kU * s;
  const double d = s + h.eps;
  const double e_d = e_s + kU * d + kU * h.eps;
  const double q = std::abs(m) / d;
  const double e_q = e_m / d + q * e_d / d + kU * q;
  const double step_size = h.lr / bc1;
  const double u = step_size * q;
  const double e_u = step_size * e_q + 2 * kU * u;
  const double p1 = p - step_size * m / d;
  const double e_p1 = e_p + e_u + kU * (mag_p + u) + kU * std::abs(p1);
  return {kSafety * e_p1 + kTiny, kSafety * (e_m + kU * std::abs(m)), kSafety * (e_v + kU * v)};
}

struct Case {
  std::string name;
  AdamHyper hyper;
  bool mid_training = false;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  AdamHyper h;
  h.lr = 1e-3;
  h.weight_decay = 0.01;
  cases.push_back({"adamw", h});
  h.weight_decay = 0.0;
  cases.push_back({"adamw_no_decay", h});
  h.weight_decay = 0.1;
  h.decoupled = false;
  cases.push_back({"adam_l2", h});
  h.bias_correction = false;
  cases.push_back({"adam_l2_no_bias_correction", h});
  h = AdamHyper{};
  h.lr = 3e-4;
  h.weight_decay = 0.05;
  h.grad_scale = 1.0 / 65536.0;
  h.step = 1000;
  cases.push_back({"adamw_scaled_mid_training", h, true});
  h = AdamHyper{};
  h.lr = 0.1;
  h.eps = 1e-6;
  h.beta1 = 0.5;
  h.beta2 = 0.9;
  h.bias_correction = false;
  h.step = 3;
  cases.push_back({"adamw_large_lr_no_bias_correction", h, true});
  return cases;
}

class AdamReferenceTest : public ::testing::TestWithParam<Case> {};

// Every supported ISA, several steps, sizes that are not multiples of any vector width: each
// step from the current state is within ErrorBound of the double reference from the same state.
TEST_P(AdamReferenceTest, EveryIsaIsWithinTheBoundOfTheDoubleReference) {
  const Case& c = GetParam();
  for (const Isa isa : SupportedIsas()) {
    for (const size_t n : {size_t{1}, size_t{5}, size_t{15}, size_t{16}, size_t{17}, size_t{31},
                           size_t{100}, size_t{1031}, size_t{4099}}) {
      SCOPED_TRACE(::testing::Message() << IsaName(isa) << ", n = " << n);
      ShardData data = MakeShard(n, static_cast<uint32_t>(n * 7 + 1), c.mid_training);
      AdamHyper h = c.hyper;
      double worst = 0;  // the largest error / bound seen
      for (int step = 0; step < 4; ++step, ++h.step) {
        if (step > 0) NewGradients(data, static_cast<uint32_t>(step * 1000 + n));
        ShardData ref = data;
        ReferenceAdamStepDouble(h, ref.Shard());
        const ShardData before = data;
        ASSERT_OK(CpuAdamStep(h, data.Shard(), CpuAdamOptions{isa, 1}));
        for (size_t i = 0; i < n; ++i) {
          const Bounds b =
              ErrorBound(h, before.master[i], before.grad[i], before.m[i], before.v[i]);
          const double ep = std::abs(static_cast<double>(data.master[i]) - ref.master[i]);
          const double em = std::abs(static_cast<double>(data.m[i]) - ref.m[i]);
          const double ev = std::abs(static_cast<double>(data.v[i]) - ref.v[i]);
          ASSERT_LE(ep, b.p) << "p at step " << h.step << ", element " << i << ": "
                             << data.master[i] << " vs " << ref.master[i] << " (grad "
                             << before.grad[i] << ")";
          ASSERT_LE(em, b.m) << "m at step " << h.step << ", element " << i << ": " << data.m[i]
                             << " vs " << ref.m[i];
          ASSERT_LE(ev, b.v) << "v at step " << h.step << ", element " << i << ": " << data.v[i]
                             << " vs " << ref.v[i];
          worst = std::max({worst, ep / b.p, em / b.m, ev / b.v});
        }
      }
      RecordProperty(
          std::string(IsaName(isa)) + "_n" + std::to_string(n) + "_worst_error_over_bound",
          std::to_string(worst));
    }
  }
}

// AVX2 and AVX-512 run the same FMA sequence: the same bits for every case, size and output.
TEST_P(AdamReferenceTest, Avx2AndAvx512GiveTheSameBits) {
  const std::vector<Isa> isas = SupportedIsas();
  if (isas.size() < 3) GTEST_SKIP() << "needs both AVX2 and AVX-512 (this CPU lacks one)";
  const Case& c = GetParam();
  for (const device::DType dtype :
       {device::DType::kBF16, device::DType::kF16, device::DType::kF32}) {
    for (const size_t n : {size_t{7}, size_t{33}, size_t{4099}}) {
      ShardData a = MakeShard(n, 99, c.mid_training);
      a.EnableOut(dtype);
      ShardData b = a;
      AdamHyper h = c.hyper;
      for (int step = 0; step < 3; ++step, ++h.step) {
        ASSERT_OK(CpuAdamStep(h, a.Shard(), CpuAdamOptions{Isa::kAvx2, 1}));
        ASSERT_OK(CpuAdamStep(h, b.Shard(), CpuAdamOptions{Isa::kAvx512, 1}));
        testing::ExpectBitIdentical(a, b, std::string("n = ") + std::to_string(n));
        NewGradients(a, 5 + step);
        NewGradients(b, 5 + step);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, AdamReferenceTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& param) {
                           return param.param.name;
                         });

// Threads only split the work: 2, 3 and 8 threads give the bits of 1 thread, with and without
// the fused copy, for every ISA (n large enough for 3+ chunks, not a multiple of anything).
TEST(AdamThreadsTest, MoreThreadsGiveTheBitsOfOneThread) {
  const size_t n = 4 * kAdamMinChunkElements + 12345;
  for (const Isa isa : SupportedIsas()) {
    for (const bool fused : {false, true}) {
      ShardData one = MakeShard(n, 3, true);
      if (fused) one.EnableOut(device::DType::kBF16);
      AdamHyper h;
      h.weight_decay = 0.01;
      h.step = 5;
      for (const int threads : {2, 3, 8}) {
        ShardData many = one;
        ShardData single = one;
        ASSERT_OK(CpuAdamStep(h, single.Shard(), CpuAdamOptions{isa, 1}));
        ASSERT_OK(CpuAdamStep(h, many.Shard(), CpuAdamOptions{isa, threads}));
        testing::ExpectBitIdentical(single, many,
                                    std::string(IsaName(isa)) + ", " + std::to_string(threads) +
                                        " threads" + (fused ? ", fused" : ""));
      }
    }
  }
}

// Several callers at once (as several CPU-device streams would call it) share the pool and
// each gets its own correct result.
TEST(AdamThreadsTest, ConcurrentCallersShareThePool) {
  const size_t n = 3 * kAdamMinChunkElements + 77;
  const Isa isa = BestIsa();
  ShardData original = MakeShard(n, 11, true);
  AdamHyper h;
  h.weight_decay = 0.02;
  ShardData expected = original;
  ASSERT_OK(CpuAdamStep(h, expected.Shard(), CpuAdamOptions{isa, 1}));
  std::vector<ShardData> copies(4, original);
  std::vector<Status> results(copies.size());
  std::vector<std::thread> callers;
  for (size_t k = 0; k < copies.size(); ++k) {
    callers.emplace_back([&, k] {
      for (int rep = 0; rep < 5 && results[k].ok(); ++rep) {
        ShardData work = original;
        results[k] = CpuAdamStep(h, work.Shard(), CpuAdamOptions{isa, 3});
        if (rep == 4) copies[k] = work;
      }
    });
  }
  for (std::thread& t : callers)
    t.join();
  for (size_t k = 0; k < copies.size(); ++k) {
    EXPECT_OK(results[k]);
    testing::ExpectBitIdentical(copies[k], expected, "caller " + std::to_string(k));
  }
}

// The fused copy is the device conversion of the updated master, bit for bit, for every ISA and
// 16-bit type, also when out16 is not aligned to anything but its element.
TEST(AdamFusedTest, OutputIsTheDeviceConversionOfTheUpdatedMaster) {
  for (const Isa isa : SupportedIsas()) {
    for (const device::DType dtype :
         {device::DType::kBF16, device::DType::kF16, device::DType::kF32}) {
      for (const size_t offset : {size_t{0}, size_t{1}, size_t{3}}) {
        const size_t n = 4099;
        ShardData data = MakeShard(n, 17, true);
        std::vector<uint32_t> storage(n + 8, 0);  // out16 starts `offset` elements in
        AdamShard shard = data.Shard();
        shard.out_dtype = dtype;
        const size_t elem = device::DTypeSize(dtype);
        shard.out16 = reinterpret_cast<char*>(storage.data()) + offset * elem;
        AdamHyper h;
        h.weight_decay = 0.1;
        ASSERT_OK(CpuAdamStep(h, shard, CpuAdamOptions{isa, 1}));
        for (size_t i = 0; i < n; ++i) {
          const float p = data.master[i];
          if (dtype == device::DType::kF32) {
            ASSERT_EQ(Bits(static_cast<const float*>(shard.out16)[i]), Bits(p)) << i;
          } else {
            const uint16_t expected =
                dtype == device::DType::kBF16 ? device::FloatToBf16(p) : device::FloatToF16(p);
            ASSERT_EQ(static_cast<const uint16_t*>(shard.out16)[i], expected)
                << IsaName(isa) << " " << device::DTypeName(dtype) << " offset " << offset
                << " element " << i << " value " << p;
          }
        }
        // Nothing outside the n elements was written.
        const auto* bytes = reinterpret_cast<const unsigned char*>(storage.data());
        for (size_t b = 0; b < storage.size() * 4; ++b) {
          if (b < offset * elem || b >= (offset + n) * elem) {
            ASSERT_EQ(bytes[b], 0) << b;
          }
        }
      }
    }
  }
}

// Fp32 values around every rounding decision of both 16-bit formats: each finite 16-bit value,
// the midpoint to its neighbour (a tie) and the fp32 values just either side of it, plus
// specials (signed zeros, subnormals, Inf, quiet and signalling NaNs with payloads, fp16's
// overflow threshold 65520) and random bit patterns.
std::vector<float> ConversionProbes() {
  std::vector<float> v;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const auto x = static_cast<uint16_t>(h);
    for (const bool bf16 : {true, false}) {
      const float a = bf16 ? device::Bf16ToFloat(x) : device::F16ToFloat(x);
      if (!std::isfinite(a)) continue;
      v.push_back(a);
      const float b = bf16 ? device::Bf16ToFloat(static_cast<uint16_t>(x + 1))
                           : device::F16ToFloat(static_cast<uint16_t>(x + 1));
      if (!std::isfinite(b) || (Bits(a) >> 31) != (Bits(b) >> 31)) continue;
      const float mid = static_cast<float>((static_cast<double>(a) + b) / 2);
      v.push_back(mid);
      v.push_back(std::nextafter(mid, -INFINITY));
      v.push_back(std::nextafter(mid, INFINITY));
    }
  }
  for (const uint32_t bits :
       {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x7f800000u, 0xff800000u, 0x7fc00000u,
        0xffc00001u, 0x7f800001u, 0xff812345u, 0x7fbfffffu, 0x477ff000u, 0x477fefffu, 0xc77ff000u,
        0x7f7fffffu, 0x33000000u, 0x33000001u, 0x32ffffffu}) {
    v.push_back(FromBits(bits));
  }
  std::mt19937 rng(1);
  for (int i = 0; i < 200000; ++i)
    v.push_back(FromBits(static_cast<uint32_t>(rng())));
  return v;
}

// With lr = 0, no decay and zero gradients the step leaves every master value as it is (a
// signalling NaN comes back quiet), so the copy shows each path's conversion of the probes.
TEST(AdamFusedTest, ConversionOfEveryRoundingCaseMatchesTheDevice) {
  const std::vector<float> probes = ConversionProbes();
  AdamHyper h;
  h.lr = 0.0;
  for (const Isa isa : SupportedIsas()) {
    for (const device::DType dtype :
         {device::DType::kBF16, device::DType::kF16, device::DType::kF32}) {
      ShardData data;
      data.master = probes;
      data.grad.assign(probes.size(), 0.0f);
      data.m.assign(probes.size(), 0.0f);
      data.v.assign(probes.size(), 0.0f);
      data.EnableOut(dtype);
      ASSERT_OK(CpuAdamStep(h, data.Shard(), CpuAdamOptions{isa, 2}));
      for (size_t i = 0; i < probes.size(); ++i) {
        const float p = data.master[i];
        if (!std::isnan(probes[i])) {
          ASSERT_EQ(Bits(p), Bits(probes[i])) << i;
        }
        switch (dtype) {
          case device::DType::kBF16:
            ASSERT_EQ(data.out16[i], device::FloatToBf16(p))
                << IsaName(isa) << " bf16 of 0x" << std::hex << Bits(p);
            break;
          case device::DType::kF16:
            ASSERT_EQ(data.out16[i], device::FloatToF16(p))
                << IsaName(isa) << " fp16 of 0x" << std::hex << Bits(p);
            break;
          case device::DType::kF32:
            ASSERT_EQ(data.out[i], Bits(p)) << i;
            break;
        }
      }
    }
  }
}

// Shards far beyond the last-level cache write the copy with streaming stores (after a peeled,
// unaligned head); the result is the same as the ordinary path's.
TEST(AdamFusedTest, LargeShardsStreamTheCopyWithTheSameResult) {
  const size_t n = (size_t{4} << 20) + 13;  // > 64 MiB of arrays: the streaming path
  ShardData data = MakeShard(n, 23, true);
  std::vector<uint16_t> storage(n + 1);
  AdamShard shard = data.Shard();
  shard.out16 = storage.data() + 1;  // 2 bytes past a 64-byte boundary at most
  AdamHyper h;
  h.weight_decay = 0.01;
  for (const Isa isa : SupportedIsas()) {
    if (isa == Isa::kScalar) continue;
    ShardData copy = data;
    AdamShard s = copy.Shard();
    s.out16 = shard.out16;
    ASSERT_OK(CpuAdamStep(h, s, CpuAdamOptions{isa, 2}));
    // The same step, 4099 elements at a time (far below the threshold: ordinary stores).
    ShardData pieces = data;
    pieces.EnableOut(device::DType::kBF16);
    for (size_t b = 0; b < n; b += 4099) {
      const size_t e = std::min(n, b + 4099);
      AdamShard piece{pieces.master.data() + b,
                      pieces.grad.data() + b,
                      pieces.m.data() + b,
                      pieces.v.data() + b,
                      e - b,
                      pieces.out16.data() + b,
                      device::DType::kBF16};
      ASSERT_OK(CpuAdamStep(h, piece, CpuAdamOptions{isa, 1}));
    }
    EXPECT_EQ(FirstBitDifference(copy.master, pieces.master), -1) << IsaName(isa);
    EXPECT_EQ(FirstBitDifference(copy.m, pieces.m), -1) << IsaName(isa);
    EXPECT_EQ(FirstBitDifference(copy.v, pieces.v), -1) << IsaName(isa);
    const std::vector<uint16_t> streamed(storage.begin() + 1, storage.end());
    EXPECT_EQ(FirstDifference(streamed, pieces.out16), -1) << IsaName(isa);
  }
}

TEST(AdamArgumentsTest, BadArgumentsAreInvalidArgument) {
  ShardData data = MakeShard(64, 1, false);
  const AdamShard good = data.Shard();
  const CpuAdamOptions options{Isa::kScalar, 1};
  auto code = [&](const AdamHyper& h, const AdamShard& s, const CpuAdamOptions& o) {
    return CpuAdamStep(h, s, o).code();
  };
  const StatusCode kInvalid = StatusCode::kInvalidArgument;
  AdamHyper h;
  EXPECT_OK(CpuAdamStep(h, good, options));
  for (auto mutate : std::vector<void (*)(AdamHyper&)>{
           [](AdamHyper& x) { x.step = 0; }, [](AdamHyper& x) { x.beta1 = 1.0; },
           [](AdamHyper& x) { x.beta1 = -0.1; }, [](AdamHyper& x) { x.beta2 = 1.5; },
           [](AdamHyper& x) { x.beta2 = NAN; }, [](AdamHyper& x) { x.eps = 0.0; },
           [](AdamHyper& x) { x.lr = -1e-3; }, [](AdamHyper& x) { x.lr = INFINITY; },
           [](AdamHyper& x) { x.weight_decay = -0.1; }, [](AdamHyper& x) { x.weight_decay = NAN; },
           [](AdamHyper& x) { x.grad_scale = -1; },
           [](AdamHyper& x) { x.grad_scale = INFINITY; }}) {
    AdamHyper bad;
    mutate(bad);
    EXPECT_EQ(code(bad, good, options), kInvalid);
  }
  for (auto mutate : std::vector<void (*)(AdamShard&)>{
           [](AdamShard& s) { s.master = nullptr; }, [](AdamShard& s) { s.grad = nullptr; },
           [](AdamShard& s) { s.m = nullptr; }, [](AdamShard& s) { s.v = nullptr; },
           [](AdamShard& s) { s.v = s.m + 1; },            // v overlaps m
           [](AdamShard& s) { s.out16 = s.master + 10; },  // out16 overlaps master
           [](AdamShard& s) {
             s.out16 = s.m;  // any address; the dtype is what is wrong
             s.out_dtype = static_cast<device::DType>(7);
           }}) {
    AdamShard bad = good;
    mutate(bad);
    EXPECT_EQ(code(h, bad, options), kInvalid);
  }
  EXPECT_EQ(code(h, good, CpuAdamOptions{Isa::kScalar, 0}), kInvalid);
  EXPECT_EQ(code(h, good, CpuAdamOptions{Isa::kScalar, -2}), kInvalid);
  for (const Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    const std::vector<Isa> supported = SupportedIsas();
    if (std::find(supported.begin(), supported.end(), isa) == supported.end()) {
      EXPECT_EQ(code(h, good, CpuAdamOptions{isa, 1}), kInvalid) << IsaName(isa);
    }
  }
  // The message names the offending value.
  AdamHyper bad_beta;
  bad_beta.beta1 = 1.0;
  EXPECT_NE(CpuAdamStep(bad_beta, good, options).message().find("beta1"), std::string::npos);
  // An empty shard needs no arrays.
  EXPECT_OK(CpuAdamStep(h, AdamShard{}, options));
}

TEST(AdamIsaTest, NamesAndSelection) {
  EXPECT_EQ(IsaName(Isa::kScalar), "scalar");
  EXPECT_EQ(IsaName(Isa::kAvx2), "avx2");
  EXPECT_EQ(IsaName(Isa::kAvx512), "avx512");
  const std::vector<Isa> supported = SupportedIsas();
  ASSERT_FALSE(supported.empty());
  EXPECT_EQ(supported.front(), Isa::kScalar);

  const char* saved = std::getenv("STRATA_ADAM_ISA");
  const std::string saved_value = saved != nullptr ? saved : "";
  unsetenv("STRATA_ADAM_ISA");
  EXPECT_EQ(BestIsa(), supported.back());
  setenv("STRATA_ADAM_ISA", "scalar", 1);
  EXPECT_EQ(BestIsa(), Isa::kScalar);
  setenv("STRATA_ADAM_ISA", "avx9000", 1);  // ignored with a warning
  EXPECT_EQ(BestIsa(), supported.back());
  for (const Isa isa : supported) {
    setenv("STRATA_ADAM_ISA", std::string(IsaName(isa)).c_str(), 1);
    EXPECT_EQ(BestIsa(), isa);
  }
  if (saved != nullptr) {
    setenv("STRATA_ADAM_ISA", saved_value.c_str(), 1);
  } else {
    unsetenv("STRATA_ADAM_ISA");
  }
}

}  // namespace
}  // namespace strata::optim

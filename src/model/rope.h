// Rotary position embeddings: the frequencies a model's config asks for, as transformers computes
// them (modeling_rope_utils.py), shared by the CPU ops and the CUDA kernels (a plain struct passed
// by value, and one function compiled for both).
//
// For pair i < head_dim / 2 of a head the angle at position p is
// p * RopeInvFreq(theta, scaling, i, head_dim), and cos and sin are multiplied by
// scaling.attention_factor (YaRN's; 1 otherwise). The types:
//   kDefault  theta^(-2i / head_dim)
//   kLinear   the default divided by `factor`
//   kLlama3   Llama 3.1's: wavelengths above original_max / low_freq_factor divided by `factor`,
//             below original_max / high_freq_factor kept, a smooth blend in between
//   kYarn     a blend of the default (extrapolation) and the default / factor (interpolation), by
//             a linear ramp over the pairs from `yarn_low` to `yarn_high` (the correction range,
//             computed from beta_fast, beta_slow and original_max when the config is read)
// transformers' "dynamic" type is the default at every position below max_position_embeddings,
// the longest sequence Strata runs, so it is read as kDefault (llama_config.cc).
// Everything is computed in double and rounded to float once, as the ops' tables are.
#pragma once

#include <cmath>
#include <cstddef>

#if defined(__CUDACC__)
#define STRATA_ROPE_HOST_DEVICE __host__ __device__
#else
#define STRATA_ROPE_HOST_DEVICE
#endif

namespace strata::model {

// The scaling of a config's RoPE (its base, rope_theta, is kept beside it in LlamaConfig).
struct RopeScaling {
  enum Kind : int { kDefault = 0, kLinear = 1, kLlama3 = 2, kYarn = 3 };
  int kind = kDefault;
  double factor = 1.0;
  // kLlama3.
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max = 0.0;  // original_max_position_embeddings
  // kYarn: the correction range (pairs), already clamped.
  double yarn_low = 0.0;
  double yarn_high = 0.0;
  double attention_factor = 1.0;

  // C++17: nvcc compiles the CUDA ops (which include this header) as C++17.
  friend bool operator==(const RopeScaling& a, const RopeScaling& b) {
    return a.kind == b.kind && a.factor == b.factor && a.low_freq_factor == b.low_freq_factor &&
           a.high_freq_factor == b.high_freq_factor && a.original_max == b.original_max &&
           a.yarn_low == b.yarn_low && a.yarn_high == b.yarn_high &&
           a.attention_factor == b.attention_factor;
  }
  friend bool operator!=(const RopeScaling& a, const RopeScaling& b) { return !(a == b); }
};

STRATA_ROPE_HOST_DEVICE inline double RopeInvFreq(double theta, const RopeScaling& r, size_t i,
                                                  size_t head_dim) {
  const double base = pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
  switch (r.kind) {
    case RopeScaling::kLinear:
      return base / r.factor;
    case RopeScaling::kLlama3: {
      const double pi = 3.14159265358979323846;
      const double wavelen = 2.0 * pi / base;
      const double low_freq_wavelen = r.original_max / r.low_freq_factor;
      const double high_freq_wavelen = r.original_max / r.high_freq_factor;
      if (wavelen > low_freq_wavelen) return base / r.factor;
      if (wavelen < high_freq_wavelen) return base;
      const double smooth = (r.original_max / wavelen - r.low_freq_factor) /
                            (r.high_freq_factor - r.low_freq_factor);
      return (1.0 - smooth) * base / r.factor + smooth * base;
    }
    case RopeScaling::kYarn: {
      const double high = r.yarn_high == r.yarn_low ? r.yarn_high + 0.001 : r.yarn_high;
      double ramp = (static_cast<double>(i) - r.yarn_low) / (high - r.yarn_low);
      ramp = ramp < 0.0 ? 0.0 : ramp > 1.0 ? 1.0 : ramp;
      const double extrapolation = 1.0 - ramp;
      return base / r.factor * (1.0 - extrapolation) + base * extrapolation;
    }
    default:
      return base;
  }
}

}  // namespace strata::model

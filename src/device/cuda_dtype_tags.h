// Element-type tags for CUDA kernels (include from .cu files only): Load reads a stored element
// as fp32, Store writes fp32 back, rounding to nearest even (device/dtype_convert.h). Kernels
// are templated on a tag and dispatched on a device::DType at launch.
#pragma once

#include <cstdint>

#include "device/dtype_convert.h"

namespace strata::device::cuda_tags {

struct F32 {
  using T = float;
  __device__ static float Load(T v) { return v; }
  __device__ static T Store(float f) { return f; }
};
struct BF16 {
  using T = uint16_t;
  __device__ static float Load(T v) { return convert::Bf16ToFloat(v); }
  __device__ static T Store(float f) { return convert::FloatToBf16(f); }
};
struct F16 {
  using T = uint16_t;
  __device__ static float Load(T v) { return convert::F16ToFloat(v); }
  __device__ static T Store(float f) { return convert::FloatToF16(f); }
};

}  // namespace strata::device::cuda_tags

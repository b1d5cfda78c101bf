// What the CUDA op files share (cuda_ops.cu, cuda_attention_tc.cu): error
// helpers, activation element types, warp reductions, the 16-bit attention kernels' dispatch and
// rounding, and their entry points. Included only by .cu files (nvcc, C++17).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <type_traits>

#include "device/dtype_convert.h"
#include "model/cuda_ops.h"

namespace strata::model::cuda::detail {

// ---- errors -------------------------------------------------------------------------------------

inline OpError CudaResult(cudaError_t err, const char* what, const char* op) {
  if (err == cudaSuccess) return OpError{};
  return OpError{ErrorSource::kCuda, static_cast<int>(err), what, op};
}

inline OpError ArgumentError(const char* why, const char* op) {
  return OpError{ErrorSource::kArgument, 0, why, op};
}

// The launch error of the kernel just enqueued.
inline OpError LaunchResult(const char* op) {
  return CudaResult(cudaGetLastError(), "kernel launch", op);
}

// Allows `kernel` `bytes` of dynamic shared memory (above the 48 KiB default).
template <typename Kernel>
OpError AllowSharedMemory(Kernel kernel, size_t bytes, const char* op) {
  return CudaResult(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(bytes)),
                    "cudaFuncSetAttribute", op);
}

// ---- activations --------------------------------------------------------------------------------

// An activation's element type in a kernel: float, __nv_bfloat16 or __half (cuda_ops.h: Act).
// ActLoad widens exactly; ActStore rounds to nearest, ties to even. Both use
// device/dtype_convert.h's conversions, bit for bit those of the CPU device (NaN included) and
// of the weights' tags (device/cuda_dtype_tags.h); for float both are the identity.
__device__ inline float ActLoad(float x) {
  return x;
}
__device__ inline float ActLoad(__nv_bfloat16 x) {
  return ::strata::device::convert::Bf16ToFloat(__bfloat16_as_ushort(x));
}
__device__ inline float ActLoad(__half x) {
  return ::strata::device::convert::F16ToFloat(__half_as_ushort(x));
}
template <typename A>
__device__ inline A ActStore(float x);
template <>
__device__ inline float ActStore<float>(float x) {
  return x;
}
template <>
__device__ inline __nv_bfloat16 ActStore<__nv_bfloat16>(float x) {
  return __ushort_as_bfloat16(::strata::device::convert::FloatToBf16(x));
}
template <>
__device__ inline __half ActStore<__half>(float x) {
  return __ushort_as_half(::strata::device::convert::FloatToF16(x));
}

// Calls fn(A{}) with the element type A of an activation dtype; false (and no call) for a dtype
// that is none of them.
template <typename Fn>
bool DispatchAct(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32:
      fn(float{});
      return true;
    case DType::kBF16:
      fn(__nv_bfloat16{});
      return true;
    case DType::kF16:
      fn(__half{});
      return true;
  }
  return false;
}

// ---- warp reductions ----------------------------------------------------------------------------

// The sum over the warp. A butterfly: every lane ends with the same bits (each step adds the
// same two values, and fp addition is commutative), so branches on the result stay uniform.
template <typename T>
__device__ inline T WarpSum(T v) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ inline float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// ---- tensor-core attention (cuda_attention_tc.cu) -----------------------------------------------

// Rounding to a 16-bit storage dtype (to nearest, ties to even).
template <typename T>
__device__ inline T Round16(float x);
template <>
__device__ inline __nv_bfloat16 Round16<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ inline __half Round16<__half>(float x) {
  return __float2half_rn(x);
}

// Calls fn(T{}, std::integral_constant<int, D>{}) for a 16-bit dtype (bf16: __nv_bfloat16, fp16:
// __half) and head_dim D of 64 or 128; false (and no call) for any other pair.
template <typename Fn>
bool DispatchAttention16(DType dtype, size_t head_dim, Fn&& fn) {
  if (head_dim != 64 && head_dim != 128) return false;
  if (dtype != DType::kBF16 && dtype != DType::kF16) return false;
  auto with_dim = [&](auto tag) {
    if (head_dim == 64) {
      fn(tag, std::integral_constant<int, 64>{});
    } else {
      fn(tag, std::integral_constant<int, 128>{});
    }
  };
  if (dtype == DType::kBF16) {
    with_dim(__nv_bfloat16{});
  } else {
    with_dim(__half{});
  }
  return true;
}

// The shape of one attention call, as AttentionForward takes it.
struct AttentionShape {
  size_t batch, seq, num_heads, num_kv_heads, head_dim;
  size_t group;      // query heads per kv head
  size_t q_stride;   // num_heads * head_dim
  size_t kv_stride;  // num_kv_heads * head_dim
  float scale;       // 1 / sqrt(head_dim)
};

// Whether the tiled kernels take this shape in `dtype` (kBF16 or kF16): head_dim 64 or 128, and
// a grid that fits CUDA's limits.
bool TensorCoreAttentionSupports(DType dtype, const AttentionShape& shape);

// As AttentionForward / AttentionBackward, with q, k, v, dout (and the probabilities and dS)
// rounded to `dtype` for the tensor cores. The activations (q, k, v, out, dout, dq, dk, dv) are of
// dtype `act`: kF32, or `dtype` itself (kArgument otherwise); outputs are stored in it, rounded
// once. lse is fp32; `delta` is device scratch of batch * num_heads * seq floats.
OpError TensorCoreAttentionForward(cudaStream_t stream, DType dtype, DType act,
                                   const AttentionShape& shape, const void* q, const void* k,
                                   const void* v, void* out, float* lse);
OpError TensorCoreAttentionBackward(cudaStream_t stream, DType dtype, DType act,
                                    const AttentionShape& shape, const void* q, const void* k,
                                    const void* v, const void* out, const float* lse,
                                    const void* dout, float* delta, void* dq, void* dk, void* dv);

}  // namespace strata::model::cuda::detail

// Causal grouped-query attention from cuDNN's fused SDPA graphs (flash attention), through the
// header-only cuDNN frontend in its dynamic-loading mode: cuDNN is found at run time
// (cudnn_loader.h), never linked. cuda_ops.cu calls these for 16-bit attention when cuDNN is
// there and the shape is one it takes; otherwise its own kernels run.
//
// C++17, no CUDA or cuDNN header (nvcc includes this from cuda_ops.cu). The frontend lives in
// cuda_cudnn_attention.cc alone (host compiler; about 100 s and 2 GB to compile), built when
// CMake found its headers (deploy/cudnn-frontend.sh); otherwise cuda_cudnn_attention_none.cc
// answers "not built".
//
// Layout (that of cuda::AttentionForward, in 16 bits): q and o [batch * seq, heads * head_dim],
// k and v [batch * seq, kv_heads * head_dim], all bf16 or fp16; stats [batch, heads, seq] fp32,
// the natural-log log-sum-exp of each row of the scaled, masked scores (cuda::AttentionForward's
// lse). dq, dk, dv as q, k, v; dk and dv summed over the query heads of each kv head.
// The backward runs cuDNN's deterministic algorithm (no atomics), as every op of cuda_ops.h.
//
// Graphs are built per shape by Prepare (the model calls it at set-up) and cached in the engine;
// a call with a shape not prepared builds it then. An engine is used by one thread at a time (that
// of its OpsContext).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "model/cuda_ops.h"

namespace strata::model::cuda::detail {

struct SdpaShape {
  int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  DType dtype = DType::kBF16;  // kBF16 or kF16
  float scale = 0;             // 1 / sqrt(head_dim)
};

inline bool operator==(const SdpaShape& a, const SdpaShape& b) {
  return a.batch == b.batch && a.seq == b.seq && a.heads == b.heads && a.kv_heads == b.kv_heads &&
         a.head_dim == b.head_dim && a.dtype == b.dtype && a.scale == b.scale;
}

class CudnnSdpa;

// Whether this build has the cuDNN path at all.
bool CudnnSdpaBuilt();

// An engine on `stream` (a cudaStream_t) of the current device: loads cuDNN (once per process),
// checks the GPU (sm_80 or newer), creates a cuDNN handle. nullptr with *why when any of that
// fails (not built, no cuDNN found, an older GPU).
CudnnSdpa* CudnnSdpaCreate(void* stream, std::string* why);
void CudnnSdpaDestroy(CudnnSdpa* engine);
// "cuDNN 9.19.0 (/path/libcudnn.so.9)": what the engine runs on, for messages and reports.
std::string CudnnSdpaDescription(const CudnnSdpa* engine);

// Logs `message` at warn level, once per distinct message (for cuda_ops.cu, which has no logger).
void CudnnSdpaNote(const std::string& message);

// Builds the forward and backward graphs of `shape` unless built; false with *why when cuDNN
// cannot run it (the caller then uses its own kernels for this shape). *forward_bytes and
// *backward_bytes: the device workspace each call needs.
bool CudnnSdpaPrepare(CudnnSdpa* engine, const SdpaShape& shape, size_t* forward_bytes,
                      size_t* backward_bytes, std::string* why);

// The graphs of a prepared shape, enqueued on the engine's stream. `workspace`: at least the
// bytes Prepare reported (nullptr when 0).
OpError CudnnSdpaForward(CudnnSdpa* engine, const SdpaShape& shape, const void* q, const void* k,
                         const void* v, void* o, float* stats, void* workspace);
OpError CudnnSdpaBackward(CudnnSdpa* engine, const SdpaShape& shape, const void* q, const void* k,
                          const void* v, const void* o, const void* dout, const float* stats,
                          void* dq, void* dk, void* dv, void* workspace);

}  // namespace strata::model::cuda::detail

// The Llama decoder's CUDA kernels (see cuda_ops.h for the contracts).
//
// Layout of this file: helpers (errors, dtype tags, reductions), the context (cuBLAS handle,
// workspace, data-error record), then one section per op mirroring cpu_ops.cc. Arithmetic is
// fp32, sums included (block-tree reductions); only the per-call RoPE angle table is computed in
// double. Where the CPU op rounds every fp32 operation of an element-wise op, the kernel does too
// (__fmul_rn and friends: nvcc would otherwise fuse a * b + c), so those agree to the last bit.
//
// Activations: each kernel is a template on the activations' element type A (float,
// __nv_bfloat16, __half; cuda_ops_internal.cuh), launched for the call's dtype (DispatchAct). It
// widens what it loads (ActLoad), computes in fp32 as above and rounds what it stores once
// (ActStore); with A = float both are the identity, so the fp32 kernels do what they did before
// activations had a dtype.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "device/cuda_dtype_tags.h"
#include "device/dtype_convert.h"
#include "model/cuda_cudnn_attention.h"
#include "model/cuda_ops.h"
#include "model/cuda_ops_internal.cuh"

namespace strata::model::cuda {
namespace {

namespace convert = ::strata::device::convert;

constexpr unsigned kBlockThreads = 256;
constexpr unsigned kWarpsPerBlock = kBlockThreads / 32;
// Grid-stride loops need only enough blocks to fill the GPU a few times over.
constexpr size_t kMaxBlocks = 4096;
// Attention kernels: one warp per row, four warps per block.
constexpr unsigned kAttentionWarps = 4;

unsigned GridFor(size_t n) {
  return static_cast<unsigned>(std::min(kMaxBlocks, (n + kBlockThreads - 1) / kBlockThreads));
}

size_t AlignUp(size_t n) {
  return (n + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

bool IsKnown(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

bool FitsInt(size_t n) {
  return n <= static_cast<size_t>(INT_MAX);
}

// ---- errors -------------------------------------------------------------------------------------

using detail::ArgumentError;
using detail::CudaResult;
using detail::LaunchResult;

OpError CublasResult(cublasStatus_t status, const char* what, const char* op) {
  if (status == CUBLAS_STATUS_SUCCESS) return OpError{};
  return OpError{ErrorSource::kCublas, static_cast<int>(status), what, op};
}

// ---- dtype tags ---------------------------------------------------------------------------------

using ::strata::device::cuda_tags::BF16;
using ::strata::device::cuda_tags::F16;
using ::strata::device::cuda_tags::F32;

// Calls fn(tag) with the tag of `dtype`, then returns the launch error of what fn enqueued.
template <typename Fn>
OpError ForWeightDType(DType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case DType::kF32:
      fn(F32{});
      return LaunchResult(op);
    case DType::kBF16:
      fn(BF16{});
      return LaunchResult(op);
    case DType::kF16:
      fn(F16{});
      return LaunchResult(op);
  }
  return ArgumentError("unknown weight dtype", op);
}

// ---- activation dtypes --------------------------------------------------------------------------

using detail::ActLoad;
using detail::ActStore;
using detail::DispatchAct;

size_t ActSize(DType dtype) {
  return dtype == DType::kF32 ? sizeof(float) : 2;
}

// The one dtype of a call's activations, in *dtype; kArgument when one is unknown or they differ.
OpError CommonActDType(std::initializer_list<DType> dtypes, const char* op, DType* dtype) {
  *dtype = *dtypes.begin();
  for (const DType d : dtypes) {
    if (!IsKnown(d)) return ArgumentError("unknown activation dtype", op);
    if (d != *dtype) return ArgumentError("activations of mixed dtypes", op);
  }
  return OpError{};
}

// Calls fn(A{}) with the element type of activation dtype `dtype`, then returns the launch error
// of what fn enqueued.
template <typename Fn>
OpError ForActDType(DType dtype, const char* op, Fn&& fn) {
  if (!DispatchAct(dtype, fn)) return ArgumentError("unknown activation dtype", op);
  return LaunchResult(op);
}

// ---- device helpers -----------------------------------------------------------------------------

__device__ inline size_t FirstIndex() {
  return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline size_t GridStride() {
  return static_cast<size_t>(gridDim.x) * blockDim.x;
}

using detail::WarpMax;
using detail::WarpSum;

// The sum over a kBlockThreads block, the same in every thread and the same on every run.
// `scratch` holds kWarpsPerBlock values; the call synchronizes the block (twice).
template <typename T>
__device__ T BlockSum(T v, T* scratch) {
  v = WarpSum(v);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  T total = scratch[0];
  for (unsigned w = 1; w < kWarpsPerBlock; ++w)
    total += scratch[w];
  __syncthreads();  // `scratch` may be reused at once
  return total;
}

__device__ float BlockMax(float v, float* scratch) {
  v = WarpMax(v);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float total = scratch[0];
  for (unsigned w = 1; w < kWarpsPerBlock; ++w)
    total = fmaxf(total, scratch[w]);
  __syncthreads();
  return total;
}

// Device-side twin of DataError (plain ints for atomicCAS).
struct DeviceDataError {
  int kind;
  int position;
  int value;
  int bound;
};
static_assert(sizeof(DeviceDataError) == sizeof(DataError), "DataError layout");

// Keeps the first error recorded since the last TakeDataError.
__device__ void RecordDataError(DeviceDataError* record, DataErrorKind kind, size_t position,
                                int32_t value, size_t bound) {
  if (atomicCAS(&record->kind, 0, static_cast<int>(kind)) == 0) {
    record->position = static_cast<int>(position);
    record->value = value;
    record->bound = static_cast<int>(bound);
  }
}

}  // namespace

// ---- cuBLAS handle ------------------------------------------------------------------------------

// Owns one cuBLAS handle.
class CublasHandle {
 public:
  CublasHandle() = default;
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  ~CublasHandle() {
    if (handle_ != nullptr) (void)cublasDestroy(handle_);
  }

  // Creates the handle on the current device, bound to `stream`, with plain fp32 math (no TF32
  // for fp32 GEMMs). Names the failing call in `*what`.
  cublasStatus_t Create(cudaStream_t stream, const char** what) {
    *what = "cublasCreate";
    cublasStatus_t status = cublasCreate(&handle_);
    if (status != CUBLAS_STATUS_SUCCESS) {
      handle_ = nullptr;
      return status;
    }
    *what = "cublasSetStream";
    status = cublasSetStream(handle_, stream);
    if (status != CUBLAS_STATUS_SUCCESS) return status;
    *what = "cublasSetMathMode";
    return cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH);
  }

  cublasHandle_t get() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

// ---- context ------------------------------------------------------------------------------------

struct OpsContext {
  cudaStream_t stream = nullptr;
  CublasHandle cublas;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  bool external_workspace = false;  // the caller's (UseWorkspace): never freed or grown here
  DeviceDataError* data_error = nullptr;
  std::vector<cudaEvent_t> marks;  // the profile's events (timing on); the first used_marks recorded
  size_t used_marks = 0;
  // cuDNN's fused attention (cuda_cudnn_attention.h), created on first use; null when it is not
  // available (sdpa_tried then says it was looked for).
  detail::CudnnSdpa* sdpa = nullptr;
  bool sdpa_tried = false;
  // The shapes asked of cuDNN, and what each needs (ok false: the context's own kernels run).
  struct SdpaPlan {
    detail::SdpaShape shape;
    bool ok = false;
    size_t forward_bytes = 0, backward_bytes = 0;
  };
  std::vector<SdpaPlan> sdpa_plans;
};

void OpsContextDeleter::operator()(OpsContext* context) const {
  if (context == nullptr) return;
  (void)cudaStreamSynchronize(context->stream);
  detail::CudnnSdpaDestroy(context->sdpa);
  for (cudaEvent_t e : context->marks) (void)cudaEventDestroy(e);
  if (!context->external_workspace) (void)cudaFree(context->workspace);
  (void)cudaFree(context->data_error);
  delete context;
}

OpError CreateOpsContext(void* stream, OpsContextPtr* out) {
  constexpr const char* kOp = "CreateOpsContext";
  OpsContextPtr context(new OpsContext);
  context->stream = static_cast<cudaStream_t>(stream);
  const char* what = "";
  const cublasStatus_t status = context->cublas.Create(context->stream, &what);
  OpError error = CublasResult(status, what, kOp);
  if (!error.ok()) return error;
  error = CudaResult(cudaMalloc(&context->data_error, sizeof(DeviceDataError)), "cudaMalloc", kOp);
  if (!error.ok()) return error;
  error =
      CudaResult(cudaMemsetAsync(context->data_error, 0, sizeof(DeviceDataError), context->stream),
                 "cudaMemsetAsync", kOp);
  if (!error.ok()) return error;
  *out = std::move(context);
  return OpError{};
}

OpError RecordMark(OpsContext* context) {
  constexpr const char* kOp = "RecordMark";
  if (context->used_marks == context->marks.size()) {
    cudaEvent_t e = nullptr;
    OpError error = CudaResult(cudaEventCreate(&e), "cudaEventCreate", kOp);
    if (!error.ok()) return error;
    context->marks.push_back(e);
  }
  return CudaResult(cudaEventRecord(context->marks[context->used_marks++], context->stream),
                    "cudaEventRecord", kOp);
}

OpError TakeMarks(OpsContext* context, std::vector<double>* seconds) {
  constexpr const char* kOp = "TakeMarks";
  seconds->clear();
  const size_t n = std::exchange(context->used_marks, 0);
  if (n == 0) return OpError{};
  OpError error =
      CudaResult(cudaEventSynchronize(context->marks[n - 1]), "cudaEventSynchronize", kOp);
  if (!error.ok()) return error;
  seconds->reserve(n);
  for (size_t i = 0; i < n; ++i) {
    float ms = 0.0f;
    error = CudaResult(cudaEventElapsedTime(&ms, context->marks[0], context->marks[i]),
                       "cudaEventElapsedTime", kOp);
    if (!error.ok()) return error;
    seconds->push_back(static_cast<double>(ms) * 1e-3);
  }
  return OpError{};
}

namespace {

OpError Reserve(OpsContext* context, size_t bytes, const char* op) {
  if (bytes <= context->workspace_bytes) return OpError{};
  if (context->external_workspace) {
    return ArgumentError("the workspace given by UseWorkspace is too small for this call", op);
  }
  // Kernels enqueued earlier may still use the old block.
  OpError error = CudaResult(cudaStreamSynchronize(context->stream), "cudaStreamSynchronize", op);
  if (!error.ok()) return error;
  error = CudaResult(cudaFree(context->workspace), "cudaFree", op);
  context->workspace = nullptr;
  context->workspace_bytes = 0;
  if (!error.ok()) return error;
  constexpr size_t kGranule = size_t{1} << 20;  // fewer regrowths for slowly growing requests
  const size_t rounded = (bytes + kGranule - 1) / kGranule * kGranule;
  error = CudaResult(cudaMalloc(&context->workspace, rounded), "cudaMalloc", op);
  if (!error.ok()) {
    context->workspace = nullptr;
    return error;
  }
  context->workspace_bytes = rounded;
  return OpError{};
}

// Carves consecutive aligned pieces out of the context's workspace (after Reserve).
class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(OpsContext* context) : base_(static_cast<char*>(context->workspace)) {}
  template <typename T>
  T* Take(size_t count) {
    T* p = reinterpret_cast<T*>(base_ + offset_);
    offset_ += AlignUp(count * sizeof(T));
    return p;
  }

 private:
  char* base_;
  size_t offset_ = 0;
};

}  // namespace

OpError ReserveWorkspace(OpsContext* context, size_t bytes) {
  return Reserve(context, bytes, "ReserveWorkspace");
}

OpError SetTf32(OpsContext* context, bool allow) {
  return CublasResult(cublasSetMathMode(context->cublas.get(),
                                        allow ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH),
                      "cublasSetMathMode", "SetTf32");
}

OpError UseWorkspace(OpsContext* context, void* workspace, size_t bytes) {
  constexpr const char* kOp = "UseWorkspace";
  if (workspace == nullptr || bytes == 0) return ArgumentError("an empty workspace", kOp);
  if (!context->external_workspace && context->workspace != nullptr) {
    OpError error =
        CudaResult(cudaStreamSynchronize(context->stream), "cudaStreamSynchronize", kOp);
    if (!error.ok()) return error;
    error = CudaResult(cudaFree(context->workspace), "cudaFree", kOp);
    if (!error.ok()) return error;
  }
  context->workspace = workspace;
  context->workspace_bytes = bytes;
  context->external_workspace = true;
  return OpError{};
}

OpError TakeDataError(OpsContext* context, DataError* out) {
  constexpr const char* kOp = "TakeDataError";
  DeviceDataError record{};
  OpError error = CudaResult(cudaMemcpyAsync(&record, context->data_error, sizeof(record),
                                             cudaMemcpyDeviceToHost, context->stream),
                             "cudaMemcpyAsync", kOp);
  if (!error.ok()) return error;
  error = CudaResult(cudaStreamSynchronize(context->stream), "cudaStreamSynchronize", kOp);
  if (!error.ok()) return error;
  error =
      CudaResult(cudaMemsetAsync(context->data_error, 0, sizeof(DeviceDataError), context->stream),
                 "cudaMemsetAsync", kOp);
  if (!error.ok()) return error;
  out->kind = static_cast<DataErrorKind>(record.kind);
  out->position = record.position;
  out->value = record.value;
  out->bound = record.bound;
  return OpError{};
}

// ---- Embedding ----------------------------------------------------------------------------------

namespace {

// The weight holds rows [vocab_begin, vocab_begin + vocab). With `shard` (tensor parallelism)
// a token outside them is another rank's: a zero row, not an error.
template <typename E, typename A>
__global__ void EmbeddingForwardKernel(const int32_t* __restrict__ tokens, size_t num_tokens,
                                       const typename E::T* __restrict__ weight, size_t vocab_begin,
                                       size_t vocab, size_t hidden, A* __restrict__ out, bool shard,
                                       DeviceDataError* record) {
  const size_t n = num_tokens * hidden;
  for (size_t idx = FirstIndex(); idx < n; idx += GridStride()) {
    const size_t t = idx / hidden;
    const size_t i = idx - t * hidden;
    const int64_t row = static_cast<int64_t>(tokens[t]) - static_cast<int64_t>(vocab_begin);
    if (row < 0 || static_cast<size_t>(row) >= vocab) {
      if (i == 0 && !shard) RecordDataError(record, DataErrorKind::kToken, t, tokens[t], vocab);
      out[idx] = ActStore<A>(0.0f);
      continue;
    }
    out[idx] = ActStore<A>(E::Load(weight[static_cast<size_t>(row) * hidden + i]));
  }
}

// One block per position t. The block that holds the first occurrence of a token id owns its
// row of dweight: it collects the positions holding that id in ascending order (a block-wide
// ordered compaction, kBlockThreads positions at a time) and adds their rows of dout in that
// order, which is the CPU's order. Blocks for later occurrences do nothing, so no two blocks
// write one row and no atomics are needed.
// dweight holds rows [vocab_begin, vocab_begin + vocab); with `shard` a token outside them is
// another rank's and adds nothing here.
template <typename A>
__global__ void EmbeddingBackwardKernel(const int32_t* __restrict__ tokens, size_t num_tokens,
                                        const A* __restrict__ dout, size_t vocab_begin,
                                        size_t vocab, size_t hidden, float* __restrict__ dweight,
                                        int32_t skip_token, bool shard, DeviceDataError* record) {
  __shared__ size_t matches[kBlockThreads];
  __shared__ unsigned warp_counts[kWarpsPerBlock];
  const size_t t = blockIdx.x;
  const int32_t token = tokens[t];
  const int64_t own = static_cast<int64_t>(token) - static_cast<int64_t>(vocab_begin);
  if (own < 0 || static_cast<size_t>(own) >= vocab) {  // uniform over the block
    if (threadIdx.x == 0 && !shard) RecordDataError(record, DataErrorKind::kToken, t, token, vocab);
    return;
  }
  if (token == skip_token) return;  // padding_idx: uniform over the block
  bool earlier = false;
  for (size_t u = threadIdx.x; u < t; u += blockDim.x)
    earlier = earlier || tokens[u] == token;
  if (__syncthreads_or(earlier)) return;

  float* row = dweight + static_cast<size_t>(own) * hidden;
  const unsigned lane = threadIdx.x & 31;
  const unsigned warp = threadIdx.x / 32;
  for (size_t base = t; base < num_tokens; base += blockDim.x) {
    const size_t u = base + threadIdx.x;
    const bool match = u < num_tokens && tokens[u] == token;
    const unsigned ballot = __ballot_sync(0xffffffffu, match);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    unsigned offset = 0, total = 0;
    for (unsigned w = 0; w < kWarpsPerBlock; ++w) {
      if (w < warp) offset += warp_counts[w];
      total += warp_counts[w];
    }
    if (match) matches[offset + __popc(ballot & ((1u << lane) - 1u))] = u;
    __syncthreads();
    if (total > 0) {
      for (size_t i = threadIdx.x; i < hidden; i += blockDim.x) {
        float acc = row[i];
        for (unsigned m = 0; m < total; ++m)
          acc = __fadd_rn(acc, ActLoad(dout[matches[m] * hidden + i]));
        row[i] = acc;
      }
    }
    __syncthreads();  // before `matches` and `warp_counts` are overwritten
  }
}

// Both embedding forwards (shard: EmbeddingForwardKernel's).
OpError LaunchEmbeddingForward(OpsContext* context, const int32_t* tokens, size_t num_tokens,
                               Weight weight, size_t vocab_begin, size_t vocab, size_t hidden,
                               Act out, bool shard, const char* op) {
  if (!IsKnown(out.dtype)) return ArgumentError("unknown activation dtype", op);
  if (num_tokens == 0 || hidden == 0) return OpError{};
  return ForWeightDType(weight.dtype, op, [&](auto tag) {
    using E = decltype(tag);
    DispatchAct(out.dtype, [&](auto a) {
      using A = decltype(a);
      EmbeddingForwardKernel<E, A>
          <<<GridFor(num_tokens * hidden), kBlockThreads, 0, context->stream>>>(
              tokens, num_tokens, static_cast<const typename E::T*>(weight.data), vocab_begin,
              vocab, hidden, static_cast<A*>(out.data), shard, context->data_error);
    });
  });
}

// Both embedding backwards (shard: EmbeddingBackwardKernel's).
OpError LaunchEmbeddingBackward(OpsContext* context, const int32_t* tokens, size_t num_tokens,
                                CAct dout, size_t vocab_begin, size_t vocab, size_t hidden,
                                float* dweight, int32_t skip_token, bool shard, const char* op) {
  if (!IsKnown(dout.dtype)) return ArgumentError("unknown activation dtype", op);
  if (num_tokens == 0 || hidden == 0) return OpError{};
  if (!FitsInt(num_tokens)) return ArgumentError("more than 2^31 - 1 tokens", op);
  return ForActDType(dout.dtype, op, [&](auto a) {
    using A = decltype(a);
    EmbeddingBackwardKernel<A>
        <<<static_cast<unsigned>(num_tokens), kBlockThreads, 0, context->stream>>>(
            tokens, num_tokens, static_cast<const A*>(dout.data), vocab_begin, vocab, hidden,
            dweight, skip_token, shard, context->data_error);
  });
}

}  // namespace

OpError EmbeddingForward(OpsContext* context, const int32_t* tokens, size_t num_tokens,
                         Weight weight, size_t vocab, size_t hidden, Act out) {
  return LaunchEmbeddingForward(context, tokens, num_tokens, weight, 0, vocab, hidden, out, false,
                                "EmbeddingForward");
}

OpError ShardEmbeddingForward(OpsContext* context, const int32_t* tokens, size_t num_tokens,
                              Weight weight, size_t vocab_begin, size_t vocab, size_t hidden,
                              Act out) {
  return LaunchEmbeddingForward(context, tokens, num_tokens, weight, vocab_begin, vocab, hidden,
                                out, true, "ShardEmbeddingForward");
}

OpError EmbeddingBackward(OpsContext* context, const int32_t* tokens, size_t num_tokens, CAct dout,
                          size_t vocab, size_t hidden, float* dweight, int32_t skip_token) {
  return LaunchEmbeddingBackward(context, tokens, num_tokens, dout, 0, vocab, hidden, dweight,
                                 skip_token, false, "EmbeddingBackward");
}

OpError ShardEmbeddingBackward(OpsContext* context, const int32_t* tokens, size_t num_tokens,
                               CAct dout, size_t vocab_begin, size_t vocab, size_t hidden,
                               float* dweight, int32_t skip_token) {
  return LaunchEmbeddingBackward(context, tokens, num_tokens, dout, vocab_begin, vocab, hidden,
                                 dweight, skip_token, true, "ShardEmbeddingBackward");
}

// ---- RMSNorm ------------------------------------------------------------------------------------

namespace {

// The rest of a row's RMSNorm once its sum of squares is known (every thread has it): its rstd
// (stored by thread 0) and y = x * rstd * w, each element read, then written, by one thread.
template <typename E, typename A>
__device__ __forceinline__ void NormalizeRow(const A* xr, float sum_sq,
                                             const typename E::T* __restrict__ weight,
                                             size_t hidden, float eps, A* yr, float* rstd) {
  const float r = rsqrtf(sum_sq / static_cast<float>(hidden) + eps);
  if (threadIdx.x == 0) *rstd = r;
  for (size_t i = threadIdx.x; i < hidden; i += blockDim.x)
    yr[i] = ActStore<A>(__fmul_rn(__fmul_rn(ActLoad(xr[i]), r), E::Load(weight[i])));
}

// One block per token row. y may alias x: each element is read, then written, by one thread.
template <typename E, typename A>
__global__ void RmsNormForwardKernel(const A* x, const typename E::T* __restrict__ weight,
                                     size_t hidden, float eps, A* y, float* __restrict__ rstd) {
  __shared__ float scratch[kWarpsPerBlock];
  const size_t t = blockIdx.x;
  const A* xr = x + t * hidden;
  float sum_sq = 0.0f;
  for (size_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = ActLoad(xr[i]);
    sum_sq += v * v;
  }
  NormalizeRow<E>(xr, BlockSum(sum_sq, scratch), weight, hidden, eps, y + t * hidden, rstd + t);
}

// sum = a + b, then RmsNormForwardKernel's work on sum as stored; one block per row. sum may
// alias a or b: each element is read, then written, by one thread, which reads it back later.
template <typename E, typename A>
__global__ void ResidualRmsNormForwardKernel(const A* a, const A* b,
                                             const typename E::T* __restrict__ weight,
                                             size_t hidden, float eps, A* sum, A* __restrict__ y,
                                             float* __restrict__ rstd) {
  __shared__ float scratch[kWarpsPerBlock];
  const size_t t = blockIdx.x;
  const A* ar = a + t * hidden;
  const A* br = b + t * hidden;
  A* sr = sum + t * hidden;
  float sum_sq = 0.0f;
  for (size_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const A stored = ActStore<A>(__fadd_rn(ActLoad(ar[i]), ActLoad(br[i])));
    sr[i] = stored;
    const float v = ActLoad(stored);
    sum_sq += v * v;
  }
  NormalizeRow<E>(sr, BlockSum(sum_sq, scratch), weight, hidden, eps, y + t * hidden, rstd + t);
}

// dx_j = r w_j dy_j - x_j r^3 / H * sum_i dy_i w_i x_i (+ residual_j with kResidual), one block
// per row (dx may alias dy: the sum is complete before any dx is written).
template <typename E, typename A, bool kResidual>
__global__ void RmsNormBackwardKernel(const A* __restrict__ x,
                                      const typename E::T* __restrict__ weight,
                                      const float* __restrict__ rstd, const A* dy, size_t hidden,
                                      A* dx, const A* __restrict__ residual) {
  __shared__ float scratch[kWarpsPerBlock];
  const size_t t = blockIdx.x;
  const A* xr = x + t * hidden;
  const A* dyr = dy + t * hidden;
  const float r = rstd[t];
  float dot = 0.0f;
  for (size_t i = threadIdx.x; i < hidden; i += blockDim.x)
    dot += ActLoad(dyr[i]) * E::Load(weight[i]) * ActLoad(xr[i]);
  dot = BlockSum(dot, scratch);
  const float coef = dot * r * r * r / static_cast<float>(hidden);
  A* dxr = dx + t * hidden;
  for (size_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float w = E::Load(weight[i]);
    float g =
        __fsub_rn(__fmul_rn(__fmul_rn(r, w), ActLoad(dyr[i])), __fmul_rn(ActLoad(xr[i]), coef));
    if constexpr (kResidual) g = __fadd_rn(g, ActLoad(residual[t * hidden + i]));
    dxr[i] = ActStore<A>(g);
  }
}

// partial[c, i] = sum over rows t of chunk c of dy[t, i] x[t, i] rstd[t].
template <typename A>
__global__ void RmsNormWeightPartialKernel(const A* __restrict__ x, const float* __restrict__ rstd,
                                           const A* __restrict__ dy, size_t num_tokens,
                                           size_t hidden, float* __restrict__ partial) {
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= hidden) return;
  const size_t chunk = blockIdx.y;
  const size_t begin = chunk * kRmsNormRowsPerPartial;
  const size_t end =
      num_tokens - begin < kRmsNormRowsPerPartial ? num_tokens : begin + kRmsNormRowsPerPartial;
  float acc = 0.0f;
  for (size_t t = begin; t < end; ++t) {
    acc = __fadd_rn(
        acc,
        __fmul_rn(__fmul_rn(ActLoad(dy[t * hidden + i]), ActLoad(x[t * hidden + i])), rstd[t]));
  }
  partial[chunk * hidden + i] = acc;
}

// dweight[i] += sum over chunks of partial[c, i], in chunk order.
__global__ void RmsNormWeightReduceKernel(const float* __restrict__ partial, size_t chunks,
                                          size_t hidden, float* __restrict__ dweight) {
  for (size_t i = FirstIndex(); i < hidden; i += GridStride()) {
    float acc = 0.0f;
    for (size_t c = 0; c < chunks; ++c)
      acc = __fadd_rn(acc, partial[c * hidden + i]);
    dweight[i] = __fadd_rn(dweight[i], acc);
  }
}

}  // namespace

OpError RmsNormForward(OpsContext* context, CAct x, Weight weight, size_t num_tokens, size_t hidden,
                       float eps, Act y, float* rstd) {
  constexpr const char* kOp = "RmsNormForward";
  DType act = DType::kF32;
  OpError error = CommonActDType({x.dtype, y.dtype}, kOp, &act);
  if (!error.ok()) return error;
  if (num_tokens == 0) return OpError{};
  if (!FitsInt(num_tokens)) return ArgumentError("more than 2^31 - 1 tokens", kOp);
  return ForWeightDType(weight.dtype, kOp, [&](auto tag) {
    using E = decltype(tag);
    DispatchAct(act, [&](auto a) {
      using A = decltype(a);
      RmsNormForwardKernel<E, A>
          <<<static_cast<unsigned>(num_tokens), kBlockThreads, 0, context->stream>>>(
              static_cast<const A*>(x.data), static_cast<const typename E::T*>(weight.data), hidden,
              eps, static_cast<A*>(y.data), rstd);
    });
  });
}

OpError ResidualRmsNormForward(OpsContext* context, CAct a, CAct b, Weight weight,
                               size_t num_tokens, size_t hidden, float eps, Act sum, Act y,
                               float* rstd) {
  constexpr const char* kOp = "ResidualRmsNormForward";
  DType act = DType::kF32;
  OpError error = CommonActDType({a.dtype, b.dtype, sum.dtype, y.dtype}, kOp, &act);
  if (!error.ok()) return error;
  if (num_tokens == 0) return OpError{};
  if (!FitsInt(num_tokens)) return ArgumentError("more than 2^31 - 1 tokens", kOp);
  return ForWeightDType(weight.dtype, kOp, [&](auto tag) {
    using E = decltype(tag);
    DispatchAct(act, [&](auto z) {
      using A = decltype(z);
      ResidualRmsNormForwardKernel<E, A>
          <<<static_cast<unsigned>(num_tokens), kBlockThreads, 0, context->stream>>>(
              static_cast<const A*>(a.data), static_cast<const A*>(b.data),
              static_cast<const typename E::T*>(weight.data), hidden, eps,
              static_cast<A*>(sum.data), static_cast<A*>(y.data), rstd);
    });
  });
}

namespace {

// RmsNormBackward, and with a residual RmsNormResidualBackward.
OpError RmsNormBackwardOf(OpsContext* context, CAct x, Weight weight, const float* rstd, CAct dy,
                          const CAct* residual, size_t num_tokens, size_t hidden, Act dx,
                          float* dweight, const char* op) {
  if (!IsKnown(weight.dtype)) return ArgumentError("unknown weight dtype", op);
  DType act = DType::kF32;
  OpError error = residual != nullptr
                      ? CommonActDType({x.dtype, dy.dtype, residual->dtype, dx.dtype}, op, &act)
                      : CommonActDType({x.dtype, dy.dtype, dx.dtype}, op, &act);
  if (!error.ok()) return error;
  if (num_tokens == 0 || hidden == 0) return OpError{};
  if (!FitsInt(num_tokens)) return ArgumentError("more than 2^31 - 1 tokens", op);
  // The weight gradient first: dx may alias dy.
  if (dweight != nullptr) {
    const size_t chunks = (num_tokens + kRmsNormRowsPerPartial - 1) / kRmsNormRowsPerPartial;
    if (chunks > 65535) return ArgumentError("too many tokens for one call", op);
    error = Reserve(context, chunks * hidden * sizeof(float), op);
    if (!error.ok()) return error;
    float* partial = WorkspaceCarver(context).Take<float>(chunks * hidden);
    const dim3 grid(static_cast<unsigned>((hidden + kBlockThreads - 1) / kBlockThreads),
                    static_cast<unsigned>(chunks));
    error = ForActDType(act, op, [&](auto a) {
      using A = decltype(a);
      RmsNormWeightPartialKernel<A><<<grid, kBlockThreads, 0, context->stream>>>(
          static_cast<const A*>(x.data), rstd, static_cast<const A*>(dy.data), num_tokens, hidden,
          partial);
    });
    if (!error.ok()) return error;
    RmsNormWeightReduceKernel<<<GridFor(hidden), kBlockThreads, 0, context->stream>>>(
        partial, chunks, hidden, dweight);
    error = LaunchResult(op);
    if (!error.ok()) return error;
  }
  return ForWeightDType(weight.dtype, op, [&](auto tag) {
    using E = decltype(tag);
    DispatchAct(act, [&](auto a) {
      using A = decltype(a);
      const dim3 grid(static_cast<unsigned>(num_tokens));
      const auto* x_a = static_cast<const A*>(x.data);
      const auto* w = static_cast<const typename E::T*>(weight.data);
      const auto* dy_a = static_cast<const A*>(dy.data);
      if (residual != nullptr) {
        RmsNormBackwardKernel<E, A, true><<<grid, kBlockThreads, 0, context->stream>>>(
            x_a, w, rstd, dy_a, hidden, static_cast<A*>(dx.data),
            static_cast<const A*>(residual->data));
      } else {
        RmsNormBackwardKernel<E, A, false><<<grid, kBlockThreads, 0, context->stream>>>(
            x_a, w, rstd, dy_a, hidden, static_cast<A*>(dx.data), nullptr);
      }
    });
  });
}

}  // namespace

OpError RmsNormBackward(OpsContext* context, CAct x, Weight weight, const float* rstd, CAct dy,
                        size_t num_tokens, size_t hidden, Act dx, float* dweight) {
  return RmsNormBackwardOf(context, x, weight, rstd, dy, nullptr, num_tokens, hidden, dx, dweight,
                           "RmsNormBackward");
}

OpError RmsNormResidualBackward(OpsContext* context, CAct x, Weight weight, const float* rstd,
                                CAct dy, CAct residual, size_t num_tokens, size_t hidden, Act dx,
                                float* dweight) {
  return RmsNormBackwardOf(context, x, weight, rstd, dy, &residual, num_tokens, hidden, dx, dweight,
                           "RmsNormResidualBackward");
}

// ---- Linear -------------------------------------------------------------------------------------
//
// cuBLAS is column-major; a row-major [r, c] matrix is a column-major [c, r] one. So
//   y[T, out] = x[T, in] W[out, in]^T   is   y^T = W^T' ... i.e. C[out, T] = op(A) B with
//   A = W (seen as [in, out], transposed), B = x (seen as [in, T]);
//   dx[T, in] = dy[T, out] W[out, in]   is   C[in, T] = A[in, out] B[out, T], A = W, B = dy;
//   dW[out, in] += dy^T x               is   C[in, out] = A[in, T] op(B), A = x, B = dy
//                                            (seen as [out, T], transposed).

namespace {

cudaDataType CudaTypeOf(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:
      return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

// y[i] = x[i] in y's element type: widened exactly, or rounded once.
template <typename S, typename D>
__global__ void ConvertActivationsKernel(const S* __restrict__ x, D* __restrict__ y, size_t n) {
  for (size_t i = FirstIndex(); i < n; i += GridStride())
    y[i] = ActStore<D>(ActLoad(x[i]));
}

// y[0, n) = x converted to `dtype` (rounded to a 16-bit dtype, or widened to fp32), enqueued on
// the context's stream. From fp32 to 16 bits this is the rounding of RoundActivations before
// activations had a dtype, bit for bit (dtype_convert.h's).
OpError ConvertActivations(OpsContext* context, CAct x, size_t n, DType dtype, void* y,
                           const char* op) {
  if (n == 0) return OpError{};
  const bool known = DispatchAct(x.dtype, [&](auto s) {
    using S = decltype(s);
    DispatchAct(dtype, [&](auto d) {
      using D = decltype(d);
      ConvertActivationsKernel<S, D><<<GridFor(n), kBlockThreads, 0, context->stream>>>(
          static_cast<const S*>(x.data), static_cast<D*>(y), n);
    });
  });
  if (!known || !IsKnown(dtype)) return ArgumentError("unknown activation dtype", op);
  return LaunchResult(op);
}

// The bytes of x [n] converted to `dtype` in the workspace: none when it is in that dtype.
size_t ConvertedBytes(DType from, DType to, size_t n) {
  return from == to ? 0 : AlignUp(n * ActSize(to));
}

// A GEMM input of dtype `type` from activation x [n]: x itself when it is in that dtype (no copy),
// else x converted into `scratch` (ConvertedBytes of the workspace).
OpError GemmInput(OpsContext* context, CAct x, size_t n, DType type, void* scratch, const char* op,
                  const void** input) {
  if (x.dtype == type) {
    *input = x.data;
    return OpError{};
  }
  *input = scratch;
  return ConvertActivations(context, x, n, type, scratch, op);
}

// Whether a GEMM whose inputs are of dtype `type` writes an output of dtype `out` through an fp32
// staging buffer: cuBLAS's CUBLAS_COMPUTE_32F takes C in fp32 or in the inputs' 16-bit dtype
// only, so a 16-bit output of fp32 inputs (or bf16 of fp16 ones) is staged and rounded once.
bool StagesOutput(DType out, DType type) {
  return out != DType::kF32 && out != type;
}

// y[i] = c[i], or y[i] + c[i] with `add`, rounded once to y's dtype.
template <typename A>
__global__ void StoreStagedKernel(const float* __restrict__ c, size_t n, bool add,
                                  A* __restrict__ y) {
  for (size_t i = FirstIndex(); i < n; i += GridStride())
    y[i] = ActStore<A>(add ? __fadd_rn(ActLoad(y[i]), c[i]) : c[i]);
}

OpError StoreStaged(OpsContext* context, const float* c, size_t n, bool add, Act y,
                    const char* op) {
  return ForActDType(y.dtype, op, [&](auto a) {
    using A = decltype(a);
    StoreStagedKernel<A>
        <<<GridFor(n), kBlockThreads, 0, context->stream>>>(c, n, add, static_cast<A*>(y.data));
  });
}

// C[m, n] (column-major, of c_type) = op_a(A) op_b(B) + beta C, inputs of `type`, fp32
// accumulation (alpha and beta fp32).
OpError Gemm(OpsContext* context, cublasOperation_t op_a, cublasOperation_t op_b, size_t m,
             size_t n, size_t k, const void* a, size_t lda, const void* b, size_t ldb,
             cudaDataType type, float beta, void* c, cudaDataType c_type, size_t ldc,
             const char* op) {
  const float alpha = 1.0f;
  return CublasResult(
      cublasGemmEx(context->cublas.get(), op_a, op_b, static_cast<int>(m), static_cast<int>(n),
                   static_cast<int>(k), &alpha, a, type, static_cast<int>(lda), b, type,
                   static_cast<int>(ldb), &beta, c, c_type, static_cast<int>(ldc),
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx", op);
}

}  // namespace

OpError LinearForward(OpsContext* context, CAct x, Weight weight, size_t num_tokens,
                      size_t in_features, size_t out_features, Act y) {
  constexpr const char* kOp = "LinearForward";
  if (!IsKnown(weight.dtype)) return ArgumentError("unknown weight dtype", kOp);
  if (!IsKnown(x.dtype) || !IsKnown(y.dtype)) return ArgumentError("unknown activation dtype", kOp);
  if (num_tokens == 0 || out_features == 0) return OpError{};
  if (!FitsInt(num_tokens) || !FitsInt(in_features) || !FitsInt(out_features)) {
    return ArgumentError("a dimension is 2^31 or more", kOp);
  }
  const size_t y_n = num_tokens * out_features;
  if (in_features == 0) {  // an empty sum: y = 0, as cblas_sgemm gives
    return CudaResult(cudaMemsetAsync(y.data, 0, y_n * ActSize(y.dtype), context->stream),
                      "cudaMemsetAsync", kOp);
  }
  // The GEMM's inputs are of the weight's dtype: x as it is or converted (the workspace's first
  // piece), the output written by cuBLAS or staged in fp32 (the second).
  const DType type = weight.dtype;
  const size_t x_n = num_tokens * in_features;
  const bool staged = StagesOutput(y.dtype, type);
  const size_t x_bytes = ConvertedBytes(x.dtype, type, x_n);
  OpError error = Reserve(context, x_bytes + (staged ? AlignUp(y_n * sizeof(float)) : 0), kOp);
  if (!error.ok()) return error;
  WorkspaceCarver carver(context);
  void* x_scratch = carver.Take<char>(x_bytes);
  const void* input = nullptr;
  error = GemmInput(context, x, x_n, type, x_scratch, kOp, &input);
  if (!error.ok()) return error;
  float* stage = staged ? carver.Take<float>(y_n) : nullptr;
  error = Gemm(context, CUBLAS_OP_T, CUBLAS_OP_N, out_features, num_tokens, in_features,
               weight.data, in_features, input, in_features, CudaTypeOf(type), 0.0f,
               staged ? static_cast<void*>(stage) : y.data,
               staged ? CUDA_R_32F : CudaTypeOf(y.dtype), out_features, kOp);
  if (!error.ok() || !staged) return error;
  return StoreStaged(context, stage, y_n, false, y, kOp);
}

OpError LinearBackward(OpsContext* context, CAct x, Weight weight, CAct dy, size_t num_tokens,
                       size_t in_features, size_t out_features, Act dx, Accumulate dx_mode,
                       float* dweight) {
  constexpr const char* kOp = "LinearBackward";
  if (!IsKnown(weight.dtype)) return ArgumentError("unknown weight dtype", kOp);
  const bool want_dx = dx.data != nullptr;
  if (!IsKnown(x.dtype) || !IsKnown(dy.dtype) || (want_dx && !IsKnown(dx.dtype))) {
    return ArgumentError("unknown activation dtype", kOp);
  }
  if (num_tokens == 0 || in_features == 0 || out_features == 0) return OpError{};
  if (!want_dx && dweight == nullptr) return OpError{};
  if (!FitsInt(num_tokens) || !FitsInt(in_features) || !FitsInt(out_features)) {
    return ArgumentError("a dimension is 2^31 or more", kOp);
  }
  // The GEMMs' inputs are of the weight's dtype. The workspace holds dy's copy (when dy is not in
  // that dtype), then x's (for the weight gradient). When dx is staged in fp32, the staging comes
  // first and x's copy reuses its bytes after dx is stored; otherwise x is converted before the
  // dx GEMM runs.
  const DType type = weight.dtype;
  const cudaDataType cuda_type = CudaTypeOf(type);
  const size_t x_n = num_tokens * in_features, dy_n = num_tokens * out_features;
  const bool staged = want_dx && StagesOutput(dx.dtype, type);
  const size_t dy_bytes = ConvertedBytes(dy.dtype, type, dy_n);
  const size_t x_bytes = dweight != nullptr ? ConvertedBytes(x.dtype, type, x_n) : 0;
  const size_t rest = std::max(x_bytes, staged ? AlignUp(x_n * sizeof(float)) : size_t{0});
  OpError error = Reserve(context, dy_bytes + rest, kOp);
  if (!error.ok()) return error;
  WorkspaceCarver carver(context);
  void* dy_scratch = carver.Take<char>(dy_bytes);
  void* rest_scratch = carver.Take<char>(rest);
  const void* dy_in = nullptr;
  error = GemmInput(context, dy, dy_n, type, dy_scratch, kOp, &dy_in);
  if (!error.ok()) return error;
  const void* x_in = nullptr;
  if (dweight != nullptr && !staged) {
    error = GemmInput(context, x, x_n, type, rest_scratch, kOp, &x_in);
    if (!error.ok()) return error;
  }
  if (want_dx) {
    const bool add = dx_mode == Accumulate::kAdd;
    if (staged) {
      float* stage = static_cast<float*>(rest_scratch);
      error = Gemm(context, CUBLAS_OP_N, CUBLAS_OP_N, in_features, num_tokens, out_features,
                   weight.data, in_features, dy_in, out_features, cuda_type, 0.0f, stage,
                   CUDA_R_32F, in_features, kOp);
      if (!error.ok()) return error;
      error = StoreStaged(context, stage, x_n, add, dx, kOp);
    } else {
      error = Gemm(context, CUBLAS_OP_N, CUBLAS_OP_N, in_features, num_tokens, out_features,
                   weight.data, in_features, dy_in, out_features, cuda_type, add ? 1.0f : 0.0f,
                   dx.data, CudaTypeOf(dx.dtype), in_features, kOp);
    }
    if (!error.ok()) return error;
  }
  if (dweight != nullptr) {
    if (staged) {  // the staging's bytes are free now (stream order)
      error = GemmInput(context, x, x_n, type, rest_scratch, kOp, &x_in);
      if (!error.ok()) return error;
    }
    return Gemm(context, CUBLAS_OP_N, CUBLAS_OP_T, in_features, out_features, num_tokens, x_in,
                in_features, dy_in, out_features, cuda_type, 1.0f, dweight, CUDA_R_32F, in_features,
                kOp);
  }
  return OpError{};
}

// ---- Rotary position embedding ------------------------------------------------------------------

namespace {

// a cos and a sin of p * inv_freq(i) (rope.h), in double as the CPU op, rounded to float;
// [seq, half] each; a = the scaling's attention factor.
__global__ void RopeTableKernel(size_t seq, size_t head_dim, float theta, RopeScaling scaling,
                                float* cos_table, float* sin_table) {
  const size_t half = head_dim / 2;
  for (size_t idx = FirstIndex(); idx < seq * half; idx += GridStride()) {
    const size_t p = idx / half;
    const size_t i = idx - p * half;
    const double inv_freq = RopeInvFreq(static_cast<double>(theta), scaling, i, head_dim);
    const double angle = static_cast<double>(p) * inv_freq;
    cos_table[idx] = static_cast<float>(scaling.attention_factor * cos(angle));
    sin_table[idx] = static_cast<float>(scaling.attention_factor * sin(angle));
  }
}

// Rotates every head of x by +angle (sign = 1) or -angle (sign = -1), one thread per pair.
template <typename A>
__global__ void RopeRotateKernel(A* x, size_t tokens, size_t seq, size_t heads, size_t head_dim,
                                 const float* __restrict__ cos_table,
                                 const float* __restrict__ sin_table,
                                 const int32_t* __restrict__ positions, float sign) {
  const size_t half = head_dim / 2;
  const size_t n = tokens * heads * half;
  for (size_t idx = FirstIndex(); idx < n; idx += GridStride()) {
    const size_t pair_row = idx / half;  // t * heads + h
    const size_t i = idx - pair_row * half;
    const size_t t = pair_row / heads;
    const size_t p = positions != nullptr ? static_cast<size_t>(positions[t]) : t % seq;
    A* row = x + pair_row * head_dim;
    const float c = cos_table[p * half + i];
    const float s = sign * sin_table[p * half + i];
    const float a = ActLoad(row[i]);
    const float b = ActLoad(row[i + half]);
    row[i] = ActStore<A>(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
    row[i + half] = ActStore<A>(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
  }
}

OpError Rotate(OpsContext* context, Act x, size_t batch, size_t seq, size_t heads, size_t head_dim,
               float theta, const RopeScaling& scaling, const int32_t* positions, float sign,
               const char* op) {
  if (!IsKnown(x.dtype)) return ArgumentError("unknown activation dtype", op);
  if (head_dim % 2 != 0) return ArgumentError("head_dim must be even", op);
  const size_t half = head_dim / 2;
  if (batch == 0 || seq == 0 || heads == 0 || half == 0) return OpError{};
  OpError error = Reserve(context, 2 * AlignUp(seq * half * sizeof(float)), op);
  if (!error.ok()) return error;
  WorkspaceCarver carver(context);
  float* cos_table = carver.Take<float>(seq * half);
  float* sin_table = carver.Take<float>(seq * half);
  RopeTableKernel<<<GridFor(seq * half), kBlockThreads, 0, context->stream>>>(
      seq, head_dim, theta, scaling, cos_table, sin_table);
  error = LaunchResult(op);
  if (!error.ok()) return error;
  return ForActDType(x.dtype, op, [&](auto a) {
    using A = decltype(a);
    RopeRotateKernel<A><<<GridFor(batch * seq * heads * half), kBlockThreads, 0, context->stream>>>(
        static_cast<A*>(x.data), batch * seq, seq, heads, head_dim, cos_table, sin_table, positions,
        sign);
  });
}

}  // namespace

OpError RopeForward(OpsContext* context, Act x, size_t batch, size_t seq, size_t heads,
                    size_t head_dim, float theta, const RopeScaling& scaling,
                    const int32_t* positions) {
  return Rotate(context, x, batch, seq, heads, head_dim, theta, scaling, positions, 1.0f,
                "RopeForward");
}

OpError RopeBackward(OpsContext* context, Act dx, size_t batch, size_t seq, size_t heads,
                     size_t head_dim, float theta, const RopeScaling& scaling,
                     const int32_t* positions) {
  // The rotation is orthogonal: its transpose is the rotation by -angle.
  return Rotate(context, dx, batch, seq, heads, head_dim, theta, scaling, positions, -1.0f,
                "RopeBackward");
}

// ---- Bias ---------------------------------------------------------------------------------------

namespace {

template <typename E, typename A>
__global__ void BiasForwardKernel(A* y, const typename E::T* __restrict__ bias, size_t rows,
                                  size_t cols) {
  const size_t n = rows * cols;
  for (size_t idx = FirstIndex(); idx < n; idx += GridStride()) {
    y[idx] = ActStore<A>(__fadd_rn(ActLoad(y[idx]), E::Load(bias[idx % cols])));
  }
}

// One thread per column, rows added in order (deterministic).
template <typename A>
__global__ void BiasBackwardKernel(const A* __restrict__ dy, size_t rows, size_t cols,
                                   float* __restrict__ dbias) {
  for (size_t c = FirstIndex(); c < cols; c += GridStride()) {
    float acc = 0.0f;
    for (size_t t = 0; t < rows; ++t)
      acc = __fadd_rn(acc, ActLoad(dy[t * cols + c]));
    dbias[c] = __fadd_rn(dbias[c], acc);
  }
}

}  // namespace

OpError BiasForward(OpsContext* context, Act y, Weight bias, size_t rows, size_t cols) {
  constexpr const char* kOp = "BiasForward";
  if (!IsKnown(y.dtype)) return ArgumentError("unknown activation dtype", kOp);
  if (rows == 0 || cols == 0) return OpError{};
  return ForWeightDType(bias.dtype, kOp, [&](auto tag) {
    using E = decltype(tag);
    DispatchAct(y.dtype, [&](auto a) {
      using A = decltype(a);
      BiasForwardKernel<E, A><<<GridFor(rows * cols), kBlockThreads, 0, context->stream>>>(
          static_cast<A*>(y.data), static_cast<const typename E::T*>(bias.data), rows, cols);
    });
  });
}

OpError BiasBackward(OpsContext* context, CAct dy, size_t rows, size_t cols, float* dbias) {
  constexpr const char* kOp = "BiasBackward";
  if (!IsKnown(dy.dtype)) return ArgumentError("unknown activation dtype", kOp);
  if (rows == 0 || cols == 0) return OpError{};
  return ForActDType(dy.dtype, kOp, [&](auto a) {
    using A = decltype(a);
    BiasBackwardKernel<A><<<GridFor(cols), kBlockThreads, 0, context->stream>>>(
        static_cast<const A*>(dy.data), rows, cols, dbias);
  });
}

// ---- Attention ----------------------------------------------------------------------------------
//
// Each warp owns one row; lane l holds elements l, l + 32, ... of a head vector (R per lane,
// head_dim <= 32 R), so a dot product is R multiply-adds and a warp sum. The forward streams the
// keys 0..i of query row i with an online softmax (running max m, running sum l);
// lse = m + log(l). The backward recomputes p = exp(s - lse) per pair.

namespace {

using detail::AttentionShape;

// The query row (b, h, i) of this warp, with the offset of its q / out / dout vector and where
// its kv group's K and V start; false past the last row (the whole warp returns).
struct QueryRow {
  size_t b, h, i;
  size_t q_off;   // (b * seq + i) * q_stride + h * head_dim
  size_t kv_off;  // b * seq * kv_stride + (h / group) * head_dim
};

__device__ inline bool WarpQueryRow(const AttentionShape& shape, QueryRow* r) {
  const size_t row = static_cast<size_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= shape.batch * shape.num_heads * shape.seq) return false;
  r->i = row % shape.seq;
  r->h = (row / shape.seq) % shape.num_heads;
  r->b = row / (shape.seq * shape.num_heads);
  r->q_off = (r->b * shape.seq + r->i) * shape.q_stride + r->h * shape.head_dim;
  r->kv_off = r->b * shape.seq * shape.kv_stride + (r->h / shape.group) * shape.head_dim;
  return true;
}

template <int R, typename A>
__device__ inline void LoadHeadVector(const A* src, size_t head_dim, unsigned lane,
                                      float (&dst)[R]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const size_t c = lane + 32 * r;
    dst[r] = c < head_dim ? ActLoad(src[c]) : 0.0f;
  }
}

template <int R, typename A>
__device__ inline float WarpDot(const float (&a)[R], const A* b, size_t head_dim, unsigned lane) {
  float part = 0.0f;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const size_t c = lane + 32 * r;
    if (c < head_dim) part += a[r] * ActLoad(b[c]);
  }
  return WarpSum(part);
}

// Warp per query row (b, h, i).
template <int R, typename A>
__global__ void AttentionForwardKernel(const A* __restrict__ q, const A* __restrict__ k,
                                       const A* __restrict__ v, AttentionShape shape,
                                       const int32_t* __restrict__ key_start, A* __restrict__ out,
                                       float* __restrict__ lse) {
  QueryRow row;
  if (!WarpQueryRow(shape, &row)) return;  // the whole warp
  const unsigned lane = threadIdx.x & 31;
  const size_t b = row.b, h = row.h, i = row.i;
  const size_t d = shape.head_dim;
  const A* kg = k + row.kv_off;
  const A* vg = v + row.kv_off;
  float qi[R], acc[R];
  LoadHeadVector<R>(q + row.q_off, d, lane, qi);
#pragma unroll
  for (int r = 0; r < R; ++r)
    acc[r] = 0.0f;
  float m = -INFINITY;
  float l = 0.0f;
  const size_t first = key_start != nullptr ? static_cast<size_t>(key_start[b * shape.seq + i]) : 0;
  for (size_t j = first; j <= i; ++j) {
    const float s = WarpDot<R>(qi, kg + j * shape.kv_stride, d, lane) * shape.scale;
    if (s > m) {  // uniform: every lane holds the same s
      const float correction = expf(m - s);
      l *= correction;
#pragma unroll
      for (int r = 0; r < R; ++r)
        acc[r] *= correction;
      m = s;
    }
    const float p = expf(s - m);
    l += p;
    const A* vj = vg + j * shape.kv_stride;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const size_t c = lane + 32 * r;
      if (c < d) acc[r] += p * ActLoad(vj[c]);
    }
  }
  const float inv = 1.0f / l;
  A* oi = out + row.q_off;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const size_t c = lane + 32 * r;
    if (c < d) oi[c] = ActStore<A>(acc[r] * inv);
  }
  if (lane == 0) {
    lse[(b * shape.num_heads + h) * shape.seq + i] = m + logf(l);
  }
}

// Warp per query row (b, h, i): delta_i = dO_i . O_i (saved for the key kernel) and
// dQ_i = scale * sum_{j<=i} dS_ij K_j with dS_ij = P_ij (dO_i . V_j - delta_i).
template <int R, typename A>
__global__ void AttentionBackwardQueryKernel(const A* __restrict__ q, const A* __restrict__ k,
                                             const A* __restrict__ v, const A* __restrict__ out,
                                             const float* __restrict__ lse,
                                             const A* __restrict__ dout, AttentionShape shape,
                                             const int32_t* __restrict__ key_start,
                                             A* __restrict__ dq, float* __restrict__ delta) {
  QueryRow row;
  if (!WarpQueryRow(shape, &row)) return;  // the whole warp
  const unsigned lane = threadIdx.x & 31;
  const size_t b = row.b, h = row.h, i = row.i;
  const size_t d = shape.head_dim;
  const size_t q_off = row.q_off;
  const A* kg = k + row.kv_off;
  const A* vg = v + row.kv_off;
  float qi[R], doi[R], dqi[R];
  LoadHeadVector<R>(q + q_off, d, lane, qi);
  LoadHeadVector<R>(dout + q_off, d, lane, doi);
  float dot = 0.0f;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const size_t c = lane + 32 * r;
    if (c < d) dot += ActLoad(out[q_off + c]) * doi[r];
    dqi[r] = 0.0f;
  }
  const size_t stat = (b * shape.num_heads + h) * shape.seq + i;
  const float di = WarpSum(dot);
  if (lane == 0) delta[stat] = di;
  const float lse_i = lse[stat];
  const size_t first = key_start != nullptr ? static_cast<size_t>(key_start[b * shape.seq + i]) : 0;
  for (size_t j = first; j <= i; ++j) {
    const A* kj = kg + j * shape.kv_stride;
    const float s = WarpDot<R>(qi, kj, d, lane) * shape.scale;
    const float p = expf(s - lse_i);
    const float dp = WarpDot<R>(doi, vg + j * shape.kv_stride, d, lane);
    const float ds = p * (dp - di);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const size_t c = lane + 32 * r;
      if (c < d) dqi[r] += ds * ActLoad(kj[c]);
    }
  }
  A* dq_row = dq + q_off;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const size_t c = lane + 32 * r;
    if (c < d) dq_row[c] = ActStore<A>(shape.scale * dqi[r]);
  }
}

// Warp per key row (b, g, j): over the query heads h of group g and the rows i >= j,
// dV_j = sum P_ij dO_i and dK_j = scale * sum dS_ij Q_i. Overwrites dk and dv.
template <int R, typename A>
__global__ void AttentionBackwardKeyKernel(const A* __restrict__ q, const A* __restrict__ k,
                                           const A* __restrict__ v, const float* __restrict__ lse,
                                           const float* __restrict__ delta,
                                           const A* __restrict__ dout, AttentionShape shape,
                                           const int32_t* __restrict__ key_start,
                                           A* __restrict__ dk, A* __restrict__ dv) {
  const size_t row = static_cast<size_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= shape.batch * shape.num_kv_heads * shape.seq) return;
  const unsigned lane = threadIdx.x & 31;
  const size_t j = row % shape.seq;
  const size_t g = (row / shape.seq) % shape.num_kv_heads;
  const size_t b = row / (shape.seq * shape.num_kv_heads);
  const size_t d = shape.head_dim;
  const size_t kv_off = (b * shape.seq + j) * shape.kv_stride + g * d;
  float kj[R], vj[R], dkj[R], dvj[R];
  LoadHeadVector<R>(k + kv_off, d, lane, kj);
  LoadHeadVector<R>(v + kv_off, d, lane, vj);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    dkj[r] = 0.0f;
    dvj[r] = 0.0f;
  }
  for (size_t h = g * shape.group; h < (g + 1) * shape.group; ++h) {
    const size_t stat_base = (b * shape.num_heads + h) * shape.seq;
    for (size_t i = j; i < shape.seq; ++i) {
      // Packed documents: the queries that see key j are those of its document, from j on
      // (key starts do not decrease along a sequence).
      if (key_start != nullptr && static_cast<size_t>(key_start[b * shape.seq + i]) > j) break;
      const size_t q_off = (b * shape.seq + i) * shape.q_stride + h * d;
      const A* qi = q + q_off;
      const A* doi = dout + q_off;
      const float s = WarpDot<R>(kj, qi, d, lane) * shape.scale;
      const float p = expf(s - lse[stat_base + i]);
      const float dp = WarpDot<R>(vj, doi, d, lane);
      const float ds = p * (dp - delta[stat_base + i]);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const size_t c = lane + 32 * r;
        if (c < d) {
          dvj[r] += p * ActLoad(doi[c]);
          dkj[r] += ds * ActLoad(qi[c]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const size_t c = lane + 32 * r;
    if (c < d) {
      dk[kv_off + c] = ActStore<A>(shape.scale * dkj[r]);
      dv[kv_off + c] = ActStore<A>(dvj[r]);
    }
  }
}

OpError CheckAttentionShape(size_t num_heads, size_t num_kv_heads, size_t head_dim,
                            const char* op) {
  if (num_kv_heads == 0 || num_heads % num_kv_heads != 0) {
    return ArgumentError("num_heads must be a positive multiple of num_kv_heads", op);
  }
  if (head_dim == 0 || head_dim > kMaxAttentionHeadDim) {
    return ArgumentError("head_dim must be in [1, 256]", op);
  }
  return OpError{};
}

AttentionShape MakeShape(size_t batch, size_t seq, size_t num_heads, size_t num_kv_heads,
                         size_t head_dim) {
  return AttentionShape{batch,
                        seq,
                        num_heads,
                        num_kv_heads,
                        head_dim,
                        num_heads / num_kv_heads,
                        num_heads * head_dim,
                        num_kv_heads * head_dim,
                        1.0f / std::sqrt(static_cast<float>(head_dim))};
}

// A developer switch, not a setting (docs/gpu.md): STRATA_ATTENTION=exact keeps 16-bit runs on
// the exact kernels, which tells a fault of the tensor-core kernels from one elsewhere;
// STRATA_ATTENTION=kernels keeps them on Strata's own kernels (no cuDNN), to compare the two.
// Read at every call (a getenv), so that tests can switch.
bool AttentionSwitch(const char* value) {
  const char* v = std::getenv("STRATA_ATTENTION");
  return v != nullptr && std::strcmp(v, value) == 0;
}
bool TensorCoresAllowed() {
  return !AttentionSwitch("exact");
}
bool CudnnAllowed() {
  return !AttentionSwitch("exact") && !AttentionSwitch("kernels");
}

detail::SdpaShape SdpaShapeOf(DType precision, const AttentionShape& s) {
  detail::SdpaShape out;
  out.batch = static_cast<int64_t>(s.batch);
  out.seq = static_cast<int64_t>(s.seq);
  out.heads = static_cast<int64_t>(s.num_heads);
  out.kv_heads = static_cast<int64_t>(s.num_kv_heads);
  out.head_dim = static_cast<int64_t>(s.head_dim);
  out.dtype = precision;
  out.scale = s.scale;
  return out;
}

// The 16-bit copies a cuDNN call works on, in the workspace before cuDNN's own.
size_t SdpaCopiesBytes(const AttentionShape& s, bool backward) {
  return AttentionCopiesBytes(s.batch * s.seq, s.q_stride, s.kv_stride, backward);
}

// cuDNN's plan for this call, or null when the context's own kernels run it: cuDNN not wanted
// (STRATA_ATTENTION), packed documents (key_start), fp32, a head_dim other than 64 or 128, no
// cuDNN, a shape cuDNN refuses, or a workspace too small for it.
const OpsContext::SdpaPlan* SdpaPlanFor(OpsContext* context, DType precision,
                                        const AttentionShape& s, const int32_t* key_start) {
  if (key_start != nullptr || !CudnnAllowed()) return nullptr;
  if (precision != DType::kBF16 && precision != DType::kF16) return nullptr;
  if (s.head_dim != 64 && s.head_dim != 128) return nullptr;
  if (!context->sdpa_tried) {
    context->sdpa_tried = true;
    std::string why;
    context->sdpa = detail::CudnnSdpaCreate(context->stream, &why);
  }
  if (context->sdpa == nullptr) return nullptr;
  const detail::SdpaShape shape = SdpaShapeOf(precision, s);
  for (const OpsContext::SdpaPlan& p : context->sdpa_plans) {
    if (p.shape == shape) return p.ok ? &p : nullptr;
  }
  OpsContext::SdpaPlan plan;
  plan.shape = shape;
  std::string why;
  plan.ok = detail::CudnnSdpaPrepare(context->sdpa, shape, &plan.forward_bytes,
                                     &plan.backward_bytes, &why);
  // A workspace given by UseWorkspace cannot grow: cuDNN needing more than WorkspaceBytes
  // reserved for it leaves this shape to the context's own kernels.
  const size_t need = SdpaCopiesBytes(s, true) + AlignUp(plan.backward_bytes);
  if (plan.ok && context->external_workspace && need > context->workspace_bytes) {
    plan.ok = false;
    detail::CudnnSdpaNote("cuDNN's attention needs " + std::to_string(need) +
                          " bytes of workspace, more than the " +
                          std::to_string(context->workspace_bytes) +
                          " reserved; Strata's own kernels run for this shape");
  }
  context->sdpa_plans.push_back(plan);
  return context->sdpa_plans.back().ok ? &context->sdpa_plans.back() : nullptr;
}

// The 16-bit copies a cuDNN call works on with fp32 activations (SdpaCopiesBytes) and cuDNN's
// own workspace after them, carved from the context's workspace. With 16-bit activations there
// are no copies: only the scratch.
struct SdpaBuffers {
  void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  void *dout = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;  // the backward's
  void* scratch = nullptr;
};

OpError TakeSdpaBuffers(OpsContext* context, const OpsContext::SdpaPlan& plan,
                        const AttentionShape& s, bool backward, bool copies, const char* op,
                        SdpaBuffers* b) {
  const size_t qn = s.batch * s.seq * s.q_stride, kvn = s.batch * s.seq * s.kv_stride;
  const size_t cudnn = backward ? plan.backward_bytes : plan.forward_bytes;
  OpError error =
      Reserve(context, (copies ? SdpaCopiesBytes(s, backward) : 0) + AlignUp(cudnn), op);
  if (!error.ok()) return error;
  WorkspaceCarver carver(context);
  if (copies) {
    b->q = carver.Take<uint16_t>(qn);
    b->k = carver.Take<uint16_t>(kvn);
    b->v = carver.Take<uint16_t>(kvn);
    b->o = carver.Take<uint16_t>(qn);
    if (backward) {
      b->dout = carver.Take<uint16_t>(qn);
      b->dq = carver.Take<uint16_t>(qn);
      b->dk = carver.Take<uint16_t>(kvn);
      b->dv = carver.Take<uint16_t>(kvn);
    }
  }
  b->scratch = cudnn > 0 ? carver.Take<char>(cudnn) : nullptr;
  return OpError{};
}

// cuDNN reads and writes 16-bit activations where they are; its kernels load whole 16-byte
// vectors (TMA on Hopper), so each tensor must start 16-byte aligned (otherwise the context's own
// kernels run the call). The copies of fp32 activations are (the workspace's pieces are).
bool CudnnTakesInPlace(std::initializer_list<const void*> tensors) {
  for (const void* p : tensors) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

// cuDNN's forward. 16-bit activations (the plan's dtype) go to cuDNN as they are; fp32 ones are
// rounded to 16-bit copies first, and its output widened back.
OpError CudnnAttentionForward(OpsContext* context, const OpsContext::SdpaPlan& plan,
                              const AttentionShape& s, CAct q, CAct k, CAct v, Act out,
                              float* lse) {
  constexpr const char* kOp = "AttentionForward";
  const size_t qn = s.batch * s.seq * s.q_stride, kvn = s.batch * s.seq * s.kv_stride;
  const bool copies = q.dtype == DType::kF32;
  SdpaBuffers b;
  OpError error = TakeSdpaBuffers(context, plan, s, false, copies, kOp, &b);
  if (!error.ok()) return error;
  if (!copies) {
    return detail::CudnnSdpaForward(context->sdpa, plan.shape, q.data, k.data, v.data, out.data,
                                    lse, b.scratch);
  }
  const DType t = plan.shape.dtype;
  for (auto [x, n, y] :
       {std::tuple{q, qn, b.q}, std::tuple{k, kvn, b.k}, std::tuple{v, kvn, b.v}}) {
    error = ConvertActivations(context, x, n, t, y, kOp);
    if (!error.ok()) return error;
  }
  error = detail::CudnnSdpaForward(context->sdpa, plan.shape, b.q, b.k, b.v, b.o, lse, b.scratch);
  if (!error.ok()) return error;
  return ConvertActivations(context, CAct(b.o, t), qn, DType::kF32, out.data, kOp);
}

// cuDNN's backward, with the forward's treatment of the activations.
OpError CudnnAttentionBackward(OpsContext* context, const OpsContext::SdpaPlan& plan,
                               const AttentionShape& s, CAct q, CAct k, CAct v, CAct out,
                               const float* lse, CAct dout, Act dq, Act dk, Act dv) {
  constexpr const char* kOp = "AttentionBackward";
  const size_t qn = s.batch * s.seq * s.q_stride, kvn = s.batch * s.seq * s.kv_stride;
  const bool copies = q.dtype == DType::kF32;
  SdpaBuffers b;
  OpError error = TakeSdpaBuffers(context, plan, s, true, copies, kOp, &b);
  if (!error.ok()) return error;
  if (!copies) {
    return detail::CudnnSdpaBackward(context->sdpa, plan.shape, q.data, k.data, v.data, out.data,
                                     dout.data, lse, dq.data, dk.data, dv.data, b.scratch);
  }
  const DType t = plan.shape.dtype;
  for (auto [x, n, y] : {std::tuple{q, qn, b.q}, std::tuple{k, kvn, b.k}, std::tuple{v, kvn, b.v},
                         std::tuple{out, qn, b.o}, std::tuple{dout, qn, b.dout}}) {
    error = ConvertActivations(context, x, n, t, y, kOp);
    if (!error.ok()) return error;
  }
  error = detail::CudnnSdpaBackward(context->sdpa, plan.shape, b.q, b.k, b.v, b.o, b.dout, lse,
                                    b.dq, b.dk, b.dv, b.scratch);
  if (!error.ok()) return error;
  for (auto [x, n, y] :
       {std::tuple{b.dq, qn, dq}, std::tuple{b.dk, kvn, dk}, std::tuple{b.dv, kvn, dv}}) {
    error = ConvertActivations(context, CAct(x, t), n, DType::kF32, y.data, kOp);
    if (!error.ok()) return error;
  }
  return OpError{};
}

unsigned AttentionBlocks(size_t rows) {
  return static_cast<unsigned>((rows + kAttentionWarps - 1) / kAttentionWarps);
}

// Calls fn(std::integral_constant<int, R>) for the smallest R in {1, 2, 4, 8} with
// head_dim <= 32 R.
template <typename Fn>
void ForLanesPerHead(size_t head_dim, Fn&& fn) {
  if (head_dim <= 32) {
    fn(std::integral_constant<int, 1>{});
  } else if (head_dim <= 64) {
    fn(std::integral_constant<int, 2>{});
  } else if (head_dim <= 128) {
    fn(std::integral_constant<int, 4>{});
  } else {
    fn(std::integral_constant<int, 8>{});
  }
}

}  // namespace

const char* PrepareAttention(OpsContext* context, size_t batch, size_t seq, size_t num_heads,
                             size_t num_kv_heads, size_t head_dim, DType precision,
                             bool packed_documents) {
  if (!IsKnown(precision) || num_kv_heads == 0 || num_heads % num_kv_heads != 0 || head_dim == 0) {
    return "exact";
  }
  const AttentionShape shape = MakeShape(batch, seq, num_heads, num_kv_heads, head_dim);
  static const int32_t kAnyKeyStart = 0;
  if (SdpaPlanFor(context, precision, shape, packed_documents ? &kAnyKeyStart : nullptr)) {
    return "cudnn";
  }
  if (!packed_documents && TensorCoresAllowed() &&
      detail::TensorCoreAttentionSupports(precision, shape)) {
    return "tensor cores";
  }
  return "exact";
}

namespace {

// The one dtype of an attention call's activations, in *act; kArgument unless they share one and
// it is fp32 or `precision` (16-bit activations are in the attention's dtype).
OpError AttentionActDType(std::initializer_list<DType> dtypes, DType precision, const char* op,
                          DType* act) {
  OpError error = CommonActDType(dtypes, op, act);
  if (!error.ok()) return error;
  if (*act != DType::kF32 && *act != precision) {
    return ArgumentError("16-bit activations must be in the attention's precision", op);
  }
  return OpError{};
}

}  // namespace

OpError AttentionForward(OpsContext* context, CAct q, CAct k, CAct v, size_t batch, size_t seq,
                         size_t num_heads, size_t num_kv_heads, size_t head_dim, Act out,
                         float* lse, DType precision, const int32_t* key_start) {
  constexpr const char* kOp = "AttentionForward";
  OpError error = CheckAttentionShape(num_heads, num_kv_heads, head_dim, kOp);
  if (!error.ok()) return error;
  if (!IsKnown(precision)) return ArgumentError("unknown attention precision", kOp);
  DType act = DType::kF32;
  error = AttentionActDType({q.dtype, k.dtype, v.dtype, out.dtype}, precision, kOp, &act);
  if (!error.ok()) return error;
  const size_t rows = batch * num_heads * seq;
  if (rows == 0) return OpError{};
  if (rows / kAttentionWarps >= static_cast<size_t>(INT_MAX)) {
    return ArgumentError("too many rows", kOp);  // gridDim.x is below 2^31
  }
  const AttentionShape shape = MakeShape(batch, seq, num_heads, num_kv_heads, head_dim);
  if (act == DType::kF32 || CudnnTakesInPlace({q.data, k.data, v.data, out.data})) {
    if (const OpsContext::SdpaPlan* plan = SdpaPlanFor(context, precision, shape, key_start)) {
      return CudnnAttentionForward(context, *plan, shape, q, k, v, out, lse);
    }
  }
  // Packed documents take the exact kernels (the tiled ones mask causally only).
  if (key_start == nullptr && TensorCoresAllowed() &&
      detail::TensorCoreAttentionSupports(precision, shape)) {
    return detail::TensorCoreAttentionForward(context->stream, precision, act, shape, q.data,
                                              k.data, v.data, out.data, lse);
  }
  return ForActDType(act, kOp, [&](auto a) {
    using A = decltype(a);
    ForLanesPerHead(head_dim, [&](auto lanes) {
      constexpr int R = decltype(lanes)::value;
      AttentionForwardKernel<R, A>
          <<<AttentionBlocks(rows), kAttentionWarps * 32, 0, context->stream>>>(
              static_cast<const A*>(q.data), static_cast<const A*>(k.data),
              static_cast<const A*>(v.data), shape, key_start, static_cast<A*>(out.data), lse);
    });
  });
}

OpError AttentionBackward(OpsContext* context, CAct q, CAct k, CAct v, CAct out, const float* lse,
                          CAct dout, size_t batch, size_t seq, size_t num_heads,
                          size_t num_kv_heads, size_t head_dim, Act dq, Act dk, Act dv,
                          DType precision, const int32_t* key_start) {
  constexpr const char* kOp = "AttentionBackward";
  OpError error = CheckAttentionShape(num_heads, num_kv_heads, head_dim, kOp);
  if (!error.ok()) return error;
  if (!IsKnown(precision)) return ArgumentError("unknown attention precision", kOp);
  DType act = DType::kF32;
  error = AttentionActDType(
      {q.dtype, k.dtype, v.dtype, out.dtype, dout.dtype, dq.dtype, dk.dtype, dv.dtype}, precision,
      kOp, &act);
  if (!error.ok()) return error;
  const size_t rows = batch * num_heads * seq;
  if (rows == 0) {  // the CPU op still zeroes dk and dv
    const size_t kv_bytes = batch * seq * num_kv_heads * head_dim * ActSize(act);
    if (kv_bytes == 0) return OpError{};
    error =
        CudaResult(cudaMemsetAsync(dk.data, 0, kv_bytes, context->stream), "cudaMemsetAsync", kOp);
    if (!error.ok()) return error;
    return CudaResult(cudaMemsetAsync(dv.data, 0, kv_bytes, context->stream), "cudaMemsetAsync",
                      kOp);
  }
  if (rows / kAttentionWarps >= static_cast<size_t>(INT_MAX)) {
    return ArgumentError("too many rows", kOp);  // gridDim.x is below 2^31
  }
  const AttentionShape shape = MakeShape(batch, seq, num_heads, num_kv_heads, head_dim);
  if (act == DType::kF32 ||
      CudnnTakesInPlace({q.data, k.data, v.data, out.data, dout.data, dq.data, dk.data, dv.data})) {
    if (const OpsContext::SdpaPlan* plan = SdpaPlanFor(context, precision, shape, key_start)) {
      return CudnnAttentionBackward(context, *plan, shape, q, k, v, out, lse, dout, dq, dk, dv);
    }
  }
  error = Reserve(context, rows * sizeof(float), kOp);
  if (!error.ok()) return error;
  float* delta = WorkspaceCarver(context).Take<float>(rows);
  if (key_start == nullptr && TensorCoresAllowed() &&
      detail::TensorCoreAttentionSupports(precision, shape)) {
    return detail::TensorCoreAttentionBackward(context->stream, precision, act, shape, q.data,
                                               k.data, v.data, out.data, lse, dout.data, delta,
                                               dq.data, dk.data, dv.data);
  }
  const size_t kv_rows = batch * num_kv_heads * seq;
  return ForActDType(act, kOp, [&](auto a) {
    using A = decltype(a);
    const A* q_a = static_cast<const A*>(q.data);
    const A* k_a = static_cast<const A*>(k.data);
    const A* v_a = static_cast<const A*>(v.data);
    const A* dout_a = static_cast<const A*>(dout.data);
    ForLanesPerHead(head_dim, [&](auto lanes) {
      constexpr int R = decltype(lanes)::value;
      AttentionBackwardQueryKernel<R, A>
          <<<AttentionBlocks(rows), kAttentionWarps * 32, 0, context->stream>>>(
              q_a, k_a, v_a, static_cast<const A*>(out.data), lse, dout_a, shape, key_start,
              static_cast<A*>(dq.data), delta);
      AttentionBackwardKeyKernel<R, A>
          <<<AttentionBlocks(kv_rows), kAttentionWarps * 32, 0, context->stream>>>(
              q_a, k_a, v_a, lse, delta, dout_a, shape, key_start, static_cast<A*>(dk.data),
              static_cast<A*>(dv.data));
    });
  });
}

// ---- SwiGLU -------------------------------------------------------------------------------------

namespace {

__device__ inline float Sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}

template <typename A>
__global__ void SiluMulForwardKernel(const A* gate, const A* up, size_t n, A* h) {
  for (size_t i = FirstIndex(); i < n; i += GridStride()) {
    const float g = ActLoad(gate[i]);
    h[i] = ActStore<A>(g * Sigmoid(g) * ActLoad(up[i]));
  }
}

// dgate and dup may alias dh: each element is read, then written, by one thread.
template <typename A>
__global__ void SiluMulBackwardKernel(const A* gate, const A* up, const A* dh, size_t n, A* dgate,
                                      A* dup) {
  for (size_t i = FirstIndex(); i < n; i += GridStride()) {
    const float g = ActLoad(gate[i]);
    const float s = Sigmoid(g);
    const float d = ActLoad(dh[i]);
    const float u = ActLoad(up[i]);
    const float dsilu = s * (1.0f + g * (1.0f - s));  // silu'(g)
    dgate[i] = ActStore<A>(d * u * dsilu);
    dup[i] = ActStore<A>(d * g * s);
  }
}

}  // namespace

OpError SiluMulForward(OpsContext* context, CAct gate, CAct up, size_t n, Act h) {
  constexpr const char* kOp = "SiluMulForward";
  DType act = DType::kF32;
  OpError error = CommonActDType({gate.dtype, up.dtype, h.dtype}, kOp, &act);
  if (!error.ok()) return error;
  if (n == 0) return OpError{};
  return ForActDType(act, kOp, [&](auto a) {
    using A = decltype(a);
    SiluMulForwardKernel<A><<<GridFor(n), kBlockThreads, 0, context->stream>>>(
        static_cast<const A*>(gate.data), static_cast<const A*>(up.data), n,
        static_cast<A*>(h.data));
  });
}

OpError SiluMulBackward(OpsContext* context, CAct gate, CAct up, CAct dh, size_t n, Act dgate,
                        Act dup) {
  constexpr const char* kOp = "SiluMulBackward";
  DType act = DType::kF32;
  OpError error =
      CommonActDType({gate.dtype, up.dtype, dh.dtype, dgate.dtype, dup.dtype}, kOp, &act);
  if (!error.ok()) return error;
  if (n == 0) return OpError{};
  return ForActDType(act, kOp, [&](auto a) {
    using A = decltype(a);
    SiluMulBackwardKernel<A><<<GridFor(n), kBlockThreads, 0, context->stream>>>(
        static_cast<const A*>(gate.data), static_cast<const A*>(up.data),
        static_cast<const A*>(dh.data), n, static_cast<A*>(dgate.data), static_cast<A*>(dup.data));
  });
}

// ---- Residual -----------------------------------------------------------------------------------

namespace {

template <typename A>
__global__ void AddKernel(const A* a, const A* b, size_t n, A* y) {
  for (size_t i = FirstIndex(); i < n; i += GridStride())
    y[i] = ActStore<A>(__fadd_rn(ActLoad(a[i]), ActLoad(b[i])));
}

template <typename A>
__global__ void ScaleKernel(A* x, size_t n, float s) {
  for (size_t i = FirstIndex(); i < n; i += GridStride())
    x[i] = ActStore<A>(__fmul_rn(ActLoad(x[i]), s));
}

// y = a + b (y may alias a or b).
OpError Add(OpsContext* context, CAct a, CAct b, size_t n, Act y, const char* op) {
  DType act = DType::kF32;
  OpError error = CommonActDType({a.dtype, b.dtype, y.dtype}, op, &act);
  if (!error.ok()) return error;
  if (n == 0) return OpError{};
  return ForActDType(act, op, [&](auto tag) {
    using A = decltype(tag);
    AddKernel<A><<<GridFor(n), kBlockThreads, 0, context->stream>>>(
        static_cast<const A*>(a.data), static_cast<const A*>(b.data), n, static_cast<A*>(y.data));
  });
}

}  // namespace

OpError ResidualAdd(OpsContext* context, CAct a, CAct b, size_t n, Act y) {
  return Add(context, a, b, n, y, "ResidualAdd");
}

OpError AccumulateGradient(OpsContext* context, CAct dy, size_t n, Act dx) {
  return Add(context, dx, dy, n, dx, "AccumulateGradient");
}

OpError Scale(OpsContext* context, Act x, size_t n, float s) {
  constexpr const char* kOp = "Scale";
  if (!IsKnown(x.dtype)) return ArgumentError("unknown activation dtype", kOp);
  if (n == 0) return OpError{};
  return ForActDType(x.dtype, kOp, [&](auto a) {
    using A = decltype(a);
    ScaleKernel<A>
        <<<GridFor(n), kBlockThreads, 0, context->stream>>>(static_cast<A*>(x.data), n, s);
  });
}

// ---- Cross-entropy ------------------------------------------------------------------------------

namespace {

__device__ inline bool IsBadTarget(int32_t target, size_t vocab, int32_t ignore_index) {
  return target != ignore_index && (target < 0 || static_cast<size_t>(target) >= vocab);
}

// One block per row: lse[t] and the row's loss (0 for ignored and bad targets).
template <typename A>
__global__ void CrossEntropyRowKernel(const A* __restrict__ logits,
                                      const int32_t* __restrict__ targets, size_t vocab,
                                      int32_t ignore_index, float* __restrict__ lse,
                                      float* __restrict__ row_loss, DeviceDataError* record) {
  __shared__ float max_scratch[kWarpsPerBlock];
  __shared__ float sum_scratch[kWarpsPerBlock];
  const size_t t = blockIdx.x;
  const A* row = logits + t * vocab;
  float max = -INFINITY;
  for (size_t j = threadIdx.x; j < vocab; j += blockDim.x)
    max = fmaxf(max, ActLoad(row[j]));
  max = BlockMax(max, max_scratch);
  float sum = 0.0f;
  for (size_t j = threadIdx.x; j < vocab; j += blockDim.x)
    sum += expf(ActLoad(row[j]) - max);
  sum = BlockSum(sum, sum_scratch);
  if (threadIdx.x != 0) return;
  const float row_lse = max + logf(sum);
  if (lse != nullptr) lse[t] = row_lse;
  const int32_t target = targets[t];
  if (IsBadTarget(target, vocab, ignore_index)) {
    RecordDataError(record, DataErrorKind::kTarget, t, target, vocab);
    row_loss[t] = 0.0f;
  } else {
    row_loss[t] = target == ignore_index ? 0.0f : row_lse - ActLoad(row[target]);
  }
}

// One block: *loss = sum(row_loss) / count over counted rows (0 when none), in a fixed order.
__global__ void CrossEntropyMeanKernel(const float* __restrict__ row_loss,
                                       const int32_t* __restrict__ targets, size_t num_tokens,
                                       size_t vocab, int32_t ignore_index, float* loss) {
  __shared__ float sum_scratch[kWarpsPerBlock];
  __shared__ unsigned long long count_scratch[kWarpsPerBlock];
  float total = 0.0f;
  unsigned long long count = 0;
  for (size_t t = threadIdx.x; t < num_tokens; t += blockDim.x) {
    total += row_loss[t];
    const int32_t target = targets[t];
    if (target != ignore_index && !IsBadTarget(target, vocab, ignore_index)) ++count;
  }
  total = BlockSum(total, sum_scratch);
  count = BlockSum(count, count_scratch);
  if (threadIdx.x == 0) {
    *loss = count == 0 ? 0.0f : total / static_cast<float>(count);
  }
}

// One block: *scale = dloss / count (0 when no token counts); records bad targets.
__global__ void CrossEntropyScaleKernel(const int32_t* __restrict__ targets, size_t num_tokens,
                                        size_t vocab, int32_t ignore_index, float dloss,
                                        float* scale, DeviceDataError* record) {
  __shared__ unsigned long long count_scratch[kWarpsPerBlock];
  unsigned long long count = 0;
  for (size_t t = threadIdx.x; t < num_tokens; t += blockDim.x) {
    const int32_t target = targets[t];
    if (IsBadTarget(target, vocab, ignore_index)) {
      RecordDataError(record, DataErrorKind::kTarget, t, target, vocab);
    } else if (target != ignore_index) {
      ++count;
    }
  }
  count = BlockSum(count, count_scratch);
  if (threadIdx.x == 0) *scale = count == 0 ? 0.0f : __fdiv_rn(dloss, static_cast<float>(count));
}

// One block per row: dlogits = (softmax - onehot) * scale, 0 for ignored (and bad) rows.
// dlogits may alias logits: each element is read, then written, by one thread.
template <typename A>
__global__ void CrossEntropyGradKernel(const A* logits, const int32_t* __restrict__ targets,
                                       const float* __restrict__ lse, size_t vocab,
                                       int32_t ignore_index, const float* __restrict__ scale_ptr,
                                       A* dlogits) {
  const size_t t = blockIdx.x;
  const int32_t target = targets[t];
  const A* row = logits + t * vocab;
  A* drow = dlogits + t * vocab;
  if (target == ignore_index || IsBadTarget(target, vocab, ignore_index)) {
    for (size_t j = threadIdx.x; j < vocab; j += blockDim.x)
      drow[j] = ActStore<A>(0.0f);
    return;
  }
  const float scale = *scale_ptr;
  const float row_lse = lse[t];
  for (size_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    float g = __fmul_rn(expf(__fsub_rn(ActLoad(row[j]), row_lse)), scale);
    if (j == static_cast<size_t>(target)) g = __fsub_rn(g, scale);
    drow[j] = ActStore<A>(g);
  }
}

}  // namespace

OpError CrossEntropyForward(OpsContext* context, CAct logits, const int32_t* targets,
                            size_t num_tokens, size_t vocab, int32_t ignore_index, float* lse,
                            float* loss) {
  constexpr const char* kOp = "CrossEntropyForward";
  if (!IsKnown(logits.dtype)) return ArgumentError("unknown activation dtype", kOp);
  if (!FitsInt(num_tokens)) return ArgumentError("more than 2^31 - 1 tokens", kOp);
  if (num_tokens == 0) {
    return CudaResult(cudaMemsetAsync(loss, 0, sizeof(float), context->stream), "cudaMemsetAsync",
                      kOp);
  }
  if (vocab == 0) return ArgumentError("vocab is 0", kOp);
  OpError error = Reserve(context, num_tokens * sizeof(float), kOp);
  if (!error.ok()) return error;
  float* row_loss = WorkspaceCarver(context).Take<float>(num_tokens);
  error = ForActDType(logits.dtype, kOp, [&](auto a) {
    using A = decltype(a);
    CrossEntropyRowKernel<A>
        <<<static_cast<unsigned>(num_tokens), kBlockThreads, 0, context->stream>>>(
            static_cast<const A*>(logits.data), targets, vocab, ignore_index, lse, row_loss,
            context->data_error);
  });
  if (!error.ok()) return error;
  CrossEntropyMeanKernel<<<1, kBlockThreads, 0, context->stream>>>(row_loss, targets, num_tokens,
                                                                   vocab, ignore_index, loss);
  return LaunchResult(kOp);
}

OpError CrossEntropyBackward(OpsContext* context, CAct logits, const int32_t* targets,
                             const float* lse, size_t num_tokens, size_t vocab,
                             int32_t ignore_index, float dloss, Act dlogits) {
  constexpr const char* kOp = "CrossEntropyBackward";
  DType act = DType::kF32;
  OpError error = CommonActDType({logits.dtype, dlogits.dtype}, kOp, &act);
  if (!error.ok()) return error;
  if (num_tokens == 0 || vocab == 0) return OpError{};
  if (!FitsInt(num_tokens)) return ArgumentError("more than 2^31 - 1 tokens", kOp);
  error = Reserve(context, sizeof(float), kOp);
  if (!error.ok()) return error;
  float* scale = WorkspaceCarver(context).Take<float>(1);
  CrossEntropyScaleKernel<<<1, kBlockThreads, 0, context->stream>>>(
      targets, num_tokens, vocab, ignore_index, dloss, scale, context->data_error);
  error = LaunchResult(kOp);
  if (!error.ok()) return error;
  return ForActDType(act, kOp, [&](auto a) {
    using A = decltype(a);
    CrossEntropyGradKernel<A>
        <<<static_cast<unsigned>(num_tokens), kBlockThreads, 0, context->stream>>>(
            static_cast<const A*>(logits.data), targets, lse, vocab, ignore_index, scale,
            static_cast<A*>(dlogits.data));
  });
}

// ---- Cross-entropy over the vocabulary split (tensor parallelism) -------------------------------

namespace {

// The rank's column of a target, or -1 (another rank's, or ignored).
__device__ inline int64_t OwnColumn(int32_t target, int32_t ignore_index, size_t vocab_begin,
                                    size_t vocab) {
  if (target == ignore_index) return -1;
  const int64_t col = static_cast<int64_t>(target) - static_cast<int64_t>(vocab_begin);
  return col >= 0 && static_cast<size_t>(col) < vocab ? col : -1;
}

// One block per row: max[t] = the largest of the rank's logits of row t.
template <typename A>
__global__ void CrossEntropyShardMaxKernel(const A* __restrict__ logits, size_t vocab,
                                           float* __restrict__ max) {
  __shared__ float scratch[kWarpsPerBlock];
  const A* row = logits + blockIdx.x * vocab;
  float m = -INFINITY;
  for (size_t j = threadIdx.x; j < vocab; j += blockDim.x)
    m = fmaxf(m, ActLoad(row[j]));
  m = BlockMax(m, scratch);
  if (threadIdx.x == 0) max[blockIdx.x] = m;
}

// One block per row: sums[t] = sum_j exp(logits[t, j] - max[t]); sums[T + t] = the target's
// logit where the rank holds it, else 0.
template <typename A>
__global__ void CrossEntropyShardSumsKernel(const A* __restrict__ logits,
                                            const int32_t* __restrict__ targets, size_t num_tokens,
                                            size_t vocab_begin, size_t vocab, int32_t ignore_index,
                                            const float* __restrict__ max,
                                            float* __restrict__ sums) {
  __shared__ float scratch[kWarpsPerBlock];
  const size_t t = blockIdx.x;
  const A* row = logits + t * vocab;
  const float m = max[t];
  float sum = 0.0f;
  for (size_t j = threadIdx.x; j < vocab; j += blockDim.x)
    sum += expf(ActLoad(row[j]) - m);
  sum = BlockSum(sum, scratch);
  if (threadIdx.x != 0) return;
  sums[t] = sum;
  const int64_t own = OwnColumn(targets[t], ignore_index, vocab_begin, vocab);
  sums[num_tokens + t] = own < 0 ? 0.0f : ActLoad(row[own]);
}

// One block: lse[t] = max[t] + log(sums[t]); *loss = the mean of lse[t] - sums[T + t] over the
// targets that are not ignored (0 with none).
__global__ void CrossEntropyShardFinishKernel(const int32_t* __restrict__ targets,
                                              size_t num_tokens, int32_t ignore_index,
                                              const float* __restrict__ max,
                                              const float* __restrict__ sums,
                                              float* __restrict__ lse, float* loss) {
  __shared__ float sum_scratch[kWarpsPerBlock];
  __shared__ unsigned long long count_scratch[kWarpsPerBlock];
  float total = 0.0f;
  unsigned long long count = 0;
  for (size_t t = threadIdx.x; t < num_tokens; t += blockDim.x) {
    const float row_lse = max[t] + logf(sums[t]);
    lse[t] = row_lse;
    if (targets[t] == ignore_index) continue;
    total += row_lse - sums[num_tokens + t];
    ++count;
  }
  total = BlockSum(total, sum_scratch);
  count = BlockSum(count, count_scratch);
  if (threadIdx.x == 0) *loss = count == 0 ? 0.0f : total / static_cast<float>(count);
}

// One block: *scale = dloss / the targets that are not ignored (0 with none).
__global__ void CrossEntropyShardScaleKernel(const int32_t* __restrict__ targets, size_t num_tokens,
                                             int32_t ignore_index, float dloss, float* scale) {
  __shared__ unsigned long long count_scratch[kWarpsPerBlock];
  unsigned long long count = 0;
  for (size_t t = threadIdx.x; t < num_tokens; t += blockDim.x)
    count += targets[t] != ignore_index ? 1 : 0;
  count = BlockSum(count, count_scratch);
  if (threadIdx.x == 0) *scale = count == 0 ? 0.0f : __fdiv_rn(dloss, static_cast<float>(count));
}

// One block per row: the rank's columns of (softmax - onehot) * scale; 0 for ignored rows.
// dlogits may alias logits: each element is read, then written, by one thread.
template <typename A>
__global__ void CrossEntropyShardGradKernel(const A* logits, const int32_t* __restrict__ targets,
                                            const float* __restrict__ lse, size_t vocab_begin,
                                            size_t vocab, int32_t ignore_index,
                                            const float* __restrict__ scale_ptr, A* dlogits) {
  const size_t t = blockIdx.x;
  const int32_t target = targets[t];
  const A* row = logits + t * vocab;
  A* drow = dlogits + t * vocab;
  if (target == ignore_index) {
    for (size_t j = threadIdx.x; j < vocab; j += blockDim.x)
      drow[j] = ActStore<A>(0.0f);
    return;
  }
  const float scale = *scale_ptr;
  const float row_lse = lse[t];
  const int64_t own = OwnColumn(target, ignore_index, vocab_begin, vocab);
  for (size_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    float g = __fmul_rn(expf(__fsub_rn(ActLoad(row[j]), row_lse)), scale);
    if (static_cast<int64_t>(j) == own) g = __fsub_rn(g, scale);
    drow[j] = ActStore<A>(g);
  }
}

}  // namespace

OpError CrossEntropyShardMax(OpsContext* context, CAct logits, size_t num_tokens, size_t vocab,
                             float* max) {
  constexpr const char* kOp = "CrossEntropyShardMax";
  if (!IsKnown(logits.dtype)) return ArgumentError("unknown activation dtype", kOp);
  if (num_tokens == 0) return OpError{};
  if (!FitsInt(num_tokens)) return ArgumentError("more than 2^31 - 1 tokens", kOp);
  if (vocab == 0) return ArgumentError("vocab is 0", kOp);
  return ForActDType(logits.dtype, kOp, [&](auto a) {
    using A = decltype(a);
    CrossEntropyShardMaxKernel<A>
        <<<static_cast<unsigned>(num_tokens), kBlockThreads, 0, context->stream>>>(
            static_cast<const A*>(logits.data), vocab, max);
  });
}

OpError CrossEntropyShardSums(OpsContext* context, CAct logits, const int32_t* targets,
                              size_t num_tokens, size_t vocab_begin, size_t vocab,
                              int32_t ignore_index, const float* max, float* sums) {
  constexpr const char* kOp = "CrossEntropyShardSums";
  if (!IsKnown(logits.dtype)) return ArgumentError("unknown activation dtype", kOp);
  if (num_tokens == 0) return OpError{};
  if (!FitsInt(num_tokens)) return ArgumentError("more than 2^31 - 1 tokens", kOp);
  if (vocab == 0) return ArgumentError("vocab is 0", kOp);
  return ForActDType(logits.dtype, kOp, [&](auto a) {
    using A = decltype(a);
    CrossEntropyShardSumsKernel<A>
        <<<static_cast<unsigned>(num_tokens), kBlockThreads, 0, context->stream>>>(
            static_cast<const A*>(logits.data), targets, num_tokens, vocab_begin, vocab,
            ignore_index, max, sums);
  });
}

OpError CrossEntropyShardFinish(OpsContext* context, const int32_t* targets, size_t num_tokens,
                                int32_t ignore_index, const float* max, const float* sums,
                                float* lse, float* loss) {
  constexpr const char* kOp = "CrossEntropyShardFinish";
  if (num_tokens == 0) {
    return CudaResult(cudaMemsetAsync(loss, 0, sizeof(float), context->stream), "cudaMemsetAsync",
                      kOp);
  }
  CrossEntropyShardFinishKernel<<<1, kBlockThreads, 0, context->stream>>>(
      targets, num_tokens, ignore_index, max, sums, lse, loss);
  return LaunchResult(kOp);
}

OpError CrossEntropyShardBackward(OpsContext* context, CAct logits, const int32_t* targets,
                                  const float* lse, size_t num_tokens, size_t vocab_begin,
                                  size_t vocab, int32_t ignore_index, float dloss, Act dlogits) {
  constexpr const char* kOp = "CrossEntropyShardBackward";
  DType act = DType::kF32;
  OpError error = CommonActDType({logits.dtype, dlogits.dtype}, kOp, &act);
  if (!error.ok()) return error;
  if (num_tokens == 0 || vocab == 0) return OpError{};
  if (!FitsInt(num_tokens)) return ArgumentError("more than 2^31 - 1 tokens", kOp);
  error = Reserve(context, sizeof(float), kOp);
  if (!error.ok()) return error;
  float* scale = WorkspaceCarver(context).Take<float>(1);
  CrossEntropyShardScaleKernel<<<1, kBlockThreads, 0, context->stream>>>(
      targets, num_tokens, ignore_index, dloss, scale);
  error = LaunchResult(kOp);
  if (!error.ok()) return error;
  return ForActDType(act, kOp, [&](auto a) {
    using A = decltype(a);
    CrossEntropyShardGradKernel<A>
        <<<static_cast<unsigned>(num_tokens), kBlockThreads, 0, context->stream>>>(
            static_cast<const A*>(logits.data), targets, lse, vocab_begin, vocab, ignore_index,
            scale, static_cast<A*>(dlogits.data));
  });
}

}  // namespace strata::model::cuda

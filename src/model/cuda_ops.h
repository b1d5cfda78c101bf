// The Llama decoder's operations on a CUDA GPU, forward and backward (cuda_ops.cu): the same ops,
// math and argument conventions as cpu_ops.h, which is their oracle (tests/model/cuda_ops_test.cc
// compares them op by op with explicit tolerances).
//
// C++17 and no CUDA header: nvcc compiles cuda_ops.cu as C++17, and C++20 code includes this
// header as is. Errors come back as an OpError holding the foreign code (cudaError_t or
// cublasStatus_t as an int); cuda_ops_status.h turns it into a Status.
//
// Conventions, beyond those of cpu_ops.h (shapes, accumulation of weight gradients, aliasing):
//   - Every pointer is device memory of the current CUDA device (the caller selects it), except
//     scalars passed by value. Every op enqueues work on the context's stream and returns
//     without waiting; outputs are ready once the stream reaches that point.
//   - Activations and their gradients (Act, CAct) are fp32, bf16 or fp16; every activation of one
//     call has the same dtype (kArgument otherwise), except that a linear layer's x, y, dy and
//     dx may each be any. Row statistics (rstd, lse), the loss, and weight and bias gradients are
//     fp32 (float*). A weight is fp32, bf16 or fp16 (Weight).
//   - Linear layers run on cuBLAS with fp32 accumulation (CUBLAS_COMPUTE_32F). With an fp32
//     weight the GEMM is fp32 throughout (no TF32 unless SetTf32); 16-bit activations are
//     widened to fp32 in the context's workspace first. With a bf16 (fp16) weight the GEMM inputs
//     are bf16 (fp16): activations already in that dtype go to cuBLAS as they are, others are
//     rounded to it on the fly (in the workspace), for the forward and for both backward GEMMs.
//     Outputs are written in their own dtype (cuBLAS rounds an fp32 accumulator once; where
//     cuBLAS cannot write that dtype from the GEMM's inputs, a 16-bit y or dx of an fp32 GEMM or
//     bf16 from fp16, the fp32 result is staged in the workspace, added to dx for
//     Accumulate::kAdd, and rounded once) and weight gradients are fp32. The tensor cores do the
//     work, at the cost of a rounding of up to 2^-8 (bf16) or 2^-11 (fp16) relative per input
//     (docs/model.md gives the tolerances the tests hold the results to).
//   - The other ops compute in fp32 whatever the activations' dtype: 16-bit values are widened
//     on load and rounded once on store, to nearest even with device/dtype_convert.h's
//     conversions (row reductions too; only the per-call RoPE angle table is computed in
//     double). With fp32 activations the kernels do what they did before activations had a
//     dtype, bit for bit. Residual add and embedding forward match the CPU to the last bit (in
//     16 bits: the CPU's fp32 result rounded once); the rest agree within the tolerances of
//     tests/model/cuda_ops_test.cc (the CPU ops sum some rows in double).
//   - Reductions are deterministic: no floating-point atomics; the same inputs give the same
//     bits on every run (embedding backward sums repeated tokens in position order).
//   - Bad data (a token or target out of range) cannot be reported synchronously: the kernel
//     records the first it meets in the context and skips it (its output is then unspecified);
//     TakeDataError (or CheckDataErrors in cuda_ops_status.h) waits for the stream and reports.
//   - Sizes are those of one layer: each dimension below 2^31.
//
// Thread safety: an OpsContext is used by one thread at a time (it owns the stream's cuBLAS
// handle and a workspace). Distinct contexts are independent.
#pragma once

#include "model/rope.h"
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace strata::model::cuda {

// Numbered as strata::device::DType (cuda_ops_status.cc asserts that they match).
enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// A read-only weight tensor in device memory, in its storage dtype.
struct Weight {
  const void* data = nullptr;
  DType dtype = DType::kF32;
};

// An activation (or activation gradient) in device memory, in its dtype: fp32, or the compute
// dtype (bf16 or fp16) with 16-bit activations. CAct is the read-only view.
struct Act {
  void* data = nullptr;
  DType dtype = DType::kF32;
};
struct CAct {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  CAct() = default;
  CAct(const void* d, DType t) : data(d), dtype(t) {}
  CAct(Act a) : data(a.data), dtype(a.dtype) {}  // NOLINT: an Act reads as a CAct
};

// Whether a function writes (=) or adds (+=) into an activation-gradient buffer.
enum class Accumulate : uint8_t { kOverwrite, kAdd };

inline constexpr int32_t kIgnoreIndex = -100;

// ---- errors -------------------------------------------------------------------------------------

enum class ErrorSource : uint8_t {
  kNone,      // success
  kCuda,      // `code` is a cudaError_t
  kCublas,    // `code` is a cublasStatus_t
  kArgument,  // the sizes or dtypes are not supported; `what` says why
  kCudnn,     // `code` is a cuDNN frontend error code (the log has its message)
};

// The outcome of one call. `what` is a string literal: the failing CUDA or cuBLAS call
// ("cudaMalloc", "cublasGemmEx", "kernel launch"), or the reason for kArgument.
struct [[nodiscard]] OpError {
  ErrorSource source = ErrorSource::kNone;
  int code = 0;
  const char* what = "";
  const char* op = "";  // the op that failed ("LinearForward", ...)

  bool ok() const { return source == ErrorSource::kNone; }
};

// Bad data a kernel met (see the conventions above).
enum class DataErrorKind : int32_t {
  kNone = 0,
  kToken = 1,   // an embedding token id outside [0, bound)
  kTarget = 2,  // a cross-entropy target neither ignore_index nor in [0, bound)
};
struct DataError {
  DataErrorKind kind = DataErrorKind::kNone;
  int32_t position = 0;  // the token's index (a count below 2^31)
  int32_t value = 0;     // the offending id
  int32_t bound = 0;     // vocab
};

// ---- context ------------------------------------------------------------------------------------

// What the ops share on one stream: a cuBLAS handle bound to the stream, a device workspace
// that grows on demand (converted copies of GEMM inputs, attention and loss temporaries) and the
// data-error record. Opaque.
struct OpsContext;
struct OpsContextDeleter {
  // Waits for the stream, then frees the workspace and the cuBLAS handle.
  void operator()(OpsContext* context) const;
};
using OpsContextPtr = std::unique_ptr<OpsContext, OpsContextDeleter>;

// A context on `stream` (a cudaStream_t; nullptr is the legacy default stream) of the current
// device. The stream must outlive the context.
OpError CreateOpsContext(void* stream, OpsContextPtr* out);

// Grows the workspace to at least `bytes` now, so that the ops need not. Growing waits for the
// stream (the old block may be in use) and calls cudaMalloc; the memory is outside any
// device::Device budget.
OpError ReserveWorkspace(OpsContext* context, size_t bytes);

// The workspace's layout: every piece 256-byte aligned; RMSNorm's weight gradient sums rows in
// partials of kRmsNormRowsPerPartial.
inline constexpr size_t kWorkspaceAlignment = 256;
inline constexpr size_t kRmsNormRowsPerPartial = 64;

// The sizes of one decoder layer and its LM head, for WorkspaceBytes.
struct WorkspaceShape {
  size_t batch = 0, seq = 0;  // tokens = batch * seq
  size_t hidden = 0, kv_dim = 0, intermediate = 0, vocab = 0;
  size_t num_heads = 0, head_dim = 0;
  size_t q_dim = 0;  // num_heads * head_dim (0: hidden)
  size_t head_tokens = 0;  // tokens per call of the LM head's GEMMs (0: batch * seq)
  // The activations' dtype. fp32: any weight dtype. 16-bit: weights of that dtype (a model
  // computes every layer in its compute dtype), whose GEMMs and attention need no copies; a call
  // with another weight dtype may find the workspace too small.
  DType activations = DType::kF32;
};
// The most workspace any op of such a layer (and the head's loss) needs in one call, with the
// activations and weights above: a caller that gives the context this much (UseWorkspace) never
// sees it grow.
// Host arithmetic (ops_workspace.cc), in every build: `strata estimate` sizes GPU runs anywhere.
size_t WorkspaceBytes(const WorkspaceShape& shape);
// The part of it a cuDNN attention call takes for its 16-bit copies of fp32 activations
// (cuda_ops.cu): q, k, v and out in the forward; dout, dq, dk and dv as well in the backward.
// `tokens` = batch * seq. 16-bit activations need no copies.
size_t AttentionCopiesBytes(size_t tokens, size_t q_dim, size_t kv_dim, bool backward);
// Makes the caller's device memory [workspace, workspace + bytes) the context's workspace (the
// caller allocates it under its own budget and keeps it until the context is destroyed). From
// then on the context never allocates: a call needing more fails with kArgument ("the workspace
// is too small"). A workspace the context had allocated itself is freed first (after waiting for
// the stream).
OpError UseWorkspace(OpsContext* context, void* workspace, size_t bytes);

// TF32 for GEMMs with fp32 weights (cublasSetMathMode CUBLAS_TF32_TENSOR_OP_MATH): inputs rounded
// to TF32 (10-bit mantissa) on the tensor cores, fp32 accumulation. Off (the default): fp32
// throughout. GEMMs with 16-bit weights are unaffected.
OpError SetTf32(OpsContext* context, bool allow);

// Waits for the stream, then copies the recorded data error (kind kNone when there is none) to
// `*out` and clears the record.
OpError TakeDataError(OpsContext* context, DataError* out);

// Per-op profiles: RecordMark records a timestamp (a CUDA event, from a pool the context keeps)
// after everything enqueued so far; TakeMarks waits for the marks and returns each one's seconds
// after the first in *seconds, and forgets them.
OpError RecordMark(OpsContext* context);
OpError TakeMarks(OpsContext* context, std::vector<double>* seconds);

// ---- Embedding ----------------------------------------------------------------------------------
// out[t, :] = weight[tokens[t], :].  tokens [T] int32, weight [V, H], out [T, H].
// A token outside [0, V) gives a zero row and a data error.
OpError EmbeddingForward(OpsContext* context, const int32_t* tokens, size_t num_tokens,
                         Weight weight, size_t vocab, size_t hidden, Act out);
// dweight[tokens[t], :] += dout[t, :], repeated tokens added in position order (bit for bit the
// CPU's sum). dout [T, H], dweight [V, H] fp32. Bad tokens are skipped and recorded; tokens
// equal to `skip_token` (-1: none) add nothing (padding_idx).
OpError EmbeddingBackward(OpsContext* context, const int32_t* tokens, size_t num_tokens, CAct dout,
                          size_t vocab, size_t hidden, float* dweight, int32_t skip_token = -1);

// ---- RMSNorm ------------------------------------------------------------------------------------
// y = x * rstd * w; x, y [T, H] (y may alias x), weight [H], rstd [T].
OpError RmsNormForward(OpsContext* context, CAct x, Weight weight, size_t num_tokens, size_t hidden,
                       float eps, Act y, float* rstd);
// dx [T, H] overwritten (may alias dy); dweight [H] accumulated (nullptr to skip), through
// per-chunk partial sums (deterministic, not the CPU's order).
OpError RmsNormBackward(OpsContext* context, CAct x, Weight weight, const float* rstd, CAct dy,
                        size_t num_tokens, size_t hidden, Act dx, float* dweight);

// The residual add and the norm after it in one pass (LlamaOps::ResidualRmsNormForward):
// sum = a + b [T, H] (may alias a or b), then y = RMSNorm(sum) and rstd as RmsNormForward
// computes them from sum as stored (rounded to its dtype). The same arithmetic in the same order
// as ResidualAdd then RmsNormForward (in fp32 the same bits), with one read of a and b.
OpError ResidualRmsNormForward(OpsContext* context, CAct a, CAct b, Weight weight,
                               size_t num_tokens, size_t hidden, float eps, Act sum, Act y,
                               float* rstd);
// RmsNormBackward with the residual path's gradient added in the same pass: dx = the norm's
// input gradient + residual [T, H], rounded once (dx may alias dy, not residual). In fp32 the
// same bits as RmsNormBackward then AccumulateGradient(residual, dx).
OpError RmsNormResidualBackward(OpsContext* context, CAct x, Weight weight, const float* rstd,
                                CAct dy, CAct residual, size_t num_tokens, size_t hidden, Act dx,
                                float* dweight);

// ---- Linear (no bias), on cuBLAS ----------------------------------------------------------------
// y = x W^T.  x [T, in], W [out, in], y [T, out].
OpError LinearForward(OpsContext* context, CAct x, Weight weight, size_t num_tokens,
                      size_t in_features, size_t out_features, Act y);
// dx (=, or += with Accumulate::kAdd) dy W [T, in] (nullptr to skip); dweight += dy^T x
// [out, in] fp32 (nullptr to skip). Does nothing when a dimension is 0, as the CPU op.
OpError LinearBackward(OpsContext* context, CAct x, Weight weight, CAct dy, size_t num_tokens,
                       size_t in_features, size_t out_features, Act dx, Accumulate dx_mode,
                       float* dweight);

// ---- Bias ---------------------------------------------------------------------------------------
// y[t, c] += bias[c]; y [rows, cols].
OpError BiasForward(OpsContext* context, Act y, Weight bias, size_t rows, size_t cols);
// dbias[c] += sum over rows of dy[t, c] (one thread per column, rows in order).
OpError BiasBackward(OpsContext* context, CAct dy, size_t rows, size_t cols, float* dbias);

// ---- Rotary position embedding (in place; head_dim even) ----------------------------------------
// As cpu::RopeForward / RopeBackward, with the same scalings (rope.h).
// positions [batch * seq] in device memory (null: t mod seq).
OpError RopeForward(OpsContext* context, Act x, size_t batch, size_t seq, size_t heads,
                    size_t head_dim, float theta, const RopeScaling& scaling = {},
                    const int32_t* positions = nullptr);
OpError RopeBackward(OpsContext* context, Act dx, size_t batch, size_t seq, size_t heads,
                     size_t head_dim, float theta, const RopeScaling& scaling = {},
                     const int32_t* positions = nullptr);

// ---- Causal grouped-query attention -------------------------------------------------------------
// As cpu::AttentionForward / AttentionBackward; no [seq, seq] matrix exists. `precision` is the
// arithmetic (the model passes its weights' dtype):
//   kF32         the exact kernels: fp32 throughout, one warp per query row with an online
//                softmax; the backward recomputes the probabilities from lse, one warp per query
//                row for dq and one per key row for dk and dv. head_dim <= kMaxAttentionHeadDim.
//   kBF16, kF16  for head_dim 64 and 128, tiled kernels on the tensor cores
//                (cuda_attention_tc.cu: FlashAttention-2's blocking, 64 x 64 tiles, WMMA): q, k,
//                v, dout and the probabilities are rounded to the dtype, products accumulate in
//                fp32, softmax statistics are fp32 and outputs are stored in the activations'
//                dtype. Other head dims take the exact kernels.
// STRATA_ATTENTION=exact in the environment keeps every run on the exact kernels (a diagnostic).
// Packed documents (key_start [batch * seq] in device memory, as cpu::AttentionForward's) run on
// the exact kernels at any precision: a query sees keys [key_start, i] only.
// Both are deterministic (no atomics). The backward uses batch * num_heads * seq floats of the
// workspace.
//
// cuDNN: for bf16 and fp16 at head_dim 64 and 128 without packed documents, cuDNN's fused
// attention (flash attention; cuda_cudnn_attention.h) runs instead of the tiled kernels when a
// cuDNN 9 is found at run time (cudnn_loader.h); with fp32 activations on q, k, v (and out, dout)
// rounded to the dtype in the workspace, its outputs widened to fp32. Its backward is cuDNN's
// deterministic one.
// STRATA_ATTENTION=kernels keeps Strata's own kernels (to compare). Where cuDNN is absent the run
// says so once (log) and the kernels above run.
//
// 16-bit activations: q, k, v, out, dout, dq, dk and dv in bf16 (fp16) must have `precision` as
// their dtype (kArgument otherwise). cuDNN then reads and writes them where they are (no copies;
// each tensor must start 16-byte aligned, else the call runs the tiled or exact kernels), the
// tiled kernels load them into their 16-bit tiles as they are, and the exact kernels widen them
// to fp32; both store their results rounded once (each element of dq, dk and dv is summed in
// fp32 by the one block that stores it: no fp32 copy in the workspace). lse stays fp32 always.
inline constexpr size_t kMaxAttentionHeadDim = 256;

// Which kernels AttentionForward / AttentionBackward run for such a call: "cudnn", "tensor cores"
// (the tiled kernels) or "exact". For "cudnn" it builds cuDNN's graphs for the shape now, if not
// yet built: the model calls it at set-up so that no step builds them.
const char* PrepareAttention(OpsContext* context, size_t batch, size_t seq, size_t num_heads,
                             size_t num_kv_heads, size_t head_dim, DType precision,
                             bool packed_documents = false);
OpError AttentionForward(OpsContext* context, CAct q, CAct k, CAct v, size_t batch, size_t seq,
                         size_t num_heads, size_t num_kv_heads, size_t head_dim, Act out,
                         float* lse, DType precision = DType::kF32,
                         const int32_t* key_start = nullptr);
OpError AttentionBackward(OpsContext* context, CAct q, CAct k, CAct v, CAct out, const float* lse,
                          CAct dout, size_t batch, size_t seq, size_t num_heads,
                          size_t num_kv_heads, size_t head_dim, Act dq, Act dk, Act dv,
                          DType precision = DType::kF32, const int32_t* key_start = nullptr);

// ---- SwiGLU's element-wise part -----------------------------------------------------------------
OpError SiluMulForward(OpsContext* context, CAct gate, CAct up, size_t n, Act h);
OpError SiluMulBackward(OpsContext* context, CAct gate, CAct up, CAct dh, size_t n, Act dgate,
                        Act dup);

// ---- Residual add -------------------------------------------------------------------------------
OpError ResidualAdd(OpsContext* context, CAct a, CAct b, size_t n, Act y);
OpError AccumulateGradient(OpsContext* context, CAct dy, size_t n, Act dx);
// x *= s in place (LoRA's alpha / r), rounded as the CPU's.
OpError Scale(OpsContext* context, Act x, size_t n, float s);

// ---- Cross-entropy loss -------------------------------------------------------------------------
// *loss (one device float) = the mean over counted tokens of lse[t] - logits[t, target[t]], 0
// when none counts; lse [T] may be nullptr. Bad targets are recorded (the loss is unspecified).
OpError CrossEntropyForward(OpsContext* context, CAct logits, const int32_t* targets,
                            size_t num_tokens, size_t vocab, int32_t ignore_index, float* lse,
                            float* loss);
// As cpu::CrossEntropyBackward; `dloss` is a host value; dlogits may alias logits. The count of
// counted tokens is computed on the GPU. Bad targets are recorded (dlogits is unspecified).
OpError CrossEntropyBackward(OpsContext* context, CAct logits, const int32_t* targets,
                             const float* lse, size_t num_tokens, size_t vocab,
                             int32_t ignore_index, float dloss, Act dlogits);

// ---- The vocabulary split over tensor-parallel ranks --------------------------------------------
// As cpu::ShardEmbeddingForward and the others (cpu_ops.h): the rank holds rows [vocab_begin,
// vocab_begin + vocab) of the embedding and the LM head; tokens and targets are ids of the whole
// vocabulary, checked by the caller (ids outside the rank's rows are another rank's, not errors).
// The embedding's backward adds repeated tokens in position order, as EmbeddingBackward; the
// row sums accumulate in fp32 (the CPU's in double).
OpError ShardEmbeddingForward(OpsContext* context, const int32_t* tokens, size_t num_tokens,
                              Weight weight, size_t vocab_begin, size_t vocab, size_t hidden,
                              Act out);
OpError ShardEmbeddingBackward(OpsContext* context, const int32_t* tokens, size_t num_tokens,
                               CAct dout, size_t vocab_begin, size_t vocab, size_t hidden,
                               float* dweight, int32_t skip_token);
OpError CrossEntropyShardMax(OpsContext* context, CAct logits, size_t num_tokens, size_t vocab,
                             float* max);
OpError CrossEntropyShardSums(OpsContext* context, CAct logits, const int32_t* targets,
                              size_t num_tokens, size_t vocab_begin, size_t vocab,
                              int32_t ignore_index, const float* max, float* sums);
// *loss: one device float.
OpError CrossEntropyShardFinish(OpsContext* context, const int32_t* targets, size_t num_tokens,
                                int32_t ignore_index, const float* max, const float* sums,
                                float* lse, float* loss);
// dlogits may alias logits.
OpError CrossEntropyShardBackward(OpsContext* context, CAct logits, const int32_t* targets,
                                  const float* lse, size_t num_tokens, size_t vocab_begin,
                                  size_t vocab, int32_t ignore_index, float dloss, Act dlogits);

}  // namespace strata::model::cuda

// The Llama-family decoder's operations on the CPU, forward and backward: the reference the CUDA
// kernels are checked against (and which PyTorch checks, in tests/model/cpu_ops_test.cc).
//
// Conventions shared by every function here:
//   - Row-major float32 activations; T = batch * seq tokens, H hidden, nh query heads, nkv kv
//     heads, d = H / nh head dim, I intermediate, V vocab. Shapes are given as [rows, cols].
//   - Compute is fp32 (row reductions in double). Matrix products go through OpenBLAS
//     (cblas_sgemm), which runs on its own threads; the other loops are plain.
//   - A weight is a `Weight`: a pointer plus its storage dtype (fp32, bf16 or fp16). A non-fp32
//     weight is converted to an fp32 copy for the call, so a bf16 weight gives bit-for-bit the
//     result an fp32 weight holding the same (rounded) values gives.
//   - Weight gradients are fp32 and are ACCUMULATED (+=), so a caller zeroes them once per step
//     and micro-batches add up. Activation gradients are OVERWRITTEN unless the function says
//     otherwise (Linear takes an Accumulate argument, since several projections read one input).
//   - Pointers are owned by the caller and must not alias unless a function says they may.
//   - Functions that can meet bad data (a token id out of range) return a Status; the rest are
//     void and assume sizes consistent with the buffers (checked with assert in debug builds).
//
// Thread safety: every function is reentrant; distinct calls may run on distinct threads when
// their output buffers are distinct.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "model/rope.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata::model::cpu {

// A read-only weight tensor in its storage dtype.
struct Weight {
  const void* data = nullptr;
  device::DType dtype = device::DType::kF32;
};

// Whether a function writes (=) or adds (+=) into an activation-gradient buffer.
enum class Accumulate { kOverwrite, kAdd };

// dst[0, n) = float(src[0, n)) for src in `dtype`.
void ConvertToFloat(const void* src, device::DType dtype, size_t n, float* dst);

// `w` as fp32: w.data itself when it is fp32, otherwise `scratch` resized and filled with the
// converted values. The pointer is valid while `scratch` and w.data are.
const float* WeightAsFloat(Weight w, size_t n, std::vector<float>& scratch);

// ---- Embedding --------------------------------------------------------------------------------
// out[t, :] = weight[tokens[t], :].  tokens [T], weight [V, H], out [T, H].
// InvalidArgument (and `out` unspecified) when a token is outside [0, V).
Status EmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight, size_t vocab,
                        size_t hidden, float* out);
// dweight[tokens[t], :] += dout[t, :] (a scatter-add: repeated tokens add up).
// dout [T, H], dweight [V, H] fp32. InvalidArgument when a token is outside [0, V). Tokens
// equal to `skip_token` (-1: none) add nothing: nn.Embedding's padding_idx.
Status EmbeddingBackward(const int32_t* tokens, size_t num_tokens, const float* dout, size_t vocab,
                         size_t hidden, float* dweight, int32_t skip_token = -1);

// ---- RMSNorm ----------------------------------------------------------------------------------
// y[t, i] = x[t, i] * rstd[t] * w[i], rstd[t] = 1 / sqrt(mean_i(x[t, i]^2) + eps).
// x, y [T, H] (y may alias x), weight [H], rstd [T] (saved for backward).
void RmsNormForward(const float* x, Weight weight, size_t num_tokens, size_t hidden, float eps,
                    float* y, float* rstd);
// dx (overwritten, may alias dy) [T, H]; dweight [H] accumulated (nullptr to skip).
void RmsNormBackward(const float* x, Weight weight, const float* rstd, const float* dy,
                     size_t num_tokens, size_t hidden, float* dx, float* dweight);

// ---- Linear (no bias) -------------------------------------------------------------------------
// y = x W^T.  x [T, in], W [out, in] (Hugging Face layout), y [T, out].
void LinearForward(const float* x, Weight weight, size_t num_tokens, size_t in_features,
                   size_t out_features, float* y);
// dx (=, or += with Accumulate::kAdd) dy W  [T, in]   (dx may be nullptr to skip)
// dweight += dy^T x                          [out, in] (fp32; nullptr to skip)
void LinearBackward(const float* x, Weight weight, const float* dy, size_t num_tokens,
                    size_t in_features, size_t out_features, float* dx, Accumulate dx_mode,
                    float* dweight);

// ---- Bias -------------------------------------------------------------------------------------
// y[t, c] += bias[c].  y [rows, cols], bias [cols] (in its storage dtype).
void BiasForward(float* y, Weight bias, size_t rows, size_t cols);
// dbias[c] += sum over t of dy[t, c] (rows added in order, in double). dy [rows, cols].
void BiasBackward(const float* dy, size_t rows, size_t cols, float* dbias);

// ---- Rotary position embedding (Hugging Face Llama convention) -------------------------------
// In place on x [batch * seq, heads * head_dim] (head_dim even). For each token t at position
// p = positions[t] (null: t mod seq; packed documents restart their positions) and each head,
// with half = head_dim / 2, for i < half:
//   angle = p * RopeInvFreq(theta, scaling, i, head_dim)       (rope.h; theta^(-2i / head_dim)
//                                                               without scaling)
//   x'[i]        = a (x[i] cos(angle) - x[i + half] sin(angle))
//   x'[i + half] = a (x[i + half] cos(angle) + x[i] sin(angle))
// with a = scaling.attention_factor (q * cos + rotate_half(q) * sin). Angles are computed in
// double.
void RopeForward(float* x, size_t batch, size_t seq, size_t heads, size_t head_dim, float theta,
                 const RopeScaling& scaling = {}, const int32_t* positions = nullptr);
// The backward is the transposed rotation, applied in place to the gradient.
void RopeBackward(float* dx, size_t batch, size_t seq, size_t heads, size_t head_dim, float theta,
                  const RopeScaling& scaling = {}, const int32_t* positions = nullptr);

// ---- Causal grouped-query attention ------------------------------------------------------------
// Per sequence b and head h (using kv head g = h / (nh / nkv)):
//   out_h = softmax(q_h k_g^T / sqrt(d) + causal mask) v_g
// q, out [batch * seq, nh * d]; k, v [batch * seq, nkv * d]; nh a multiple of nkv.
// lse [batch, nh, seq]: the log-sum-exp of each row of the masked, scaled scores, saved so the
// backward recomputes the probabilities without a second max/sum pass.
// Packed documents: key_start [batch * seq] (null: all 0) gives each query the first key of its
// document within the sequence; query i attends to keys [key_start[i], i] only, so attention
// never crosses a document boundary. A document's keys are contiguous and key_start[i] <= i.
void AttentionForward(const float* q, const float* k, const float* v, size_t batch, size_t seq,
                      size_t num_heads, size_t num_kv_heads, size_t head_dim, float* out,
                      float* lse, const int32_t* key_start = nullptr);
// dq [batch * seq, nh * d], dk, dv [batch * seq, nkv * d], all overwritten; dk and dv sum over the
// nh / nkv query heads sharing each kv head. `out` and `lse` are the forward's.
void AttentionBackward(const float* q, const float* k, const float* v, const float* out,
                       const float* lse, const float* dout, size_t batch, size_t seq,
                       size_t num_heads, size_t num_kv_heads, size_t head_dim, float* dq, float* dk,
                       float* dv, const int32_t* key_start = nullptr);

// ---- SwiGLU's elementwise part -----------------------------------------------------------------
// h = silu(gate) * up, silu(g) = g / (1 + exp(-g)); gate, up, h [n] (h may alias gate or up).
// In the MLP: gate = x W_gate^T, up = x W_up^T, out = h W_down^T (the linears are separate).
void SiluMulForward(const float* gate, const float* up, size_t n, float* h);
// dgate = dh * up * silu'(gate), dup = dh * silu(gate); [n] each, overwritten. dgate and dup may
// alias dh but not gate or up.
void SiluMulBackward(const float* gate, const float* up, const float* dh, size_t n, float* dgate,
                     float* dup);

// ---- Residual add ------------------------------------------------------------------------------
// y = a + b, [n] each; y may alias a or b. The backward passes dy unchanged to both inputs, so
// callers add dy into the residual stream's gradient with AccumulateGradient.
void ResidualAdd(const float* a, const float* b, size_t n, float* y);
// dx[i] += dy[i].
void AccumulateGradient(const float* dy, size_t n, float* dx);
// x[i] *= s (LoRA's alpha / r).
void Scale(float* x, size_t n, float s);

// ---- Cross-entropy loss ------------------------------------------------------------------------
inline constexpr int32_t kIgnoreIndex = -100;

// Mean over the tokens whose target is not `ignore_index` of -log softmax(logits[t])[target[t]].
// logits [T, V], targets [T]; lse [T] receives each row's log-sum-exp (for the backward; may be
// nullptr). With no counted token the loss is 0 (PyTorch gives NaN). InvalidArgument when a
// target is neither ignore_index nor in [0, V).
Result<float> CrossEntropyForward(const float* logits, const int32_t* targets, size_t num_tokens,
                                  size_t vocab, int32_t ignore_index, float* lse);
// dlogits[t] = dloss * (softmax(logits[t]) - onehot(target[t])) / count for counted tokens, 0 for
// ignored ones; count = the number of counted tokens. dlogits [T, V] may alias logits (in place,
// saving a second [T, V] buffer). lse as written by the forward.
Status CrossEntropyBackward(const float* logits, const int32_t* targets, const float* lse,
                            size_t num_tokens, size_t vocab, int32_t ignore_index, float dloss,
                            float* dlogits);


// ---- The vocabulary split over tensor-parallel ranks --------------------------------------------
// A rank holds rows [vocab_begin, vocab_begin + vocab) of the [V, H] embedding and LM head
// (Megatron's vocabulary-parallel layers). Tokens and targets are ids of the whole vocabulary,
// checked by the caller; those outside the rank's rows are another rank's.

// out[t, :] = weight[tokens[t] - vocab_begin, :] for the rank's tokens, 0 for the others (the
// all-reduce over the ranks then gives every token its row).
void ShardEmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight,
                           size_t vocab_begin, size_t vocab, size_t hidden, float* out);
// dweight[tokens[t] - vocab_begin, :] += dout[t, :] for the rank's tokens but `skip_token`.
void ShardEmbeddingBackward(const int32_t* tokens, size_t num_tokens, const float* dout,
                            size_t vocab_begin, size_t vocab, size_t hidden, float* dweight,
                            int32_t skip_token);
// The cross-entropy over logits split by vocabulary, in three steps around two all-reduces
// (the whole [T, V] logits never exist on one rank):
//   1. max[t] = the largest of the rank's logits of row t          (then all-reduce max)
//   2. sums[t] = sum_j exp(logits[t, j] - max[t]) over the rank's j, and sums[T + t] = the
//      target's logit when the rank holds it, else 0               (then all-reduce sum)
//   3. lse[t] = max[t] + log(sums[t]); the loss is the mean of lse[t] - sums[T + t] over the
//      targets that are not `ignore_index` (0 with none).
void CrossEntropyShardMax(const float* logits, size_t num_tokens, size_t vocab, float* max);
void CrossEntropyShardSums(const float* logits, const int32_t* targets, size_t num_tokens,
                           size_t vocab_begin, size_t vocab, int32_t ignore_index,
                           const float* max, float* sums);
float CrossEntropyShardFinish(const int32_t* targets, size_t num_tokens, int32_t ignore_index,
                              const float* max, const float* sums, float* lse);
// CrossEntropyBackward for the rank's columns: the one-hot only where the rank holds the target;
// count = the targets that are not `ignore_index` (every rank counts the same).
void CrossEntropyShardBackward(const float* logits, const int32_t* targets, const float* lse,
                               size_t num_tokens, size_t vocab_begin, size_t vocab,
                               int32_t ignore_index, float dloss, float* dlogits);

}  // namespace strata::model::cpu

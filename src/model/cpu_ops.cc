#include "model/cpu_ops.h"

#include <cblas.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

namespace strata::model::cpu {
namespace {

using device::DType;

// cblas takes int sizes; every size here is far below 2^31 for one layer's tensors.
int I(size_t n) {
  assert(n <= static_cast<size_t>(std::numeric_limits<int>::max()));
  return static_cast<int>(n);
}

Status CheckTokens(const int32_t* tokens, size_t n, size_t vocab, const char* what) {
  for (size_t t = 0; t < n; ++t) {
    if (tokens[t] < 0 || static_cast<size_t>(tokens[t]) >= vocab) {
      return InvalidArgumentError(std::string(what) + " " + std::to_string(tokens[t]) +
                                  " at position " + std::to_string(t) + " is outside [0, " +
                                  std::to_string(vocab) + ")");
    }
  }
  return Status::Ok();
}

double Sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// a cos and a sin of p * inv_freq(i) for i < d/2 (rope.h), one row of `half` entries per
// position; a = the scaling's attention factor.
void RopeTables(size_t seq, size_t head_dim, float theta, const RopeScaling& scaling,
                std::vector<float>& cos_table, std::vector<float>& sin_table) {
  const size_t half = head_dim / 2;
  cos_table.resize(seq * half);
  sin_table.resize(seq * half);
  for (size_t i = 0; i < half; ++i) {
    const double inv_freq = RopeInvFreq(static_cast<double>(theta), scaling, i, head_dim);
    for (size_t p = 0; p < seq; ++p) {
      const double angle = static_cast<double>(p) * inv_freq;
      cos_table[p * half + i] = static_cast<float>(scaling.attention_factor * std::cos(angle));
      sin_table[p * half + i] = static_cast<float>(scaling.attention_factor * std::sin(angle));
    }
  }
}

// Rotates every head of x by +angle (sign = 1) or -angle (sign = -1).
void Rotate(float* x, size_t batch, size_t seq, size_t heads, size_t head_dim, float theta,
            const RopeScaling& scaling, const int32_t* positions, float sign) {
  assert(head_dim % 2 == 0);
  std::vector<float> cos_table, sin_table;
  RopeTables(seq, head_dim, theta, scaling, cos_table, sin_table);
  const size_t half = head_dim / 2;
  for (size_t t = 0; t < batch * seq; ++t) {
    // A position is below seq (a document's tokens within its sequence).
    const size_t p = positions != nullptr ? static_cast<size_t>(positions[t]) : t % seq;
    const float* c = &cos_table[p * half];
    const float* s = &sin_table[p * half];
    for (size_t h = 0; h < heads; ++h) {
      float* row = x + (t * heads + h) * head_dim;
      for (size_t i = 0; i < half; ++i) {
        const float a = row[i];
        const float b = row[i + half];
        const float si = sign * s[i];
        row[i] = a * c[i] - b * si;
        row[i + half] = b * c[i] + a * si;
      }
    }
  }
}

}  // namespace

void ConvertToFloat(const void* src, DType dtype, size_t n, float* dst) {
  device::ConvertHost(src, dtype, dst, DType::kF32, n);
}

const float* WeightAsFloat(Weight w, size_t n, std::vector<float>& scratch) {
  if (w.dtype == DType::kF32) return static_cast<const float*>(w.data);
  scratch.resize(n);
  ConvertToFloat(w.data, w.dtype, n, scratch.data());
  return scratch.data();
}

// ---- Embedding ----------------------------------------------------------------------------------

Status EmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight, size_t vocab,
                        size_t hidden, float* out) {
  STRATA_RETURN_IF_ERROR(CheckTokens(tokens, num_tokens, vocab, "token id"));
  // Rows are converted one at a time: converting the whole [V, H] table would dwarf the lookup.
  const size_t row_bytes = hidden * device::DTypeSize(weight.dtype);
  for (size_t t = 0; t < num_tokens; ++t) {
    const auto* row = static_cast<const char*>(weight.data) + tokens[t] * row_bytes;
    ConvertToFloat(row, weight.dtype, hidden, out + t * hidden);
  }
  return Status::Ok();
}

Status EmbeddingBackward(const int32_t* tokens, size_t num_tokens, const float* dout, size_t vocab,
                         size_t hidden, float* dweight, int32_t skip_token) {
  STRATA_RETURN_IF_ERROR(CheckTokens(tokens, num_tokens, vocab, "token id"));
  for (size_t t = 0; t < num_tokens; ++t) {
    if (tokens[t] == skip_token) continue;
    float* dst = dweight + static_cast<size_t>(tokens[t]) * hidden;
    const float* src = dout + t * hidden;
    for (size_t i = 0; i < hidden; ++i)
      dst[i] += src[i];
  }
  return Status::Ok();
}

// ---- Bias ---------------------------------------------------------------------------------------

void BiasForward(float* y, Weight bias, size_t rows, size_t cols) {
  std::vector<float> scratch;
  const float* b = WeightAsFloat(bias, cols, scratch);
  for (size_t t = 0; t < rows; ++t) {
    float* yr = y + t * cols;
    for (size_t c = 0; c < cols; ++c)
      yr[c] += b[c];
  }
}

void BiasBackward(const float* dy, size_t rows, size_t cols, float* dbias) {
  std::vector<double> sum(cols, 0.0);
  for (size_t t = 0; t < rows; ++t) {
    const float* dyr = dy + t * cols;
    for (size_t c = 0; c < cols; ++c)
      sum[c] += dyr[c];
  }
  for (size_t c = 0; c < cols; ++c)
    dbias[c] += static_cast<float>(sum[c]);
}

// ---- RMSNorm ------------------------------------------------------------------------------------

void RmsNormForward(const float* x, Weight weight, size_t num_tokens, size_t hidden, float eps,
                    float* y, float* rstd) {
  std::vector<float> scratch;
  const float* w = WeightAsFloat(weight, hidden, scratch);
  for (size_t t = 0; t < num_tokens; ++t) {
    const float* xr = x + t * hidden;
    double sum_sq = 0.0;
    for (size_t i = 0; i < hidden; ++i)
      sum_sq += static_cast<double>(xr[i]) * xr[i];
    const float r = static_cast<float>(1.0 / std::sqrt(sum_sq / hidden + eps));
    rstd[t] = r;
    float* yr = y + t * hidden;
    for (size_t i = 0; i < hidden; ++i)
      yr[i] = xr[i] * r * w[i];
  }
}

void RmsNormBackward(const float* x, Weight weight, const float* rstd, const float* dy,
                     size_t num_tokens, size_t hidden, float* dx, float* dweight) {
  std::vector<float> scratch;
  const float* w = WeightAsFloat(weight, hidden, scratch);
  // With r = rstd: dx_j = r w_j dy_j - x_j r^3 / H * sum_i dy_i w_i x_i.
  for (size_t t = 0; t < num_tokens; ++t) {
    const float* xr = x + t * hidden;
    const float* dyr = dy + t * hidden;
    const float r = rstd[t];
    double dot = 0.0;
    for (size_t i = 0; i < hidden; ++i)
      dot += static_cast<double>(dyr[i]) * w[i] * xr[i];
    const float coef = static_cast<float>(dot * r * r * r / hidden);
    if (dweight != nullptr) {
      for (size_t i = 0; i < hidden; ++i)
        dweight[i] += dyr[i] * xr[i] * r;
    }
    float* dxr = dx + t * hidden;
    for (size_t i = 0; i < hidden; ++i)
      dxr[i] = r * w[i] * dyr[i] - xr[i] * coef;
  }
}

// ---- Linear -------------------------------------------------------------------------------------

void LinearForward(const float* x, Weight weight, size_t num_tokens, size_t in_features,
                   size_t out_features, float* y) {
  if (num_tokens == 0 || out_features == 0) return;
  std::vector<float> scratch;
  const float* w = WeightAsFloat(weight, out_features * in_features, scratch);
  // y[T, out] = x[T, in] * W[out, in]^T
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, I(num_tokens), I(out_features),
              I(in_features), 1.0f, x, I(in_features), w, I(in_features), 0.0f, y, I(out_features));
}

void LinearBackward(const float* x, Weight weight, const float* dy, size_t num_tokens,
                    size_t in_features, size_t out_features, float* dx, Accumulate dx_mode,
                    float* dweight) {
  if (num_tokens == 0 || in_features == 0 || out_features == 0) return;
  if (dx != nullptr) {
    std::vector<float> scratch;
    const float* w = WeightAsFloat(weight, out_features * in_features, scratch);
    // dx[T, in] (+)= dy[T, out] * W[out, in]
    const float beta = dx_mode == Accumulate::kAdd ? 1.0f : 0.0f;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, I(num_tokens), I(in_features),
                I(out_features), 1.0f, dy, I(out_features), w, I(in_features), beta, dx,
                I(in_features));
  }
  if (dweight != nullptr) {
    // dW[out, in] += dy[T, out]^T * x[T, in]
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, I(out_features), I(in_features),
                I(num_tokens), 1.0f, dy, I(out_features), x, I(in_features), 1.0f, dweight,
                I(in_features));
  }
}

// ---- Rotary position embedding ------------------------------------------------------------------

void RopeForward(float* x, size_t batch, size_t seq, size_t heads, size_t head_dim, float theta,
                 const RopeScaling& scaling, const int32_t* positions) {
  Rotate(x, batch, seq, heads, head_dim, theta, scaling, positions, 1.0f);
}

void RopeBackward(float* dx, size_t batch, size_t seq, size_t heads, size_t head_dim, float theta,
                  const RopeScaling& scaling, const int32_t* positions) {
  // The rotation is orthogonal, so its transpose (the backward) is the rotation by -angle.
  Rotate(dx, batch, seq, heads, head_dim, theta, scaling, positions, -1.0f);
}

// ---- Attention ----------------------------------------------------------------------------------
//
// One (sequence, head) at a time, with the [seq, seq] score matrix materialised: simple and exact
// enough to be the reference. The gemms compute the full square; the causal mask then zeroes the
// upper triangle of the probabilities.

void AttentionForward(const float* q, const float* k, const float* v, size_t batch, size_t seq,
                      size_t num_heads, size_t num_kv_heads, size_t head_dim, float* out,
                      float* lse, const int32_t* key_start) {
  assert(num_kv_heads > 0 && num_heads % num_kv_heads == 0);
  if (batch == 0 || seq == 0 || num_heads == 0) return;
  const size_t group = num_heads / num_kv_heads;
  const size_t q_stride = num_heads * head_dim;
  const size_t kv_stride = num_kv_heads * head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  std::vector<float> probs(seq * seq);
  for (size_t b = 0; b < batch; ++b) {
    for (size_t h = 0; h < num_heads; ++h) {
      const size_t g = h / group;
      const float* qh = q + b * seq * q_stride + h * head_dim;
      const float* kg = k + b * seq * kv_stride + g * head_dim;
      const float* vg = v + b * seq * kv_stride + g * head_dim;
      float* oh = out + b * seq * q_stride + h * head_dim;
      float* lse_h = lse + (b * num_heads + h) * seq;
      // S = scale * Q K^T   [seq, seq]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, I(seq), I(seq), I(head_dim), scale, qh,
                  I(q_stride), kg, I(kv_stride), 0.0f, probs.data(), I(seq));
      for (size_t i = 0; i < seq; ++i) {
        float* row = &probs[i * seq];
        const size_t first = key_start != nullptr ? static_cast<size_t>(key_start[b * seq + i]) : 0;
        float max = row[first];
        for (size_t j = first + 1; j <= i; ++j)
          max = std::max(max, row[j]);
        double sum = 0.0;
        for (size_t j = first; j <= i; ++j) {
          row[j] = std::exp(row[j] - max);
          sum += row[j];
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (size_t j = first; j <= i; ++j)
          row[j] *= inv;
        for (size_t j = 0; j < first; ++j)
          row[j] = 0.0f;
        for (size_t j = i + 1; j < seq; ++j)
          row[j] = 0.0f;
        lse_h[i] = max + static_cast<float>(std::log(sum));
      }
      // O = P V   [seq, d]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, I(seq), I(head_dim), I(seq), 1.0f,
                  probs.data(), I(seq), vg, I(kv_stride), 0.0f, oh, I(q_stride));
    }
  }
}

void AttentionBackward(const float* q, const float* k, const float* v, const float* out,
                       const float* lse, const float* dout, size_t batch, size_t seq,
                       size_t num_heads, size_t num_kv_heads, size_t head_dim, float* dq, float* dk,
                       float* dv, const int32_t* key_start) {
  assert(num_kv_heads > 0 && num_heads % num_kv_heads == 0);
  const size_t group = num_heads / num_kv_heads;
  const size_t q_stride = num_heads * head_dim;
  const size_t kv_stride = num_kv_heads * head_dim;
  std::fill(dk, dk + batch * seq * kv_stride, 0.0f);
  std::fill(dv, dv + batch * seq * kv_stride, 0.0f);
  if (batch == 0 || seq == 0 || num_heads == 0) return;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  std::vector<float> probs(seq * seq);
  std::vector<float> dprobs(seq * seq);
  for (size_t b = 0; b < batch; ++b) {
    for (size_t h = 0; h < num_heads; ++h) {
      const size_t g = h / group;
      const size_t q_off = b * seq * q_stride + h * head_dim;
      const size_t kv_off = b * seq * kv_stride + g * head_dim;
      const float* lse_h = lse + (b * num_heads + h) * seq;
      // P = exp(scale * Q K^T - lse), masked.
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, I(seq), I(seq), I(head_dim), scale,
                  q + q_off, I(q_stride), k + kv_off, I(kv_stride), 0.0f, probs.data(), I(seq));
      for (size_t i = 0; i < seq; ++i) {
        float* row = &probs[i * seq];
        const size_t first = key_start != nullptr ? static_cast<size_t>(key_start[b * seq + i]) : 0;
        for (size_t j = 0; j < first; ++j)
          row[j] = 0.0f;
        for (size_t j = first; j <= i; ++j)
          row[j] = std::exp(row[j] - lse_h[i]);
        for (size_t j = i + 1; j < seq; ++j)
          row[j] = 0.0f;
      }
      // dP = dO V^T   [seq, seq]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, I(seq), I(seq), I(head_dim), 1.0f,
                  dout + q_off, I(q_stride), v + kv_off, I(kv_stride), 0.0f, dprobs.data(), I(seq));
      // dS = P * (dP - rowsum(dO * O)), the softmax backward (rowsum(P * dP) = dO . O).
      for (size_t i = 0; i < seq; ++i) {
        const float* o_row = out + q_off + i * q_stride;
        const float* do_row = dout + q_off + i * q_stride;
        double dot = 0.0;
        for (size_t c = 0; c < head_dim; ++c)
          dot += static_cast<double>(o_row[c]) * do_row[c];
        const float di = static_cast<float>(dot);
        float* ds = &dprobs[i * seq];
        const float* p = &probs[i * seq];
        for (size_t j = 0; j < seq; ++j)
          ds[j] = p[j] * (ds[j] - di);
      }
      // dV_g += P^T dO   [seq, d]
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, I(seq), I(head_dim), I(seq), 1.0f,
                  probs.data(), I(seq), dout + q_off, I(q_stride), 1.0f, dv + kv_off, I(kv_stride));
      // dQ_h = scale * dS K   [seq, d]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, I(seq), I(head_dim), I(seq), scale,
                  dprobs.data(), I(seq), k + kv_off, I(kv_stride), 0.0f, dq + q_off, I(q_stride));
      // dK_g += scale * dS^T Q   [seq, d]
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, I(seq), I(head_dim), I(seq), scale,
                  dprobs.data(), I(seq), q + q_off, I(q_stride), 1.0f, dk + kv_off, I(kv_stride));
    }
  }
}

// ---- SwiGLU -------------------------------------------------------------------------------------

void SiluMulForward(const float* gate, const float* up, size_t n, float* h) {
  for (size_t i = 0; i < n; ++i) {
    const double g = gate[i];
    h[i] = static_cast<float>(g * Sigmoid(g) * up[i]);
  }
}

void SiluMulBackward(const float* gate, const float* up, const float* dh, size_t n, float* dgate,
                     float* dup) {
  for (size_t i = 0; i < n; ++i) {
    const double g = gate[i];
    const double s = Sigmoid(g);
    const double d = dh[i];
    // silu'(g) = s + g s (1 - s)
    const double dg = d * up[i] * (s * (1.0 + g * (1.0 - s)));
    const double du = d * g * s;
    dgate[i] = static_cast<float>(dg);
    dup[i] = static_cast<float>(du);
  }
}

// ---- Residual -----------------------------------------------------------------------------------

void ResidualAdd(const float* a, const float* b, size_t n, float* y) {
  for (size_t i = 0; i < n; ++i)
    y[i] = a[i] + b[i];
}

void AccumulateGradient(const float* dy, size_t n, float* dx) {
  for (size_t i = 0; i < n; ++i)
    dx[i] += dy[i];
}

void Scale(float* x, size_t n, float s) {
  for (size_t i = 0; i < n; ++i)
    x[i] *= s;
}

// ---- Cross-entropy ------------------------------------------------------------------------------

namespace {

Status CheckTargets(const int32_t* targets, size_t n, size_t vocab, int32_t ignore_index,
                    size_t* count) {
  *count = 0;
  for (size_t t = 0; t < n; ++t) {
    if (targets[t] == ignore_index) continue;
    if (targets[t] < 0 || static_cast<size_t>(targets[t]) >= vocab) {
      return InvalidArgumentError("target " + std::to_string(targets[t]) + " at position " +
                                  std::to_string(t) + " is outside [0, " + std::to_string(vocab) +
                                  ") and is not the ignore index " + std::to_string(ignore_index));
    }
    ++*count;
  }
  return Status::Ok();
}

}  // namespace

Result<float> CrossEntropyForward(const float* logits, const int32_t* targets, size_t num_tokens,
                                  size_t vocab, int32_t ignore_index, float* lse) {
  size_t count = 0;
  STRATA_RETURN_IF_ERROR(CheckTargets(targets, num_tokens, vocab, ignore_index, &count));
  double total = 0.0;
  for (size_t t = 0; t < num_tokens; ++t) {
    const float* row = logits + t * vocab;
    float max = -std::numeric_limits<float>::infinity();
    for (size_t j = 0; j < vocab; ++j)
      max = std::max(max, row[j]);
    double sum = 0.0;
    for (size_t j = 0; j < vocab; ++j)
      sum += std::exp(static_cast<double>(row[j]) - max);
    const double row_lse = max + std::log(sum);
    if (lse != nullptr) lse[t] = static_cast<float>(row_lse);
    if (targets[t] != ignore_index) total += row_lse - row[targets[t]];
  }
  return count == 0 ? 0.0f : static_cast<float>(total / static_cast<double>(count));
}

Status CrossEntropyBackward(const float* logits, const int32_t* targets, const float* lse,
                            size_t num_tokens, size_t vocab, int32_t ignore_index, float dloss,
                            float* dlogits) {
  size_t count = 0;
  STRATA_RETURN_IF_ERROR(CheckTargets(targets, num_tokens, vocab, ignore_index, &count));
  // The whole vocabulary is one rank's "shard": the same arithmetic.
  CrossEntropyShardBackward(logits, targets, lse, num_tokens, 0, vocab, ignore_index, dloss,
                            dlogits);
  return Status::Ok();
}

// ---- The vocabulary split over tensor-parallel ranks --------------------------------------------

namespace {

// The row of `token` among the rank's rows [vocab_begin, vocab_begin + vocab), or -1.
int64_t OwnRow(int32_t token, size_t vocab_begin, size_t vocab) {
  const int64_t row = static_cast<int64_t>(token) - static_cast<int64_t>(vocab_begin);
  return row >= 0 && row < static_cast<int64_t>(vocab) ? row : -1;
}

}  // namespace

void ShardEmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight,
                           size_t vocab_begin, size_t vocab, size_t hidden, float* out) {
  const size_t row_bytes = hidden * device::DTypeSize(weight.dtype);
  for (size_t t = 0; t < num_tokens; ++t) {
    const int64_t row = OwnRow(tokens[t], vocab_begin, vocab);
    if (row < 0) {
      std::fill(out + t * hidden, out + (t + 1) * hidden, 0.0f);
      continue;
    }
    const auto* src = static_cast<const char*>(weight.data) + static_cast<size_t>(row) * row_bytes;
    ConvertToFloat(src, weight.dtype, hidden, out + t * hidden);
  }
}

void ShardEmbeddingBackward(const int32_t* tokens, size_t num_tokens, const float* dout,
                            size_t vocab_begin, size_t vocab, size_t hidden, float* dweight,
                            int32_t skip_token) {
  for (size_t t = 0; t < num_tokens; ++t) {
    const int64_t row = OwnRow(tokens[t], vocab_begin, vocab);
    if (row < 0 || tokens[t] == skip_token) continue;
    float* dst = dweight + static_cast<size_t>(row) * hidden;
    const float* src = dout + t * hidden;
    for (size_t i = 0; i < hidden; ++i)
      dst[i] += src[i];
  }
}

void CrossEntropyShardMax(const float* logits, size_t num_tokens, size_t vocab, float* max) {
  for (size_t t = 0; t < num_tokens; ++t) {
    const float* row = logits + t * vocab;
    float m = -std::numeric_limits<float>::infinity();
    for (size_t j = 0; j < vocab; ++j)
      m = std::max(m, row[j]);
    max[t] = m;
  }
}

void CrossEntropyShardSums(const float* logits, const int32_t* targets, size_t num_tokens,
                           size_t vocab_begin, size_t vocab, int32_t ignore_index,
                           const float* max, float* sums) {
  for (size_t t = 0; t < num_tokens; ++t) {
    const float* row = logits + t * vocab;
    double sum = 0.0;
    for (size_t j = 0; j < vocab; ++j)
      sum += std::exp(static_cast<double>(row[j]) - max[t]);
    sums[t] = static_cast<float>(sum);
    const int64_t own = targets[t] == ignore_index ? -1 : OwnRow(targets[t], vocab_begin, vocab);
    sums[num_tokens + t] = own < 0 ? 0.0f : row[own];
  }
}

float CrossEntropyShardFinish(const int32_t* targets, size_t num_tokens, int32_t ignore_index,
                              const float* max, const float* sums, float* lse) {
  double total = 0.0;
  size_t count = 0;
  for (size_t t = 0; t < num_tokens; ++t) {
    const double row_lse = static_cast<double>(max[t]) + std::log(static_cast<double>(sums[t]));
    lse[t] = static_cast<float>(row_lse);
    if (targets[t] == ignore_index) continue;
    total += row_lse - sums[num_tokens + t];
    ++count;
  }
  return count == 0 ? 0.0f : static_cast<float>(total / static_cast<double>(count));
}

void CrossEntropyShardBackward(const float* logits, const int32_t* targets, const float* lse,
                               size_t num_tokens, size_t vocab_begin, size_t vocab,
                               int32_t ignore_index, float dloss, float* dlogits) {
  size_t count = 0;
  for (size_t t = 0; t < num_tokens; ++t)
    count += targets[t] != ignore_index ? 1 : 0;
  const float scale = count == 0 ? 0.0f : dloss / static_cast<float>(count);
  for (size_t t = 0; t < num_tokens; ++t) {
    const float* row = logits + t * vocab;
    float* drow = dlogits + t * vocab;  // may be `row` itself
    if (targets[t] == ignore_index) {
      std::fill(drow, drow + vocab, 0.0f);
      continue;
    }
    const float row_lse = lse[t];
    for (size_t j = 0; j < vocab; ++j)
      drow[j] = std::exp(row[j] - row_lse) * scale;
    const int64_t own = OwnRow(targets[t], vocab_begin, vocab);
    if (own >= 0) drow[own] -= scale;
  }
}

}  // namespace strata::model::cpu

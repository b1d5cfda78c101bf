// CpuLlamaOps: cpu_ops.h behind the LlamaOps interface; OpProfiler, which times any LlamaOps;
// and the CUDA factory's stand-in in a build without CUDA.
#include "model/llama_ops.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <utility>

#include "model/cuda_ops.h"
#include "model/llama_config.h"
#include "model/llama_model.h"

namespace strata::model {

namespace {

class CpuLlamaOps final : public LlamaOps {
 public:
  Status EmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight, size_t vocab,
                          size_t hidden, float* out) override {
    return cpu::EmbeddingForward(tokens, num_tokens, weight, vocab, hidden, out);
  }
  Status EmbeddingBackward(const int32_t* tokens, size_t num_tokens, const float* dout,
                           size_t vocab, size_t hidden, float* dweight,
                           int32_t skip_token) override {
    return cpu::EmbeddingBackward(tokens, num_tokens, dout, vocab, hidden, dweight, skip_token);
  }
  Status RmsNormForward(const float* x, Weight weight, size_t num_tokens, size_t hidden, float eps,
                        float* y, float* rstd) override {
    cpu::RmsNormForward(x, weight, num_tokens, hidden, eps, y, rstd);
    return Status::Ok();
  }
  Status RmsNormBackward(const float* x, Weight weight, const float* rstd, const float* dy,
                         size_t num_tokens, size_t hidden, float* dx, float* dweight) override {
    cpu::RmsNormBackward(x, weight, rstd, dy, num_tokens, hidden, dx, dweight);
    return Status::Ok();
  }
  Status LinearForward(const float* x, Weight weight, size_t num_tokens, size_t in_features,
                       size_t out_features, float* y) override {
    cpu::LinearForward(x, weight, num_tokens, in_features, out_features, y);
    return Status::Ok();
  }
  Status LinearBackward(const float* x, Weight weight, const float* dy, size_t num_tokens,
                        size_t in_features, size_t out_features, float* dx, Accumulate dx_mode,
                        float* dweight) override {
    cpu::LinearBackward(x, weight, dy, num_tokens, in_features, out_features, dx, dx_mode, dweight);
    return Status::Ok();
  }
  Status BiasForward(float* y, Weight bias, size_t rows, size_t cols) override {
    cpu::BiasForward(y, bias, rows, cols);
    return Status::Ok();
  }
  Status BiasBackward(const float* dy, size_t rows, size_t cols, float* dbias) override {
    cpu::BiasBackward(dy, rows, cols, dbias);
    return Status::Ok();
  }
  Status RopeForward(float* x, size_t batch, size_t seq, size_t heads, size_t head_dim, float theta,
                     const RopeScaling& scaling, const int32_t* positions) override {
    cpu::RopeForward(x, batch, seq, heads, head_dim, theta, scaling, positions);
    return Status::Ok();
  }
  Status RopeBackward(float* dx, size_t batch, size_t seq, size_t heads, size_t head_dim,
                      float theta, const RopeScaling& scaling, const int32_t* positions) override {
    cpu::RopeBackward(dx, batch, seq, heads, head_dim, theta, scaling, positions);
    return Status::Ok();
  }
  Status AttentionForward(const float* q, const float* k, const float* v, size_t batch, size_t seq,
                          size_t num_heads, size_t num_kv_heads, size_t head_dim, float* out,
                          float* lse, device::DType /*precision*/,
                          const int32_t* key_start) override {
    cpu::AttentionForward(q, k, v, batch, seq, num_heads, num_kv_heads, head_dim, out, lse,
                          key_start);
    return Status::Ok();
  }
  Status AttentionBackward(const float* q, const float* k, const float* v, const float* out,
                           const float* lse, const float* dout, size_t batch, size_t seq,
                           size_t num_heads, size_t num_kv_heads, size_t head_dim, float* dq,
                           float* dk, float* dv, device::DType /*precision*/,
                           const int32_t* key_start) override {
    cpu::AttentionBackward(q, k, v, out, lse, dout, batch, seq, num_heads, num_kv_heads, head_dim,
                           dq, dk, dv, key_start);
    return Status::Ok();
  }
  Status SiluMulForward(const float* gate, const float* up, size_t n, float* h) override {
    cpu::SiluMulForward(gate, up, n, h);
    return Status::Ok();
  }
  Status SiluMulBackward(const float* gate, const float* up, const float* dh, size_t n,
                         float* dgate, float* dup) override {
    cpu::SiluMulBackward(gate, up, dh, n, dgate, dup);
    return Status::Ok();
  }
  Status ResidualAdd(const float* a, const float* b, size_t n, float* y) override {
    cpu::ResidualAdd(a, b, n, y);
    return Status::Ok();
  }
  Status AccumulateGradient(const float* dy, size_t n, float* dx) override {
    cpu::AccumulateGradient(dy, n, dx);
    return Status::Ok();
  }
  Status Scale(float* x, size_t n, float s) override {
    cpu::Scale(x, n, s);
    return Status::Ok();
  }
  Status CrossEntropyForward(const float* logits, const int32_t* targets, size_t num_tokens,
                             size_t vocab, int32_t ignore_index, float* lse, float* loss) override {
    STRATA_ASSIGN_OR_RETURN(
        *loss, cpu::CrossEntropyForward(logits, targets, num_tokens, vocab, ignore_index, lse));
    return Status::Ok();
  }
  Status CrossEntropyBackward(const float* logits, const int32_t* targets, const float* lse,
                              size_t num_tokens, size_t vocab, int32_t ignore_index, float dloss,
                              float* dlogits) override {
    return cpu::CrossEntropyBackward(logits, targets, lse, num_tokens, vocab, ignore_index, dloss,
                                     dlogits);
  }
  Status ShardEmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight,
                               size_t vocab_begin, size_t vocab, size_t hidden,
                               float* out) override {
    cpu::ShardEmbeddingForward(tokens, num_tokens, weight, vocab_begin, vocab, hidden, out);
    return Status::Ok();
  }
  Status ShardEmbeddingBackward(const int32_t* tokens, size_t num_tokens, const float* dout,
                                size_t vocab_begin, size_t vocab, size_t hidden, float* dweight,
                                int32_t skip_token) override {
    cpu::ShardEmbeddingBackward(tokens, num_tokens, dout, vocab_begin, vocab, hidden, dweight,
                                skip_token);
    return Status::Ok();
  }
  Status CrossEntropyShardMax(const float* logits, size_t num_tokens, size_t vocab,
                              float* max) override {
    cpu::CrossEntropyShardMax(logits, num_tokens, vocab, max);
    return Status::Ok();
  }
  Status CrossEntropyShardSums(const float* logits, const int32_t* targets, size_t num_tokens,
                               size_t vocab_begin, size_t vocab, int32_t ignore_index,
                               const float* max, float* sums) override {
    cpu::CrossEntropyShardSums(logits, targets, num_tokens, vocab_begin, vocab, ignore_index, max,
                               sums);
    return Status::Ok();
  }
  Status CrossEntropyShardFinish(const int32_t* targets, size_t num_tokens, int32_t ignore_index,
                                 const float* max, const float* sums, float* lse,
                                 float* loss) override {
    *loss = cpu::CrossEntropyShardFinish(targets, num_tokens, ignore_index, max, sums, lse);
    return Status::Ok();
  }
  Status CrossEntropyShardBackward(const float* logits, const int32_t* targets, const float* lse,
                                   size_t num_tokens, size_t vocab_begin, size_t vocab,
                                   int32_t ignore_index, float dloss, float* dlogits) override {
    cpu::CrossEntropyShardBackward(logits, targets, lse, num_tokens, vocab_begin, vocab,
                                   ignore_index, dloss, dlogits);
    return Status::Ok();
  }
  bool HasShardOps() const override { return true; }
  Status CheckDataErrors() override { return Status::Ok(); }

  Status Mark() override {
    std::lock_guard<std::mutex> lock(mu_);
    marks_.push_back(std::chrono::steady_clock::now());
    return Status::Ok();
  }
  Result<std::vector<double>> TakeMarks() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<double> out;
    out.reserve(marks_.size());
    for (const auto& t : marks_) {
      out.push_back(std::chrono::duration<double>(t - marks_.front()).count());
    }
    marks_.clear();
    return out;
  }

 private:
  std::mutex mu_;  // the ops serve every stream; a profile's marks come from one
  std::vector<std::chrono::steady_clock::time_point> marks_;
};

}  // namespace

// ---- OpProfiler
// -----------------------------------------------------------------------------------

template <typename Call>
Status OpProfiler::Timed(const char* op, Call&& call) {
  STRATA_RETURN_IF_ERROR(inner_->Mark());
  Status st = call();
  STRATA_RETURN_IF_ERROR(inner_->Mark());
  pending_.push_back(op);
  return st;
}

Status OpProfiler::Collect() {
  STRATA_ASSIGN_OR_RETURN(std::vector<double> t, inner_->TakeMarks());
  if (t.size() != 2 * pending_.size()) {
    const size_t marks = t.size(), ops = pending_.size();
    pending_.clear();
    return InternalError(fmt::format("op profile: {} marks for {} ops", marks, ops));
  }
  for (size_t i = 0; i < pending_.size(); ++i) {
    auto it = std::find_if(totals_.begin(), totals_.end(),
                           [&](const OpTime& o) { return o.op == pending_[i]; });
    if (it == totals_.end()) it = totals_.insert(totals_.end(), OpTime{pending_[i], 0, 0.0});
    ++it->calls;
    it->seconds += t[2 * i + 1] - t[2 * i];
  }
  pending_.clear();
  return Status::Ok();
}

std::vector<OpTime> OpProfiler::totals() const {
  std::vector<OpTime> out = totals_;
  std::stable_sort(out.begin(), out.end(),
                   [](const OpTime& a, const OpTime& b) { return a.seconds > b.seconds; });
  return out;
}

void OpProfiler::Reset() {
  totals_.clear();
}

Status OpProfiler::EmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight,
                                    size_t vocab, size_t hidden, float* out) {
  return Timed("EmbeddingForward", [&] {
    return inner_->EmbeddingForward(tokens, num_tokens, weight, vocab, hidden, out);
  });
}
Status OpProfiler::EmbeddingBackward(const int32_t* tokens, size_t num_tokens, const float* dout,
                                     size_t vocab, size_t hidden, float* dweight,
                                     int32_t skip_token) {
  return Timed("EmbeddingBackward", [&] {
    return inner_->EmbeddingBackward(tokens, num_tokens, dout, vocab, hidden, dweight, skip_token);
  });
}
Status OpProfiler::RmsNormForward(const float* x, Weight weight, size_t num_tokens, size_t hidden,
                                  float eps, float* y, float* rstd) {
  return Timed("RmsNormForward",
               [&] { return inner_->RmsNormForward(x, weight, num_tokens, hidden, eps, y, rstd); });
}
Status OpProfiler::RmsNormBackward(const float* x, Weight weight, const float* rstd,
                                   const float* dy, size_t num_tokens, size_t hidden, float* dx,
                                   float* dweight) {
  return Timed("RmsNormBackward", [&] {
    return inner_->RmsNormBackward(x, weight, rstd, dy, num_tokens, hidden, dx, dweight);
  });
}
Status OpProfiler::LinearForward(const float* x, Weight weight, size_t num_tokens,
                                 size_t in_features, size_t out_features, float* y) {
  return Timed("LinearForward", [&] {
    return inner_->LinearForward(x, weight, num_tokens, in_features, out_features, y);
  });
}
Status OpProfiler::LinearBackward(const float* x, Weight weight, const float* dy, size_t num_tokens,
                                  size_t in_features, size_t out_features, float* dx,
                                  Accumulate dx_mode, float* dweight) {
  return Timed("LinearBackward", [&] {
    return inner_->LinearBackward(x, weight, dy, num_tokens, in_features, out_features, dx, dx_mode,
                                  dweight);
  });
}
Status OpProfiler::BiasForward(float* y, Weight bias, size_t rows, size_t cols) {
  return Timed("BiasForward", [&] { return inner_->BiasForward(y, bias, rows, cols); });
}
Status OpProfiler::BiasBackward(const float* dy, size_t rows, size_t cols, float* dbias) {
  return Timed("BiasBackward", [&] { return inner_->BiasBackward(dy, rows, cols, dbias); });
}
Status OpProfiler::RopeForward(float* x, size_t batch, size_t seq, size_t heads, size_t head_dim,
                               float theta, const RopeScaling& scaling, const int32_t* positions) {
  return Timed("RopeForward", [&] {
    return inner_->RopeForward(x, batch, seq, heads, head_dim, theta, scaling, positions);
  });
}
Status OpProfiler::RopeBackward(float* dx, size_t batch, size_t seq, size_t heads, size_t head_dim,
                                float theta, const RopeScaling& scaling, const int32_t* positions) {
  return Timed("RopeBackward", [&] {
    return inner_->RopeBackward(dx, batch, seq, heads, head_dim, theta, scaling, positions);
  });
}
Status OpProfiler::AttentionForward(const float* q, const float* k, const float* v, size_t batch,
                                    size_t seq, size_t num_heads, size_t num_kv_heads,
                                    size_t head_dim, float* out, float* lse,
                                    device::DType precision, const int32_t* key_start) {
  return Timed("AttentionForward", [&] {
    return inner_->AttentionForward(q, k, v, batch, seq, num_heads, num_kv_heads, head_dim, out,
                                    lse, precision, key_start);
  });
}
Status OpProfiler::AttentionBackward(const float* q, const float* k, const float* v,
                                     const float* out, const float* lse, const float* dout,
                                     size_t batch, size_t seq, size_t num_heads,
                                     size_t num_kv_heads, size_t head_dim, float* dq, float* dk,
                                     float* dv, device::DType precision, const int32_t* key_start) {
  return Timed("AttentionBackward", [&] {
    return inner_->AttentionBackward(q, k, v, out, lse, dout, batch, seq, num_heads, num_kv_heads,
                                     head_dim, dq, dk, dv, precision, key_start);
  });
}
Status OpProfiler::SiluMulForward(const float* gate, const float* up, size_t n, float* h) {
  return Timed("SiluMulForward", [&] { return inner_->SiluMulForward(gate, up, n, h); });
}
Status OpProfiler::SiluMulBackward(const float* gate, const float* up, const float* dh, size_t n,
                                   float* dgate, float* dup) {
  return Timed("SiluMulBackward",
               [&] { return inner_->SiluMulBackward(gate, up, dh, n, dgate, dup); });
}
Status OpProfiler::ResidualAdd(const float* a, const float* b, size_t n, float* y) {
  return Timed("ResidualAdd", [&] { return inner_->ResidualAdd(a, b, n, y); });
}
Status OpProfiler::AccumulateGradient(const float* dy, size_t n, float* dx) {
  return Timed("AccumulateGradient", [&] { return inner_->AccumulateGradient(dy, n, dx); });
}
Status OpProfiler::Scale(float* x, size_t n, float s) {
  return Timed("Scale", [&] { return inner_->Scale(x, n, s); });
}
Status OpProfiler::CrossEntropyForward(const float* logits, const int32_t* targets,
                                       size_t num_tokens, size_t vocab, int32_t ignore_index,
                                       float* lse, float* loss) {
  return Timed("CrossEntropyForward", [&] {
    return inner_->CrossEntropyForward(logits, targets, num_tokens, vocab, ignore_index, lse, loss);
  });
}
Status OpProfiler::CrossEntropyBackward(const float* logits, const int32_t* targets,
                                        const float* lse, size_t num_tokens, size_t vocab,
                                        int32_t ignore_index, float dloss, float* dlogits) {
  return Timed("CrossEntropyBackward", [&] {
    return inner_->CrossEntropyBackward(logits, targets, lse, num_tokens, vocab, ignore_index,
                                        dloss, dlogits);
  });
}

Status OpProfiler::ShardEmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight,
                                         size_t vocab_begin, size_t vocab, size_t hidden,
                                         float* out) {
  return Timed("ShardEmbeddingForward", [&] {
    return inner_->ShardEmbeddingForward(tokens, num_tokens, weight, vocab_begin, vocab, hidden,
                                         out);
  });
}
Status OpProfiler::ShardEmbeddingBackward(const int32_t* tokens, size_t num_tokens,
                                          const float* dout, size_t vocab_begin, size_t vocab,
                                          size_t hidden, float* dweight, int32_t skip_token) {
  return Timed("ShardEmbeddingBackward", [&] {
    return inner_->ShardEmbeddingBackward(tokens, num_tokens, dout, vocab_begin, vocab, hidden,
                                          dweight, skip_token);
  });
}
Status OpProfiler::CrossEntropyShardMax(const float* logits, size_t num_tokens, size_t vocab,
                                        float* max) {
  return Timed("CrossEntropyShardMax",
               [&] { return inner_->CrossEntropyShardMax(logits, num_tokens, vocab, max); });
}
Status OpProfiler::CrossEntropyShardSums(const float* logits, const int32_t* targets,
                                         size_t num_tokens, size_t vocab_begin, size_t vocab,
                                         int32_t ignore_index, const float* max, float* sums) {
  return Timed("CrossEntropyShardSums", [&] {
    return inner_->CrossEntropyShardSums(logits, targets, num_tokens, vocab_begin, vocab,
                                         ignore_index, max, sums);
  });
}
Status OpProfiler::CrossEntropyShardFinish(const int32_t* targets, size_t num_tokens,
                                           int32_t ignore_index, const float* max,
                                           const float* sums, float* lse, float* loss) {
  return Timed("CrossEntropyShardFinish", [&] {
    return inner_->CrossEntropyShardFinish(targets, num_tokens, ignore_index, max, sums, lse, loss);
  });
}
Status OpProfiler::CrossEntropyShardBackward(const float* logits, const int32_t* targets,
                                             const float* lse, size_t num_tokens,
                                             size_t vocab_begin, size_t vocab, int32_t ignore_index,
                                             float dloss, float* dlogits) {
  return Timed("CrossEntropyShardBackward", [&] {
    return inner_->CrossEntropyShardBackward(logits, targets, lse, num_tokens, vocab_begin, vocab,
                                             ignore_index, dloss, dlogits);
  });
}

// ---- DeferredOps --------------------------------------------------------------------------------

Status DeferredOps::Flush(device::Device& device, device::Stream& stream, std::string_view label) {
  if (calls_.empty()) return Status::Ok();
  return device.HostTask(
      stream,
      [&inner = inner_, calls = std::exchange(calls_, {})]() -> Status {
        for (const Call& call : calls)
          STRATA_RETURN_IF_ERROR(call(inner));
        return Status::Ok();
      },
      label);
}

Status DeferredOps::Mark() {
  return Defer([](LlamaOps& ops) { return ops.Mark(); });
}

Status DeferredOps::EmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight,
                                     size_t vocab, size_t hidden, float* out) {
  return Defer([tokens, num_tokens, weight, vocab, hidden, out](LlamaOps& ops) {
    return ops.EmbeddingForward(tokens, num_tokens, weight, vocab, hidden, out);
  });
}
Status DeferredOps::EmbeddingBackward(const int32_t* tokens, size_t num_tokens, const float* dout,
                                      size_t vocab, size_t hidden, float* dweight,
                                      int32_t skip_token) {
  return Defer([tokens, num_tokens, dout, vocab, hidden, dweight, skip_token](LlamaOps& ops) {
    return ops.EmbeddingBackward(tokens, num_tokens, dout, vocab, hidden, dweight, skip_token);
  });
}
Status DeferredOps::RmsNormForward(const float* x, Weight weight, size_t num_tokens, size_t hidden,
                                   float eps, float* y, float* rstd) {
  return Defer([x, weight, num_tokens, hidden, eps, y, rstd](LlamaOps& ops) {
    return ops.RmsNormForward(x, weight, num_tokens, hidden, eps, y, rstd);
  });
}
Status DeferredOps::RmsNormBackward(const float* x, Weight weight, const float* rstd,
                                    const float* dy, size_t num_tokens, size_t hidden, float* dx,
                                    float* dweight) {
  return Defer([x, weight, rstd, dy, num_tokens, hidden, dx, dweight](LlamaOps& ops) {
    return ops.RmsNormBackward(x, weight, rstd, dy, num_tokens, hidden, dx, dweight);
  });
}
Status DeferredOps::LinearForward(const float* x, Weight weight, size_t num_tokens,
                                  size_t in_features, size_t out_features, float* y) {
  return Defer([x, weight, num_tokens, in_features, out_features, y](LlamaOps& ops) {
    return ops.LinearForward(x, weight, num_tokens, in_features, out_features, y);
  });
}
Status DeferredOps::LinearBackward(const float* x, Weight weight, const float* dy,
                                   size_t num_tokens, size_t in_features, size_t out_features,
                                   float* dx, Accumulate dx_mode, float* dweight) {
  return Defer(
      [x, weight, dy, num_tokens, in_features, out_features, dx, dx_mode, dweight](LlamaOps& ops) {
        return ops.LinearBackward(x, weight, dy, num_tokens, in_features, out_features, dx, dx_mode,
                                  dweight);
      });
}
Status DeferredOps::BiasForward(float* y, Weight bias, size_t rows, size_t cols) {
  return Defer(
      [y, bias, rows, cols](LlamaOps& ops) { return ops.BiasForward(y, bias, rows, cols); });
}
Status DeferredOps::BiasBackward(const float* dy, size_t rows, size_t cols, float* dbias) {
  return Defer(
      [dy, rows, cols, dbias](LlamaOps& ops) { return ops.BiasBackward(dy, rows, cols, dbias); });
}
Status DeferredOps::RopeForward(float* x, size_t batch, size_t seq, size_t heads, size_t head_dim,
                                float theta, const RopeScaling& scaling, const int32_t* positions) {
  return Defer([x, batch, seq, heads, head_dim, theta, scaling, positions](LlamaOps& ops) {
    return ops.RopeForward(x, batch, seq, heads, head_dim, theta, scaling, positions);
  });
}
Status DeferredOps::RopeBackward(float* dx, size_t batch, size_t seq, size_t heads, size_t head_dim,
                                 float theta, const RopeScaling& scaling,
                                 const int32_t* positions) {
  return Defer([dx, batch, seq, heads, head_dim, theta, scaling, positions](LlamaOps& ops) {
    return ops.RopeBackward(dx, batch, seq, heads, head_dim, theta, scaling, positions);
  });
}
Status DeferredOps::AttentionForward(const float* q, const float* k, const float* v, size_t batch,
                                     size_t seq, size_t num_heads, size_t num_kv_heads,
                                     size_t head_dim, float* out, float* lse,
                                     device::DType precision, const int32_t* key_start) {
  return Defer([q, k, v, batch, seq, num_heads, num_kv_heads, head_dim, out, lse, precision,
                key_start](LlamaOps& ops) {
    return ops.AttentionForward(q, k, v, batch, seq, num_heads, num_kv_heads, head_dim, out, lse,
                                precision, key_start);
  });
}
Status DeferredOps::AttentionBackward(const float* q, const float* k, const float* v,
                                      const float* out, const float* lse, const float* dout,
                                      size_t batch, size_t seq, size_t num_heads,
                                      size_t num_kv_heads, size_t head_dim, float* dq, float* dk,
                                      float* dv, device::DType precision,
                                      const int32_t* key_start) {
  return Defer([q, k, v, out, lse, dout, batch, seq, num_heads, num_kv_heads, head_dim, dq, dk, dv,
                precision, key_start](LlamaOps& ops) {
    return ops.AttentionBackward(q, k, v, out, lse, dout, batch, seq, num_heads, num_kv_heads,
                                 head_dim, dq, dk, dv, precision, key_start);
  });
}
Status DeferredOps::SiluMulForward(const float* gate, const float* up, size_t n, float* h) {
  return Defer([gate, up, n, h](LlamaOps& ops) { return ops.SiluMulForward(gate, up, n, h); });
}
Status DeferredOps::SiluMulBackward(const float* gate, const float* up, const float* dh, size_t n,
                                    float* dgate, float* dup) {
  return Defer([gate, up, dh, n, dgate, dup](LlamaOps& ops) {
    return ops.SiluMulBackward(gate, up, dh, n, dgate, dup);
  });
}
Status DeferredOps::ResidualAdd(const float* a, const float* b, size_t n, float* y) {
  return Defer([a, b, n, y](LlamaOps& ops) { return ops.ResidualAdd(a, b, n, y); });
}
Status DeferredOps::AccumulateGradient(const float* dy, size_t n, float* dx) {
  return Defer([dy, n, dx](LlamaOps& ops) { return ops.AccumulateGradient(dy, n, dx); });
}
Status DeferredOps::Scale(float* x, size_t n, float s) {
  return Defer([x, n, s](LlamaOps& ops) { return ops.Scale(x, n, s); });
}
Status DeferredOps::CrossEntropyForward(const float* logits, const int32_t* targets,
                                        size_t num_tokens, size_t vocab, int32_t ignore_index,
                                        float* lse, float* loss) {
  return Defer([logits, targets, num_tokens, vocab, ignore_index, lse, loss](LlamaOps& ops) {
    return ops.CrossEntropyForward(logits, targets, num_tokens, vocab, ignore_index, lse, loss);
  });
}
Status DeferredOps::CrossEntropyBackward(const float* logits, const int32_t* targets,
                                         const float* lse, size_t num_tokens, size_t vocab,
                                         int32_t ignore_index, float dloss, float* dlogits) {
  return Defer(
      [logits, targets, lse, num_tokens, vocab, ignore_index, dloss, dlogits](LlamaOps& ops) {
        return ops.CrossEntropyBackward(logits, targets, lse, num_tokens, vocab, ignore_index,
                                        dloss, dlogits);
      });
}
Status DeferredOps::ShardEmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight,
                                          size_t vocab_begin, size_t vocab, size_t hidden,
                                          float* out) {
  return Defer([tokens, num_tokens, weight, vocab_begin, vocab, hidden, out](LlamaOps& ops) {
    return ops.ShardEmbeddingForward(tokens, num_tokens, weight, vocab_begin, vocab, hidden, out);
  });
}
Status DeferredOps::ShardEmbeddingBackward(const int32_t* tokens, size_t num_tokens,
                                           const float* dout, size_t vocab_begin, size_t vocab,
                                           size_t hidden, float* dweight, int32_t skip_token) {
  return Defer(
      [tokens, num_tokens, dout, vocab_begin, vocab, hidden, dweight, skip_token](LlamaOps& ops) {
        return ops.ShardEmbeddingBackward(tokens, num_tokens, dout, vocab_begin, vocab, hidden,
                                          dweight, skip_token);
      });
}
Status DeferredOps::CrossEntropyShardMax(const float* logits, size_t num_tokens, size_t vocab,
                                         float* max) {
  return Defer([logits, num_tokens, vocab, max](LlamaOps& ops) {
    return ops.CrossEntropyShardMax(logits, num_tokens, vocab, max);
  });
}
Status DeferredOps::CrossEntropyShardSums(const float* logits, const int32_t* targets,
                                          size_t num_tokens, size_t vocab_begin, size_t vocab,
                                          int32_t ignore_index, const float* max, float* sums) {
  return Defer(
      [logits, targets, num_tokens, vocab_begin, vocab, ignore_index, max, sums](LlamaOps& ops) {
        return ops.CrossEntropyShardSums(logits, targets, num_tokens, vocab_begin, vocab,
                                         ignore_index, max, sums);
      });
}
Status DeferredOps::CrossEntropyShardFinish(const int32_t* targets, size_t num_tokens,
                                            int32_t ignore_index, const float* max,
                                            const float* sums, float* lse, float* loss) {
  return Defer([targets, num_tokens, ignore_index, max, sums, lse, loss](LlamaOps& ops) {
    return ops.CrossEntropyShardFinish(targets, num_tokens, ignore_index, max, sums, lse, loss);
  });
}
Status DeferredOps::CrossEntropyShardBackward(const float* logits, const int32_t* targets,
                                              const float* lse, size_t num_tokens,
                                              size_t vocab_begin, size_t vocab,
                                              int32_t ignore_index, float dloss, float* dlogits) {
  return Defer([logits, targets, lse, num_tokens, vocab_begin, vocab, ignore_index, dloss,
                dlogits](LlamaOps& ops) {
    return ops.CrossEntropyShardBackward(logits, targets, lse, num_tokens, vocab_begin, vocab,
                                         ignore_index, dloss, dlogits);
  });
}

std::unique_ptr<LlamaOps> CreateCpuLlamaOps() {
  return std::make_unique<CpuLlamaOps>();
}

#ifndef STRATA_WITH_CUDA
Result<std::unique_ptr<LlamaOps>> CreateCudaLlamaOps(device::Device&, device::Stream&,
                                                     const LlamaOpsShape&, bool) {
  return UnimplementedError(
      "this build of Strata has no CUDA support (configure with the CUDA "
      "toolkit to run the model on a GPU)");
}
#endif

LlamaOpsShape LlamaOpsShapeFor(const LlamaConfig& c, int64_t seq_len, int64_t micro_batch,
                               bool vocab_split) {
  LlamaOpsShape shape;
  shape.batch = static_cast<size_t>(micro_batch);
  shape.seq = static_cast<size_t>(seq_len);
  shape.hidden = static_cast<size_t>(c.hidden_size);
  shape.kv_dim = static_cast<size_t>(c.kv_dim());
  shape.intermediate = static_cast<size_t>(c.intermediate_size);
  shape.vocab = static_cast<size_t>(c.vocab_size);
  shape.num_heads = static_cast<size_t>(c.num_attention_heads);
  shape.head_dim = static_cast<size_t>(c.head_dim());
  shape.q_dim = static_cast<size_t>(c.q_dim());
  shape.head_tokens =
      static_cast<size_t>(LlamaHeadChunkTokens(c, seq_len * micro_batch, vocab_split));
  return shape;
}

size_t CudaLlamaOpsWorkspaceBytes(const LlamaOpsShape& s) {
  return cuda::WorkspaceBytes(s);
}

}  // namespace strata::model

// CpuLlamaOps: cpu_ops.h behind the LlamaOps interface; OpProfiler, which times any LlamaOps;
// and the CUDA factory's stand-in in a build without CUDA.
#include "model/llama_ops.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <initializer_list>
#include <mutex>
#include <utility>

#include "model/cuda_ops.h"
#include "model/llama_config.h"
#include "model/llama_model.h"

namespace strata::model {

namespace {

// The CPU ops compute on fp32 activations only (the CPU device's path, and the oracle of the
// CUDA ops): a 16-bit one is refused, naming the op.
Status Fp32(std::initializer_list<CAct> acts, const char* op) {
  for (const CAct& a : acts) {
    if (a.dtype != device::DType::kF32) {
      return InvalidArgumentError(fmt::format("{}: the CPU ops take fp32 activations, not {}", op,
                                              device::DTypeName(a.dtype)));
    }
  }
  return Status::Ok();
}
float* F(Act a) {
  return static_cast<float*>(a.data);
}
const float* F(CAct a) {
  return static_cast<const float*>(a.data);
}

class CpuLlamaOps final : public LlamaOps {
 public:
  Status EmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight, size_t vocab,
                          size_t hidden, Act out) override {
    STRATA_RETURN_IF_ERROR(Fp32({out}, "EmbeddingForward"));
    return cpu::EmbeddingForward(tokens, num_tokens, weight, vocab, hidden, F(out));
  }
  Status EmbeddingBackward(const int32_t* tokens, size_t num_tokens, CAct dout, size_t vocab,
                           size_t hidden, float* dweight, int32_t skip_token) override {
    STRATA_RETURN_IF_ERROR(Fp32({dout}, "EmbeddingBackward"));
    return cpu::EmbeddingBackward(tokens, num_tokens, F(dout), vocab, hidden, dweight, skip_token);
  }
  Status RmsNormForward(CAct x, Weight weight, size_t num_tokens, size_t hidden, float eps, Act y,
                        float* rstd) override {
    STRATA_RETURN_IF_ERROR(Fp32({x, y}, "RmsNormForward"));
    cpu::RmsNormForward(F(x), weight, num_tokens, hidden, eps, F(y), rstd);
    return Status::Ok();
  }
  Status RmsNormBackward(CAct x, Weight weight, const float* rstd, CAct dy, size_t num_tokens,
                         size_t hidden, Act dx, float* dweight) override {
    STRATA_RETURN_IF_ERROR(Fp32({x, dy, dx}, "RmsNormBackward"));
    cpu::RmsNormBackward(F(x), weight, rstd, F(dy), num_tokens, hidden, F(dx), dweight);
    return Status::Ok();
  }
  Status ResidualRmsNormForward(CAct a, CAct b, Weight weight, size_t num_tokens, size_t hidden,
                                float eps, Act sum, Act y, float* rstd) override {
    STRATA_RETURN_IF_ERROR(Fp32({a, b, sum, y}, "ResidualRmsNormForward"));
    cpu::ResidualAdd(F(a), F(b), num_tokens * hidden, F(sum));
    cpu::RmsNormForward(F(sum), weight, num_tokens, hidden, eps, F(y), rstd);
    return Status::Ok();
  }
  Status RmsNormResidualBackward(CAct x, Weight weight, const float* rstd, CAct dy, CAct residual,
                                 size_t num_tokens, size_t hidden, Act dx,
                                 float* dweight) override {
    STRATA_RETURN_IF_ERROR(Fp32({x, dy, residual, dx}, "RmsNormResidualBackward"));
    cpu::RmsNormBackward(F(x), weight, rstd, F(dy), num_tokens, hidden, F(dx), dweight);
    cpu::AccumulateGradient(F(residual), num_tokens * hidden, F(dx));
    return Status::Ok();
  }
  Status LinearForward(CAct x, Weight weight, size_t num_tokens, size_t in_features,
                       size_t out_features, Act y) override {
    STRATA_RETURN_IF_ERROR(Fp32({x, y}, "LinearForward"));
    cpu::LinearForward(F(x), weight, num_tokens, in_features, out_features, F(y));
    return Status::Ok();
  }
  Status LinearBackward(CAct x, Weight weight, CAct dy, size_t num_tokens, size_t in_features,
                        size_t out_features, Act dx, Accumulate dx_mode, float* dweight) override {
    STRATA_RETURN_IF_ERROR(Fp32({x, dy, dx}, "LinearBackward"));
    cpu::LinearBackward(F(x), weight, F(dy), num_tokens, in_features, out_features, F(dx), dx_mode,
                        dweight);
    return Status::Ok();
  }
  Status BiasForward(Act y, Weight bias, size_t rows, size_t cols) override {
    STRATA_RETURN_IF_ERROR(Fp32({y}, "BiasForward"));
    cpu::BiasForward(F(y), bias, rows, cols);
    return Status::Ok();
  }
  Status BiasBackward(CAct dy, size_t rows, size_t cols, float* dbias) override {
    STRATA_RETURN_IF_ERROR(Fp32({dy}, "BiasBackward"));
    cpu::BiasBackward(F(dy), rows, cols, dbias);
    return Status::Ok();
  }
  Status RopeForward(Act x, size_t batch, size_t seq, size_t heads, size_t head_dim, float theta,
                     const RopeScaling& scaling, const int32_t* positions) override {
    STRATA_RETURN_IF_ERROR(Fp32({x}, "RopeForward"));
    cpu::RopeForward(F(x), batch, seq, heads, head_dim, theta, scaling, positions);
    return Status::Ok();
  }
  Status RopeBackward(Act dx, size_t batch, size_t seq, size_t heads, size_t head_dim, float theta,
                      const RopeScaling& scaling, const int32_t* positions) override {
    STRATA_RETURN_IF_ERROR(Fp32({dx}, "RopeBackward"));
    cpu::RopeBackward(F(dx), batch, seq, heads, head_dim, theta, scaling, positions);
    return Status::Ok();
  }
  Status AttentionForward(CAct q, CAct k, CAct v, size_t batch, size_t seq, size_t num_heads,
                          size_t num_kv_heads, size_t head_dim, Act out, float* lse,
                          device::DType /*precision*/, const int32_t* key_start) override {
    STRATA_RETURN_IF_ERROR(Fp32({q, k, v, out}, "AttentionForward"));
    cpu::AttentionForward(F(q), F(k), F(v), batch, seq, num_heads, num_kv_heads, head_dim, F(out),
                          lse, key_start);
    return Status::Ok();
  }
  Status AttentionBackward(CAct q, CAct k, CAct v, CAct out, const float* lse, CAct dout,
                           size_t batch, size_t seq, size_t num_heads, size_t num_kv_heads,
                           size_t head_dim, Act dq, Act dk, Act dv, device::DType /*precision*/,
                           const int32_t* key_start) override {
    STRATA_RETURN_IF_ERROR(Fp32({q, k, v, out, dout, dq, dk, dv}, "AttentionBackward"));
    cpu::AttentionBackward(F(q), F(k), F(v), F(out), lse, F(dout), batch, seq, num_heads,
                           num_kv_heads, head_dim, F(dq), F(dk), F(dv), key_start);
    return Status::Ok();
  }
  Status SiluMulForward(CAct gate, CAct up, size_t n, Act h) override {
    STRATA_RETURN_IF_ERROR(Fp32({gate, up, h}, "SiluMulForward"));
    cpu::SiluMulForward(F(gate), F(up), n, F(h));
    return Status::Ok();
  }
  Status SiluMulBackward(CAct gate, CAct up, CAct dh, size_t n, Act dgate, Act dup) override {
    STRATA_RETURN_IF_ERROR(Fp32({gate, up, dh, dgate, dup}, "SiluMulBackward"));
    cpu::SiluMulBackward(F(gate), F(up), F(dh), n, F(dgate), F(dup));
    return Status::Ok();
  }
  Status ResidualAdd(CAct a, CAct b, size_t n, Act y) override {
    STRATA_RETURN_IF_ERROR(Fp32({a, b, y}, "ResidualAdd"));
    cpu::ResidualAdd(F(a), F(b), n, F(y));
    return Status::Ok();
  }
  Status AccumulateGradient(CAct dy, size_t n, Act dx) override {
    STRATA_RETURN_IF_ERROR(Fp32({dy, dx}, "AccumulateGradient"));
    cpu::AccumulateGradient(F(dy), n, F(dx));
    return Status::Ok();
  }
  Status Scale(Act x, size_t n, float s) override {
    STRATA_RETURN_IF_ERROR(Fp32({x}, "Scale"));
    cpu::Scale(F(x), n, s);
    return Status::Ok();
  }
  Status CrossEntropyForward(CAct logits, const int32_t* targets, size_t num_tokens, size_t vocab,
                             int32_t ignore_index, float* lse, float* loss) override {
    STRATA_RETURN_IF_ERROR(Fp32({logits}, "CrossEntropyForward"));
    STRATA_ASSIGN_OR_RETURN(
        *loss, cpu::CrossEntropyForward(F(logits), targets, num_tokens, vocab, ignore_index, lse));
    return Status::Ok();
  }
  Status CrossEntropyBackward(CAct logits, const int32_t* targets, const float* lse,
                              size_t num_tokens, size_t vocab, int32_t ignore_index, float dloss,
                              Act dlogits) override {
    STRATA_RETURN_IF_ERROR(Fp32({logits, dlogits}, "CrossEntropyBackward"));
    return cpu::CrossEntropyBackward(F(logits), targets, lse, num_tokens, vocab, ignore_index,
                                     dloss, F(dlogits));
  }
  Status ShardEmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight,
                               size_t vocab_begin, size_t vocab, size_t hidden, Act out) override {
    STRATA_RETURN_IF_ERROR(Fp32({out}, "ShardEmbeddingForward"));
    cpu::ShardEmbeddingForward(tokens, num_tokens, weight, vocab_begin, vocab, hidden, F(out));
    return Status::Ok();
  }
  Status ShardEmbeddingBackward(const int32_t* tokens, size_t num_tokens, CAct dout,
                                size_t vocab_begin, size_t vocab, size_t hidden, float* dweight,
                                int32_t skip_token) override {
    STRATA_RETURN_IF_ERROR(Fp32({dout}, "ShardEmbeddingBackward"));
    cpu::ShardEmbeddingBackward(tokens, num_tokens, F(dout), vocab_begin, vocab, hidden, dweight,
                                skip_token);
    return Status::Ok();
  }
  Status CrossEntropyShardMax(CAct logits, size_t num_tokens, size_t vocab, float* max) override {
    STRATA_RETURN_IF_ERROR(Fp32({logits}, "CrossEntropyShardMax"));
    cpu::CrossEntropyShardMax(F(logits), num_tokens, vocab, max);
    return Status::Ok();
  }
  Status CrossEntropyShardSums(CAct logits, const int32_t* targets, size_t num_tokens,
                               size_t vocab_begin, size_t vocab, int32_t ignore_index,
                               const float* max, float* sums) override {
    STRATA_RETURN_IF_ERROR(Fp32({logits}, "CrossEntropyShardSums"));
    cpu::CrossEntropyShardSums(F(logits), targets, num_tokens, vocab_begin, vocab, ignore_index,
                               max, sums);
    return Status::Ok();
  }
  Status CrossEntropyShardFinish(const int32_t* targets, size_t num_tokens, int32_t ignore_index,
                                 const float* max, const float* sums, float* lse,
                                 float* loss) override {
    *loss = cpu::CrossEntropyShardFinish(targets, num_tokens, ignore_index, max, sums, lse);
    return Status::Ok();
  }
  Status CrossEntropyShardBackward(CAct logits, const int32_t* targets, const float* lse,
                                   size_t num_tokens, size_t vocab_begin, size_t vocab,
                                   int32_t ignore_index, float dloss, Act dlogits) override {
    STRATA_RETURN_IF_ERROR(Fp32({logits, dlogits}, "CrossEntropyShardBackward"));
    cpu::CrossEntropyShardBackward(F(logits), targets, lse, num_tokens, vocab_begin, vocab,
                                   ignore_index, dloss, F(dlogits));
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
                                    size_t vocab, size_t hidden, Act out) {
  return Timed("EmbeddingForward", [&] {
    return inner_->EmbeddingForward(tokens, num_tokens, weight, vocab, hidden, out);
  });
}
Status OpProfiler::EmbeddingBackward(const int32_t* tokens, size_t num_tokens, CAct dout,
                                     size_t vocab, size_t hidden, float* dweight,
                                     int32_t skip_token) {
  return Timed("EmbeddingBackward", [&] {
    return inner_->EmbeddingBackward(tokens, num_tokens, dout, vocab, hidden, dweight, skip_token);
  });
}
Status OpProfiler::RmsNormForward(CAct x, Weight weight, size_t num_tokens, size_t hidden,
                                  float eps, Act y, float* rstd) {
  return Timed("RmsNormForward",
               [&] { return inner_->RmsNormForward(x, weight, num_tokens, hidden, eps, y, rstd); });
}
Status OpProfiler::RmsNormBackward(CAct x, Weight weight, const float* rstd, CAct dy,
                                   size_t num_tokens, size_t hidden, Act dx, float* dweight) {
  return Timed("RmsNormBackward", [&] {
    return inner_->RmsNormBackward(x, weight, rstd, dy, num_tokens, hidden, dx, dweight);
  });
}
Status OpProfiler::ResidualRmsNormForward(CAct a, CAct b, Weight weight, size_t num_tokens,
                                          size_t hidden, float eps, Act sum, Act y, float* rstd) {
  return Timed("ResidualRmsNormForward", [&] {
    return inner_->ResidualRmsNormForward(a, b, weight, num_tokens, hidden, eps, sum, y, rstd);
  });
}
Status OpProfiler::RmsNormResidualBackward(CAct x, Weight weight, const float* rstd, CAct dy,
                                           CAct residual, size_t num_tokens, size_t hidden, Act dx,
                                           float* dweight) {
  return Timed("RmsNormResidualBackward", [&] {
    return inner_->RmsNormResidualBackward(x, weight, rstd, dy, residual, num_tokens, hidden, dx,
                                           dweight);
  });
}
Status OpProfiler::LinearForward(CAct x, Weight weight, size_t num_tokens, size_t in_features,
                                 size_t out_features, Act y) {
  return Timed("LinearForward", [&] {
    return inner_->LinearForward(x, weight, num_tokens, in_features, out_features, y);
  });
}
Status OpProfiler::LinearBackward(CAct x, Weight weight, CAct dy, size_t num_tokens,
                                  size_t in_features, size_t out_features, Act dx,
                                  Accumulate dx_mode, float* dweight) {
  return Timed("LinearBackward", [&] {
    return inner_->LinearBackward(x, weight, dy, num_tokens, in_features, out_features, dx, dx_mode,
                                  dweight);
  });
}
Status OpProfiler::BiasForward(Act y, Weight bias, size_t rows, size_t cols) {
  return Timed("BiasForward", [&] { return inner_->BiasForward(y, bias, rows, cols); });
}
Status OpProfiler::BiasBackward(CAct dy, size_t rows, size_t cols, float* dbias) {
  return Timed("BiasBackward", [&] { return inner_->BiasBackward(dy, rows, cols, dbias); });
}
Status OpProfiler::RopeForward(Act x, size_t batch, size_t seq, size_t heads, size_t head_dim,
                               float theta, const RopeScaling& scaling, const int32_t* positions) {
  return Timed("RopeForward", [&] {
    return inner_->RopeForward(x, batch, seq, heads, head_dim, theta, scaling, positions);
  });
}
Status OpProfiler::RopeBackward(Act dx, size_t batch, size_t seq, size_t heads, size_t head_dim,
                                float theta, const RopeScaling& scaling, const int32_t* positions) {
  return Timed("RopeBackward", [&] {
    return inner_->RopeBackward(dx, batch, seq, heads, head_dim, theta, scaling, positions);
  });
}
Status OpProfiler::AttentionForward(CAct q, CAct k, CAct v, size_t batch, size_t seq,
                                    size_t num_heads, size_t num_kv_heads, size_t head_dim, Act out,
                                    float* lse, device::DType precision, const int32_t* key_start) {
  return Timed("AttentionForward", [&] {
    return inner_->AttentionForward(q, k, v, batch, seq, num_heads, num_kv_heads, head_dim, out,
                                    lse, precision, key_start);
  });
}
Status OpProfiler::AttentionBackward(CAct q, CAct k, CAct v, CAct out, const float* lse, CAct dout,
                                     size_t batch, size_t seq, size_t num_heads,
                                     size_t num_kv_heads, size_t head_dim, Act dq, Act dk, Act dv,
                                     device::DType precision, const int32_t* key_start) {
  return Timed("AttentionBackward", [&] {
    return inner_->AttentionBackward(q, k, v, out, lse, dout, batch, seq, num_heads, num_kv_heads,
                                     head_dim, dq, dk, dv, precision, key_start);
  });
}
Status OpProfiler::SiluMulForward(CAct gate, CAct up, size_t n, Act h) {
  return Timed("SiluMulForward", [&] { return inner_->SiluMulForward(gate, up, n, h); });
}
Status OpProfiler::SiluMulBackward(CAct gate, CAct up, CAct dh, size_t n, Act dgate, Act dup) {
  return Timed("SiluMulBackward",
               [&] { return inner_->SiluMulBackward(gate, up, dh, n, dgate, dup); });
}
Status OpProfiler::ResidualAdd(CAct a, CAct b, size_t n, Act y) {
  return Timed("ResidualAdd", [&] { return inner_->ResidualAdd(a, b, n, y); });
}
Status OpProfiler::AccumulateGradient(CAct dy, size_t n, Act dx) {
  return Timed("AccumulateGradient", [&] { return inner_->AccumulateGradient(dy, n, dx); });
}
Status OpProfiler::Scale(Act x, size_t n, float s) {
  return Timed("Scale", [&] { return inner_->Scale(x, n, s); });
}
Status OpProfiler::CrossEntropyForward(CAct logits, const int32_t* targets, size_t num_tokens,
                                       size_t vocab, int32_t ignore_index, float* lse,
                                       float* loss) {
  return Timed("CrossEntropyForward", [&] {
    return inner_->CrossEntropyForward(logits, targets, num_tokens, vocab, ignore_index, lse, loss);
  });
}
Status OpProfiler::CrossEntropyBackward(CAct logits, const int32_t* targets, const float* lse,
                                        size_t num_tokens, size_t vocab, int32_t ignore_index,
                                        float dloss, Act dlogits) {
  return Timed("CrossEntropyBackward", [&] {
    return inner_->CrossEntropyBackward(logits, targets, lse, num_tokens, vocab, ignore_index,
                                        dloss, dlogits);
  });
}

Status OpProfiler::ShardEmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight,
                                         size_t vocab_begin, size_t vocab, size_t hidden, Act out) {
  return Timed("ShardEmbeddingForward", [&] {
    return inner_->ShardEmbeddingForward(tokens, num_tokens, weight, vocab_begin, vocab, hidden,
                                         out);
  });
}
Status OpProfiler::ShardEmbeddingBackward(const int32_t* tokens, size_t num_tokens, CAct dout,
                                          size_t vocab_begin, size_t vocab, size_t hidden,
                                          float* dweight, int32_t skip_token) {
  return Timed("ShardEmbeddingBackward", [&] {
    return inner_->ShardEmbeddingBackward(tokens, num_tokens, dout, vocab_begin, vocab, hidden,
                                          dweight, skip_token);
  });
}
Status OpProfiler::CrossEntropyShardMax(CAct logits, size_t num_tokens, size_t vocab, float* max) {
  return Timed("CrossEntropyShardMax",
               [&] { return inner_->CrossEntropyShardMax(logits, num_tokens, vocab, max); });
}
Status OpProfiler::CrossEntropyShardSums(CAct logits, const int32_t* targets, size_t num_tokens,
                                         size_t vocab_begin, size_t vocab, int32_t ignore_index,
                                         const float* max, float* sums) {
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
Status OpProfiler::CrossEntropyShardBackward(CAct logits, const int32_t* targets, const float* lse,
                                             size_t num_tokens, size_t vocab_begin, size_t vocab,
                                             int32_t ignore_index, float dloss, Act dlogits) {
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
                                     size_t vocab, size_t hidden, Act out) {
  return Defer([tokens, num_tokens, weight, vocab, hidden, out](LlamaOps& ops) {
    return ops.EmbeddingForward(tokens, num_tokens, weight, vocab, hidden, out);
  });
}
Status DeferredOps::EmbeddingBackward(const int32_t* tokens, size_t num_tokens, CAct dout,
                                      size_t vocab, size_t hidden, float* dweight,
                                      int32_t skip_token) {
  return Defer([tokens, num_tokens, dout, vocab, hidden, dweight, skip_token](LlamaOps& ops) {
    return ops.EmbeddingBackward(tokens, num_tokens, dout, vocab, hidden, dweight, skip_token);
  });
}
Status DeferredOps::RmsNormForward(CAct x, Weight weight, size_t num_tokens, size_t hidden,
                                   float eps, Act y, float* rstd) {
  return Defer([x, weight, num_tokens, hidden, eps, y, rstd](LlamaOps& ops) {
    return ops.RmsNormForward(x, weight, num_tokens, hidden, eps, y, rstd);
  });
}
Status DeferredOps::RmsNormBackward(CAct x, Weight weight, const float* rstd, CAct dy,
                                    size_t num_tokens, size_t hidden, Act dx, float* dweight) {
  return Defer([x, weight, rstd, dy, num_tokens, hidden, dx, dweight](LlamaOps& ops) {
    return ops.RmsNormBackward(x, weight, rstd, dy, num_tokens, hidden, dx, dweight);
  });
}
Status DeferredOps::ResidualRmsNormForward(CAct a, CAct b, Weight weight, size_t num_tokens,
                                           size_t hidden, float eps, Act sum, Act y, float* rstd) {
  return Defer([a, b, weight, num_tokens, hidden, eps, sum, y, rstd](LlamaOps& ops) {
    return ops.ResidualRmsNormForward(a, b, weight, num_tokens, hidden, eps, sum, y, rstd);
  });
}
Status DeferredOps::RmsNormResidualBackward(CAct x, Weight weight, const float* rstd, CAct dy,
                                            CAct residual, size_t num_tokens, size_t hidden, Act dx,
                                            float* dweight) {
  return Defer([x, weight, rstd, dy, residual, num_tokens, hidden, dx, dweight](LlamaOps& ops) {
    return ops.RmsNormResidualBackward(x, weight, rstd, dy, residual, num_tokens, hidden, dx,
                                       dweight);
  });
}
Status DeferredOps::LinearForward(CAct x, Weight weight, size_t num_tokens, size_t in_features,
                                  size_t out_features, Act y) {
  return Defer([x, weight, num_tokens, in_features, out_features, y](LlamaOps& ops) {
    return ops.LinearForward(x, weight, num_tokens, in_features, out_features, y);
  });
}
Status DeferredOps::LinearBackward(CAct x, Weight weight, CAct dy, size_t num_tokens,
                                   size_t in_features, size_t out_features, Act dx,
                                   Accumulate dx_mode, float* dweight) {
  return Defer(
      [x, weight, dy, num_tokens, in_features, out_features, dx, dx_mode, dweight](LlamaOps& ops) {
        return ops.LinearBackward(x, weight, dy, num_tokens, in_features, out_features, dx, dx_mode,
                                  dweight);
      });
}
Status DeferredOps::BiasForward(Act y, Weight bias, size_t rows, size_t cols) {
  return Defer(
      [y, bias, rows, cols](LlamaOps& ops) { return ops.BiasForward(y, bias, rows, cols); });
}
Status DeferredOps::BiasBackward(CAct dy, size_t rows, size_t cols, float* dbias) {
  return Defer(
      [dy, rows, cols, dbias](LlamaOps& ops) { return ops.BiasBackward(dy, rows, cols, dbias); });
}
Status DeferredOps::RopeForward(Act x, size_t batch, size_t seq, size_t heads, size_t head_dim,
                                float theta, const RopeScaling& scaling, const int32_t* positions) {
  return Defer([x, batch, seq, heads, head_dim, theta, scaling, positions](LlamaOps& ops) {
    return ops.RopeForward(x, batch, seq, heads, head_dim, theta, scaling, positions);
  });
}
Status DeferredOps::RopeBackward(Act dx, size_t batch, size_t seq, size_t heads, size_t head_dim,
                                 float theta, const RopeScaling& scaling,
                                 const int32_t* positions) {
  return Defer([dx, batch, seq, heads, head_dim, theta, scaling, positions](LlamaOps& ops) {
    return ops.RopeBackward(dx, batch, seq, heads, head_dim, theta, scaling, positions);
  });
}
Status DeferredOps::AttentionForward(CAct q, CAct k, CAct v, size_t batch, size_t seq,
                                     size_t num_heads, size_t num_kv_heads, size_t head_dim,
                                     Act out, float* lse, device::DType precision,
                                     const int32_t* key_start) {
  return Defer([q, k, v, batch, seq, num_heads, num_kv_heads, head_dim, out, lse, precision,
                key_start](LlamaOps& ops) {
    return ops.AttentionForward(q, k, v, batch, seq, num_heads, num_kv_heads, head_dim, out, lse,
                                precision, key_start);
  });
}
Status DeferredOps::AttentionBackward(CAct q, CAct k, CAct v, CAct out, const float* lse, CAct dout,
                                      size_t batch, size_t seq, size_t num_heads,
                                      size_t num_kv_heads, size_t head_dim, Act dq, Act dk, Act dv,
                                      device::DType precision, const int32_t* key_start) {
  return Defer([q, k, v, out, lse, dout, batch, seq, num_heads, num_kv_heads, head_dim, dq, dk, dv,
                precision, key_start](LlamaOps& ops) {
    return ops.AttentionBackward(q, k, v, out, lse, dout, batch, seq, num_heads, num_kv_heads,
                                 head_dim, dq, dk, dv, precision, key_start);
  });
}
Status DeferredOps::SiluMulForward(CAct gate, CAct up, size_t n, Act h) {
  return Defer([gate, up, n, h](LlamaOps& ops) { return ops.SiluMulForward(gate, up, n, h); });
}
Status DeferredOps::SiluMulBackward(CAct gate, CAct up, CAct dh, size_t n, Act dgate, Act dup) {
  return Defer([gate, up, dh, n, dgate, dup](LlamaOps& ops) {
    return ops.SiluMulBackward(gate, up, dh, n, dgate, dup);
  });
}
Status DeferredOps::ResidualAdd(CAct a, CAct b, size_t n, Act y) {
  return Defer([a, b, n, y](LlamaOps& ops) { return ops.ResidualAdd(a, b, n, y); });
}
Status DeferredOps::AccumulateGradient(CAct dy, size_t n, Act dx) {
  return Defer([dy, n, dx](LlamaOps& ops) { return ops.AccumulateGradient(dy, n, dx); });
}
Status DeferredOps::Scale(Act x, size_t n, float s) {
  return Defer([x, n, s](LlamaOps& ops) { return ops.Scale(x, n, s); });
}
Status DeferredOps::CrossEntropyForward(CAct logits, const int32_t* targets, size_t num_tokens,
                                        size_t vocab, int32_t ignore_index, float* lse,
                                        float* loss) {
  return Defer([logits, targets, num_tokens, vocab, ignore_index, lse, loss](LlamaOps& ops) {
    return ops.CrossEntropyForward(logits, targets, num_tokens, vocab, ignore_index, lse, loss);
  });
}
Status DeferredOps::CrossEntropyBackward(CAct logits, const int32_t* targets, const float* lse,
                                         size_t num_tokens, size_t vocab, int32_t ignore_index,
                                         float dloss, Act dlogits) {
  return Defer(
      [logits, targets, lse, num_tokens, vocab, ignore_index, dloss, dlogits](LlamaOps& ops) {
        return ops.CrossEntropyBackward(logits, targets, lse, num_tokens, vocab, ignore_index,
                                        dloss, dlogits);
      });
}
Status DeferredOps::ShardEmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight,
                                          size_t vocab_begin, size_t vocab, size_t hidden,
                                          Act out) {
  return Defer([tokens, num_tokens, weight, vocab_begin, vocab, hidden, out](LlamaOps& ops) {
    return ops.ShardEmbeddingForward(tokens, num_tokens, weight, vocab_begin, vocab, hidden, out);
  });
}
Status DeferredOps::ShardEmbeddingBackward(const int32_t* tokens, size_t num_tokens, CAct dout,
                                           size_t vocab_begin, size_t vocab, size_t hidden,
                                           float* dweight, int32_t skip_token) {
  return Defer(
      [tokens, num_tokens, dout, vocab_begin, vocab, hidden, dweight, skip_token](LlamaOps& ops) {
        return ops.ShardEmbeddingBackward(tokens, num_tokens, dout, vocab_begin, vocab, hidden,
                                          dweight, skip_token);
      });
}
Status DeferredOps::CrossEntropyShardMax(CAct logits, size_t num_tokens, size_t vocab, float* max) {
  return Defer([logits, num_tokens, vocab, max](LlamaOps& ops) {
    return ops.CrossEntropyShardMax(logits, num_tokens, vocab, max);
  });
}
Status DeferredOps::CrossEntropyShardSums(CAct logits, const int32_t* targets, size_t num_tokens,
                                          size_t vocab_begin, size_t vocab, int32_t ignore_index,
                                          const float* max, float* sums) {
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
Status DeferredOps::CrossEntropyShardBackward(CAct logits, const int32_t* targets, const float* lse,
                                              size_t num_tokens, size_t vocab_begin, size_t vocab,
                                              int32_t ignore_index, float dloss, Act dlogits) {
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
                               bool vocab_split, device::DType activations) {
  LlamaOpsShape shape;
  // The enums are numbered alike (cuda_ops_status.cc checks it in CUDA builds).
  shape.activations = static_cast<cuda::DType>(activations);
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

// CudaLlamaOps: cuda_ops.h behind the LlamaOps interface, on one stream, with its workspace
// allocated once from the device under its budget. Built only with CUDA.
#include <fmt/format.h>

#include "model/cuda_ops.h"
#include "model/cuda_ops_status.h"
#include "model/llama_ops.h"

namespace strata::model {

namespace {

cuda::Accumulate ToCuda(cpu::Accumulate a) {
  return a == cpu::Accumulate::kAdd ? cuda::Accumulate::kAdd : cuda::Accumulate::kOverwrite;
}

// The same activation views for cuda_ops.h (the dtypes are numbered alike).
cuda::Act ToCuda(Act a) {
  return cuda::Act{a.data, cuda::ToCudaDType(a.dtype)};
}
cuda::CAct ToCuda(CAct a) {
  return cuda::CAct(a.data, cuda::ToCudaDType(a.dtype));
}

class CudaLlamaOps final : public LlamaOps {
 public:
  CudaLlamaOps(device::Device& device, cuda::OpsContextPtr context, void* workspace)
      : device_(device), context_(std::move(context)), workspace_(workspace) {}
  ~CudaLlamaOps() override {
    context_.reset();  // waits for the stream before the workspace goes
    device_.Free(workspace_);
  }

  Status EmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight, size_t vocab,
                          size_t hidden, Act out) override {
    return cuda::ToStatus(cuda::EmbeddingForward(
        ctx(), tokens, num_tokens, cuda::ToCudaWeight(weight), vocab, hidden, ToCuda(out)));
  }
  Status EmbeddingBackward(const int32_t* tokens, size_t num_tokens, CAct dout, size_t vocab,
                           size_t hidden, float* dweight, int32_t skip_token) override {
    return cuda::ToStatus(cuda::EmbeddingBackward(ctx(), tokens, num_tokens, ToCuda(dout), vocab,
                                                  hidden, dweight, skip_token));
  }
  Status RmsNormForward(CAct x, Weight weight, size_t num_tokens, size_t hidden, float eps, Act y,
                        float* rstd) override {
    return cuda::ToStatus(cuda::RmsNormForward(ctx(), ToCuda(x), cuda::ToCudaWeight(weight),
                                               num_tokens, hidden, eps, ToCuda(y), rstd));
  }
  Status RmsNormBackward(CAct x, Weight weight, const float* rstd, CAct dy, size_t num_tokens,
                         size_t hidden, Act dx, float* dweight) override {
    return cuda::ToStatus(cuda::RmsNormBackward(ctx(), ToCuda(x), cuda::ToCudaWeight(weight), rstd,
                                                ToCuda(dy), num_tokens, hidden, ToCuda(dx),
                                                dweight));
  }
  Status ResidualRmsNormForward(CAct a, CAct b, Weight weight, size_t num_tokens, size_t hidden,
                                float eps, Act sum, Act y, float* rstd) override {
    return cuda::ToStatus(cuda::ResidualRmsNormForward(ctx(), ToCuda(a), ToCuda(b),
                                                       cuda::ToCudaWeight(weight), num_tokens,
                                                       hidden, eps, ToCuda(sum), ToCuda(y), rstd));
  }
  Status RmsNormResidualBackward(CAct x, Weight weight, const float* rstd, CAct dy, CAct residual,
                                 size_t num_tokens, size_t hidden, Act dx,
                                 float* dweight) override {
    return cuda::ToStatus(cuda::RmsNormResidualBackward(
        ctx(), ToCuda(x), cuda::ToCudaWeight(weight), rstd, ToCuda(dy), ToCuda(residual),
        num_tokens, hidden, ToCuda(dx), dweight));
  }
  Status LinearForward(CAct x, Weight weight, size_t num_tokens, size_t in_features,
                       size_t out_features, Act y) override {
    return cuda::ToStatus(cuda::LinearForward(ctx(), ToCuda(x), cuda::ToCudaWeight(weight),
                                              num_tokens, in_features, out_features, ToCuda(y)));
  }
  Status LinearBackward(CAct x, Weight weight, CAct dy, size_t num_tokens, size_t in_features,
                        size_t out_features, Act dx, Accumulate dx_mode, float* dweight) override {
    return cuda::ToStatus(cuda::LinearBackward(ctx(), ToCuda(x), cuda::ToCudaWeight(weight),
                                               ToCuda(dy), num_tokens, in_features, out_features,
                                               ToCuda(dx), ToCuda(dx_mode), dweight));
  }
  Status BiasForward(Act y, Weight bias, size_t rows, size_t cols) override {
    return cuda::ToStatus(
        cuda::BiasForward(ctx(), ToCuda(y), cuda::ToCudaWeight(bias), rows, cols));
  }
  Status BiasBackward(CAct dy, size_t rows, size_t cols, float* dbias) override {
    return cuda::ToStatus(cuda::BiasBackward(ctx(), ToCuda(dy), rows, cols, dbias));
  }
  Status RopeForward(Act x, size_t batch, size_t seq, size_t heads, size_t head_dim, float theta,
                     const RopeScaling& scaling, const int32_t* positions) override {
    return cuda::ToStatus(cuda::RopeForward(ctx(), ToCuda(x), batch, seq, heads, head_dim, theta,
                                            scaling, positions));
  }
  Status RopeBackward(Act dx, size_t batch, size_t seq, size_t heads, size_t head_dim, float theta,
                      const RopeScaling& scaling, const int32_t* positions) override {
    return cuda::ToStatus(cuda::RopeBackward(ctx(), ToCuda(dx), batch, seq, heads, head_dim, theta,
                                             scaling, positions));
  }
  Status AttentionForward(CAct q, CAct k, CAct v, size_t batch, size_t seq, size_t num_heads,
                          size_t num_kv_heads, size_t head_dim, Act out, float* lse,
                          device::DType precision, const int32_t* key_start) override {
    return cuda::ToStatus(cuda::AttentionForward(ctx(), ToCuda(q), ToCuda(k), ToCuda(v), batch, seq,
                                                 num_heads, num_kv_heads, head_dim, ToCuda(out),
                                                 lse, cuda::ToCudaDType(precision), key_start));
  }
  Status AttentionBackward(CAct q, CAct k, CAct v, CAct out, const float* lse, CAct dout,
                           size_t batch, size_t seq, size_t num_heads, size_t num_kv_heads,
                           size_t head_dim, Act dq, Act dk, Act dv, device::DType precision,
                           const int32_t* key_start) override {
    return cuda::ToStatus(cuda::AttentionBackward(
        ctx(), ToCuda(q), ToCuda(k), ToCuda(v), ToCuda(out), lse, ToCuda(dout), batch, seq,
        num_heads, num_kv_heads, head_dim, ToCuda(dq), ToCuda(dk), ToCuda(dv),
        cuda::ToCudaDType(precision), key_start));
  }
  Status SiluMulForward(CAct gate, CAct up, size_t n, Act h) override {
    return cuda::ToStatus(cuda::SiluMulForward(ctx(), ToCuda(gate), ToCuda(up), n, ToCuda(h)));
  }
  Status SiluMulBackward(CAct gate, CAct up, CAct dh, size_t n, Act dgate, Act dup) override {
    return cuda::ToStatus(cuda::SiluMulBackward(ctx(), ToCuda(gate), ToCuda(up), ToCuda(dh), n,
                                                ToCuda(dgate), ToCuda(dup)));
  }
  Status ResidualAdd(CAct a, CAct b, size_t n, Act y) override {
    return cuda::ToStatus(cuda::ResidualAdd(ctx(), ToCuda(a), ToCuda(b), n, ToCuda(y)));
  }
  Status AccumulateGradient(CAct dy, size_t n, Act dx) override {
    return cuda::ToStatus(cuda::AccumulateGradient(ctx(), ToCuda(dy), n, ToCuda(dx)));
  }
  Status Scale(Act x, size_t n, float s) override {
    return cuda::ToStatus(cuda::Scale(ctx(), ToCuda(x), n, s));
  }
  Status CrossEntropyForward(CAct logits, const int32_t* targets, size_t num_tokens, size_t vocab,
                             int32_t ignore_index, float* lse, float* loss) override {
    return cuda::ToStatus(cuda::CrossEntropyForward(ctx(), ToCuda(logits), targets, num_tokens,
                                                    vocab, ignore_index, lse, loss));
  }
  Status CrossEntropyBackward(CAct logits, const int32_t* targets, const float* lse,
                              size_t num_tokens, size_t vocab, int32_t ignore_index, float dloss,
                              Act dlogits) override {
    return cuda::ToStatus(cuda::CrossEntropyBackward(ctx(), ToCuda(logits), targets, lse,
                                                     num_tokens, vocab, ignore_index, dloss,
                                                     ToCuda(dlogits)));
  }
  Status ShardEmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight,
                               size_t vocab_begin, size_t vocab, size_t hidden, Act out) override {
    return cuda::ToStatus(cuda::ShardEmbeddingForward(ctx(), tokens, num_tokens,
                                                      cuda::ToCudaWeight(weight), vocab_begin,
                                                      vocab, hidden, ToCuda(out)));
  }
  Status ShardEmbeddingBackward(const int32_t* tokens, size_t num_tokens, CAct dout,
                                size_t vocab_begin, size_t vocab, size_t hidden, float* dweight,
                                int32_t skip_token) override {
    return cuda::ToStatus(cuda::ShardEmbeddingBackward(
        ctx(), tokens, num_tokens, ToCuda(dout), vocab_begin, vocab, hidden, dweight, skip_token));
  }
  Status CrossEntropyShardMax(CAct logits, size_t num_tokens, size_t vocab, float* max) override {
    return cuda::ToStatus(
        cuda::CrossEntropyShardMax(ctx(), ToCuda(logits), num_tokens, vocab, max));
  }
  Status CrossEntropyShardSums(CAct logits, const int32_t* targets, size_t num_tokens,
                               size_t vocab_begin, size_t vocab, int32_t ignore_index,
                               const float* max, float* sums) override {
    return cuda::ToStatus(cuda::CrossEntropyShardSums(ctx(), ToCuda(logits), targets, num_tokens,
                                                      vocab_begin, vocab, ignore_index, max, sums));
  }
  Status CrossEntropyShardFinish(const int32_t* targets, size_t num_tokens, int32_t ignore_index,
                                 const float* max, const float* sums, float* lse,
                                 float* loss) override {
    return cuda::ToStatus(cuda::CrossEntropyShardFinish(ctx(), targets, num_tokens, ignore_index,
                                                        max, sums, lse, loss));
  }
  Status CrossEntropyShardBackward(CAct logits, const int32_t* targets, const float* lse,
                                   size_t num_tokens, size_t vocab_begin, size_t vocab,
                                   int32_t ignore_index, float dloss, Act dlogits) override {
    return cuda::ToStatus(cuda::CrossEntropyShardBackward(ctx(), ToCuda(logits), targets, lse,
                                                          num_tokens, vocab_begin, vocab,
                                                          ignore_index, dloss, ToCuda(dlogits)));
  }
  bool HasShardOps() const override { return true; }
  const char* PrepareAttention(size_t batch, size_t seq, size_t num_heads, size_t num_kv_heads,
                               size_t head_dim, device::DType precision) override {
    return cuda::PrepareAttention(ctx(), batch, seq, num_heads, num_kv_heads, head_dim,
                                  cuda::ToCudaDType(precision));
  }
  Status CheckDataErrors() override { return cuda::CheckDataErrors(ctx()); }
  Status Mark() override { return cuda::ToStatus(cuda::RecordMark(ctx())); }
  Result<std::vector<double>> TakeMarks() override {
    std::vector<double> seconds;
    STRATA_RETURN_IF_ERROR(cuda::ToStatus(cuda::TakeMarks(ctx(), &seconds)));
    return seconds;
  }

 private:
  cuda::OpsContext* ctx() { return context_.get(); }

  device::Device& device_;
  cuda::OpsContextPtr context_;
  void* workspace_;
};

}  // namespace

Result<std::unique_ptr<LlamaOps>> CreateCudaLlamaOps(device::Device& device,
                                                     device::Stream& stream,
                                                     const LlamaOpsShape& shape,
                                                     bool allow_tf32) {
  STRATA_ASSIGN_OR_RETURN(cuda::OpsContextPtr context, cuda::CreateOpsContext(stream));
  STRATA_RETURN_IF_ERROR(cuda::ToStatus(cuda::SetTf32(context.get(), allow_tf32)));
  const size_t bytes = CudaLlamaOpsWorkspaceBytes(shape);
  Result<void*> workspace = device.Alloc(bytes);
  if (!workspace.ok()) {
    return workspace.status().WithContext(
        fmt::format("the model's CUDA op workspace ({} bytes)", bytes));
  }
  Status st = cuda::ToStatus(cuda::UseWorkspace(context.get(), *workspace, bytes));
  if (!st.ok()) {
    device.Free(*workspace);
    return st;
  }
  return std::unique_ptr<LlamaOps>(new CudaLlamaOps(device, std::move(context), *workspace));
}

}  // namespace strata::model

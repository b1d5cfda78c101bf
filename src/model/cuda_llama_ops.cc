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

class CudaLlamaOps final : public LlamaOps {
 public:
  CudaLlamaOps(device::Device& device, cuda::OpsContextPtr context, void* workspace)
      : device_(device), context_(std::move(context)), workspace_(workspace) {}
  ~CudaLlamaOps() override {
    context_.reset();  // waits for the stream before the workspace goes
    device_.Free(workspace_);
  }

  Status EmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight, size_t vocab,
                          size_t hidden, float* out) override {
    return cuda::ToStatus(cuda::EmbeddingForward(ctx(), tokens, num_tokens,
                                                 cuda::ToCudaWeight(weight), vocab, hidden, out));
  }
  Status EmbeddingBackward(const int32_t* tokens, size_t num_tokens, const float* dout,
                           size_t vocab, size_t hidden, float* dweight,
                           int32_t skip_token) override {
    return cuda::ToStatus(cuda::EmbeddingBackward(ctx(), tokens, num_tokens, dout, vocab, hidden,
                                                  dweight, skip_token));
  }
  Status RmsNormForward(const float* x, Weight weight, size_t num_tokens, size_t hidden, float eps,
                        float* y, float* rstd) override {
    return cuda::ToStatus(cuda::RmsNormForward(ctx(), x, cuda::ToCudaWeight(weight), num_tokens,
                                               hidden, eps, y, rstd));
  }
  Status RmsNormBackward(const float* x, Weight weight, const float* rstd, const float* dy,
                         size_t num_tokens, size_t hidden, float* dx, float* dweight) override {
    return cuda::ToStatus(cuda::RmsNormBackward(ctx(), x, cuda::ToCudaWeight(weight), rstd, dy,
                                                num_tokens, hidden, dx, dweight));
  }
  Status LinearForward(const float* x, Weight weight, size_t num_tokens, size_t in_features,
                       size_t out_features, float* y) override {
    return cuda::ToStatus(cuda::LinearForward(ctx(), x, cuda::ToCudaWeight(weight), num_tokens,
                                              in_features, out_features, y));
  }
  Status LinearBackward(const float* x, Weight weight, const float* dy, size_t num_tokens,
                        size_t in_features, size_t out_features, float* dx, Accumulate dx_mode,
                        float* dweight) override {
    return cuda::ToStatus(cuda::LinearBackward(ctx(), x, cuda::ToCudaWeight(weight), dy,
                                               num_tokens, in_features, out_features, dx,
                                               ToCuda(dx_mode), dweight));
  }
  Status BiasForward(float* y, Weight bias, size_t rows, size_t cols) override {
    return cuda::ToStatus(cuda::BiasForward(ctx(), y, cuda::ToCudaWeight(bias), rows, cols));
  }
  Status BiasBackward(const float* dy, size_t rows, size_t cols, float* dbias) override {
    return cuda::ToStatus(cuda::BiasBackward(ctx(), dy, rows, cols, dbias));
  }
  Status RopeForward(float* x, size_t batch, size_t seq, size_t heads, size_t head_dim,
                     float theta, const RopeScaling& scaling, const int32_t* positions) override {
    return cuda::ToStatus(
        cuda::RopeForward(ctx(), x, batch, seq, heads, head_dim, theta, scaling, positions));
  }
  Status RopeBackward(float* dx, size_t batch, size_t seq, size_t heads, size_t head_dim,
                      float theta, const RopeScaling& scaling,
                      const int32_t* positions) override {
    return cuda::ToStatus(
        cuda::RopeBackward(ctx(), dx, batch, seq, heads, head_dim, theta, scaling, positions));
  }
  Status AttentionForward(const float* q, const float* k, const float* v, size_t batch,
                          size_t seq, size_t num_heads, size_t num_kv_heads, size_t head_dim,
                          float* out, float* lse, device::DType precision,
                          const int32_t* key_start) override {
    return cuda::ToStatus(cuda::AttentionForward(ctx(), q, k, v, batch, seq, num_heads,
                                                 num_kv_heads, head_dim, out, lse,
                                                 cuda::ToCudaDType(precision), key_start));
  }
  Status AttentionBackward(const float* q, const float* k, const float* v, const float* out,
                           const float* lse, const float* dout, size_t batch, size_t seq,
                           size_t num_heads, size_t num_kv_heads, size_t head_dim, float* dq,
                           float* dk, float* dv, device::DType precision,
                           const int32_t* key_start) override {
    return cuda::ToStatus(cuda::AttentionBackward(ctx(), q, k, v, out, lse, dout, batch, seq,
                                                  num_heads, num_kv_heads, head_dim, dq, dk, dv,
                                                  cuda::ToCudaDType(precision), key_start));
  }
  Status SiluMulForward(const float* gate, const float* up, size_t n, float* h) override {
    return cuda::ToStatus(cuda::SiluMulForward(ctx(), gate, up, n, h));
  }
  Status SiluMulBackward(const float* gate, const float* up, const float* dh, size_t n,
                         float* dgate, float* dup) override {
    return cuda::ToStatus(cuda::SiluMulBackward(ctx(), gate, up, dh, n, dgate, dup));
  }
  Status ResidualAdd(const float* a, const float* b, size_t n, float* y) override {
    return cuda::ToStatus(cuda::ResidualAdd(ctx(), a, b, n, y));
  }
  Status AccumulateGradient(const float* dy, size_t n, float* dx) override {
    return cuda::ToStatus(cuda::AccumulateGradient(ctx(), dy, n, dx));
  }
  Status Scale(float* x, size_t n, float s) override {
    return cuda::ToStatus(cuda::Scale(ctx(), x, n, s));
  }
  Status CrossEntropyForward(const float* logits, const int32_t* targets, size_t num_tokens,
                             size_t vocab, int32_t ignore_index, float* lse,
                             float* loss) override {
    return cuda::ToStatus(cuda::CrossEntropyForward(ctx(), logits, targets, num_tokens, vocab,
                                                    ignore_index, lse, loss));
  }
  Status CrossEntropyBackward(const float* logits, const int32_t* targets, const float* lse,
                              size_t num_tokens, size_t vocab, int32_t ignore_index, float dloss,
                              float* dlogits) override {
    return cuda::ToStatus(cuda::CrossEntropyBackward(ctx(), logits, targets, lse, num_tokens,
                                                     vocab, ignore_index, dloss, dlogits));
  }
  Status ShardEmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight,
                               size_t vocab_begin, size_t vocab, size_t hidden,
                               float* out) override {
    return cuda::ToStatus(cuda::ShardEmbeddingForward(
        ctx(), tokens, num_tokens, cuda::ToCudaWeight(weight), vocab_begin, vocab, hidden, out));
  }
  Status ShardEmbeddingBackward(const int32_t* tokens, size_t num_tokens, const float* dout,
                                size_t vocab_begin, size_t vocab, size_t hidden, float* dweight,
                                int32_t skip_token) override {
    return cuda::ToStatus(cuda::ShardEmbeddingBackward(ctx(), tokens, num_tokens, dout, vocab_begin,
                                                       vocab, hidden, dweight, skip_token));
  }
  Status CrossEntropyShardMax(const float* logits, size_t num_tokens, size_t vocab,
                              float* max) override {
    return cuda::ToStatus(cuda::CrossEntropyShardMax(ctx(), logits, num_tokens, vocab, max));
  }
  Status CrossEntropyShardSums(const float* logits, const int32_t* targets, size_t num_tokens,
                               size_t vocab_begin, size_t vocab, int32_t ignore_index,
                               const float* max, float* sums) override {
    return cuda::ToStatus(cuda::CrossEntropyShardSums(ctx(), logits, targets, num_tokens,
                                                      vocab_begin, vocab, ignore_index, max, sums));
  }
  Status CrossEntropyShardFinish(const int32_t* targets, size_t num_tokens, int32_t ignore_index,
                                 const float* max, const float* sums, float* lse,
                                 float* loss) override {
    return cuda::ToStatus(cuda::CrossEntropyShardFinish(ctx(), targets, num_tokens, ignore_index,
                                                        max, sums, lse, loss));
  }
  Status CrossEntropyShardBackward(const float* logits, const int32_t* targets, const float* lse,
                                   size_t num_tokens, size_t vocab_begin, size_t vocab,
                                   int32_t ignore_index, float dloss, float* dlogits) override {
    return cuda::ToStatus(cuda::CrossEntropyShardBackward(
        ctx(), logits, targets, lse, num_tokens, vocab_begin, vocab, ignore_index, dloss, dlogits));
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

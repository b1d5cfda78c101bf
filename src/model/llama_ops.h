// The decoder's operations behind one interface, so that LlamaModel has a single code path for
// every device (internal to src/model).
//
//   cpu   CpuLlamaOps runs cpu_ops.h synchronously. LlamaModel calls it from inside a HostTask on
//         the compute stream, so the calls still run in stream order on the stream's thread.
//   cuda  CudaLlamaOps enqueues cuda_ops.h on one CUDA stream (its OpsContext's) and returns at
//         once; LlamaModel calls it from the thread that enqueues the unit.
//
// Every pointer is device memory of the model's device (on the CPU device, host memory). The
// shapes, aliasing rules and accumulation conventions are those of cpu_ops.h; the CUDA kernels
// are checked against the CPU ones in tests/model/cuda_ops_test.cc.
//
// Errors: a CPU op that meets bad data returns InvalidArgument at once. A CUDA kernel records it
// instead; CheckDataErrors (called once per micro-batch, after the loss) waits and reports it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "model/cpu_ops.h"
#include "model/cuda_ops.h"
#include "model/op_time.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata::model {

// An activation (or an activation's gradient) in the model's device memory, in its dtype: fp32
// everywhere, or the compute dtype (bf16, fp16) on the CUDA device with 16-bit activations
// (LlamaModelOptions::activation_dtype). CAct is the read-only view. Row statistics (rstd, lse),
// the loss, and weight and bias gradients are always fp32, and are plain float pointers.
struct Act {
  void* data = nullptr;
  device::DType dtype = device::DType::kF32;

  Act() = default;
  Act(void* d, device::DType t) : data(d), dtype(t) {}
  Act(float* d) : data(d) {}  // NOLINT: fp32 memory reads as an fp32 activation
  // The tensor from element `n` on.
  Act At(size_t n) const {
    return {data == nullptr ? nullptr : static_cast<char*>(data) + n * device::DTypeSize(dtype),
            dtype};
  }
  explicit operator bool() const { return data != nullptr; }
};
struct CAct {
  const void* data = nullptr;
  device::DType dtype = device::DType::kF32;

  CAct() = default;
  CAct(const void* d, device::DType t) : data(d), dtype(t) {}
  CAct(const float* d) : data(d) {}              // NOLINT: as Act's
  CAct(float* d) : data(d) {}                    // NOLINT
  CAct(Act a) : data(a.data), dtype(a.dtype) {}  // NOLINT: an Act reads as a CAct
};

// The sizes the ops are used with, for the CUDA workspace (the CUDA ops' own shape type).
using LlamaOpsShape = cuda::WorkspaceShape;

struct LlamaConfig;
// The shape of `config` at micro_batch x seq_len tokens.
// `vocab_split`: tensor parallelism (the LM head then takes every token at once).
// `activations`: their dtype (LlamaModelOptions::activation_dtype).
LlamaOpsShape LlamaOpsShapeFor(const LlamaConfig& config, int64_t seq_len, int64_t micro_batch,
                               bool vocab_split = false,
                               device::DType activations = device::DType::kF32);

class LlamaOps {
 public:
  using Weight = cpu::Weight;
  using Accumulate = cpu::Accumulate;
  virtual ~LlamaOps() = default;

  virtual Status EmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight,
                                  size_t vocab, size_t hidden, Act out) = 0;
  // `skip_token` (-1: none) adds nothing: the padding_idx of the model's pad_token_id.
  virtual Status EmbeddingBackward(const int32_t* tokens, size_t num_tokens, CAct dout,
                                   size_t vocab, size_t hidden, float* dweight,
                                   int32_t skip_token) = 0;
  virtual Status RmsNormForward(CAct x, Weight weight, size_t num_tokens, size_t hidden, float eps,
                                Act y, float* rstd) = 0;
  virtual Status RmsNormBackward(CAct x, Weight weight, const float* rstd, CAct dy,
                                 size_t num_tokens, size_t hidden, Act dx, float* dweight) = 0;
  // The residual add and the norm after it in one pass: sum = a + b ([T, H]; may alias a or b),
  // y = RMSNorm(sum) as RmsNormForward computes it from sum as stored (in its dtype), so the
  // backward, which reads sum, sees what the forward normalised. The CPU ops run ResidualAdd and
  // RmsNormForward (the same bits).
  virtual Status ResidualRmsNormForward(CAct a, CAct b, Weight weight, size_t num_tokens,
                                        size_t hidden, float eps, Act sum, Act y, float* rstd) = 0;
  // RmsNormBackward with the residual path's gradient added in the same pass: dx = the norm's
  // input gradient + residual ([T, H]; dx may alias dy, not residual). The CPU ops run
  // RmsNormBackward and AccumulateGradient (the same bits).
  virtual Status RmsNormResidualBackward(CAct x, Weight weight, const float* rstd, CAct dy,
                                         CAct residual, size_t num_tokens, size_t hidden, Act dx,
                                         float* dweight) = 0;
  virtual Status LinearForward(CAct x, Weight weight, size_t num_tokens, size_t in_features,
                               size_t out_features, Act y) = 0;
  virtual Status LinearBackward(CAct x, Weight weight, CAct dy, size_t num_tokens,
                                size_t in_features, size_t out_features, Act dx, Accumulate dx_mode,
                                float* dweight) = 0;
  virtual Status BiasForward(Act y, Weight bias, size_t rows, size_t cols) = 0;
  virtual Status BiasBackward(CAct dy, size_t rows, size_t cols, float* dbias) = 0;
  // `positions` (device memory, [batch * seq]; null: t mod seq): packed documents' positions.
  virtual Status RopeForward(Act x, size_t batch, size_t seq, size_t heads, size_t head_dim,
                             float theta, const RopeScaling& scaling, const int32_t* positions) = 0;
  virtual Status RopeBackward(Act dx, size_t batch, size_t seq, size_t heads, size_t head_dim,
                              float theta, const RopeScaling& scaling,
                              const int32_t* positions) = 0;
  // `precision`: the weights' dtype. The CUDA ops run 16-bit attention on the tensor cores
  // (cuda::AttentionForward); the CPU ops compute in fp32 whatever it is.
  virtual Status AttentionForward(CAct q, CAct k, CAct v, size_t batch, size_t seq,
                                  size_t num_heads, size_t num_kv_heads, size_t head_dim, Act out,
                                  float* lse, device::DType precision,
                                  const int32_t* key_start) = 0;
  virtual Status AttentionBackward(CAct q, CAct k, CAct v, CAct out, const float* lse, CAct dout,
                                   size_t batch, size_t seq, size_t num_heads, size_t num_kv_heads,
                                   size_t head_dim, Act dq, Act dk, Act dv, device::DType precision,
                                   const int32_t* key_start) = 0;
  virtual Status SiluMulForward(CAct gate, CAct up, size_t n, Act h) = 0;
  virtual Status SiluMulBackward(CAct gate, CAct up, CAct dh, size_t n, Act dgate, Act dup) = 0;
  virtual Status ResidualAdd(CAct a, CAct b, size_t n, Act y) = 0;
  virtual Status AccumulateGradient(CAct dy, size_t n, Act dx) = 0;
  // x *= s in place (LoRA's scale).
  virtual Status Scale(Act x, size_t n, float s) = 0;
  // *loss (one float of device memory) = the mean cross-entropy (cpu::CrossEntropyForward).
  virtual Status CrossEntropyForward(CAct logits, const int32_t* targets, size_t num_tokens,
                                     size_t vocab, int32_t ignore_index, float* lse,
                                     float* loss) = 0;
  virtual Status CrossEntropyBackward(CAct logits, const int32_t* targets, const float* lse,
                                      size_t num_tokens, size_t vocab, int32_t ignore_index,
                                      float dloss, Act dlogits) = 0;
  // The vocabulary split over tensor-parallel ranks (cpu_ops.h: ShardEmbeddingForward and the
  // others): tokens and targets are ids of the whole vocabulary, checked by the caller. The CPU
  // and CUDA ops have them; elsewhere they are Unimplemented (LlamaModel refuses tensor
  // parallelism on such a device at Create, before any of them is called).
  virtual Status ShardEmbeddingForward(const int32_t* /*tokens*/, size_t /*num_tokens*/,
                                       Weight /*weight*/, size_t /*vocab_begin*/, size_t /*vocab*/,
                                       size_t /*hidden*/, Act /*out*/) {
    return ShardOpsMissing();
  }
  virtual Status ShardEmbeddingBackward(const int32_t* /*tokens*/, size_t /*num_tokens*/,
                                        CAct /*dout*/, size_t /*vocab_begin*/, size_t /*vocab*/,
                                        size_t /*hidden*/, float* /*dweight*/,
                                        int32_t /*skip_token*/) {
    return ShardOpsMissing();
  }
  virtual Status CrossEntropyShardMax(CAct /*logits*/, size_t /*num_tokens*/, size_t /*vocab*/,
                                      float* /*max*/) {
    return ShardOpsMissing();
  }
  virtual Status CrossEntropyShardSums(CAct /*logits*/, const int32_t* /*targets*/,
                                       size_t /*num_tokens*/, size_t /*vocab_begin*/,
                                       size_t /*vocab*/, int32_t /*ignore_index*/,
                                       const float* /*max*/, float* /*sums*/) {
    return ShardOpsMissing();
  }
  // *loss (one float of device memory): the mean cross-entropy.
  virtual Status CrossEntropyShardFinish(const int32_t* /*targets*/, size_t /*num_tokens*/,
                                         int32_t /*ignore_index*/, const float* /*max*/,
                                         const float* /*sums*/, float* /*lse*/, float* /*loss*/) {
    return ShardOpsMissing();
  }
  virtual Status CrossEntropyShardBackward(CAct /*logits*/, const int32_t* /*targets*/,
                                           const float* /*lse*/, size_t /*num_tokens*/,
                                           size_t /*vocab_begin*/, size_t /*vocab*/,
                                           int32_t /*ignore_index*/, float /*dloss*/,
                                           Act /*dlogits*/) {
    return ShardOpsMissing();
  }
  // Gets the attention ready for calls of this shape at `precision` (CUDA: cuDNN's graphs, built
  // now rather than in the first step) and names the kernels that will run them
  // (cuda::PrepareAttention); the CPU ops have one attention ("cpu").
  virtual const char* PrepareAttention(size_t /*batch*/, size_t /*seq*/, size_t /*num_heads*/,
                                       size_t /*num_kv_heads*/, size_t /*head_dim*/,
                                       device::DType /*precision*/) {
    return "cpu";
  }
  // Whether this device's ops have the vocabulary-split ops above.
  virtual bool HasShardOps() const { return false; }
  // Bad tokens or targets met since the last call (CUDA: waits for the stream). OK on the CPU,
  // whose ops report them at once.
  virtual Status CheckDataErrors() = 0;

  // Stream-ordered timestamps for per-op profiles (OpProfiler): Mark() records one after every
  // op called so far; TakeMarks() waits for them, returns each one's seconds after the first,
  // and forgets them. CPU: the host clock (its ops run to completion in the call). CUDA: events
  // on the ops' stream.
  virtual Status Mark() = 0;
  virtual Result<std::vector<double>> TakeMarks() = 0;

 protected:
  static Status ShardOpsMissing() {
    return UnimplementedError(
        "the vocabulary-parallel ops of tensor parallelism are not built for this device");
  }
};

// The LlamaOps of `inner`, each call bracketed by two marks (strata train --profile-ops): where
// a step's device time goes, per op. Collect() (after the stream has reached the calls, e.g. once
// per micro-batch after the loss is read) adds the calls' times to the totals.
class OpProfiler final : public LlamaOps {
 public:
  explicit OpProfiler(std::unique_ptr<LlamaOps> inner) : inner_(std::move(inner)) {}

  Status Collect();
  // The totals since the last Reset, largest first.
  std::vector<OpTime> totals() const;
  void Reset();

  Status EmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight, size_t vocab,
                          size_t hidden, Act out) override;
  Status EmbeddingBackward(const int32_t* tokens, size_t num_tokens, CAct dout, size_t vocab,
                           size_t hidden, float* dweight, int32_t skip_token) override;
  Status RmsNormForward(CAct x, Weight weight, size_t num_tokens, size_t hidden, float eps, Act y,
                        float* rstd) override;
  Status RmsNormBackward(CAct x, Weight weight, const float* rstd, CAct dy, size_t num_tokens,
                         size_t hidden, Act dx, float* dweight) override;
  Status ResidualRmsNormForward(CAct a, CAct b, Weight weight, size_t num_tokens, size_t hidden,
                                float eps, Act sum, Act y, float* rstd) override;
  Status RmsNormResidualBackward(CAct x, Weight weight, const float* rstd, CAct dy, CAct residual,
                                 size_t num_tokens, size_t hidden, Act dx, float* dweight) override;
  Status LinearForward(CAct x, Weight weight, size_t num_tokens, size_t in_features,
                       size_t out_features, Act y) override;
  Status LinearBackward(CAct x, Weight weight, CAct dy, size_t num_tokens, size_t in_features,
                        size_t out_features, Act dx, Accumulate dx_mode, float* dweight) override;
  Status BiasForward(Act y, Weight bias, size_t rows, size_t cols) override;
  Status BiasBackward(CAct dy, size_t rows, size_t cols, float* dbias) override;
  Status RopeForward(Act x, size_t batch, size_t seq, size_t heads, size_t head_dim, float theta,
                     const RopeScaling& scaling, const int32_t* positions) override;
  Status RopeBackward(Act dx, size_t batch, size_t seq, size_t heads, size_t head_dim, float theta,
                      const RopeScaling& scaling, const int32_t* positions) override;
  Status AttentionForward(CAct q, CAct k, CAct v, size_t batch, size_t seq, size_t num_heads,
                          size_t num_kv_heads, size_t head_dim, Act out, float* lse,
                          device::DType precision, const int32_t* key_start) override;
  Status AttentionBackward(CAct q, CAct k, CAct v, CAct out, const float* lse, CAct dout,
                           size_t batch, size_t seq, size_t num_heads, size_t num_kv_heads,
                           size_t head_dim, Act dq, Act dk, Act dv, device::DType precision,
                           const int32_t* key_start) override;
  Status SiluMulForward(CAct gate, CAct up, size_t n, Act h) override;
  Status SiluMulBackward(CAct gate, CAct up, CAct dh, size_t n, Act dgate, Act dup) override;
  Status ResidualAdd(CAct a, CAct b, size_t n, Act y) override;
  Status AccumulateGradient(CAct dy, size_t n, Act dx) override;
  Status Scale(Act x, size_t n, float s) override;
  Status CrossEntropyForward(CAct logits, const int32_t* targets, size_t num_tokens, size_t vocab,
                             int32_t ignore_index, float* lse, float* loss) override;
  Status CrossEntropyBackward(CAct logits, const int32_t* targets, const float* lse,
                              size_t num_tokens, size_t vocab, int32_t ignore_index, float dloss,
                              Act dlogits) override;
  Status ShardEmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight,
                               size_t vocab_begin, size_t vocab, size_t hidden, Act out) override;
  Status ShardEmbeddingBackward(const int32_t* tokens, size_t num_tokens, CAct dout,
                                size_t vocab_begin, size_t vocab, size_t hidden, float* dweight,
                                int32_t skip_token) override;
  Status CrossEntropyShardMax(CAct logits, size_t num_tokens, size_t vocab, float* max) override;
  Status CrossEntropyShardSums(CAct logits, const int32_t* targets, size_t num_tokens,
                               size_t vocab_begin, size_t vocab, int32_t ignore_index,
                               const float* max, float* sums) override;
  Status CrossEntropyShardFinish(const int32_t* targets, size_t num_tokens, int32_t ignore_index,
                                 const float* max, const float* sums, float* lse,
                                 float* loss) override;
  Status CrossEntropyShardBackward(CAct logits, const int32_t* targets, const float* lse,
                                   size_t num_tokens, size_t vocab_begin, size_t vocab,
                                   int32_t ignore_index, float dloss, Act dlogits) override;
  bool HasShardOps() const override { return inner_->HasShardOps(); }
  const char* PrepareAttention(size_t batch, size_t seq, size_t num_heads, size_t num_kv_heads,
                               size_t head_dim, device::DType precision) override {
    return inner_->PrepareAttention(batch, seq, num_heads, num_kv_heads, head_dim, precision);
  }
  Status CheckDataErrors() override { return inner_->CheckDataErrors(); }
  Status Mark() override { return inner_->Mark(); }
  Result<std::vector<double>> TakeMarks() override { return inner_->TakeMarks(); }

 private:
  // Marks, runs `call`, marks, and remembers that the two marks bracket `op`.
  template <typename Call>
  Status Timed(const char* op, Call&& call);

  std::unique_ptr<LlamaOps> inner_;
  std::vector<const char*> pending_;  // the ops bracketed by the marks not yet collected
  std::vector<OpTime> totals_;
};

// The ops of `inner` (the CPU ops), recorded instead of run: each call is kept, in order, until
// Flush enqueues them as one HostTask on a stream. With tensor parallelism the model's code runs
// when the engine calls it, as on CUDA, so that its collectives are enqueued between its ops in
// program order, the same on every rank (the MPI backend runs operations in enqueue order).
// Calls only record and return OK; an op's error comes from its HostTask (the stream's error).
class DeferredOps final : public LlamaOps {
 public:
  explicit DeferredOps(LlamaOps& inner) : inner_(inner) {}

  // Enqueues the calls recorded since the last Flush on `stream` (nothing if none).
  Status Flush(device::Device& device, device::Stream& stream, std::string_view label);
  // Forgets the calls recorded since the last Flush.
  void Discard() { calls_.clear(); }

  Status EmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight, size_t vocab,
                          size_t hidden, Act out) override;
  Status EmbeddingBackward(const int32_t* tokens, size_t num_tokens, CAct dout, size_t vocab,
                           size_t hidden, float* dweight, int32_t skip_token) override;
  Status RmsNormForward(CAct x, Weight weight, size_t num_tokens, size_t hidden, float eps, Act y,
                        float* rstd) override;
  Status RmsNormBackward(CAct x, Weight weight, const float* rstd, CAct dy, size_t num_tokens,
                         size_t hidden, Act dx, float* dweight) override;
  Status ResidualRmsNormForward(CAct a, CAct b, Weight weight, size_t num_tokens, size_t hidden,
                                float eps, Act sum, Act y, float* rstd) override;
  Status RmsNormResidualBackward(CAct x, Weight weight, const float* rstd, CAct dy, CAct residual,
                                 size_t num_tokens, size_t hidden, Act dx, float* dweight) override;
  Status LinearForward(CAct x, Weight weight, size_t num_tokens, size_t in_features,
                       size_t out_features, Act y) override;
  Status LinearBackward(CAct x, Weight weight, CAct dy, size_t num_tokens, size_t in_features,
                        size_t out_features, Act dx, Accumulate dx_mode, float* dweight) override;
  Status BiasForward(Act y, Weight bias, size_t rows, size_t cols) override;
  Status BiasBackward(CAct dy, size_t rows, size_t cols, float* dbias) override;
  Status RopeForward(Act x, size_t batch, size_t seq, size_t heads, size_t head_dim, float theta,
                     const RopeScaling& scaling, const int32_t* positions) override;
  Status RopeBackward(Act dx, size_t batch, size_t seq, size_t heads, size_t head_dim, float theta,
                      const RopeScaling& scaling, const int32_t* positions) override;
  Status AttentionForward(CAct q, CAct k, CAct v, size_t batch, size_t seq, size_t num_heads,
                          size_t num_kv_heads, size_t head_dim, Act out, float* lse,
                          device::DType precision, const int32_t* key_start) override;
  Status AttentionBackward(CAct q, CAct k, CAct v, CAct out, const float* lse, CAct dout,
                           size_t batch, size_t seq, size_t num_heads, size_t num_kv_heads,
                           size_t head_dim, Act dq, Act dk, Act dv, device::DType precision,
                           const int32_t* key_start) override;
  Status SiluMulForward(CAct gate, CAct up, size_t n, Act h) override;
  Status SiluMulBackward(CAct gate, CAct up, CAct dh, size_t n, Act dgate, Act dup) override;
  Status ResidualAdd(CAct a, CAct b, size_t n, Act y) override;
  Status AccumulateGradient(CAct dy, size_t n, Act dx) override;
  Status Scale(Act x, size_t n, float s) override;
  Status CrossEntropyForward(CAct logits, const int32_t* targets, size_t num_tokens, size_t vocab,
                             int32_t ignore_index, float* lse, float* loss) override;
  Status CrossEntropyBackward(CAct logits, const int32_t* targets, const float* lse,
                              size_t num_tokens, size_t vocab, int32_t ignore_index, float dloss,
                              Act dlogits) override;
  Status ShardEmbeddingForward(const int32_t* tokens, size_t num_tokens, Weight weight,
                               size_t vocab_begin, size_t vocab, size_t hidden, Act out) override;
  Status ShardEmbeddingBackward(const int32_t* tokens, size_t num_tokens, CAct dout,
                                size_t vocab_begin, size_t vocab, size_t hidden, float* dweight,
                                int32_t skip_token) override;
  Status CrossEntropyShardMax(CAct logits, size_t num_tokens, size_t vocab, float* max) override;
  Status CrossEntropyShardSums(CAct logits, const int32_t* targets, size_t num_tokens,
                               size_t vocab_begin, size_t vocab, int32_t ignore_index,
                               const float* max, float* sums) override;
  Status CrossEntropyShardFinish(const int32_t* targets, size_t num_tokens, int32_t ignore_index,
                                 const float* max, const float* sums, float* lse,
                                 float* loss) override;
  Status CrossEntropyShardBackward(CAct logits, const int32_t* targets, const float* lse,
                                   size_t num_tokens, size_t vocab_begin, size_t vocab,
                                   int32_t ignore_index, float dloss, Act dlogits) override;
  Status CheckDataErrors() override { return Status::Ok(); }
  Status Mark() override;
  Result<std::vector<double>> TakeMarks() override { return inner_.TakeMarks(); }
  bool HasShardOps() const override { return inner_.HasShardOps(); }

 private:
  using Call = std::function<Status(LlamaOps&)>;
  Status Defer(Call call) {
    calls_.push_back(std::move(call));
    return Status::Ok();
  }

  LlamaOps& inner_;
  std::vector<Call> calls_;
};

// The CPU ops (stateless; one instance serves every stream).
std::unique_ptr<LlamaOps> CreateCpuLlamaOps();

// The CUDA ops on `stream` (a stream of a CUDA device) with a workspace of
// WorkspaceBytes(shape) bytes allocated from `device` under its budget (freed with the ops).
// Unimplemented in a build without CUDA.
// `allow_tf32`: fp32 GEMMs on TF32 tensor cores (cuda::SetTf32).
Result<std::unique_ptr<LlamaOps>> CreateCudaLlamaOps(device::Device& device, device::Stream& stream,
                                                     const LlamaOpsShape& shape,
                                                     bool allow_tf32 = false);
// The workspace CreateCudaLlamaOps allocates (the same arithmetic in a build without CUDA).
size_t CudaLlamaOpsWorkspaceBytes(const LlamaOpsShape& shape);

}  // namespace strata::model

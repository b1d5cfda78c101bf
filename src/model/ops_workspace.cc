// cuda::WorkspaceBytes: plain arithmetic, built with or without CUDA, so that memory plans
// (train/estimate.h) include the CUDA ops' workspace on any machine. The kernels that use the
// workspace are in cuda_ops.cu.
#include <algorithm>
#include <cstddef>

#include "model/cuda_ops.h"

namespace strata::model::cuda {
namespace {

size_t AlignUp(size_t n) {
  return (n + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

}  // namespace

size_t AttentionCopiesBytes(size_t tokens, size_t q_dim, size_t kv_dim, bool backward) {
  const size_t copies = 2 * AlignUp(tokens * q_dim * 2) + 2 * AlignUp(tokens * kv_dim * 2);
  return backward ? 2 * copies : copies;
}

size_t WorkspaceBytes(const WorkspaceShape& s) {
  const size_t t = s.batch * s.seq;
  // RMSNorm backward's per-chunk partial sums.
  size_t most = ((t + kRmsNormRowsPerPartial - 1) / kRmsNormRowsPerPartial) * s.hidden *
                sizeof(float);
  // Linear layers (cuda_ops.cu): a GEMM input not in the weight's dtype is converted to it (x, or
  // dy and x: 2 bytes an element for a 16-bit weight, 4 for an fp32 one), and an output cuBLAS
  // cannot write from those inputs (a 16-bit y or dx of an fp32 GEMM, or bf16 of fp16) is staged
  // in fp32. Forward: x's copy and y's staging; backward: dy's copy, then dx's staging, whose
  // bytes x's copy reuses. fp32 activations with a 16-bit weight take 2 bytes per element of x
  // and of y (an fp32 weight none); 16-bit activations with a weight of their dtype (the shape's
  // promise) none.
  const bool act16 = s.activations != DType::kF32;
  const size_t q = s.q_dim > 0 ? s.q_dim : s.hidden;
  const size_t pairs[][2] = {{s.hidden, q},       {q, s.hidden},   {s.hidden, s.kv_dim},
                             {s.hidden, s.intermediate}, {s.intermediate, s.hidden},
                             {s.hidden, s.vocab}};
  for (const auto& p : pairs) {
    if (act16) break;
    // The LM head's GEMMs take its chunks' tokens (LlamaHeadChunkTokens).
    const size_t rows = &p == &pairs[5] && s.head_tokens > 0 ? s.head_tokens : t;
    most = std::max(most, AlignUp(rows * p[0] * 2) + AlignUp(rows * p[1] * 2));
  }
  most = std::max(most, 2 * AlignUp(s.seq * (s.head_dim / 2) * sizeof(float)));  // RoPE tables
  most = std::max(most, AlignUp(s.batch * s.num_heads * s.seq * sizeof(float)));  // attention
  // cuDNN's attention (16-bit weights, head_dim 64 or 128; cuda_ops.cu): with fp32 activations
  // the backward's 16-bit copies of q, k, v, out, dout and of the three gradients (16-bit
  // activations need none), then cuDNN's own workspace. That is
  // known only once its graph is built on a GPU; this reserves an fp32 dq accumulator and two
  // row statistics twice over, plus 16 MiB. A plan needing more runs Strata's own kernels, and
  // the log says so.
  if (s.head_dim == 64 || s.head_dim == 128) {
    const size_t rows = s.batch * s.num_heads * s.seq;
    const size_t copies = act16 ? 0 : AttentionCopiesBytes(t, q, s.kv_dim, true);
    const size_t cudnn = 2 * (AlignUp(t * q * sizeof(float)) + 2 * AlignUp(rows * sizeof(float))) +
                         (size_t{16} << 20);
    most = std::max(most, copies + cudnn);
  }
  most = std::max(most, AlignUp(t * sizeof(float)));                              // the loss
  return AlignUp(std::max<size_t>(most, 1));
}

}  // namespace strata::model::cuda

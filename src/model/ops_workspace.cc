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

size_t WorkspaceBytes(const WorkspaceShape& s) {
  const size_t t = s.batch * s.seq;
  // RMSNorm backward's per-chunk partial sums.
  size_t most = ((t + kRmsNormRowsPerPartial - 1) / kRmsNormRowsPerPartial) * s.hidden *
                sizeof(float);
  // Linear layers with 16-bit weights: the activations (and output gradients) rounded to 16 bits.
  const size_t q = s.q_dim > 0 ? s.q_dim : s.hidden;
  const size_t pairs[][2] = {{s.hidden, q},       {q, s.hidden},   {s.hidden, s.kv_dim},
                             {s.hidden, s.intermediate}, {s.intermediate, s.hidden},
                             {s.hidden, s.vocab}};
  for (const auto& p : pairs) {
    most = std::max(most, AlignUp(t * p[0] * 2));                         // forward
    most = std::max(most, AlignUp(t * p[1] * 2) + AlignUp(t * p[0] * 2));  // backward
  }
  most = std::max(most, 2 * AlignUp(s.seq * (s.head_dim / 2) * sizeof(float)));  // RoPE tables
  most = std::max(most, AlignUp(s.batch * s.num_heads * s.seq * sizeof(float)));  // attention
  most = std::max(most, AlignUp(t * sizeof(float)));                              // the loss
  return AlignUp(std::max<size_t>(most, 1));
}

}  // namespace strata::model::cuda

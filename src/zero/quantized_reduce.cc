#include "zero/quantized_reduce.h"

#include <fmt/format.h>

#include "zero/partition.h"

namespace strata::zero::engine_internal {

namespace {

using device::DType;

// The staging of one reduction of `count` elements per part, in this order: the parts quantized
// for the first all-to-all (later reused for the second's), what the first receives, the N
// partial sums (fp32), one dequantized part (fp32), what the second all-to-all receives.
struct Staging {
  uint64_t part = 0;  // one quantized part: count int8 values, then count / block scales
  uint64_t send = 0, recv1 = 0, partials = 0, scratch = 0, recv2 = 0, total = 0;

  Staging(int world, int nodes, size_t count) {
    part = QuantizedShardBytes(static_cast<int64_t>(count));
    const auto w = static_cast<uint64_t>(world);
    const auto n = static_cast<uint64_t>(nodes);
    send = 0;
    recv1 = send + w * part;
    partials = recv1 + w * part;
    scratch = partials + n * count * sizeof(float);
    recv2 = scratch + count * sizeof(float);
    total = recv2 + n * part;
  }
};

}  // namespace

uint64_t QuantizedReduceScatter::StagingBytes(const comm::Topology& topology, size_t max_count) {
  return Staging(topology.world, topology.nodes(), max_count).total;
}

Status QuantizedReduceScatter::Run(const float* send, size_t stride, size_t count, float* recv,
                                   device::Stream& stream) const {
  const auto block = static_cast<size_t>(kQuantBlockElems);
  if (count % block != 0 || count > max_count_ || count > stride) {
    return InternalError(fmt::format(
        "qgZ reduce-scatter: {} elements per part (stride {}); expected a multiple of {} of at "
        "most {} and at most the stride",
        count, stride, block, max_count_));
  }
  if (count == 0) return Status::Ok();
  if (topology_.world == 1) {
    if (recv == send) return Status::Ok();
    return device_.CopyAsync(recv, send, count * sizeof(float), device::CopyKind::kDeviceToDevice,
                             stream);
  }
  const int nodes = topology_.nodes();
  const int per_node = topology_.ranks_per_node;
  const Staging at(topology_.world, nodes, count);
  const uint64_t q = at.part;
  char* send_q = staging_ + at.send;
  char* recv1 = staging_ + at.recv1;
  auto* partials = reinterpret_cast<float*>(staging_ + at.partials);
  auto* scratch = reinterpret_cast<float*>(staging_ + at.scratch);
  char* recv2 = staging_ + at.recv2;

  auto quantize = [&](const float* x, char* to) {
    return device_.QuantizeInt8(x, DType::kF32, count, block, to,
                                reinterpret_cast<float*>(to + count), stream);
  };
  // out = the k dequantized parts at from, from + step, ..., added in fp32 in that order.
  auto sum_parts = [&](const char* from, uint64_t step, int k, float* out) -> Status {
    for (int i = 0; i < k; ++i) {
      const char* part = from + static_cast<uint64_t>(i) * step;
      float* to = i == 0 ? out : scratch;
      STRATA_RETURN_IF_ERROR(device_.DequantizeInt8(
          part, reinterpret_cast<const float*>(part + count), count, block, to, DType::kF32,
          stream));
      if (i > 0) STRATA_RETURN_IF_ERROR(device_.Axpy(1.0f, scratch, out, DType::kF32, count, stream));
    }
    return Status::Ok();
  };
  // An all-to-all of `bytes` per peer: 16-bit elements carry the packed int8 values and scales
  // (a quantized part is a multiple of 4 bytes).
  auto exchange = [&](comm::Collective& group, const char* from, char* to, uint64_t bytes) {
    return group.AllToAll(from, to, bytes / 2, DType::kBF16, stream);
  };

  // Level 1, within the node: the partial sum, over the node's ranks, of part n' * L + local for
  // every node n' (with one node, that is the result).
  auto level1_sum = [&](int node) -> float* {
    return nodes == 1 ? recv : partials + static_cast<size_t>(node) * count;
  };
  auto partial = [&](int node) -> const float* {
    if (per_node == 1) return send + static_cast<size_t>(node) * stride;  // nothing to add
    return level1_sum(node);
  };
  if (per_node > 1) {
    for (int l = 0; l < per_node; ++l) {
      for (int n = 0; n < nodes; ++n) {
        const size_t p = static_cast<size_t>(n * per_node + l);
        STRATA_RETURN_IF_ERROR(quantize(
            send + p * stride, send_q + (static_cast<uint64_t>(l) * nodes + n) * q));
      }
    }
    STRATA_RETURN_IF_ERROR(
        exchange(*groups_.intra, send_q, recv1, static_cast<uint64_t>(nodes) * q));
    for (int n = 0; n < nodes; ++n) {
      STRATA_RETURN_IF_ERROR(sum_parts(recv1 + static_cast<uint64_t>(n) * q,
                                       static_cast<uint64_t>(nodes) * q, per_node, level1_sum(n)));
    }
  }
  if (nodes == 1) return Status::Ok();
  // Level 2, across nodes: node n' gets this rank's partial of rank n' * L + local's part.
  for (int n = 0; n < nodes; ++n) {
    STRATA_RETURN_IF_ERROR(quantize(partial(n), send_q + static_cast<uint64_t>(n) * q));
  }
  STRATA_RETURN_IF_ERROR(exchange(*groups_.inter, send_q, recv2, q));
  return sum_parts(recv2, q, nodes, recv);
}

}  // namespace strata::zero::engine_internal

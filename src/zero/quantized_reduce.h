// ZeRO++ qgZ (zero_quantized_gradients): the gradient reduce-scatter of stages 2-3 as a two-level
// all-to-all of int8 blocks instead of an fp32 reduce-scatter. Private to src/zero.
//
// With W = N nodes x L ranks per node, rank r = n * L + l, and `count` elements per part:
//
//   1. within the node  every rank quantizes the W parts of its gradient (symmetric int8, one fp32
//                       scale per kQuantBlockElems) and sends local rank l' the N parts that ranks
//                       {n' * L + l'} own (an all-to-all over the intra-node group); it then
//                       dequantizes what it received and adds it in fp32, in local-rank order:
//                       one partial sum per node n', of the parts rank n' * L + l owns
//   2. across nodes     it quantizes those N partial sums and sends node n' its partial of rank
//                       n' * L + l's part (an all-to-all over the inter-node group, one rank per
//                       node); the owner dequantizes the N partials and adds them in fp32, in node
//                       order, into `recv`
//
// So every value is quantized at most twice, whatever the world size (a ring would requantize at
// every hop), and each rank sends (N - 1) int8 parts across nodes where the fp32 reduce-scatter
// sends (N - 1) x L fp32 parts: 1 / (4 L) of the bytes, plus one scale per block. With one rank
// per node the first level is skipped (nothing to quantize), with one node the second.
//
// The arithmetic is the device's quantize / dequantize / Axpy in a fixed order, so every backend
// gives the same bits. Everything runs on `stream` (the comm stream) in stream order; `staging`
// is one device buffer of StagingBytes, reused by successive reductions on that stream.
//
// Threading: the engine's driving thread calls Run; the work runs on `stream`.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/topology.h"
#include "strata/collective.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata::zero::engine_internal {

class QuantizedReduceScatter {
 public:
  // The device bytes of staging that parts of up to `max_count` elements need on `topology`.
  static uint64_t StagingBytes(const comm::Topology& topology, size_t max_count);

  // `groups`: the node groups of `topology` (SplitNodeGroups); `staging` holds
  // StagingBytes(topology, max_count) bytes of device memory. All must outlive this.
  QuantizedReduceScatter(device::Device& device, const comm::Topology& topology,
                         const comm::NodeGroups& groups, void* staging, size_t max_count)
      : device_(device),
        topology_(topology),
        groups_(groups),
        staging_(static_cast<char*>(staging)),
        max_count_(max_count) {}

  // recv[i] = sum over ranks q of rank q's send[rank * stride + i], i < count: rank q's part p
  // is at send + p * stride. `count`: a multiple of kQuantBlockElems, at most max_count, and at
  // most `stride`. `recv` may be this rank's part of `send` (it is written last).
  Status Run(const float* send, size_t stride, size_t count, float* recv,
             device::Stream& stream) const;

 private:
  device::Device& device_;
  const comm::Topology topology_;
  const comm::NodeGroups& groups_;
  char* const staging_;
  const size_t max_count_;
};

}  // namespace strata::zero::engine_internal
